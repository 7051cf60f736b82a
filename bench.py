"""
Benchmark minizero against torch's own DistributedDataParallel and FSDP2 on local gloo
CPU ranks, and measure how much bigger a model ZeRO-3 fits than DDP.

    python bench.py                      # the timing table, world size 2
    python bench.py --world-size 4
    python bench.py --quick              # CI: tiny model, one rep, a few rows (< 1 min)
    python bench.py --max-model          # largest GPT per rank budget: DDP, FSDP2, stage 3 (+ disk), 4 ranks
    python bench.py --overhead           # one rank: minizero against a plain torch loop (GPU if there is one)
    python bench.py --gpu [--quick]      # gpu_check.sh: overhead over a plain torch loop, rows on CUDA
    python bench.py --plot DIR [--quick] # memory.png and timeline.png (needs matplotlib: ".[plot]")

Timing: ONE world builds every variant from the same initial weights (each with its own
fp32 AdamW), warms each up, then interleaves: every rep runs a few steps of every variant
(in an order that rotates, reversed every other rep, so that of two rows compared each
runs first as often), so machine noise hits all alike; each variant's first step in a
rep is untimed (its state back in cache, as in a run that trains one model: cold, a variant
paid for the 15 others run since). A step's time is the slowest
rank's; the table shows medians over reps, a ratio the median of the ratios within a rep
(its rows run one after the other, in the same load). One torch thread per rank (2 cores /
2 ranks; at --world-size 4 ranks share cores). Ring headers are off (check=False).
Overhead: one rank, a plain torch loop against minizero's stage-0 engine, alternating reps:
nothing is sent, so the difference is the engine's own work (a tiny GPT: its fixed cost).

Memory: peak RSS is a lifetime maximum, so each row's comes from a fresh world that builds
only that variant. "+model" is the peak above the rank's RSS after a tiny warm-up step (so
~300 MiB of torch libraries and lazily loaded kernels are baseline). Memory worlds run with
glibc's mmap threshold fixed (run_measured), so RSS follows the tensors alive.

--max-model: fresh 4-rank worlds train a wide GPT of n_layer blocks for two steps, as DDP
(stage 0), torch FSDP2, stage 3, and stage 3 with the optimizer state on disk; the largest
n_layer whose peak above baseline fits --budget-mb.
"""
import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from minizero_lib import flight
from minizero_lib import launch
import minizero
from minizero_lib import plots
from minizero_lib import user_model
from train_gpt import GPT, GPTConfig

MiB = 2 ** 20
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1  # nanoGPT's AdamW: decay only on matrices
METERED = 2  # untimed steps per variant that count bytes sent


@dataclass(frozen=True)
class Config:
    world_size: int = 2
    n_layer: int = 4        # the timing table's GPT; --quick and --max-model change it
    n_head: int = 4
    n_embd: int = 256
    block: int = 64
    batch: int = 8          # sequences per rank per step
    reps: int = 15          # interleaved repetitions: the table shows their medians
    steps: int = 3          # timed steps per variant per rep
    warmup: int = 2
    budget_mb: int = 768
    variants: tuple = ()


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "ddp", "fsdp2" or "zero"
    stage: int = 0
    native: bool = False
    overlap: bool = True
    offload: str = None  # "disk": the optimizer state in files under OFFLOAD_DIR
    record: bool = True  # False: the flight record switched off, to time what it costs

    @property
    def zero_stage(self):  # what the formulas count it as: DDP keeps all (0), FSDP2 shards all (3)
        return {"ddp": 0, "fsdp2": 3}.get(self.kind, self.stage)


OFFLOAD_DIR = os.path.join(tempfile.gettempdir(), "minizero-bench-offload")  # (on a disk, not tmpfs, here)


def variants(quick):
    ours = lambda s, native, ov=True: Variant(f"stage{s}-{'native' if native else 'ring'}{'' if ov else '-noovl'}",
                                              "zero", s, native, ov)  # noqa: E731
    # the rows a summary ratio compares come one after the other (a rep rotates the order, or reverses it)
    rows = [Variant("torch-ddp", "ddp"), ours(0, True), ours(0, False), Variant("stage3-ring-disk", "zero", 3,
            offload="disk"), ours(3, False), ours(3, True, False), ours(3, True), Variant("torch-fsdp2", "fsdp2")]
    unrecorded = [Variant(f"stage{s}-ring-norec", "zero", s, record=False) for s in (0, 3)]
    if quick:  # just what the summary line needs
        return rows + unrecorded
    # overlap (the reduce-scatter during backward; at stage 3 also the prefetch) at both ends
    return rows + [ours(s, f, ov) for s in (0, 1, 2, 3) for f in (False, True)
                   for ov in ((True, False) if s in (0, 3) else (True,)) if ours(s, f, ov) not in rows] + unrecorded


# -----------------------------------------------------------------------------
# one variant: a model with its optimizer, behind step(x, y) -> loss


def build(v, comm, gcfg, meta=False):
    """The same GPT (same seed, so the same weights) wrapped the variant's way. meta=True
    (the memory worlds): minizero and FSDP2 build it on the meta device and make each
    unit (FSDP2: each rank's shard) real in turn, as one does for a model too big for a
    rank; DDP has no such path and builds it whole."""
    meta = meta and v.kind != "ddp"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(gcfg, None if meta else torch.Generator().manual_seed(1337))
    model = model if meta else model.to(comm.device)
    if v.kind == "zero":
        # native=None: the engine leaves comm.native alone; we set it per step, since every
        # engine in this world shares one communicator
        engine = minizero.Engine(model, comm, v.stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                 decay=lambda name, p: p.dim() >= 2, overlap=v.overlap, native=None,
                                 offload=v.offload, offload_dir=OFFLOAD_DIR if v.offload else None,
                                 init=model.init_weights if meta else None)
        record = comm.flight if v.record else NoRecord(comm.rank)

        def step(x, y):
            comm.native, comm.flight = v.native, record
            _, loss = model(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        return step, engine
    if v.kind == "ddp":
        model = DDP(model)
    else:  # FSDP2: every block is its own group, the root (embeddings, tied head) the last
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        if meta:  # FSDP2's recipe: shard on meta, then allocate and fill only this rank's shards
            model.to_empty(device=comm.device)
            for name, p in model.named_parameters():
                model.init_weights(name, p.to_local())
    opt = torch.optim.AdamW(decay_groups(model), lr=LR, betas=BETAS, eps=EPS)

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step, None


class NoRecord(flight.Flight):
    """The flight record switched off (here only): the difference in ms/step is what it costs."""

    def start(self, op, kind, t):
        return None

    def end(self, rec):
        pass


def decay_groups(model):
    """AdamW's groups as minizero's engines get them (decay=...): matrices decay, the rest not."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def slowest(res, names, reps, key="times"):
    """Seconds per step of each variant in each rep: the slowest rank's (key="cpu": CPU seconds)."""
    return {name: [max(r[name][key][i] for r in res) for i in range(reps)] for name in names}


def medians(times):
    """ms per step of each variant: the median over reps."""
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def paired(times, a, b):
    """a's time over b's: the median over reps of the ratio within each rep."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def ratios(times):
    """The table's three comparisons with torch and with no overlap."""
    return {"stage0-native/ddp": paired(times, "stage0-native", "torch-ddp"),
            "stage3-native/fsdp2": paired(times, "stage3-native", "torch-fsdp2"),
            "stage3 overlap on/off": paired(times, "stage3-native", "stage3-native-noovl")}


def batches(cfg, rank, n, device="cpu"):
    """n fixed batches of random tokens for this rank: every variant sees the same ones."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, 256, (n, cfg.batch, cfg.block + 1), generator=g).to(device)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in x]


def gpt_config(cfg, n_layer=None):
    return GPTConfig(n_layer or cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block, 256, True)


def run_measured(fn, world_size, *args):
    """launch.run_processes, with glibc's malloc told to give every block over 128 KiB straight
    back to the OS (a fixed mmap threshold). By default glibc raises that threshold as big
    tensors are freed and keeps freed memory cached, per thread arena: peak RSS then swings
    by 100s of MiB from run to run. With it fixed, RSS follows the tensors alive."""
    env = dict(os.environ)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # read by each spawned rank at start
    try:
        return launch.run_processes(fn, world_size, *args, check=False, timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(env)


def loopback_tx():
    """Bytes sent over this machine's loopback so far (Linux), or None: every rank's gloo
    traffic, whoever's collectives they are, torch's included."""
    try:
        with open("/proc/net/dev") as f:
            return next(int(line.split(":")[1].split()[8]) for line in f if line.strip().startswith("lo:"))
    except (OSError, StopIteration):
        return None


def warm_baseline(v, comm, cfg):
    """Train one step of a tiny model the variant's way, then return RSS: torch's lazily
    loaded kernels and machinery count as baseline, not as the model's memory."""
    tiny = replace(cfg, n_layer=1, n_embd=32, n_head=1)
    step, engine = build(v, comm, gpt_config(tiny), meta=True)
    step(*batches(tiny, comm.rank, 1)[0])
    if engine is not None:
        engine.close()
    return rss_now()


def rss_now():
    """This process's resident set size in bytes, now (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


# -----------------------------------------------------------------------------
# the worlds: each function runs on every rank (spawned by launch.run_processes)


def time_world(comm, cfg):
    """All variants in one world, interleaved. Returns per variant: this rank's seconds
    per step for each rep, bytes sent in one step, the last loss, and Psi."""
    torch.set_num_threads(1)
    gcfg = gpt_config(cfg)
    built = [build(v, comm, gcfg) for v in cfg.variants]
    data = batches(cfg, comm.rank, cfg.warmup + METERED + cfg.reps * (1 + cfg.steps), comm.device)
    out = {v.name: dict(times=[], cpu=[], sent=None, loss=None, numel=None) for v in cfg.variants}
    k = {v.name: 0 for v in cfg.variants}  # each variant walks the same batches in the same order

    def run(v, step, n):
        for _ in range(n):
            out[v.name]["loss"] = step(*data[k[v.name]])
            k[v.name] += 1

    for v, (step, engine) in zip(cfg.variants, built):
        run(v, step, cfg.warmup)  # allocates optimizer state, records stage 3's gather order
        wire = []
        for _ in range(METERED):  # two untimed steps: the ledger, and the loopback's bytes
            before = sum(comm.sent.values())
            dist.barrier()
            tx = loopback_tx()
            run(v, step, 1)
            dist.barrier()
            out[v.name]["sent"] = sum(comm.sent.values()) - before if engine is not None else None
            wire.append(loopback_tx() - tx if tx is not None else None)
        # all ranks' traffic shares the one counter: per rank is 1/N of it; the min of two
        # steps dodges other programs' loopback traffic
        out[v.name]["wire"] = min(wire) / comm.world_size if None not in wire else None
        out[v.name]["numel"] = engine.numel() if engine is not None else None
    pairs = list(zip(cfg.variants, built))
    for rep in range(cfg.reps):
        order = pairs[rep % len(pairs):] + pairs[:rep % len(pairs)]
        for v, (step, _) in order[::-1] if rep % 2 else order:  # (each of two neighbours first as often)
            run(v, step, 1)  # untimed: the variant's state back in cache
            dist.barrier()  # line the ranks up outside the timed window
            t0, c0 = time.perf_counter(), time.process_time()
            run(v, step, cfg.steps)
            out[v.name]["times"].append((time.perf_counter() - t0) / cfg.steps)
            out[v.name]["cpu"].append((time.process_time() - c0) / cfg.steps)  # every thread of the rank
    for _, engine in built:
        if engine is not None:
            engine.close()
    return out


def memory_world(comm, cfg, v, n_layer=None):
    """One variant alone in a fresh world, two steps: (peak RSS, baseline RSS, Psi)."""
    torch.set_num_threads(1)
    base = warm_baseline(v, comm, cfg)
    step, engine = build(v, comm, gpt_config(cfg, n_layer), meta=True)
    for x, y in batches(cfg, comm.rank, 2):  # the second step has all the optimizer state
        step(x, y)
    peak = minizero.peak_memory("cpu")
    if engine is not None:
        engine.close()  # (workers leave by os._exit, so no finalizer would remove offload files)
    return peak, base, engine.numel() if engine else None


# -----------------------------------------------------------------------------
# the drivers


def comm_formula(v, numel, n_params, N):
    """Bytes one rank sends per step by DESIGN.md's table: 2Psi (DDP, stages 0-2) or 3Psi
    (FSDP2, stage 3); torch's rows count Psi unpadded."""
    return sum(minizero.comm_bytes_per_step(numel or n_params, N, v.zero_stage, torch.float32).values())


def bench(cfg):
    N, t_start = cfg.world_size, time.time()
    n_params = meta_params(cfg, cfg.n_layer)
    print(f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide ({n_params / 1e6:.2f}M params, fp32), batch "
          f"{cfg.batch}x{cfg.block} per rank, {N} gloo CPU ranks, 1 torch thread each\n"
          f"medians over {cfg.reps} interleaved reps of {cfg.steps} steps after {cfg.warmup} warm-up; "
          f"a step's time is the slowest rank's" + ("\n--quick: proves it runs; its times are too short "
                                                    "to mean much" if cfg.reps == 1 else ""), flush=True)
    res = launch.run_processes(time_world, N, cfg, check=False, timeout=900)
    times = slowest(res, [v.name for v in cfg.variants], cfg.reps)
    cpu = slowest(res, [v.name for v in cfg.variants], cfg.reps, "cpu")  # steadier on a loaded machine
    ms, cpu_ms = medians(times), medians(cpu)
    mem = {}
    for v in cfg.variants:  # one fresh world per row: peak RSS is a lifetime maximum
        per_rank = run_measured(memory_world, N, cfg, v) if v.record else [(float("nan"),) * 3]
        mem[v.name] = (max(p for p, _, _ in per_rank), max(p - b for p, b, _ in per_rank))
    ddp, fsdp = ms["torch-ddp"], ms["torch-fsdp2"]
    mib = lambda b: "n/a" if b is None else f"{b / MiB:.2f}"  # noqa: E731
    print(f"\n{'':<49}{'MiB sent/step/rank':^26}{'peak RSS MiB':^17}\n{'variant':<20}{'ms/step':>8}"
          f"{'CPU ms':>8}{'/ddp':>6}{'/fsdp2':>7}{'ledger':>9}{'formula':>9}{'wire':>8}{'total':>9}{'+model':>8}")
    for v in cfg.variants:
        r0 = res[0][v.name]
        psi = {"ddp": "  (2Psi)", "fsdp2": "  (3Psi)"}.get(v.kind, "")
        print(f"{v.name:<20}{ms[v.name]:>8.1f}{cpu_ms[v.name]:>8.1f}{ms[v.name] / ddp:>6.2f}{ms[v.name] / fsdp:>7.2f}"
              f"{mib(r0['sent']):>9}{mib(comm_formula(v, r0['numel'], n_params, N)):>9}{mib(r0['wire']):>8}"
              f"{mem[v.name][0] / MiB:>9.0f}{mem[v.name][1] / MiB:>8.0f}{psi}")
    drift = max(abs(res[0][v.name]["loss"] - res[0]["torch-ddp"]["loss"]) for v in cfg.variants)
    print(f"  ledger: minizero's own count of one step's payload (rank 0); torch keeps none\n"
          f"  formula: DESIGN.md's ring bytes, (N-1)/N of Psi per collective over Psi\n"
          f"  wire: loopback bytes of one step, all ranks, / N; gloo's reduce_scatter_tensor is an "
          f"all-reduce underneath (twice the ring's bytes)\n"
          f"  CPU ms: CPU seconds of every thread of the slowest rank's process (gloo's included) per step\n"
          f"  peak RSS: max over ranks, a fresh world per row; +model: above the RSS after a tiny warm-up\n"
          f"  last losses agree with DDP's to {drift:.1e}; {time.time() - t_start:.0f} s")

    disk = paired(times, "stage3-ring-disk", "stage3-ring")
    (s0, s3, ovl), (s0_cpu, s3_cpu, _) = ratios(times).values(), ratios(cpu).values()
    ring = {s: paired(times, f"stage{s}-ring", f"stage{s}-native") for s in range(4) if f"stage{s}-ring" in ms}
    worst = max(ring, key=ring.get)
    print("overhead over a plain torch loop (AdamW fused=False):", flush=True)
    (big, big_cpu), (tiny, _) = overhead(cfg)
    ok = lambda good: "met" if good else "MISSED"  # noqa: E731
    print(f"targets: stage0-native/ddp <= 1.00 {ok(s0 <= 1.00)}; stage3-native/fsdp2 <= 0.85 {ok(s3 <= 0.85)}; "
          f"stage3 overlap on/off < 1 {ok(ovl < 1)}; ring/native <= 1.5 {ok(ring[worst] <= 1.5)} "
          f"(worst stage: {worst}); overhead over a plain loop <= 1.05 {ok(big <= 1.05)}")
    print("flight record (always on), ms/step with / without: " + ", ".join(
        f"stage{s}-ring {ms[f'stage{s}-ring']:.1f} / {ms[f'stage{s}-ring-norec']:.1f} "
        f"({ms[f'stage{s}-ring'] / ms[f'stage{s}-ring-norec']:.3f}x)" for s in (0, 3)))
    print(f"summary: stage0-native/ddp {s0:.2f}x (CPU {s0_cpu:.2f}x)  stage3-native/fsdp2 {s3:.2f}x (CPU "
          f"{s3_cpu:.2f}x)  stage3 overlap on/off {ovl:.2f}x  ring/native {ring[worst]:.2f}x  stage3 disk offload/in "
          f"memory {disk:.2f}x  overhead/plain loop {big:.2f}x (CPU {big_cpu:.2f}x, tiny GPT {tiny:.2f}x)")


def plot(out_dir, quick):
    """--plot: memory.png (stages 0-3 against N: formula lines, Engine.memory() points, thread
    worlds) and timeline.png (a stage-3 step traced on gloo ranks) in out_dir (plots.py)."""
    plt = plots.pyplot()
    if plt is None:
        return 2
    cfg = Config(n_layer=2, n_embd=64, block=32, batch=4) if quick else Config()
    worlds = range(1, 5 if quick else 9)
    measured = {}
    for n in worlds:
        for stage, nbytes in enumerate(launch.run_threads(state_bytes, n, gpt_config(cfg))[0]):
            measured[stage, n] = nbytes
    os.makedirs(out_dir, exist_ok=True)
    plots.memory_png(plt, os.path.join(out_dir, "memory.png"), meta_params(cfg, cfg.n_layer), torch.bfloat16,
                     measured, list(worlds))
    with tempfile.TemporaryDirectory() as tmp:
        launch.run_processes(traced_world, cfg.world_size, cfg, tmp, check=False, timeout=600)
        traces = []
        for r in range(cfg.world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                traces.append(json.load(f)["traceEvents"])
    plots.timeline_png(plt, os.path.join(out_dir, "timeline.png"), traces, step=2)
    print(f"wrote {out_dir}/memory.png and {out_dir}/timeline.png")
    return 0


def state_bytes(comm, gcfg):
    """Engine.memory() of each stage (bf16 compute, fp32 AdamW) on this thread world."""
    out = []
    for stage in range(4):
        engine = minizero.Engine(GPT(gcfg, torch.Generator().manual_seed(1337)), comm, stage, dtype=torch.bfloat16)
        out.append(sum(engine.memory().values()))
        engine.close()
    return out


def traced_world(comm, cfg, trace_dir):
    """Three stage-3 steps of the timing table's GPT with Engine(trace=...): its first three."""
    torch.set_num_threads(1)
    step, engine = build(Variant("stage3-ring", "zero", 3), comm, gpt_config(cfg))
    flight.Tracer(trace_dir, comm, engine.units, user_model.tensors)  # (build() makes the engine; this is trace=trace_dir)
    for x, y in batches(cfg, comm.rank, 3):
        step(x, y)
    engine.close()


MAX_MODEL_ROWS = [Variant("stage0-ring", "zero", 0), Variant("torch-fsdp2", "fsdp2"),
                  Variant("stage3-ring", "zero", 3), Variant("stage3-ring-disk", "zero", 3, offload="disk")]


def meta_params(cfg, n_layer):
    """The GPT's parameter count, built on the meta device: building it for real here would
    raise this process's peak RSS, which spawned ranks inherit in ru_maxrss (Linux keeps
    the high-water mark across fork and exec), and every later row would measure high."""
    with torch.device("meta"):
        return GPT(gpt_config(cfg, n_layer)).num_params()


def max_model(cfg):
    """For each row (DDP, torch FSDP2, stage 3, stage 3 with the optimizer on disk), the
    largest n_layer whose measured per-rank peak (above baseline) fits the budget: a secant
    search (peak RSS is near-linear in n_layer) that ends only when both sides of the
    boundary are measured, n fits and n + 1 does not. Disk offload reads and writes its
    files (pread/pwrite, never mapped), so page cache is no part of this RSS: it is the
    anonymous memory."""
    N, budget, t_start = cfg.world_size, cfg.budget_mb * MiB, time.time()
    print(f"max model: GPT of width {cfg.n_embd}, batch {cfg.batch}x{cfg.block}, {N} gloo CPU ranks, fp32, "
          f"ring; budget {cfg.budget_mb} MiB of peak RSS per rank above baseline", flush=True)
    found = {}
    for v in MAX_MODEL_ROWS:
        seen = {}  # n_layer -> (peak above baseline, max over ranks; Psi)
        n, lo, hi = 1, 0, None  # lo: largest n that fits so far; hi: smallest that does not
        while hi is None or hi > lo + 1:
            per_rank = run_measured(memory_world, N, cfg, v, n)
            seen[n] = (max(p - b for p, b, _ in per_rank), per_rank[0][2] or meta_params(cfg, n))
            fits = seen[n][0] <= budget
            print(f"  {v.name}, {n:3d} layers ({seen[n][1] / 1e6:6.1f}M params): peak "
                  f"{seen[n][0] / MiB:6.0f} MiB, {'fits' if fits else 'too big'}", flush=True)
            lo, hi = (n, hi) if fits else (lo, n)
            if hi == 1:
                break
            # next guess: the line through the bracket, or through the two largest sizes so far
            a, b = (lo, hi) if hi else sorted(seen)[-2:] if len(seen) > 1 else (0, n)
            pa, pb = (seen[a][0] if a else 0), seen[b][0]
            n = max(lo + 1, a + int((budget - pa) * (b - a) / max(pb - pa, 1)))
            n = min(n, hi - 1) if hi else n
        a = min((k for k in seen if 1 < k < lo), default=None)  # the widest span past the first layer
        per_layer = (seen[lo][0] - seen[a][0]) / (lo - a) if a else float("nan")
        formula = sum(minizero.model_state_bytes(seen[lo][1] - seen[a][1], N, v.zero_stage, torch.float32,
                                                 v.offload).values()) / (lo - a) if a else float("nan")
        found[v.name] = (lo, seen[lo][1] if lo else 0)
        print(f"  {v.name}: largest {lo} layers; near it {per_layer / MiB:.1f} MiB per layer measured, "
              f"{formula / MiB:.1f} by the formula (fp32: {'4+4 of 16 bytes' if v.offload else '16 bytes'}"
              f"{'/N' if v.zero_stage == 3 else ''} per parameter resident)", flush=True)
    print(f"largest fitting ({time.time() - t_start:.0f} s): " + ", ".join(
        f"{name} {lo} layers ({p / 1e6:.1f}M params)" for name, (lo, p) in found.items()))
    p = {name: params for name, (_, params) in found.items()}
    print(f"summary: max model at {N} ranks, {cfg.budget_mb} MiB/rank: stage3/stage0 "
          f"{p['stage3-ring'] / max(p['stage0-ring'], 1):.2f}x, stage3/fsdp2 "
          f"{p['stage3-ring'] / max(p['torch-fsdp2'], 1):.2f}x, stage3+disk/stage3 "
          f"{p['stage3-ring-disk'] / max(p['stage3-ring'], 1):.2f}x params")


# -----------------------------------------------------------------------------
# --gpu (gpu_check.sh): minizero against a plain torch loop on one GPU, and the native
# rows on CUDA. Without CUDA the same code runs, tiny, on the CPU: it proves it starts.


def plain_vs_engine(comm, cfg):
    """One rank trains the same GPT two ways, alternating reps: a plain torch loop (AdamW
    unfused, bf16 autocast on GPU, as nanoGPT) and minizero's stage-0 engine (bf16 params,
    fp32 master). Returns {name: [seconds per step, per rep]} ("name cpu": CPU) and the last losses."""
    cuda = comm.device.type == "cuda"
    data = batches(cfg, 0, cfg.warmup + cfg.reps * cfg.steps, comm.device)
    plain = GPT(gpt_config(cfg), torch.Generator().manual_seed(1337)).to(comm.device)
    opt = torch.optim.AdamW(decay_groups(plain), lr=LR, betas=BETAS, eps=EPS, fused=False, foreach=cuda)
    ours = GPT(gpt_config(cfg), torch.Generator().manual_seed(1337)).to(comm.device)
    engine = minizero.Engine(ours, comm, 0, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, native=True,
                             decay=lambda name, p: p.dim() >= 2, dtype=torch.bfloat16 if cuda else torch.float32)

    def plain_step(x, y):
        with torch.autocast(comm.device.type, torch.bfloat16, enabled=cuda):
            loss = plain(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def engine_step(x, y):
        loss = ours(x, y)[1]
        engine.backward(loss)
        engine.step()
        return loss.detach()

    steps = {"plain": plain_step, "minizero": engine_step}
    out = {key: [] for name in steps for key in (name, name + " cpu")}
    for step in steps.values():
        for x, y in data[:cfg.warmup]:
            step(x, y)
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # time the GPU's work, not its queue
    for rep in range(cfg.reps):
        batch = data[cfg.warmup + rep * cfg.steps:][:cfg.steps]
        for name in list(steps)[::1 if rep % 2 == 0 else -1]:  # alternate who goes first
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for x, y in batch:
                steps[name](x, y)
            sync()
            out[name].append((time.perf_counter() - t0) / len(batch))
            out[name + " cpu"].append((time.process_time() - c0) / len(batch))
    losses = {name: float(steps[name](*data[-1])) for name in steps}  # the same batch: near-equal losses
    return out, losses


def overhead(cfg, tiny=True):
    """One rank (on a GPU if there is one): minizero's stage-0 engine over a plain torch loop at
    cfg's GPT (and a tiny one: mostly the fixed cost). Returns [(ratio, ratio of CPU times)]."""
    torch.set_num_threads(1)  # as every rank of the table: one torch thread
    cuda, out = torch.cuda.is_available(), {}
    small = replace(cfg, n_layer=1, n_head=2, n_embd=32, block=16, batch=2, steps=10 * cfg.steps,
                    reps=4 * cfg.reps)  # (ms steps: more reps, for a steady ratio)
    for name, c in {"GPT": cfg, **({"tiny GPT": small} if tiny else {})}.items():
        c = replace(c, world_size=1)
        times, losses = launch.run_threads(plain_vs_engine, 1, c, device="cuda" if cuda else "cpu")[0]
        ms, out[name] = medians(times), (paired(times, "minizero", "plain"), paired(times, "minizero cpu", "plain cpu"))
        print(f"  {name} {c.n_layer}x{c.n_embd}, batch {c.batch}x{c.block}, {c.reps} reps of {c.steps} steps: plain "
              f"torch loop{' (bf16 autocast)' if cuda else ''} {ms['plain']:.2f} ms/step, minizero stage 0 at one rank"
              f"{' (bf16)' if cuda else ''} {ms['minizero']:.2f} ({ms['minizero'] - ms['plain']:+.2f} ms, "
              f"{out[name][0]:.3f}x; CPU time {out[name][1]:.3f}x); last losses {losses['plain']:.4f} and "
              f"{losses['minizero']:.4f}", flush=True)
    return list(out.values())


def gpu_bench(quick):
    torch.set_num_threads(1)  # as every rank of the table: one torch thread
    cuda = torch.cuda.is_available()
    big = dict(n_layer=12, n_head=12, n_embd=768, block=1024, batch=8, reps=5, steps=3, warmup=3)  # GPT-2 shape
    tiny = dict(n_layer=1, n_head=2, n_embd=32, block=16, batch=2, reps=2, steps=1, warmup=1)
    cfg = Config(world_size=1, **(tiny if quick or not cuda else big))
    where = torch.cuda.get_device_name() if cuda else "the CPU (no CUDA: tiny sizes, times mean nothing)"
    print(f"--gpu on {where}:", flush=True)
    over = overhead(cfg, tiny=False)[0][0]
    # the native rows: NCCL puts one rank on each GPU, so one GPU runs world size 1 only
    n = max(1, torch.cuda.device_count()) if cuda else 1
    rows = [Variant("torch-ddp", "ddp"), Variant("torch-fsdp2", "fsdp2"), Variant("stage0-native", "zero", 0, True),
            Variant("stage3-native", "zero", 3, True), Variant("stage3-native-noovl", "zero", 3, True, False)]
    cfg = replace(cfg, world_size=n, variants=tuple(rows), reps=min(cfg.reps, 3), steps=min(cfg.steps, 2),
                  warmup=min(cfg.warmup, 2))
    res = launch.run_processes(time_world, n, cfg, backend="nccl" if cuda else "gloo", check=False, timeout=600)
    row = slowest(res, [v.name for v in rows], cfg.reps)
    print(f"  native rows, fp32, world size {n} ({'nccl' if cuda else 'gloo'}): "
          + ", ".join(f"{name} {t:.1f} ms" for name, t in medians(row).items()), flush=True)
    skipped = "world sizes above 1 (one GPU; NCCL takes one GPU per rank)" if cuda and n == 1 else "none"
    print(f"summary: overhead vs plain torch loop {over:.2f}x; world {n}: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios(row).items()) + f"; skipped: {skipped}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default 2; 4 with --max-model)")
    ap.add_argument("--quick", action="store_true", help="tiny model, one rep, fewer rows: proves it runs")
    ap.add_argument("--max-model", action="store_true", help="the scale claim: largest model per budget")
    ap.add_argument("--overhead", action="store_true", help="one rank: minizero against a plain torch loop")
    ap.add_argument("--gpu", action="store_true", help="gpu_check.sh: overhead over a plain torch loop, "
                                                       "native rows on CUDA (tiny on the CPU)")
    ap.add_argument("--budget-mb", type=int, default=Config.budget_mb,
                    help=f"--max-model: MiB of peak RSS per rank above baseline (default {Config.budget_mb})")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant per rep")
    ap.add_argument("--plot", metavar="DIR", help="write memory.png and timeline.png there (needs matplotlib)")
    a = ap.parse_args()

    if a.plot:
        raise SystemExit(plot(a.plot, a.quick))
    if a.gpu:
        gpu_bench(a.quick)
    elif a.max_model:  # wide and shallow per layer, tiny batch: model state dominates activations
        cfg = Config(world_size=a.world_size or 4, n_head=8, n_embd=512, block=32, batch=1, budget_mb=a.budget_mb)
        max_model(cfg)
    else:
        cfg = Config(world_size=a.world_size or 2, variants=tuple(variants(a.quick)))
        if a.quick:
            cfg = replace(cfg, n_layer=2, n_embd=64, block=32, batch=4, reps=1, steps=2)
        cfg = replace(cfg, reps=a.reps or cfg.reps, steps=a.steps or cfg.steps)
        if not a.overhead:
            bench(cfg)
        else:
            (big, big_cpu), (tiny, _) = overhead(cfg)
            print(f"summary: overhead/plain loop {big:.2f}x (CPU {big_cpu:.2f}x, tiny GPT {tiny:.2f}x)")

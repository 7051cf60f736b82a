"""
The timing table (the default mode): minizero's stages against torch's own
DistributedDataParallel and FSDP2 on local gloo CPU ranks, with bytes sent and peak RSS.

Timing: ONE world builds every variant from the same initial weights (each with its own
fp32 AdamW), warms each up, then interleaves: every rep runs a few steps of every variant
(in an order that rotates, reversed every other rep, so that of two rows compared each
runs first as often), so machine noise hits all alike; each variant's first step in a
rep is untimed (its state back in cache, as in a run that trains one model: cold, a
variant paid for the 15 others run since). A step's time is the slowest rank's; the table
shows medians over reps, a ratio the median of the ratios within a rep (its rows run one
after the other, in the same load). One torch thread per rank (2 cores / 2 ranks; at
--world-size 4 ranks share cores). Ring headers are off (check=False).
"""
import time

import torch
import torch.distributed as dist

import minizero
from minizero_lib import launch
from bench.common import (MiB, Variant, batches, build, gpt_config, meta_params, medians, paired,
                          ratios, slowest)
from bench.memory import peak_rows
from bench.overhead import overhead

METERED = 2  # untimed steps per variant that count bytes sent


def variants(quick):
    """The table's rows: --quick, just what the summary line needs."""
    def ours(s, native, ov=True):
        return Variant(f"stage{s}-{'native' if native else 'ring'}{'' if ov else '-noovl'}",
                       "zero", s, native, ov)
    # the rows a summary ratio compares come one after the other (a rep rotates the order,
    # or reverses it)
    rows = [Variant("torch-ddp", "ddp"), ours(0, True), ours(0, False),
            Variant("stage3-ring-disk", "zero", 3, offload="disk"), ours(3, False),
            ours(3, True, False), ours(3, True), Variant("torch-fsdp2", "fsdp2")]
    unrecorded = [Variant(f"stage{s}-ring-norec", "zero", s, record=False) for s in (0, 3)]
    if quick:
        return rows + unrecorded
    # overlap (the reduce-scatter during backward; at stage 3 also the prefetch) at both ends
    more = [ours(s, f, ov) for s in (0, 1, 2, 3) for f in (False, True)
            for ov in ((True, False) if s in (0, 3) else (True,))]
    return rows + [v for v in more if v not in rows] + unrecorded


def loopback_tx():
    """Bytes sent over this machine's loopback so far (Linux), or None: every rank's gloo
    traffic, whoever's collectives they are, torch's included."""
    try:
        with open("/proc/net/dev") as f:
            return next(int(line.split(":")[1].split()[8]) for line in f
                        if line.strip().startswith("lo:"))
    except (OSError, StopIteration):
        return None


def time_world(comm, cfg):
    """All variants in one world, interleaved (runs on every rank). Returns per variant:
    this rank's seconds per step for each rep (and CPU seconds), bytes sent in one step
    (the ledger's and the loopback's), the last loss, and Psi."""
    torch.set_num_threads(1)
    gcfg = gpt_config(cfg)
    built = [build(v, comm, gcfg) for v in cfg.variants]
    data = batches(cfg, comm.rank, cfg.warmup + METERED + cfg.reps * (1 + cfg.steps), comm.device)
    out = {v.name: dict(times=[], cpu=[], sent=None, loss=None, numel=None) for v in cfg.variants}
    # each variant walks the same batches in the same order
    k = {v.name: 0 for v in cfg.variants}

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
        # (reversed every other rep: each of two neighbours first as often)
        for v, (step, _) in order[::-1] if rep % 2 else order:
            run(v, step, 1)  # untimed: the variant's state back in cache
            dist.barrier()  # line the ranks up outside the timed window
            t0, c0 = time.perf_counter(), time.process_time()
            run(v, step, cfg.steps)
            out[v.name]["times"].append((time.perf_counter() - t0) / cfg.steps)
            # (every thread of the rank)
            out[v.name]["cpu"].append((time.process_time() - c0) / cfg.steps)
    for _, engine in built:
        if engine is not None:
            engine.close()
    return out


def comm_formula(v, numel, n_params, N):
    """Bytes one rank sends per step by DESIGN.md's table: 2Psi (DDP, stages 0-2) or 3Psi
    (FSDP2, stage 3); torch's rows count Psi unpadded."""
    per_step = minizero.comm_bytes_per_step(numel or n_params, N, v.zero_stage, torch.float32)
    return sum(per_step.values())


def timing_table(cfg):
    """The default mode: the table, then the overhead lines, the targets and the summary."""
    N, t_start = cfg.world_size, time.time()
    n_params = meta_params(cfg, cfg.n_layer)
    quick = "\n--quick: proves it runs; its times are too short to mean much"
    print(f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide ({n_params / 1e6:.2f}M params, fp32), "
          f"batch {cfg.batch}x{cfg.block} per rank, {N} gloo CPU ranks, 1 torch thread each\n"
          f"medians over {cfg.reps} interleaved reps of {cfg.steps} steps after {cfg.warmup} "
          f"warm-up; a step's time is the slowest rank's" + (quick if cfg.reps == 1 else ""),
          flush=True)
    res = launch.run_processes(time_world, N, cfg, check=False, timeout=900)
    names = [v.name for v in cfg.variants]
    times = slowest(res, names, cfg.reps)
    cpu = slowest(res, names, cfg.reps, "cpu")  # steadier on a loaded machine
    ms, cpu_ms = medians(times), medians(cpu)
    mem = peak_rows(cfg)
    ddp, fsdp = ms["torch-ddp"], ms["torch-fsdp2"]

    def mib(b):
        return "n/a" if b is None else f"{b / MiB:.2f}"
    print(f"\n{'':<49}{'MiB sent/step/rank':^26}{'peak RSS MiB':^17}\n{'variant':<20}"
          f"{'ms/step':>8}{'CPU ms':>8}{'/ddp':>6}{'/fsdp2':>7}{'ledger':>9}{'formula':>9}"
          f"{'wire':>8}{'total':>9}{'+model':>8}")
    for v in cfg.variants:
        r0 = res[0][v.name]
        psi = {"ddp": "  (2Psi)", "fsdp2": "  (3Psi)"}.get(v.kind, "")
        formula = comm_formula(v, r0['numel'], n_params, N)
        print(f"{v.name:<20}{ms[v.name]:>8.1f}{cpu_ms[v.name]:>8.1f}{ms[v.name] / ddp:>6.2f}"
              f"{ms[v.name] / fsdp:>7.2f}{mib(r0['sent']):>9}{mib(formula):>9}"
              f"{mib(r0['wire']):>8}{mem[v.name][0] / MiB:>9.0f}{mem[v.name][1] / MiB:>8.0f}{psi}")
    drift = max(abs(res[0][v.name]["loss"] - res[0]["torch-ddp"]["loss"]) for v in cfg.variants)
    print(f"  ledger: minizero's own count of one step's payload (rank 0); torch keeps none\n"
          f"  formula: DESIGN.md's ring bytes, (N-1)/N of Psi per collective over Psi\n"
          f"  wire: loopback bytes of one step, all ranks, / N; gloo's reduce_scatter_tensor is "
          f"an all-reduce underneath (twice the ring's bytes)\n"
          f"  CPU ms: CPU seconds of every thread of the slowest rank's process (gloo's "
          f"included) per step\n"
          f"  peak RSS: max over ranks, a fresh world per row; +model: above the RSS after a "
          f"tiny warm-up\n"
          f"  last losses agree with DDP's to {drift:.1e}; {time.time() - t_start:.0f} s")
    targets(cfg, times, cpu, ms)


def targets(cfg, times, cpu, ms):
    """The overhead lines, then each target met or missed, the flight record's cost, and the
    summary line."""
    disk = paired(times, "stage3-ring-disk", "stage3-ring")
    (s0, s3, ovl), (s0_cpu, s3_cpu, _) = ratios(times).values(), ratios(cpu).values()
    ring = {s: paired(times, f"stage{s}-ring", f"stage{s}-native") for s in range(4)
            if f"stage{s}-ring" in ms}
    worst = max(ring, key=ring.get)
    print("overhead over a plain torch loop (AdamW fused=False):", flush=True)
    (big, big_cpu), (tiny, _) = overhead(cfg)

    def ok(good):
        return "met" if good else "MISSED"
    print(f"targets: stage0-native/ddp <= 1.00 {ok(s0 <= 1.00)}; stage3-native/fsdp2 <= 0.85 "
          f"{ok(s3 <= 0.85)}; stage3 overlap on/off < 1 {ok(ovl < 1)}; ring/native <= 1.5 "
          f"{ok(ring[worst] <= 1.5)} (worst stage: {worst}); overhead over a plain loop <= 1.05 "
          f"{ok(big <= 1.05)}")
    print("flight record (always on), ms/step with / without: " + ", ".join(
        f"stage{s}-ring {ms[f'stage{s}-ring']:.1f} / {ms[f'stage{s}-ring-norec']:.1f} "
        f"({ms[f'stage{s}-ring'] / ms[f'stage{s}-ring-norec']:.3f}x)" for s in (0, 3)))
    print(f"summary: stage0-native/ddp {s0:.2f}x (CPU {s0_cpu:.2f}x)  stage3-native/fsdp2 "
          f"{s3:.2f}x (CPU {s3_cpu:.2f}x)  stage3 overlap on/off {ovl:.2f}x  ring/native "
          f"{ring[worst]:.2f}x  stage3 disk offload/in memory {disk:.2f}x  overhead/plain loop "
          f"{big:.2f}x (CPU {big_cpu:.2f}x, tiny GPT {tiny:.2f}x)")

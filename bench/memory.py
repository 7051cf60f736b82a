"""
Memory: peak RSS of each variant, the timing table's last two columns, and --max-model.

Peak RSS is a lifetime maximum, so each row's comes from a fresh world that builds only
that variant. "+model" is the peak above the rank's RSS after a tiny warm-up step (so
~300 MiB of torch libraries and lazily loaded kernels are baseline). Memory worlds run with
glibc's mmap threshold fixed (run_measured), so RSS follows the tensors alive.

--max-model: fresh 4-rank worlds train a wide GPT of n_layer blocks for two steps, as DDP
(stage 0), torch FSDP2, stage 3, and stage 3 with the optimizer state on disk; the largest
n_layer whose peak above baseline fits --budget-mb.
"""
import os
import time
from dataclasses import replace

import torch

import minizero
from minizero_lib import launch
from bench.common import MiB, Variant, batches, build, gpt_config, meta_params

MAX_MODEL_ROWS = [Variant("stage0-ring", "zero", 0), Variant("torch-fsdp2", "fsdp2"),
                  Variant("stage3-ring", "zero", 3),
                  Variant("stage3-ring-disk", "zero", 3, offload="disk")]


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


def rss_now():
    """This process's resident set size in bytes, now (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def warm_baseline(v, comm, cfg):
    """Train one step of a tiny model the variant's way, then return RSS: torch's lazily
    loaded kernels and machinery count as baseline, not as the model's memory."""
    tiny = replace(cfg, n_layer=1, n_embd=32, n_head=1)
    step, engine = build(v, comm, gpt_config(tiny), meta=True)
    step(*batches(tiny, comm.rank, 1)[0])
    if engine is not None:
        engine.close()
    return rss_now()


def memory_world(comm, cfg, v, n_layer=None):
    """One variant alone in a fresh world, two steps: (peak RSS, baseline RSS, Psi)."""
    torch.set_num_threads(1)
    base = warm_baseline(v, comm, cfg)
    step, engine = build(v, comm, gpt_config(cfg, n_layer), meta=True)
    for x, y in batches(cfg, comm.rank, 2):  # the second step has all the optimizer state
        step(x, y)
    peak = minizero.peak_memory("cpu")
    if engine is not None:
        # (workers leave by os._exit, so no finalizer would remove offload files)
        engine.close()
    return peak, base, engine.numel() if engine else None


def peak_rows(cfg):
    """Each variant's (peak RSS, peak above baseline), max over ranks, a fresh world per row
    (peak RSS is a lifetime maximum); a row without the flight record gets NaN."""
    mem = {}
    for v in cfg.variants:
        per_rank = [(float("nan"),) * 3]
        if v.record:
            per_rank = run_measured(memory_world, cfg.world_size, cfg, v)
        mem[v.name] = (max(p for p, _, _ in per_rank), max(p - b for p, b, _ in per_rank))
    return mem


# -----------------------------------------------------------------------------
# --max-model


def max_model(cfg):
    """For each row (DDP, torch FSDP2, stage 3, stage 3 with the optimizer on disk), the
    largest n_layer whose measured per-rank peak (above baseline) fits the budget: a secant
    search (peak RSS is near-linear in n_layer) that ends only when both sides of the
    boundary are measured, n fits and n + 1 does not. Disk offload reads and writes its
    files (pread/pwrite, never mapped), so page cache is no part of this RSS: it is the
    anonymous memory."""
    N, t_start = cfg.world_size, time.time()
    print(f"max model: GPT of width {cfg.n_embd}, batch {cfg.batch}x{cfg.block}, {N} gloo CPU "
          f"ranks, fp32, ring; budget {cfg.budget_mb} MiB of peak RSS per rank above baseline",
          flush=True)
    found = {v.name: largest_fitting(cfg, v) for v in MAX_MODEL_ROWS}
    print(f"largest fitting ({time.time() - t_start:.0f} s): " + ", ".join(
        f"{name} {lo} layers ({p / 1e6:.1f}M params)" for name, (lo, p) in found.items()))
    p = {name: params for name, (_, params) in found.items()}
    print(f"summary: max model at {N} ranks, {cfg.budget_mb} MiB/rank: stage3/stage0 "
          f"{p['stage3-ring'] / max(p['stage0-ring'], 1):.2f}x, stage3/fsdp2 "
          f"{p['stage3-ring'] / max(p['torch-fsdp2'], 1):.2f}x, stage3+disk/stage3 "
          f"{p['stage3-ring-disk'] / max(p['stage3-ring'], 1):.2f}x params")


def largest_fitting(cfg, v):
    """One row of --max-model: (the largest n_layer that fits, its Psi), printing each world
    measured and, near the largest, MiB per layer measured against the formula."""
    N, budget = cfg.world_size, cfg.budget_mb * MiB
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
    a = min((k for k in seen if 1 < k < lo), default=None)
    per_layer = formula = float("nan")
    if a:  # the widest span past the first layer
        per_layer = (seen[lo][0] - seen[a][0]) / (lo - a)
        state = minizero.model_state_bytes(seen[lo][1] - seen[a][1], N, v.zero_stage,
                                           torch.float32, v.offload)
        formula = sum(state.values()) / (lo - a)
    print(f"  {v.name}: largest {lo} layers; near it {per_layer / MiB:.1f} MiB per layer "
          f"measured, {formula / MiB:.1f} by the formula (fp32: "
          f"{'4+4 of 16 bytes' if v.offload else '16 bytes'}"
          f"{'/N' if v.zero_stage == 3 else ''} per parameter resident)", flush=True)
    return lo, seen[lo][1] if lo else 0

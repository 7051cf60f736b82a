"""
gpu_check.sh's probes of what a CPU cannot show (DESIGN.md §9.11), one GPU. Each prints one
line "probe NAME: ..." that the summary picks up; a probe that finds a rule broken exits
non-zero.

    python tests/gpu_probe.py versions          torch, CUDA, NCCL, the GPU (also on a CPU)
    python tests/gpu_probe.py wait              host time in NCCL's Work.wait(), with and
                                                without a timeout, behind a 50 ms kernel
    python tests/gpu_probe.py syncs             set_sync_debug_mode("warn") counts per phase
    python tests/gpu_probe.py offload           offload's bits against stage 0 for every
                                                optimizer, is_pinned, host bytes vs formula
    python tests/gpu_probe.py profile           stage 3's memory vs the formula, one step's
                                                GPU idle fraction (torch.profiler)
    python tests/gpu_probe.py csan -- ARGS      pytest ARGS with CUDA's sanitizer in every
                                                rank thread and communication thread
    python tests/gpu_probe.py jitter -- ARGS    pytest ARGS with random sleeps queued on the
                                                streams (torch.cuda._sleep), not the host
"""
import collections
import os
import random
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CUDA = torch.device("cuda")


def versions():
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"
    gpu = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}" if cuda else "no CUDA"
    print(f"probe versions: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
          f"{gpu}")


def _cycles(ms):
    """torch.cuda._sleep's cycles for about ms milliseconds on this GPU."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    return int(10_000_000 * ms / 1000 / (time.perf_counter() - t))


def wait():
    """A one-rank NCCL group: a 50 ms kernel, then an all-reduce; the host's time in wait()
    without a timeout (the stream's wait: returns at once) and with one (polls the host)."""
    import torch.distributed as dist
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    x, cycles, out = torch.ones(1 << 20, device=CUDA), _cycles(50), {}
    for how in ("without", "with"):
        torch.cuda._sleep(cycles)
        work = dist.all_reduce(x, async_op=True)
        t = time.perf_counter()
        work.wait() if how == "without" else work.wait(timedelta(seconds=60))
        out[how] = 1000 * (time.perf_counter() - t)
        torch.cuda.synchronize()
    dist.destroy_process_group()
    print(f"probe wait: host ms in NCCL wait() without timeout {out['without']:.1f}, "
          f"with timeout {out['with']:.1f} (behind a 50 ms kernel)")


def _train(comm, stage, kw, steps, phase, keep=None):
    """test_host_reads' loop (a small GPT, the phases marked); -> keep(engine) before it closes."""
    from test_host_reads import train
    return train(comm, stage, kw, steps, phase, keep)


def syncs():
    """CUDA's own count of synchronizing calls (set_sync_debug_mode("warn")), per phase, on
    thread ranks on the GPU: 0 in forward, backward and the communication thread; the step's."""
    from minizero_lib import launch
    counts, phase, lock = collections.Counter(), threading.local(), threading.Lock()
    shown = warnings.showwarning

    def show(message, category, *a, **k):
        if "synchroniz" in str(message):
            comm = threading.current_thread().name.startswith("minizero-comm")
            with lock:
                counts["comm" if comm else getattr(phase, "now", "other")] += 1
        else:
            shown(message, category, *a, **k)
    warnings.showwarning, steps = show, 3
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for stage in (0, 3):
            launch.run_threads(_train, 2, stage, {}, steps, phase, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    per = 2 * 2 * steps  # two stages, two ranks
    print("probe syncs: sync_debug warnings per rank-step: " + ", ".join(
        f"{k} {counts[k] / per:g}" for k in ("forward", "backward", "comm", "step")))
    return 1 if counts["forward"] + counts["backward"] + counts["comm"] else 0


def offload():
    """Offload on the GPU: bits against stage 0 for every optimizer, the host state pinned,
    its bytes those of the formula (one region)."""
    from minizero_lib import launch
    phase, bad = threading.local(), []

    def keep(e):
        state = {k: v.cpu() for k, v in e.full_state_dict().items()}
        host = [t for u in e.units for t in ([u.master, *u.state.values()] if e.offload else [])
                + ([u.shard] if e.offload_params else [])]
        pinned = all(t.is_pinned() for t in host)
        region = 0 if e.pinned is None else e.pinned.numel()
        formula = e.formula(offloaded=True).get("cpu", 0)
        return state, pinned, e.offloaded().get("cpu", 0), formula, region
    for optimizer in ("adamw", "sgd", "muon", "adafactor"):
        kw = dict(optimizer=optimizer, dtype=torch.bfloat16)
        ref = launch.run_threads(_train, 2, 0, kw, 2, phase, keep, device="cuda")
        for stage, more in ((1, {}), (3, dict(offload_params=True))):
            more = dict(kw, offload="cpu", **more)
            got = launch.run_threads(_train, 2, stage, more, 2, phase, keep, device="cuda")
            for (a, *_), (b, pinned, held, formula, region) in zip(ref, got):
                same = all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
                if not (same and pinned and held == formula == region):
                    bad.append(f"{optimizer} stage {stage}: bits {'same' if same else 'DIFFER'}, "
                               f"pinned {pinned}, host {held:,} formula {formula:,} "
                               f"region {region:,}")
    good = "all the same bits, pinned, host bytes = formula = one region"
    print(f"probe offload: 4 optimizers x stages 1 and 3 vs stage 0: {'; '.join(bad) or good}")
    return 1 if bad else 0


def profile():
    """Stage 3 on one GPU (one rank): memory() against the formula, one step under
    torch.profiler: the fraction of the step's wall time the GPU ran no kernel; and the trace
    of the first three steps (Engine(trace=...)): its spans, timed by events on the streams."""
    import json
    import tempfile
    from minizero import Engine
    from train_gpt import GPT, GPTConfig
    model = GPT(GPTConfig(12, 12, 768, 256, 256, True), torch.Generator().manual_seed(0)).to(CUDA)
    from minizero_lib import launch

    trace = tempfile.mkdtemp()

    def run(comm):
        eng = Engine(model, comm, 3, lr=1e-3, dtype=torch.bfloat16, trace=trace)
        x = torch.randint(0, 256, (8, 257), device=CUDA)

        def step():
            _, loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            eng.backward(loss)
            eng.step()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, end = 0.0, float("-inf")
        for a, b in kernels:  # the union of the kernels' intervals, in µs
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        held, formula = eng.memory(), eng.formula()
        return sum(held.values()), sum(formula.values()), 1 - busy / 1e6 / wall, wall
    held, formula, idle, wall = launch.run_threads(run, 1, device="cuda")[0]
    with open(os.path.join(trace, "rank0.json")) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X" and e["args"]["step"] == 2]
    ms = {cat: sum(e["dur"] for e in spans if e["cat"] == cat) / 1e3 for cat in ("compute", "collective")}
    print(f"probe profile: stage 3 model state {held / 2**20:.1f} MiB vs formula "
          f"{formula / 2**20:.1f} MiB; one step {1000 * wall:.1f} ms, GPU idle {100 * idle:.0f}%; "
          f"trace of step 2: compute {ms['compute']:.1f} ms, collectives {ms['collective']:.1f} ms "
          f"in {len(spans)} spans")
    return 0 if held == formula and spans and all(e["dur"] >= 0 for e in spans) else 1


def _csan():
    """CUDA's sanitizer in every thread that runs CUDA work: TORCH_CUDA_SANITIZER=1 enters
    its dispatch mode in the main thread only. One mode, shared (it holds what every stream
    touched), entered in each rank thread and communication thread, its handler locked."""
    from torch.cuda._sanitizer import CUDASanitizerDispatchMode
    import minizero
    from minizero_lib import launch
    lock = threading.RLock()

    class Shared(CUDASanitizerDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            with lock:
                return super().__torch_dispatch__(func, types, args, kwargs)
    mode = Shared()
    rank_on, comm_thread = launch._rank_on, minizero.comm_thread

    import contextlib

    @contextlib.contextmanager
    def checked(device):
        with rank_on(device), mode:
            yield

    def checked_thread(comm):
        pool = comm_thread(comm)
        pool.submit(mode.__enter__).result()  # (one worker: its mode stays entered)
        return pool
    launch._rank_on, minizero.comm_thread = checked, checked_thread
    mode.__enter__()


def _jitter():
    """Every message's and read's event is recorded after a random sleep queued on the
    making stream (0-2 ms on the GPU, none on the host): a receiver that reads without
    waiting for the event reads what is not made yet."""
    from minizero_lib import nccl_model
    made, cycles = nccl_model._made, _cycles(1)

    def late(t):
        if nccl_model.on_gpu(t):
            torch.cuda._sleep(random.randint(0, 2 * cycles))
        return made(t)
    nccl_model._made = late


PROBES = dict(versions=versions, wait=wait, syncs=syncs, offload=offload, profile=profile)


def main(argv):
    """`csan -- ARGS` or `jitter -- ARGS`: pytest ARGS so instrumented; else each probe named,
    in order (one that raises says so on its line, and the rest still run)."""
    if argv and argv[0] in ("csan", "jitter"):
        import pytest
        _csan() if argv[0] == "csan" else _jitter()
        return pytest.main(argv[argv.index("--") + 1:] if "--" in argv else [])
    unknown = [a for a in argv if a not in PROBES]
    if unknown or not argv:
        sys.exit(f"gpu_probe.py: unknown probe {unknown[:1] or '(none)'}; the probes: "
                 f"{', '.join(PROBES)}, csan -- ARGS, jitter -- ARGS")
    rc = 0
    for name in argv:
        try:
            rc = max(rc, PROBES[name]() or 0)
        except Exception as e:
            traceback.print_exc()
            print(f"probe {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rc = 1
    return rc


if __name__ == "__main__":
    torch.set_num_threads(4)
    sys.exit(main(sys.argv[1:]))

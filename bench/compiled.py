"""
Compiled against eager (--compile): what torch.compile of each block buys minizero at stages
0 and 3, beside what it buys torch's own DDP and FSDP2 on the same GPT, in one world.

Every row trains the timing table's GPT (speed.py's interleaved reps: machine noise hits
all rows alike); a compiled row compiles each block (inductor, CPU) during its warm-up:
torch's rows before DDP or FSDP2 wrap the model (torchtitan's order), minizero's after
Engine(...). A kind's speedup is eager / compiled, the median over reps of the ratio within
a rep; the target is that minizero keeps at least 95% of torch's own: stage 0's speedup
over DDP's, stage 3's over FSDP2's, at least 0.95.
"""
import time
from dataclasses import replace

from bench.common import Variant, medians, paired, slowest
from bench.speed import time_world
from minizero_lib import launch

# (kind, stage, native) of each pair of rows: minizero on torch's collectives, as torch's
KINDS = {"torch-ddp": ("ddp", 0, False), "torch-fsdp2": ("fsdp2", 0, False),
         "stage0-native": ("zero", 0, True), "stage3-native": ("zero", 3, True)}
# whose speedup each of minizero's is held to
AGAINST = {"stage0-native": "torch-ddp", "stage3-native": "torch-fsdp2"}


def compiled_variants():
    """Each kind eager and compiled, the two one after the other (a rep rotates the order)."""
    return tuple(Variant(name + ("-compiled" if c else ""), kind, stage, native, compile=c)
                 for name, (kind, stage, native) in KINDS.items() for c in (False, True))


def compiled_table(cfg):
    """--compile: ms/step eager and compiled per kind, each kind's speedup, and minizero's
    speedup over torch's."""
    cfg = replace(cfg, variants=compiled_variants(), warmup=max(cfg.warmup, 3))
    N, t_start = cfg.world_size, time.time()
    print(f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide, batch {cfg.batch}x{cfg.block} per "
          f"rank, {N} gloo CPU ranks, 1 torch thread each; each block compiled (inductor) or "
          f"eager; medians over {cfg.reps} interleaved reps of {cfg.steps} steps after "
          f"{cfg.warmup} warm-up (the compile)", flush=True)
    res = launch.run_processes(time_world, N, cfg, check=False, timeout=1800)
    names = [v.name for v in cfg.variants]
    times = slowest(res, names, cfg.reps)
    ms = medians(times)
    speedup = {k: paired(times, k, k + "-compiled") for k in KINDS}
    print(f"\n{'kind':<16}{'eager ms':>10}{'compiled ms':>13}{'eager/compiled':>16}"
          f"{'last loss eager, compiled':>28}")
    for k in KINDS:
        eager, comp = res[0][k]["loss"], res[0][k + "-compiled"]["loss"]
        print(f"{k:<16}{ms[k]:>10.1f}{ms[k + '-compiled']:>13.1f}{speedup[k]:>15.3f}x"
              f"{eager:>18.4f}, {comp:.4f}")
    kept = {k: speedup[k] / speedup[t] for k, t in AGAINST.items()}
    verdict = ", ".join(f"{k} {kept[k]:.3f} of {t}'s ({'met' if kept[k] >= 0.95 else 'MISSED'})"
                        for k, t in AGAINST.items())
    print(f"  eager/compiled: the median over reps of the ratio within a rep; "
          f"{time.time() - t_start:.0f} s\ntarget: minizero keeps >= 0.95 of torch's compile "
          f"speedup: {verdict}")
    print("summary: compile speedup " + "  ".join(f"{k} {speedup[k]:.2f}x" for k in KINDS))
    return speedup

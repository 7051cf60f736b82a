"""
The tree's order against the ring's (--tree): Engine(reduce_order="tree") at stages 0 and 3,
beside the same stage on the ring, at 2 and 4 ranks, in one run. Both send the same bytes; the
tree sends them in log2 N messages instead of N-1, keeps log2 A + 1 partial sums, and sums the
clipping norm as a tree. Every row trains the timing table's GPT (speed.py's interleaved reps);
tree/ring is the median over reps of the ratio within a rep.
"""
import time
from dataclasses import replace

from bench.common import Variant, medians, paired, slowest
from bench.speed import time_world
from minizero_lib import launch


def tree_variants():
    """Each stage's ring and tree rows, one after the other (a rep rotates the order)."""
    return tuple(Variant(f"stage{s}-{order}", "zero", s, order=order)
                 for s in (0, 3) for order in ("ring", "tree"))


def tree_table(cfg, world_sizes=(2, 4)):
    """--tree: ms/step of the ring and the tree per stage and world size, and tree/ring."""
    cfg = replace(cfg, variants=tree_variants())
    t_start, ratios = time.time(), {}
    print(f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide, batch {cfg.batch}x{cfg.block} per rank, "
          f"gloo CPU ranks, 1 torch thread each; medians over {cfg.reps} interleaved reps of "
          f"{cfg.steps} steps after {cfg.warmup} warm-up", flush=True)
    print(f"\n{'ranks':<7}{'stage':<7}{'ring ms':>9}{'tree ms':>9}{'tree/ring':>11}"
          f"{'sent/step ring, tree (bytes)':>31}")
    for n in world_sizes:
        res = launch.run_processes(time_world, n, replace(cfg, world_size=n), check=False,
                                   timeout=900)
        names = [v.name for v in cfg.variants]
        times = slowest(res, names, cfg.reps)
        ms = medians(times)
        for s in (0, 3):
            ring, tree = f"stage{s}-ring", f"stage{s}-tree"
            ratios[n, s] = paired(times, tree, ring)
            print(f"{n:<7}{s:<7}{ms[ring]:>9.1f}{ms[tree]:>9.1f}{ratios[n, s]:>10.2f}x"
                  f"{res[0][ring]['sent']:>17,}, {res[0][tree]['sent']:,}")
    print(f"  sent/step: rank 0's ledger, one step (the same payload: (N-1)/N of Psi per "
          f"collective); {time.time() - t_start:.0f} s")
    print("summary: tree/ring " + "  ".join(f"{n} ranks stage {s} {r:.2f}x"
                                             for (n, s), r in ratios.items()))
    return ratios

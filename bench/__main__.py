"""
Benchmark minizero against torch's own DistributedDataParallel and FSDP2 on local gloo
CPU ranks, and measure how much bigger a model ZeRO-3 fits than DDP.

    python -m bench                  # the timing table, world size 2 (speed.py)
    python -m bench --world-size 4
    python -m bench --quick          # CI: tiny model, one rep, a few rows (< 1 min)
    python -m bench --max-model      # largest GPT per rank budget: DDP, FSDP2, stage 3
                                     # (+ disk), 4 ranks (memory.py)
    python -m bench --overhead       # one rank: minizero against a plain torch loop
                                     # (GPU if there is one; overhead.py)
    python -m bench --compile        # each block compiled vs eager: stages 0 and 3
                                     # beside DDP and FSDP2 (compiled.py)
    python -m bench --tree           # reduce_order tree against the ring, stages 0 and 3,
                                     # at 2 and 4 ranks (tree.py)
    python -m bench --gpu [--quick]  # gpu_check.sh: overhead over a plain torch loop,
                                     # rows on CUDA (gpu.py)
    python -m bench --plot DIR [--quick]  # memory.png and timeline.png (figures.py;
                                          # needs matplotlib: ".[plot]")

Each mode's module says how it measures; what they share is in common.py.
"""
import argparse
from dataclasses import replace

from bench.common import Config
from bench.compiled import compiled_table
from bench.figures import plot
from bench.gpu import gpu_bench
from bench.memory import max_model
from bench.overhead import overhead_summary
from bench.speed import timing_table, variants
from bench.tree import tree_table


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=None,
                    help="ranks (default 2; 4 with --max-model)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, one rep, fewer rows: proves it runs")
    ap.add_argument("--max-model", action="store_true",
                    help="the scale claim: largest model per budget")
    ap.add_argument("--overhead", action="store_true",
                    help="one rank: minizero against a plain torch loop")
    ap.add_argument("--compile", action="store_true",
                    help="each block compiled vs eager, minizero beside torch's DDP and FSDP2")
    ap.add_argument("--tree", action="store_true",
                    help="reduce_order tree against the ring, stages 0 and 3, at 2 and 4 ranks")
    ap.add_argument("--gpu", action="store_true", help="gpu_check.sh: overhead over a plain "
                    "torch loop, native rows on CUDA (tiny on the CPU)")
    ap.add_argument("--budget-mb", type=int, default=Config.budget_mb,
                    help=f"--max-model: MiB of peak RSS per rank above baseline "
                         f"(default {Config.budget_mb})")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant per rep")
    ap.add_argument("--plot", metavar="DIR",
                    help="write memory.png and timeline.png there (needs matplotlib)")
    return ap.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    if a.plot:
        return plot(a.plot, a.quick)
    if a.gpu:
        gpu_bench(a.quick)
    elif a.max_model:  # wide and shallow per layer, tiny batch: model state dominates activations
        max_model(Config(world_size=a.world_size or 4, n_head=8, n_embd=512, block=32, batch=1,
                         budget_mb=a.budget_mb))
    else:
        cfg = Config(world_size=a.world_size or 2, variants=tuple(variants(a.quick)))
        if a.quick:
            cfg = replace(cfg, n_layer=2, n_embd=64, block=32, batch=4, reps=1, steps=2)
        cfg = replace(cfg, reps=a.reps or cfg.reps, steps=a.steps or cfg.steps)
        if a.overhead:
            overhead_summary(cfg)
        elif a.compile:
            compiled_table(cfg)
        elif a.tree:
            tree_table(cfg)
        else:
            timing_table(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""
The command line of `python minizero.py` (train_gpt.py has its own):

    python minizero.py --params 7.5e9 --world-size 64 [--dtype bf16] [--memory 80GB]
                       [--offload disk] [--optimizer adamw|sgd|muon|adafactor]
    python minizero.py --params 7.5e9 --world-size 1024 --gpus-per-node 8 [--shard-size 8]
                       [--intra-gbps 900 --inter-gbps 400 --latency-us 5 --units 32]
                       [--grad-accum 16]   (each mode's bytes: reduce_every, reshard_after_forward)
    python minizero.py consolidate CHECKPOINT_DIR OUT.pt  (or --out-dir DIR OUT.pt: DIR's newest)
    python minizero.py check FILE.py [--world-sizes 1,2,3,4] [--dtype bf16] [--processes] ...

A user's mistake is one line on stderr and exit status 2; tracebacks are for bugs.
"""
import argparse
import importlib
import os
import sys
import time

import torch

from minizero_lib import checkpoint
from minizero_lib.ds_config import dtype_arg, reshard_arg
from minizero_lib.optimizers import OPTIMIZERS
from minizero_lib.planner import Links, parse_bytes, plan, plan_hybrid, plan_modes, plan_zeropp

# `python minizero.py --help` lists every command (each has its own --help): the docstring's
COMMANDS = "commands:\n" + __doc__.split("\n\n")[1]


def main(argv):
    if argv[:1] == ["check"]:  # the proof on your model (check.py)
        sys.exit(check_main(argv[1:]))
    try:
        if argv[:1] == ["consolidate"]:
            return consolidate_main(argv[1:])
        ap = argparse.ArgumentParser(prog="minizero.py", allow_abbrev=False, epilog=COMMANDS,
                                     description="ZeRO memory planner: model-state bytes per "
                                                 "rank, per stage",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7.5e9")
        ap.add_argument("--world-size", type=int, required=True)
        ap.add_argument("--dtype", type=dtype_arg, default="bfloat16", help="fp32, bf16 or fp16")
        ap.add_argument("--memory",
                        help="memory per rank, e.g. 80GB, 80GiB, 1TB (a bare number: GB): "
                             "also print the largest model per stage")
        ap.add_argument("--offload", choices=["cpu", "disk"],
                        help="the optimizer state off the device (stages 1-3): print what stays "
                             "resident")
        ap.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw",
                        help="its state per parameter beside the fp32 master: AdamW m, v; SGD "
                             "(with momentum) and Muon a momentum; Adafactor's factored rows and "
                             "columns, counted as 0")
        ap.add_argument("--gpus-per-node", type=int,
                        help="also print flat against hybrid sharding: bytes inside and across "
                             "nodes, and the ring model's time")
        ap.add_argument("--shard-size", type=int,
                        help="hybrid: ranks a unit is sharded over (default: a node)")
        ap.add_argument("--intra-gbps", type=float, default=900.0,
                        help="link inside a node, Gbit/s per GPU and direction (default 900)")
        ap.add_argument("--inter-gbps", type=float, default=400.0,
                        help="link across nodes, Gbit/s per GPU and direction (default 400)")
        ap.add_argument("--latency-us", type=float, default=5.0,
                        help="per ring hop, microseconds (default 5)")
        ap.add_argument("--units", type=int, default=32,
                        help="units (layers): collectives per step (default 32)")
        ap.add_argument("--grad-accum", type=int,
                        help="with --gpus-per-node: micro-batches per step; also print each mode "
                             "(reduce_every, stage 3's reshard_after_forward)")
        a = ap.parse_args(argv)
        memory = parse_bytes(a.memory) if a.memory is not None else None
        dtype = getattr(torch, a.dtype)
        lines = plan(a.params, a.world_size, dtype, memory, a.offload, a.optimizer, verdict=True)
        if a.gpus_per_node is not None or a.shard_size is not None:  # flat against hybrid sharding
            links = Links(a.intra_gbps * 1e9 / 8, a.inter_gbps * 1e9 / 8, a.latency_us * 1e-6)
            node, S = a.gpus_per_node or a.world_size, a.shard_size or a.gpus_per_node
            lines += [""] + plan_hybrid(a.params, a.world_size, node, S, links, a.units, dtype)
            if a.grad_accum is not None:
                lines += [""] + plan_modes(a.params, a.world_size, node, S, links, a.units, dtype,
                                           a.grad_accum)
            lines += [""] + plan_zeropp(a.params, a.world_size, node, links, a.units, dtype)
        print("\n".join(lines))
    except (ValueError, OSError) as e:  # the user's input: one line, as argparse's own errors
        print(f"minizero.py: error: {e}", file=sys.stderr)
        sys.exit(2)


# -----------------------------------------------------------------------------
# consolidate: a sharded checkpoint (checkpoint.py) as one plain state_dict


def consolidate_main(args):
    """A sharded checkpoint as one plain state_dict, no process group: CHECKPOINT_DIR, or the
    newest complete step-N checkpoint in train_gpt.py's --out-dir DIR (or CHECKPOINT_DIR)."""
    ap = argparse.ArgumentParser(prog="python minizero.py consolidate", allow_abbrev=False,
                                 usage="%(prog)s CHECKPOINT_DIR OUT.pt, or --out-dir DIR OUT.pt",
                                 description=consolidate_main.__doc__)
    ap.add_argument("paths", nargs="*", help="CHECKPOINT_DIR OUT.pt, or OUT.pt after --out-dir")
    ap.add_argument("--out-dir", help="train_gpt.py's --out-dir: its newest complete checkpoint")
    a = ap.parse_args(args)
    if len(a.paths) != 2 - bool(a.out_dir):
        raise ValueError(ap.format_usage().strip())
    path, out = (a.out_dir, *a.paths) if a.out_dir else a.paths
    folder = os.path.dirname(os.path.abspath(out))  # checked before the checkpoint is read
    if os.path.isdir(out):
        raise ValueError(f"OUT {out} is a directory; give a file name, like "
                         f"{os.path.join(out, 'model.pt')}")
    if not os.path.isdir(folder):
        raise ValueError(f"OUT {out}: the directory {folder} does not exist; create it first")
    found = checkpoint.checkpoints(path)  # a run's folder of step-N checkpoints: the newest
    if found and (a.out_dir or not os.path.exists(os.path.join(path, "manifest.json"))):
        path = found[0]
    step = (checkpoint.read_manifest(path).get("meta") or {}).get("step", "unknown")  # (or raise)
    print(f"consolidating {path} (training step {step}): reading every shard...", flush=True)
    state = checkpoint.consolidate(path)
    torch.save(state, out)
    print(f"wrote {len(state)} tensors to {out}; model.load_state_dict(torch.load(...)) takes them")


# -----------------------------------------------------------------------------
# check: the equivalence proof on the user's model (check.py)


def check_main(argv):
    """Exit 0 when everything agrees, 1 when something diverges, 2 on bad input."""
    from minizero_lib import check  # (only this command needs the engine)
    ap = argparse.ArgumentParser(prog="python minizero.py check", allow_abbrev=False,
                                 description=check.__doc__.split("\n\n")[0])
    ap.add_argument("file", help="a .py file defining make_model(), make_batch(step, rank, micro), "
                                 "optionally loss_fn(model, batch) and an ENGINE dict of Engine "
                                 "options")
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--world-sizes", type=ints, default=(1, 2, 3, 4))
    ap.add_argument("--stages", type=ints, default=(0, 1, 2, 3))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", type=dtype_arg, help="fp32 (float32), bf16 (bfloat16) or fp16")
    ap.add_argument("--grad-accum", type=int)
    ap.add_argument("--shard-size", type=int,
                    help="hybrid: shard over groups of this many ranks (dividing each world size)")
    ap.add_argument("--reduce-every", choices=["micro_batch", "step"],
                    help="step: one gradient reduction per step (DDP's no_sync)")
    ap.add_argument("--reshard-after-forward",
                    help="stage 3: true, false (keep for backward), or N: hpZ among N ranks")
    ap.add_argument("--quantize-grads", type=int, choices=[8, 4],
                    help="ZeRO++ qgZ: int8 or int4 gradients on the wire (refereed loosely)")
    ap.add_argument("--reduce-order", choices=["ring", "tree"],
                    help="tree: the same bits at any world size, each held to the first's")
    ap.add_argument("--processes", action="store_true", help="gloo processes instead of threads")
    ap.add_argument("--jitter", action="store_true", help="random delays in the communication jobs")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each unit's module after Engine(...), as torchtitan")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the ranks share one GPU (--processes: one nccl process per GPU)")
    a = ap.parse_args(argv)
    if a.device == "cuda":  # before the user's file may start cuBLAS (check.deterministic)
        os.environ.setdefault(*check.CUBLAS)
    try:
        user = _load(a.file)
        kw = dict(getattr(user, "ENGINE", {}))
        if a.dtype:
            kw["dtype"] = getattr(torch, a.dtype)
        if a.grad_accum:
            kw["grad_accum"] = a.grad_accum
        for key in ("shard_size", "reduce_every", "quantize_grads", "reduce_order"):
            if getattr(a, key) is not None:
                kw[key] = getattr(a, key)
        if a.reshard_after_forward is not None:
            kw["reshard_after_forward"] = reshard_arg(a.reshard_after_forward)
        if min(a.world_sizes) < 1 or a.steps < 1 or not set(a.stages) <= {0, 1, 2, 3}:
            raise ValueError("world sizes and --steps must be >= 1, stages among 0,1,2,3")
        t0 = time.perf_counter()
        report = check.check(user.make_model, user.make_batch,
                             loss_fn=getattr(user, "loss_fn", None), world_sizes=a.world_sizes,
                             stages=a.stages, steps=a.steps, processes=a.processes,
                             jitter=a.jitter, device=a.device, compile=a.compile,
                             progress=progress_lines(a), **kw)
    except (ValueError, TypeError, AttributeError, ImportError, OSError, SyntaxError) as e:
        print(f"check: {a.file}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(report)
    print(f"{time.perf_counter() - t0:.1f} s")
    errors = [r.first for r in report.rows if r.first is not None and r.first.what == "error"]
    if errors:
        print(f"check: {a.file}: the model failed to run: {errors[0].name}", file=sys.stderr)
        return 2
    return 0 if report.ok else 1


def progress_lines(a):
    """check()'s progress callback: a line as the first run (world size, stage) starts and one
    as each ends, naming the run that starts next; on stdout, before the report's table."""
    runs, done = [(n, s) for n in a.world_sizes for s in sorted({0, *a.stages})], []

    def progress(n, s, row):
        if row is None and not done:
            print(f"check: {len(runs)} runs; now world size {n}, stage {s}...", flush=True)
        elif row is not None:
            done.append(row)
            what = f"failed ({row.first.what})" if row.first else "agrees" if s else "held to torch"
            k = len(done)
            after = "; now world size {}, stage {}...".format(*runs[k]) if k < len(runs) else ""
            print(f"check: world size {n}, stage {s}: {what}, {row.seconds:.1f} s ({k} of "
                  f"{len(runs)}){after}", flush=True)
    return progress


def _load(path):
    """Import FILE.py as a module by its name (so that processes can import it too)."""
    if not os.path.isfile(path):
        raise OSError(f"no such file {path}")
    folder, name = os.path.split(os.path.abspath(path))
    sys.path.insert(0, folder)
    sys.modules.pop(os.path.splitext(name)[0], None)  # another file of that name may be loaded
    module = importlib.import_module(os.path.splitext(name)[0])
    for fn in ("make_model", "make_batch"):
        if not callable(getattr(module, fn, None)):
            raise AttributeError(f"it defines no function {fn}(); see example_check.py")
    return module

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
import math
import os
import sys
import time
from typing import NamedTuple

import torch

from minizero import sharded
from minizero_lib import checkpoint
from minizero_lib.ds_config import dtype_arg, reshard_arg
from minizero_lib.formulas import comm_bytes_per_step, model_state_bytes, offloaded_bytes
from minizero_lib.optimizers import GATHERED, OPTIMIZERS, STATE_PER_PARAM
from minizero_lib.quantize import BLOCK, packed_bytes

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
# the planner: stages.py's formulas as a table; for hybrid sharding, also the bytes per
# link (link_bytes_per_step) and the ring model's time


def plan(params, world_size, dtype=torch.bfloat16, memory=None, offload=None, optimizer="adamw",
         verdict=False):
    """Lines of the planner's table, from the same formulas the tests hold the engine to
    (the optimizer's state: STATE_PER_PARAM fp32 elements per parameter); verdict=True: a last
    line naming the stages whose model state does not fit in memory."""
    if not (math.isfinite(params) and params >= 1):
        raise ValueError("the parameter count must be a finite number >= 1, like --params 7.5e9; "
                         f"got {params}")
    if world_size < 1:
        raise ValueError(f"the world size must be at least 1 rank; got {world_size}")
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise ValueError("the memory per rank must be a positive size, like --memory 80GB; got "
                         f"{memory:.3g} B")
    numel = -(-int(params) // world_size) * world_size
    rows = [["stage", "params", "grads", "optimizer", "total/rank",
             "sent/step"] + (["offloaded"] if offload else [])]
    k, gathered = STATE_PER_PARAM[optimizer], {optimizer: numel} if optimizer in GATHERED else None
    for stage in range(4):
        off = offload if stage else None  # stage 0 keeps the whole state on the device
        state = lambda n: k * n // (world_size if sharded(stage)["optimizer"] else 1)  # noqa: E731
        b = model_state_bytes(numel, world_size, stage, dtype, off, state=state(numel))
        sent = sum(comm_bytes_per_step(numel, world_size, stage, dtype,
                                       whole_numel=gathered).values())
        gb = [b["params"], b["grads"], b["optimizer"], sum(b.values()), sent]
        gb += [sum(offloaded_bytes(numel, world_size, stage, dtype, off,
                                   state=state(numel)).values())] \
            if offload else []
        rows.append([str(stage)] + [f"{x / 1e9:.2f}" for x in gb])
        if memory:
            per_param = sum(model_state_bytes(world_size, world_size, stage, dtype, off,
                                              state=state(world_size)).values()) / world_size
            rows[-1].append(f"{memory / per_param:.3g} parameters")
    if memory:
        rows[0].append("largest model that fits")
    cols = 7 if offload else 6
    # so that numbers never run together
    widths = [2 + max(len(r[i]) for r in rows) for i in range(cols)]
    title = (f"{params:.3g} parameters, {world_size} ranks, {str(dtype).replace('torch.', '')} "
             f"compute, {optimizer} (GB = 1e9 bytes; model state only: activations and buffers "
             "come on top)"
             + ("\nresident per rank; 'offloaded': the optimizer's fp32 master and state in "
                f"{offload} ({'host memory' if offload == 'cpu' else 'files'}), stages 1-3"
                if offload else ""))
    over = [f"stage {r[0]} ({r[4]} GB)" for r in rows[1:] if memory and float(r[4]) * 1e9 > memory]
    fit = f"in {memory / 1e9:.3g} GB per rank (model state alone)" if memory else ""
    fit = f"does not fit {fit}: {', '.join(over)}" if over else f"every stage fits {fit}"
    return [title] + [r[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(r[1:cols],
                                                                                 widths[1:]))
                      + "".join("  " + c for c in r[cols:]) for r in rows] \
        + ([fit] if verdict and memory else [])


class Links(NamedTuple):
    """The ring model's machine: bytes/s per GPU and direction inside a node and across
    nodes, and seconds per ring hop."""
    intra: float
    inter: float
    latency: float


def link_bytes_per_step(numel, world_size, stage, node_size, dtype=torch.bfloat16, grad_accum=1,
                        reduce_dtype=None, shard_size=None, **modes):
    """Payload bytes a node's ranks send in one step, nodes being node_size consecutive
    ranks -> {"intra": to ranks in the node, "inter": to other nodes, each the most any
    node sends; "busiest": the most one rank sends to other nodes}. A ring sends each
    rank's bytes to the next rank of its ring: the shard group's ring for the
    reduce-scatters and all-gathers, the replicas' ring for the all-reduce. Flat, one rank
    per node sends all it sends across; hybrid with S = node_size, every rank sends only
    its all-reduce across. modes: reduce_every=, reshard_after_forward= (hpZ's G: its
    backward gathers run on rings of G consecutive ranks)."""
    S = shard_size or world_size
    G = modes.get("reshard_after_forward")
    intra, inter = [0] * world_size, [0] * world_size  # per rank
    sent = comm_bytes_per_step(numel, S, stage, dtype, grad_accum, reduce_dtype, world_size // S,
                               **modes)
    for kind, b in sent.items():
        for r in range(world_size):
            ring = G if kind == "hpz_gather" else S
            right = (r + S) % world_size if kind == "all_reduce" else r - r % ring + (r + 1) % ring
            (inter if right // node_size != r // node_size else intra)[r] += b
    # noqa: E731
    node = lambda per_rank: max(sum(per_rank[n:n + node_size]) for n in range(0, world_size,
                                                                              node_size))
    return {"intra": node(intra), "inter": node(inter), "busiest": max(inter)}


def ring_seconds(numel, world_size, stage, node_size, shard_size, links, units,
                 dtype=torch.bfloat16, grad_accum=1, reduce_every="micro_batch",
                 reshard_after_forward=True, reduce_order="ring"):
    """Communication time per step in the ring model, nothing overlapped: a ring collective
    on n ranks is n-1 hops (an all-reduce 2(n-1)), each a latency, and every rank sends its
    bytes at the bandwidth of the slowest link the ring crosses (across nodes if any hop
    leaves a node). Each unit runs its own collectives: latency counts per unit. At
    grad_accum micro-batches, in a mode (reduce_every, reshard_after_forward) as formulas.py;
    reduce_order="tree": one reduce-scatter per step by recursive halving, log2 n messages
    (the copies' all-reduce: log2 R, then R-1 for its all-gather), the ring's bytes.
    -> (bandwidth seconds, latency seconds)."""
    S, R, N, k = shard_size, world_size // shard_size, world_size, grad_accum
    G = reshard_after_forward
    shard_rings = [list(range(g, g + S)) for g in range(0, N, S)]
    replica_rings = [list(range(p, N, S)) for p in range(S)]

    def bandwidth(rings):
        crosses = any(a // node_size != b // node_size
                      for ring in rings for a, b in zip(ring, ring[1:] + ring[:1]))
        return links.inter if crosses else links.intra
    # per unit and step
    tree = reduce_order == "tree"
    calls = {"reduce_scatter": 1 if reduce_every == "step" or tree else k, "all_reduce": 1,
             "hpz_gather": k, "all_gather": (2 if G is True else 1) * k if stage == 3 else 1}
    hops = {"reduce_scatter": (S - 1).bit_length() if tree else S - 1, "all_gather": S - 1,
            "all_reduce": (R - 1).bit_length() + R - 1 if tree else 2 * (R - 1),
            "hpz_gather": G - 1}
    bw = {"reduce_scatter": bandwidth(shard_rings), "all_gather": bandwidth(shard_rings),
          "all_reduce": bandwidth(replica_rings),
          "hpz_gather": type(G) is int and bandwidth([list(range(g, g + G))
                                                      for g in range(0, N, G)])}
    sent = comm_bytes_per_step(numel, S, stage, dtype, k, replicas=R, reduce_every=reduce_every,
                               reshard_after_forward=G, reduce_order=reduce_order)
    return (sum(b / bw[k] for k, b in sent.items()),
            sum(calls[k] * units * hops[k] * links.latency for k in sent))


def plan_hybrid(params, world_size, node_size, shard_size, links, units, dtype=torch.bfloat16):
    """Lines of the flat-against-hybrid table: per stage, model state per rank, payload bytes
    per step a node's ranks send inside the node and across nodes (link_bytes_per_step,
    which the tests hold the ledger to), and the ring model's communication time."""
    for name, n in (("--gpus-per-node", node_size), ("--shard-size", shard_size),
                    ("--units", units)):
        if n < 1:
            raise ValueError(f"{name} must be at least 1; got {n}")
    if world_size % node_size or world_size % shard_size:
        raise ValueError(f"--gpus-per-node {node_size} and --shard-size {shard_size} must divide "
                         f"the world size {world_size}")
    if min(links.intra, links.inter) <= 0 or links.latency < 0:
        raise ValueError("--intra-gbps and --inter-gbps must be positive, --latency-us at least 0")
    numel = -(-int(params) // world_size) * world_size
    rows = [["stage", "sharding", "memory/rank", "inside/node", "across/node", "across/rank",
             "comm s/step",
             "(bw + latency)"]]
    for stage in range(4):
        for name, S in (("flat", world_size),
                        (f"hybrid {shard_size}x{world_size // shard_size}", shard_size)):
            memory = sum(model_state_bytes(numel, S, stage, dtype).values())
            link = link_bytes_per_step(numel, world_size, stage, node_size, dtype, shard_size=S)
            bw, lat = ring_seconds(numel, world_size, stage, node_size, S, links, units, dtype)
            rows.append([str(stage), name, f"{memory / 1e9:.2f}", f"{link['intra'] / 1e9:.2f}",
                         f"{link['inter'] / 1e9:.2f}", f"{link['busiest'] / 1e9:.2f}",
                         f"{bw + lat:.3f}",
                         f"({bw:.3f} + {lat:.3f})"])
    widths = [2 + max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    R = world_size // shard_size
    title = (f"{params:.3g} parameters, {world_size // node_size} nodes x {node_size} ranks, "
             f"{str(dtype).replace('torch.', '')} (GB = 1e9 bytes; one micro-batch per step)\n"
             f"flat: each unit sharded over all {world_size} ranks; hybrid {shard_size}x{R}: over "
             f"{shard_size} consecutive ranks, copied {R} times\n"
             "bytes sent per step: by a node's ranks inside it and to other nodes; by its busiest "
             "rank across\n"
             f"time: ring model, {links.intra * 8 / 1e9:g} / {links.inter * 8 / 1e9:g} Gbit/s per "
             f"GPU inside / across nodes, {links.latency * 1e6:g} us per hop, {units} units, "
             "nothing overlapped")
    return [title] + [r[0].ljust(widths[0]) + r[1].ljust(widths[1])
                      + "".join(c.rjust(w) for c, w in zip(r[2:], widths[2:])) for r in rows]


def plan_modes(params, world_size, node_size, shard_size, links, units, dtype, grad_accum):
    """Lines of the modes table at grad_accum micro-batches: per stage, sharding (flat, hybrid)
    and mode (reduce_every, or reduce_order="tree" where every count is a power of two; stage
    3's reshard_after_forward: True, False, hpZ over a node), model state per rank, the bytes
    inside and across nodes, and the ring model's time."""
    if grad_accum < 1:
        raise ValueError(f"--grad-accum must be at least 1; got {grad_accum}")
    N, numel = world_size, -(-int(params) // world_size) * world_size
    rows = [["stage", "reduce", "reshard", "sharding", "memory/rank", "inside/node", "across/node",
             "across/rank", "comm s/step", "(bw + latency)"]]
    for stage in range(4):
        for name, S in (("flat", N), (f"hybrid {shard_size}x{N // shard_size}", shard_size)):
            hpz = [node_size] if stage == 3 and 1 < node_size < S and S % node_size == 0 else []
            for rf in ([True, False] + hpz if stage == 3 else [True]):
                tree = ["tree"] if all(x & (x - 1) == 0 for x in (S, N // S, grad_accum)) else []
                for every in ["micro_batch", "step"] + tree:
                    modes = dict(reduce_every=every, reshard_after_forward=rf)
                    if every == "tree":
                        modes.update(reduce_every="step", reduce_order="tree")
                    memory = sum(model_state_bytes(numel, S, stage, dtype, **modes,
                                                   grad_accum=grad_accum).values())
                    link = link_bytes_per_step(numel, N, stage, node_size, dtype, grad_accum,
                                               shard_size=S, **modes)
                    bw, lat = ring_seconds(numel, N, stage, node_size, S, links, units, dtype,
                                           grad_accum, **modes)
                    rf_name = "-" if stage < 3 else str(rf) if rf in (True, False) else f"hpZ {rf}"
                    rows.append([str(stage), every, rf_name, name, f"{memory / 1e9:.2f}",
                                 *(f"{link[k] / 1e9:.2f}" for k in ("intra", "inter", "busiest")),
                                 f"{bw + lat:.3f}", f"({bw:.3f} + {lat:.3f})"])
    widths = [2 + max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    title = (f"each mode at --grad-accum {grad_accum} (GB per step; memory includes what a mode "
             f"keeps in a step)\nreduce: micro_batch reduce-scatters every micro-batch; step sums "
             f"locally and reduces once (DDP's no_sync); tree: once, by recursive halving "
             f"(the same bits at any N)\nreshard (stage 3): True gathers twice per "
             f"micro-batch; False once (kept from forward to backward); hpZ G: the backward "
             f"gathers among G ranks (a node)")
    return [title] + ["".join(c.ljust(w) for c, w in zip(r[:4], widths)) +
                      "".join(c.rjust(w) for c, w in zip(r[4:], widths[4:])) for r in rows]


# -----------------------------------------------------------------------------
# ZeRO++ beside ZeRO-3: quantized messages (quantize.py) in the ring model, per move


def zeropp_moves(params, world_size, node_size, units, dtype=torch.bfloat16, block=BLOCK):
    """Stage 3's moves in one step (one micro-batch) under ZeRO-3, minizero's quantized run
    (Engine(quantize_weights=8, quantize_grads=4): int8 ring gathers, int4 flat all-to-all)
    and ZeRO++ (qwZ + qgZ + hpZ): -> {row: [(pattern, ranks, message bytes, calls)]}, per
    unit; a pattern is "ring" (N ranks in a ring), "all_to_all" (N-1 shifts) or "node" (a
    ring inside each node), over all ranks unless ranks says "node" or "across" (one rank
    per node: hierarchical qgZ's second hop). hpZ is Engine(reshard_after_forward=G): its backward
    gather stays in the node, from a copy cut over the node."""
    N, G, d = world_size, node_size, torch.finfo(dtype).bits // 8
    numel_u = -(-int(params) // (units * N)) * N  # each unit padded to a multiple of N
    int8, int4 = packed_bytes(numel_u // N, 8, block), packed_bytes(numel_u // N, 4, block)
    return {
        "ZeRO-3": [("ring", N, d * numel_u // N, 2), ("ring", N, d * numel_u // N, 1)],
        "qwZ + qgZ (minizero)": [("ring", N, int8, 2), ("all_to_all", N, int4, 1)],
        # forward gather int8 over all; backward gather in the node from hpZ's copy (Ψ/G each);
        # qgZ: an all-to-all in the node, then one across nodes among the ranks at one position
        "qwZ + qgZ + hpZ (ZeRO++)": [("ring", N, int8, 1), ("node", G, d * numel_u // G, 1),
                                     ("all_to_all", G, packed_bytes(numel_u // G, 4, block), 1),
                                     ("across", N // G, int4, 1)],
    }


def move_cost(pattern, ranks, message, calls, node_size, links):
    """One move per unit: (bytes a rank sends across nodes, bytes a node sends across, seconds).
    A ring over every rank crosses at one rank per node, whose link sets the ring's pace; a
    flat all-to-all sends N-G of its N-1 messages across from every rank, shift by shift, each
    shift as slow as its slowest pair; "node" and an all-to-all inside a node stay in it;
    "across" (a group of one rank per node, N/G ranks, at every place in the node) sends all
    its messages across."""
    G, hops = node_size, ranks - 1
    inside = pattern == "node" or (pattern == "all_to_all" and ranks == G) or ranks == 1
    if inside:
        return 0, 0, calls * hops * (message / links.intra + links.latency)
    if pattern == "ring":
        # (one rank per node sends across: the node's bytes are that rank's)
        out, per_node = hops * message, hops * message
    else:
        out = hops * message if pattern == "across" else (ranks - G) * message
        per_node = G * out
    return calls * out, calls * per_node, calls * hops * (message / links.inter + links.latency)


def plan_zeropp(params, world_size, node_size, links, units, dtype=torch.bfloat16, block=BLOCK):
    """Lines of ZeRO++ beside ZeRO-3 (stage 3, one micro-batch): bytes across nodes per rank
    and per node, and the ring model's communication time, nothing overlapped."""
    rows = [["stage 3", "across/rank GB", "across/node GB", "comm s/step"]]
    for name, moves in zeropp_moves(params, world_size, node_size, units, dtype, block).items():
        costs = [move_cost(*m, node_size, links) for m in moves]
        rank, node, secs = (units * sum(c[i] for c in costs) for i in range(3))
        rows.append([name, f"{rank / 1e9:.2f}", f"{node / 1e9:.2f}", f"{secs:.3f}"])
    widths = [2 + max(len(r[i]) for r in rows) for i in range(4)]
    title = (f"ZeRO++ beside ZeRO-3: {params:.3g} parameters, {world_size // node_size} nodes x "
             f"{node_size} ranks, int8 weights and int4 gradients in blocks of {block} (+4 bytes "
             "of scale each); hpZ: the backward gather in the node")
    return [title] + [r[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(r[1:], widths[1:]))
                      for r in rows]


BYTES = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,  # what people type after --memory
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text):
    """'80GB', '80GiB', '1TB', '512MB', '1.5TiB', or a bare number of GB -> bytes."""
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].lower() or "gb"
    if unit not in BYTES:
        raise ValueError(f"--memory {text!r}: the unit must be one of B, KB, MB, GB, TB, KiB, MiB, "
                         "GiB, TiB")
    try:
        return float(number) * BYTES[unit]
    except ValueError:
        raise ValueError(f"--memory {text!r} is not a size; give memory per rank like 80GB, 80GiB "
                         "or 80 (GB)")


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

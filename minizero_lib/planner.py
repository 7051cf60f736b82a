"""
The planner: formulas.py's formulas as tables, for models too big to run here. Per stage, the
model state per rank and the bytes a step sends (plan); for hybrid sharding, the bytes per
link and a ring model's time (plan_hybrid); each mode at grad_accum micro-batches (plan_modes);
ZeRO++'s quantized moves beside ZeRO-3's (plan_zeropp). `python minizero.py --params ...` prints
them (cli.py); the tests hold link_bytes_per_step to the ledger.
"""
import math
from typing import NamedTuple

import torch

from minizero import sharded
from minizero_lib.formulas import comm_bytes_per_step, model_state_bytes, offloaded_bytes
from minizero_lib.optimizers import GATHERED, STATE_PER_PARAM
from minizero_lib.quantize import BLOCK, packed_bytes


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

"""
The formulas: what a rank holds and sends at each stage, for Ψ parameters on N ranks:

    stage  params grads optimizer  bytes/rank (16-bit, AdamW)  sent per step
    0      full   full  full       16Ψ                         2Ψ: reduce-scatter, all-gather grads
    1      full   full  1/N        4Ψ + 12Ψ/N                  2Ψ: reduce-scatter, all-gather params
    2      full   1/N   1/N        2Ψ + 14Ψ/N                  2Ψ: the same, scattered in backward
    3      1/N    1/N   1/N        16Ψ/N                       3Ψ: gather fwd, bwd; reduce-scatter

(2 bytes of param, 2 of grad, 12 of fp32 master, m and v per parameter; "Ψ sent": a ring
collective over Ψ, each rank sending (N-1)/N·Ψ.) Below, the same in bytes, for a layout of Ψ
(padded) parameters and every mode. The tests hold the engine's measurements (Engine.memory,
.offloaded, comm.sent: measured below) to these, to the byte; the planner (cli.py) prints them
for real models. Read after minizero.py: each formula is the sum of what its stage
functions keep and send.
"""
import resource

import torch

from minizero import sharded
from minizero_lib.optimizers import GATHERED, state_numel, whole_numel
from minizero_lib.quantize import BLOCK, Quant, packed_bytes


def model_state_bytes(numel, world_size, stage, dtype=torch.bfloat16, offload=None,
                      offload_params=False,
                      reduce_dtype=None, state=None, reduce_every="micro_batch",
                      reshard_after_forward=True, reduce_order="ring", grad_accum=1):
    """Bytes of model state resident per rank, for numel (padded) parameters: params and
    grads in the compute dtype; the fp32 master (fp32 compute: the params are it) and the
    optimizer's `state` fp32 elements per rank (default AdamW's m and v, cut like master:
    16-bit AdamW keeps 2 + 2 + 12 bytes per parameter). Each is cut N ways once sharded; a
    sharded grad is the reduced shard, in reduce_dtype. Offloaded state: 0 here. Hybrid:
    world_size is S, what a unit is cut over. What a mode keeps within a step counts too:
    reduce_every="step" sums in reduce_dtype (stages 0-1: the bucket; 2-3: a whole bucket
    per unit besides the shard, +Ψ); stage 3's reshard_after_forward=False keeps every unit
    gathered from forward to backward (+Ψ params), G a secondary shard (+Ψ/G).
    reduce_order="tree" sums a step's micro-batches in a pairwise tree, in reduce_dtype: at
    most log2(grad_accum) + 1 whole partial sums alive (+that many Ψ, beside the bucket or
    the shard)."""
    d, r = torch.finfo(dtype).bits // 8, torch.finfo(reduce_dtype or dtype).bits // 8
    tree = tree_buckets(grad_accum) if reduce_order == "tree" else 0
    step = reduce_every == "step" and not tree
    g = r if sharded(stage)["grads"] or step else d
    cut = {k: world_size if c else 1 for k, c in sharded(stage).items()}
    state = 2 * numel // cut["optimizer"] if state is None else state
    opt = 0 if offload else (4 if d != 4 else 0) * numel // cut["optimizer"] + 4 * state
    rf = reshard_after_forward  # (stage 3's: every unit gathered, or the secondary shard)
    kept = 0 if rf is True else d * numel if rf is False else d * numel // rf
    return {"params": (0 if offload_params else d) * numel // cut["params"] + kept,
            "grads": (g * numel // cut["grads"]
                      + (r * numel if step and sharded(stage)["grads"] else 0) + tree * r * numel),
            "optimizer": opt}


def tree_buckets(grad_accum):
    """reduce_order="tree": the most whole partial sums a unit keeps alive, log2 A + 1."""
    return grad_accum.bit_length()


def offloaded_bytes(numel, world_size, stage, dtype=torch.bfloat16, offload=None,
                    offload_params=False,
                    state=None):
    """{where: bytes} of model state offloaded per rank: the optimizer's fp32 master and
    state (AdamW: 12Ψ/N, with fp32 compute too: the host keeps its own master) to "cpu"
    or "disk", and with offload_params the 16-bit shard to "cpu"."""
    out = {}
    if offload:
        out[offload] = (4 * numel // world_size
                        + 4 * (2 * numel // world_size if state is None else state))
    if offload_params:
        out["cpu"] = out.get("cpu", 0) + torch.finfo(dtype).bits // 8 * numel // world_size
    return out


def comm_bytes_per_step(numel, world_size, stage, dtype=torch.bfloat16, grad_accum=1,
                        reduce_dtype=None,
                        replicas=1, whole_numel=None, reduce_every="micro_batch",
                        reshard_after_forward=True, quantize_weights=None, quantize_grads=None,
                        quant_block=BLOCK, reduce_order="ring"):
    """Payload bytes one rank sends in one step, by the ledger's kinds: each ring collective
    over Ψ elements on N ranks sends (N-1)/N·Ψ. Gradients (in reduce_dtype) are
    reduce-scattered once per micro-batch; sharded params are gathered twice per micro-batch
    (forward and backward), whole ones once per step (the grads at stage 0, the updated
    params at 1-2). Hybrid: world_size is S, the shard group's ranks, and the reduced shard
    (Ψ/S) is also all-reduced across the R = replicas copies once per step, 2(R-1)/R·Ψ/S.
    A sharded optimizer with whole-tensor updates gathers what they read ("optimizer",
    GATHERED bytes per element) of the units that have them: whole_numel = {"muon"|"adafactor": Ψ}.
    reduce_every="step", and reduce_order="tree": the gradients are reduce-scattered once per
    step, whatever grad_accum (the tree: by recursive halving, the ring's bytes in log2 N
    messages; hybrid's copies the same, 2(R-1)/R·Ψ/S).
    Stage 3's reshard_after_forward=False: one gather per micro-batch (the forward's); G: the
    backward's gather runs among G ranks, (G-1)/G·Ψ each, kind "hpz_gather".
    Quantized (quantize.py): numel may be each unit's padded Ψ_u (a list), as every piece is
    padded to whole blocks; see quantized_bytes."""
    units = [numel] if isinstance(numel, int) else list(numel)
    numel, S, R, rf = sum(units), world_size, replicas, reshard_after_forward
    per = lambda n, k, t: (n - 1) * (k // n) * (torch.finfo(t).bits // 8)  # noqa: E731
    grad, param = per(S, numel, reduce_dtype or dtype), per(S, numel, dtype)
    # stage 3's gathers per step, and the gradient reductions per step
    gathers_3 = (2 if rf is True else 1) * grad_accum
    reductions = 1 if reduce_every == "step" or reduce_order == "tree" else grad_accum
    gathers = gathers_3 * param if sharded(stage)["params"] \
        else param if sharded(stage)["optimizer"] else grad
    out = {"reduce_scatter": grad * reductions, "all_gather": gathers,
           "all_reduce": 2 * per(R, numel // S, reduce_dtype or dtype),
           "hpz_gather": grad_accum * per(rf, numel, dtype) if type(rf) is int else 0}
    if whole_numel and sharded(stage)["optimizer"]:
        out["optimizer"] = sum((S - 1) * (n // S) * GATHERED[k] for k, n in whole_numel.items())
    if quantize_weights or quantize_grads:
        out.update(quantized_bytes(units, S, R, stage, gathers_3, reductions,
                                   reduce_dtype or dtype, quantize_weights, quantize_grads,
                                   quant_block))
    return {k: v for k, v in out.items() if v}


def quantized_bytes(units, S, R, stage, gathers, reductions, reduce_dtype, weights, grads, block):
    """The kinds quantization changes, summed over units Ψ_u: each of stage 3's `gathers` per
    step sends (S-1) int8 messages of Ψ_u/S values; each of the `reductions` (S-1) messages
    of grads bits; hybrid's all-reduce (R-1) of Ψ_u/(SR) values quantized, then (R-1) pieces
    exact. A message of n values: quantize.packed_bytes(n), codes and scales."""
    out, g = {}, torch.finfo(reduce_dtype).bits // 8
    if weights and sharded(stage)["params"]:
        out["all_gather"] = gathers * sum((S - 1) * packed_bytes(n // S, weights, block)
                                          for n in units)
    if grads:
        out["reduce_scatter"] = reductions * sum((S - 1) * packed_bytes(n // S, grads, block)
                                                 for n in units)
        pieces = [n // (S * R) for n in units]  # what a rank sums of each unit across replicas
        out["all_reduce"] = sum((R - 1) * (packed_bytes(p, grads, block) + g * p) for p in pieces)
    return out


def features(engine):
    """What an engine's features set (a plain engine has none: plain ZeRO's values):
    (offload, offload_params, replicas, reduce_every, reshard_after_forward, quant, order)."""
    e = engine
    return (getattr(e, "offload", None), getattr(e, "offload_params", False),
            e.replicas.world_size if getattr(e, "replicas", None) else 1,
            getattr(e, "reduce_every", "micro_batch"), getattr(e, "reshard_after_forward", True),
            getattr(e, "quant", None) or Quant(), "tree" if getattr(e, "tree", False) else "ring")


def engine_formula(engine, offloaded=False, sent=False):
    """Engine.formula: the formulas above for an engine's layout and optimizer."""
    e = engine
    offload, offload_params, replicas, every, rf, q, order = features(e)
    layout = (e.numel(), e.group.world_size, e.stage, e.dtype)
    modes = dict(reduce_every=every, reshard_after_forward=rf, reduce_order=order)
    if sent:  # (each unit's Ψ_u: a quantized piece pads to whole blocks)
        return comm_bytes_per_step([u.padded for u in e.units], *layout[1:], e.grad_accum,
                                   e.reduce_dtype, replicas, whole_numel(e.units),
                                   **modes, quantize_weights=q.weights, quantize_grads=q.grads,
                                   quant_block=q.block)
    if offloaded:
        return offloaded_bytes(*layout, offload, offload_params, state_numel(e.units))
    return model_state_bytes(*layout, offload, offload_params, e.reduce_dtype,
                             state_numel(e.units), **modes, grad_accum=e.grad_accum)


def engine_held(engine):
    """Engine.memory: held_bytes for an engine's units and modes."""
    e = engine
    offload, offload_params, _, every, rf, _, order = features(e)
    tree = tree_buckets(e.grad_accum) if order == "tree" else 0
    return held_bytes(e.units, e.device, e.stage, e.dtype, e.reduce_dtype, offload,
                      offload_params, every, rf, getattr(e, "secondary", {}), tree)


def engine_offloaded(engine):
    """Engine.offloaded: offloaded_held for an engine's units."""
    offload, offload_params, *_ = features(engine)
    return offloaded_held(engine.units, getattr(engine, "disk", None), offload,
                          offload_params)


def held_bytes(units, device, stage, dtype, reduce_dtype, offload=None, offload_params=False,
               reduce_every="micro_batch", reshard_after_forward=True, secondary=None, tree=0):
    """Measured: bytes of model state the units hold on `device` in a step, by category.
    Stages 2-3's reduced gradient shards live only from a step's first reduction to its
    update: between steps, count the ones the next step makes; so too what a mode keeps
    within a step (reduce_every="step": stages 2-3's whole bucket; reduce_order="tree": its
    partial sums; stage 3's unit kept gathered, or its secondary shard). On a CPU run what
    offload keeps in host memory is on "the device" too: offloaded_held counts it."""
    params = grads = opt = 0
    cut, rf = sharded(stage), reshard_after_forward
    own = dtype != torch.float32  # a master apart from the params (an offloaded one is not here)
    cpu = device.type == "cpu"
    for u in units:
        params += 0 if cpu and offload_params else _nbytes(device,
                                                           u.shard if cut["params"] else u.flat)
        grad = u.reduced if cut["grads"] else u.bucket
        grads += _nbytes(device, grad) if grad is not None else u.shard_size * reduce_dtype.itemsize
        if cut["grads"] and reduce_every == "step" and not tree:  # the local sum, whole
            whole = u.padded * reduce_dtype.itemsize
            grads += _nbytes(device, u.bucket) if u.bucket is not None else whole
        # reduce_order="tree": the partial sums of a step's micro-batches (at most `tree` alive)
        grads += tree * u.padded * reduce_dtype.itemsize
        if cut["params"] and rf is not True:  # gathered (False) or the secondary shard (G)
            secondary_bytes = u.padded // (1 if rf is False else rf) * dtype.itemsize
            kept = (secondary or {}).get(u.index)
            params += _nbytes(device, kept) if kept is not None else secondary_bytes
        opt += 0 if cpu and offload else _nbytes(device, *(u.state or {}).values(),
                                                 u.master if own else None)
    return {"params": params, "grads": grads, "optimizer": opt}


def offloaded_held(units, disk, offload=None, offload_params=False):
    """Measured: {where: bytes} of the units' state kept off the device: "cpu" or "disk"."""
    host = sum(_nbytes(torch.device("cpu"),
                       *([u.master, *(u.state or {}).values()] if offload == "cpu" else []),
                       u.shard if offload_params else None) for u in units)
    return {**({"disk": disk.nbytes()} if disk else {}), **({"cpu": host} if host else {})}


def _nbytes(device, *ts):
    """Bytes of those of ts (None skipped) that live on device (Engine.memory and .offloaded)."""
    return sum(t.numel() * t.element_size() for t in ts
               if t is not None and t.device.type == device.type)


def peak_memory(device):
    """Measured peak bytes of this process: CUDA's max allocated on GPU, peak RSS on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


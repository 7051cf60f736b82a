"""
What ZeRO computes: the layout every stage shares, and DDP (stage 0) and ZeRO stages 1, 2
and 3 as functions over explicit tensors. Read it after ops.py's ring collectives:

    1. the layout    every stage cuts the model's parameters the same way
    2. the stages    what each stage keeps, and the functions that reduce, update and gather

formulas.py then says what each stage holds and sends; unit.py keeps one unit's tensors and
runs these functions on them; engine.py decides when, from autograd's hooks.

A model's trainable parameters are grouped into units (each block of an nn.ModuleList,
plus the root for the rest); each unit is flattened into one buffer padded to a multiple
of the world size N, and rank r owns chunk r of it. The stages differ only in what a
rank keeps (README.md has the table). Gradients are always reduced with the same ring
reduce-scatter, so the reduced gradient shard is the same bits in every stage; AdamW and
SGD are elementwise, so updating a shard gives the same bits as updating the whole buffer,
and Muon and Adafactor gather the whole tensors they read (optimizers.py). Hence every
stage is bit-identical to DDP (DESIGN.md has the whole argument).

Hybrid sharding (Engine(shard_size=S), FSDP2's HSDP) cuts units over groups of S ranks and
copies them across the R = N/S groups: read N as S below, and see the last section.
"""
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.nn as nn

from ops import all_gather, all_reduce, reduce_scatter, split
from minizero_lib import nccl_model
from minizero_lib.optimizers import host_wait, update


# -----------------------------------------------------------------------------
# 1. the layout: units of parameters, each flattened into one padded buffer


def default_units(model):
    """The model is the root unit; every module held in an nn.ModuleList is a unit."""
    return [model] + [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml]


def group_params(model, units, sharded_params=False):
    """Give each trainable parameter to the innermost unit that holds it, once (a tied
    parameter goes to the first unit that registers it). Returns, per unit, its
    [(name, param)] in registration order. Stage 3 gathers one unit at a time: there a
    tie across units is an error."""
    index = {}
    for i, m in enumerate(units):
        if id(m) in index:
            raise ValueError(f"units lists the module {type(m).__name__} twice; list each unit "
                             "once")
        index[id(m)] = i
    groups, first, cross, seen = [[] for _ in units], {}, [], set()

    def walk(module, prefix, unit):
        unit = index.get(id(module), unit)
        seen.add(id(module))
        for name, p in module._parameters.items():
            if p is None or not p.requires_grad:
                continue
            if id(p) in first:
                if first[id(p)][0] != unit:
                    cross.append((first[id(p)][1], prefix + name))
                continue
            if unit is None:
                raise ValueError(f"parameter {prefix + name} is in no unit; add the model itself "
                                 f"to units (the root unit takes every parameter not in another)")
            first[id(p)] = (unit, prefix + name)
            groups[unit].append((prefix + name, p))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, prefix + name + ".", unit)

    walk(model, "", None)
    strangers = [type(m).__name__ for m in units if id(m) not in seen]
    if strangers:
        raise ValueError(f"units lists modules that are not part of the model: {strangers}")
    if cross and sharded_params:
        raise ValueError(f"{cross[0][0]} and {cross[0][1]} are one parameter tied across two "
                         "units; stage 3 gathers one unit at a time, so put both modules in one "
                         "unit (units=...) or use stage 0-2")
    return groups


class Layout(NamedTuple):
    """Where a unit's parameters sit in its flat buffer, and how the buffer is cut."""
    offsets: list    # where each parameter starts in the flat buffer
    numel: int       # Ψ_u, the unit's trainable elements
    padded: int      # ...plus zeros up to a multiple of N (so a chunk also cuts R ways)
    shard_size: int  # shard group rank r owns elements [r·shard_size, (r+1)·shard_size)


def layout(params, world_size, shard_group_size):
    """The flat layout of a unit's parameters on world_size ranks, cut over its shard group."""
    sizes = [p.numel() for p in params]
    numel = sum(sizes)
    padded = -(-numel // world_size) * world_size
    return Layout(list(accumulate(sizes, initial=0))[:-1], numel, padded,
                  padded // shard_group_size)


def chunk(x, shard_size, rank):
    """Rank `rank`'s chunk of a flat buffer: the elements it owns once something is sharded."""
    return x.view(-1, shard_size)[rank]


# -----------------------------------------------------------------------------
# 2. the stages. Each stage is named by what it shards (llm.c asks the same question:
# is this state sharded at this stage?); the functions below take explicit tensors.

SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}  # the first stage that shards each


def sharded(stage):
    """{"optimizer": bool, "grads": bool, "params": bool}: what a rank keeps 1/N of."""
    return {what: stage >= first for what, first in SHARDED_FROM.items()}


def reduce_grads(bucket, reduced, group):
    """Every stage, every micro-batch: reduce-scatter the local gradient bucket (each rank
    sends (N-1)/N·Ψ_u) and add this rank's shard to what earlier micro-batches reduced.
    The ring fixes the order of the sum: the same bits in every stage."""
    shard = reduce_scatter(bucket, group)
    return shard if reduced is None else reduced + shard


def ddp_gather_grads(reduced, group, out=None):
    """Stage 0, after a step's last micro-batch: all-gather the summed shard, so every rank
    holds the whole reduced gradient ((N-1)/N·Ψ_u more). reduce_grads and then this is DDP's
    all-reduce, cut in two around accumulation."""
    return all_gather(reduced, group, out=out)


def ddp_update(flat, master, state, full_grad, steps, hp, whole_rule=None):
    """Stage 0: every rank holds the whole reduced gradient and the whole optimizer
    state, and updates the whole buffer. Nothing is sent."""
    update(master, state, full_grad, steps, hp, whole_rule)
    if flat is not master:  # 16-bit compute: round the fp32 master into the params
        flat.copy_(master)


def zero_update(master, state, reduced, steps, hp, group, flat, shard, whole_rule=None):
    """Stages 1-3: each rank updates only its chunk, with its 1/N of the optimizer state
    (what Muon and Adafactor read of whole tensors is gathered: gather_whole), then shares
    it (share_params). Hybrid: each replica of a chunk makes the same update from the same
    all-reduced gradient, so the copies stay equal."""
    gather = gather_whole(group, flat.device) if whole_rule else None
    update(master, state, reduced, steps, hp, whole_rule, gather, flat.device)
    share_params(master, group, flat, shard)


def share_params(master, group, flat, shard):
    """Stages 1-2 keep whole params: all-gather the updated chunks into flat (each rank
    sends (N-1)/N·Ψ_u). Stage 3 keeps only the 16-bit shard, which the next forward
    gathers: nothing is sent here."""
    if shard is None:
        all_gather(master.to(flat.device, flat.dtype, non_blocking=True), group, out=flat)
    elif shard is not master:
        # (offload_params alone: from the GPU to the pinned shard, queued; read after an event)
        shard.copy_(master, non_blocking=True)
        if nccl_model.on_gpu(master) and not nccl_model.on_gpu(shard):
            host_wait()


def gather_params(shard, flat, group):
    """Stage 3, before a unit's forward and again before its backward: all-gather the
    16-bit shards into the unit's flat buffer (each rank sends (N-1)/N·Ψ_u)."""
    # (a shard offloaded: copied in from pinned memory, queued, not blocking: DESIGN.md §9.11)
    return all_gather(shard.to(flat.device, non_blocking=True), group, out=flat)


def release_params(flat):
    """Stage 3, after a unit's forward and after its backward: give the gathered memory
    back. flat keeps its shape, so tensors autograd saved see the data again once the
    storage is resized and regathered."""
    flat.untyped_storage().resize_(0)


def clip_coef(grad_shards, max_norm, group):
    """torch's clip_grad_norm_ coefficient. The squared norm is summed per shard, then
    across the shard group in rank order, so it is the same number in every stage. Hybrid:
    the replicas hold the same reduced shards, so the group's sum is the whole norm (over
    the replicas too it would count each element R times)."""
    local = sum((g * g).sum() for g in grad_shards).reshape(1)
    # N floats, booked apart from Ψ
    per_rank = all_gather(local, group, kind="clip")
    total = per_rank[0]
    for x in per_rank[1:]:
        total = total + x
    # (torch's max_norm / (norm + 1e-6), as the reciprocal times max_norm)
    return torch.clamp((total.sqrt() + 1e-6).reciprocal() * max_norm, max=1.0)


# -----------------------------------------------------------------------------
# helpers a first reading can skip: whole tensors for Muon and Adafactor, hybrid sharding's
# copies, stage 0's one all-reduce where it needs no reduce-scatter, and hpZ's secondary shard


def gather_whole(group, device):
    """What Muon and Adafactor read of whole tensors, all-gathered over the unit (each rank
    sends (N-1)/N·Ψ_u of it, kind "optimizer"), on the device: offloaded or not, the
    whole-tensor part runs where stage 0 runs it."""
    return lambda x: all_gather(x.to(device, non_blocking=True), group, kind="optimizer")


def all_reduce_replicas(reduced, replicas):
    """Hybrid, after a step's last micro-batch: all-reduce the reduced shard across the R
    copies of the unit (2(R-1)/R·Ψ_u/S each, the only gradient bytes that leave a shard
    group, once per step)."""
    return all_reduce(reduced, replicas, kind="all_reduce")


def ddp_all_reduce(bucket, group):
    """Stage 0 with one micro-batch, where the split into two halves buys nothing: one rank
    (its gradient is the sum: nothing moves, and its bucket is overwritten only after the
    step), or torch's own all-reduce (one collective, in the bucket, as DDP's).
    -> (reduced shard, whole)."""
    full = bucket if group.world_size == 1 else all_reduce(bucket, group, out=bucket)
    return chunk(full, full.numel() // group.world_size, group.rank), full


def keep_secondary(flat, group):
    """Stage 3 with reshard_after_forward=G (ZeRO++ hpZ), after a unit's forward: keep this
    rank's chunk of the gathered unit at G-way granularity, the secondary shard (Ψ_u/G, in
    the compute dtype). A local copy: nothing is sent."""
    return chunk(flat, flat.numel() // group.world_size, group.rank).clone()


def gather_secondary(secondary, flat, group):
    """Stage 3 with reshard_after_forward=G, before a unit's backward: all-gather the
    secondary shards among the G consecutive ranks of `group` (a node) into flat (each rank
    sends (G-1)/G·Ψ_u, kind "hpz_gather"): the backward's gather never leaves the group.
    The same bits as gather_params: both copy the one set of 16-bit values."""
    return all_gather(secondary, group, out=flat, kind="hpz_gather")


def hpz_group(comm, reshard_after_forward):
    """reshard_after_forward=G (ZeRO++ hpZ): this rank's G consecutive ranks (inside its
    shard group, as G divides S: a node), among which a unit's backward gathers; else None."""
    G = reshard_after_forward
    return split(comm, G)[0] if type(G) is int else None

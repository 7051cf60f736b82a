"""
minizero: data-parallel training with the Zero Redundancy Optimizer, DDP (stage 0) and
ZeRO stages 1, 2 and 3. This file is what ZeRO computes, read top to bottom:

    1. the layout    every stage cuts the model's parameters the same way
    2. the stages    what each stage keeps, and the functions that reduce, update and gather
    3. the formulas  bytes kept and sent per rank, which the tests hold the engine to

engine.py wires these functions to autograd's hooks (minizero.Engine is that engine);
`python minizero.py ...` is the command line of cli.py (planner, consolidate, check).

A model's trainable parameters are grouped into units (each block of an nn.ModuleList,
plus the root for the rest); each unit is flattened into one buffer padded to a multiple
of the world size N, and rank r owns chunk r of it. The stages differ only in what a
rank keeps (Ψ = parameter count):

    stage   params  grads  optimizer   sends per step
    0 DDP   full    full   full        reduce-scatter grads + all-gather grads    2Ψ
    1       full    full   1/N         reduce-scatter grads + all-gather params   2Ψ
    2       full    1/N    1/N         same, reduce-scatter during backward       2Ψ
    3       1/N     1/N    1/N         all-gather fwd + bwd + reduce-scatter       3Ψ

Gradients are always reduced with the same ring reduce-scatter (ops.py), so the reduced
gradient shard is the same bits in every stage; AdamW is elementwise, so updating a shard
gives the same bits as updating the whole buffer. Hence every stage is bit-identical to
DDP. DESIGN.md has the whole argument.

Hybrid sharding (Engine(shard_size=S), FSDP2's HSDP): units are cut over groups of S
consecutive ranks (a node) and copied across the R = N/S groups; read N as S above, and
the reduced shard is also all-reduced across the R copies once per step (DESIGN.md §10).
"""
import dataclasses
import math
import resource
import sys
from itertools import accumulate, chain
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from checkpoint import consolidate, read_checkpoint  # noqa: F401  (minizero.consolidate, for users)
from ops import all_gather, all_reduce, broadcast, check_same, reduce_scatter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def __getattr__(name):  # minizero.Engine and minizero.check, imported on first use (they import this file)
    if name == "Engine":
        from engine import Engine
        return Engine
    if name == "check":
        from check import check
        return check
    raise AttributeError(f"module 'minizero' has no attribute {name!r}")


# -----------------------------------------------------------------------------
# 1. the layout: units of parameters, each flattened into one padded buffer


def default_units(model):
    """The model is the root unit; every module held in an nn.ModuleList is a unit."""
    return [model] + [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml]


def group_params(model, units):
    """Give each trainable parameter to the innermost unit that holds it, once (a tied
    parameter goes to the first unit that registers it). Returns, per unit, its
    [(name, param)] in registration order, and the ties that cross units."""
    index = {}
    for i, m in enumerate(units):
        if id(m) in index:
            raise ValueError(f"units lists the module {type(m).__name__} twice; list each unit once")
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
    return groups, cross


def meta_owners(model, init):
    """For a model built on the meta device: where each trainable parameter's real one must
    go, id(param) -> [(module, key)] (a tie has two), or None if none is on meta. Only
    trainable parameters are made real (by init); anything else on meta is an error."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]  # built under torch.device("meta")
    if meta and init is None:
        raise ValueError(f"{meta[0]} is on the meta device: pass init=fn, fn(name, param) filling a parameter "
                         f"once its unit exists (or build the model for real)")
    frozen = [n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta and not t.requires_grad]
    if frozen:
        raise ValueError(f"{frozen[0]} (frozen, or a buffer) is on the meta device; the engine makes only "
                         f"trainable parameters real: make it real first (module.to_empty, then set it)")
    if not meta:
        return None
    owners = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            owners.setdefault(id(p), []).append((module, key))
    return owners


def materialize(named, owners, device, init):
    """For a model built on the meta device (DeepSpeed's zero.Init, FSDP2's to_empty): one
    unit's [(name, param)] made real on device, set in every module that holds them
    (owners: id(param) -> [(module, key)], so ties follow), and filled by init(name, p).
    Units are made one at a time, so no rank ever holds the whole model."""
    out = []
    for name, p in named:
        q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for module, key in owners[id(p)]:
            module._parameters[key] = q
        init(name, q)
        out.append((name, q))
    return out


class Place(NamedTuple):
    """Where a unit's state lives (engine.py decides, from Engine(offload=...))."""
    state: str = "device"   # the optimizer's master, m, v: "device", "cpu" (host memory) or "disk"
    params: str = "device"  # stage 3's 16-bit shard: "device" or "cpu"
    pin: bool = False       # host memory pinned, for fast copies to and from a GPU
    disk: object = None     # with state "disk": the offload.DiskState that holds them
    index: int = 0          # the unit's number (its file's name)

    def host(self, t, where):
        if where != "cpu":
            return t
        t = t.to("cpu", copy=True)  # (a copy on a CPU run too: the host path runs, as on a GPU)
        return t.pin_memory() if self.pin else t


class Unit:
    """One unit: its parameters flattened into `flat`, padded to a multiple of N, and
    everything this rank keeps for it. What the stage shards is held as chunk r, r this
    rank's place in `shards` (its shard group: all N ranks, or S of them when hybrid)."""

    def __init__(self, module, named, comm, shards, dtype, sharded, decay, place):
        N, S = comm.world_size, shards.world_size
        self.index = place.index                    # the unit's number, in the engine's list
        self.module = module                        # the nn.Module whose parameters these are
        self.names = [n for n, _ in named]          # their names in the model, in registration order
        self.params = [p for _, p in named]         # the nn.Parameters: views into flat
        sizes = [p.numel() for p in self.params]
        self.offsets = list(accumulate(sizes, initial=0))[:-1]  # where each parameter starts in flat
        self.numel = sum(sizes)                     # Ψ_u, the unit's trainable elements
        self.padded = -(-self.numel // N) * N       # ...plus zeros up to a multiple of N (a chunk cuts R ways)
        self.shard_size = self.padded // S          # shard group rank r owns elements [r·s, (r+1)·s)
        self.decays = [decay is None or bool(decay(n, p)) for n, p in named]  # per parameter: weight decay?
        self.used = [False] * len(self.params)      # per parameter: got a gradient this step (any rank)
        self.steps = [0] * len(self.params)         # per parameter: AdamW's step count (bias correction)
        self.flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)  # full params
        for p, o in zip(self.params, self.offsets):
            self.flat[o:o + p.numel()].copy_(p.detach().view(-1))
        self.point(self.flat)
        broadcast(self.flat, comm)  # as DDP does: every rank starts from rank 0's values
        mine = self.chunk(self.flat, shards.rank) if sharded["optimizer"] else self.flat
        self.shard = place.host(mine.clone(), place.params) if sharded["params"] else None  # stage 3: gathered
        mine = mine if self.shard is None else self.shard
        own = dtype != torch.float32 or place.state != "device"  # else the params are the master
        master = place.host(mine.float(), place.state) if own else mine
        if place.state == "disk":  # master, m and v live in a file (offload.py), not here
            place.disk.add(place.index, master)
            master = None
        self.master = master                        # fp32 params the optimizer updates
        self.m = None if master is None else torch.zeros_like(master)  # AdamW's first moment, cut like master
        self.v = None if master is None else torch.zeros_like(master)  # ...and its second moment
        self.grad = None if sharded["grads"] else torch.zeros_like(self.flat)  # stages 0-1: full bucket
        self.local = None                           # stages 2-3: that bucket, alive only until reduced
        self.reduced = None                         # the reduced gradient shard, summed over micro-batches:
                                                    # made by a step's first reduction, freed after its update
        self.full_grad = None                       # stage 0: the reduced gradient, all-gathered
        self.arrived = set()                        # parameters whose gradient came in this micro-batch
        self.ready = False                          # its local gradient is complete (this micro-batch)
        self.flushed = False                        # reduce-scattered in this micro-batch?
        self.pending = None                         # stage 3: the gather in flight or done, or None
        self.held = None                            # stage 3, in engine.gathered(): the params read there
        self.viewing = self.flat                    # the buffer the parameters are views of now
        if sharded["params"]:  # a read of a released parameter is then an error, not freed memory
            for n, p in zip(self.names, self.params):
                p.__class__, p.zero_name, p.zero_released = ShardedParameter, n, True
            release_params(self.flat)  # now, not once every unit is built: the model is never here twice

    def chunk(self, x, rank):
        return x.view(-1, self.shard_size)[rank]

    def point(self, buf):
        """Make the parameters views into buf (flat, or what engine.gathered() holds)."""
        for p, o in zip(self.params, self.offsets):
            p.data = buf[o:o + p.numel()].view(p.shape)
        self.viewing = buf

    def mark(self, released):
        """Stage 3: say whether the parameters may be read now."""
        for p in self.params:
            p.zero_released = released


def check_same_model(model, comm):
    """Collective: every rank must have built the same model, the same names, shapes,
    dtypes, trainability and ties of every parameter and buffer (each later collective's
    size depends on it). Otherwise raise on every rank, naming the first difference.
    First, the model must be on the device the communicator moves tensors on."""
    device = next(model.parameters()).device
    if device != comm.device and device.type != "meta":  # (a GPU model on CPU thread ranks would run all its backwards on one thread)
        raise ValueError(f"the model is on {device}, but this rank's communicator works on {comm.device}; "
                         f"move it there first: model.to(comm.device)")
    entries, first = [], {}
    for n, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        tie = first.setdefault(id(t), n)
        entries.append(f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                       + (" trainable" if t.requires_grad else "") + (f" = {tie}" if tie != n else ""))
    check_same(entries, comm, "the ranks built different models: parameter/buffer", "build the same model on "
               "every rank before Engine(...)")


# -----------------------------------------------------------------------------
# 2. the stages. Each stage is named by what it shards (llm.c asks the same question:
# is this state sharded at this stage?); the functions below take explicit tensors.

SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}  # the first stage that shards each


def sharded(stage):
    """{"optimizer": bool, "grads": bool, "params": bool}: what a rank keeps 1/N of (1/S, hybrid)."""
    return {what: stage >= first for what, first in SHARDED_FROM.items()}


class Hyper(NamedTuple):
    """One step's AdamW hyperparameters, and what turns the reduced gradient sum into
    the mean gradient: 1/(N·loss scale), then the clipping coefficient (or None)."""
    lr: float
    betas: tuple
    eps: float
    weight_decay: float
    unscale: float
    coef: Optional[torch.Tensor]


def adamw(p, g, m, v, t, lr, beta1, beta2, eps, decay):
    """One AdamW step, torch.optim.AdamW semantics: decoupled weight decay (decay is
    1 - lr·weight_decay), bias correction, eps outside the sqrt. Elementwise, with only
    + - * / sqrt (each rounded once, never fused), so a shard gives the same bits as the
    whole buffer, and the same on the host (offload) as on a GPU: every divisor is a
    tensor on p's device (DESIGN.md §2). p, m and v are updated in place (the same
    operations in the same order as p * decay, m * beta1 + g * (1 - beta1), ...): out of
    place, a step would need ten full-size temporaries."""
    if decay != 1:  # (x·1 is x: no pass over parameters that do not decay)
        p.mul_(decay)
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_(g.mul(g).mul_(1 - beta2))
    denom = v.sqrt().div_(torch.full((), math.sqrt(1 - beta2 ** t), device=v.device)).add_(eps)
    p.sub_(m.div(denom).mul_(lr / (1 - beta1 ** t)))
    return p, m, v


def runs(u, lo, hi, hp):
    """The pieces of the unit's parameters inside elements [lo, hi) of its layout, as
    (a, b, step count, decay factor) relative to lo; neighbours that agree are merged,
    padding is left out, and so is a parameter no rank gave a gradient this step (torch's
    AdamW skips a grad=None parameter: no decay, no moments, no step). Every stage cuts
    its range the same way, so the same elements see the same numbers."""
    out = []
    for o, p, d, t, used in zip(u.offsets, u.params, u.decays, u.steps, u.used):
        a, b = max(o, lo) - lo, min(o + p.numel(), hi) - lo
        if a >= b or not used:
            continue
        decay = 1 - hp.lr * hp.weight_decay if d and hp.weight_decay else 1.0
        if out and out[-1][1] == a and out[-1][2:] == (t, decay):
            out[-1] = (out[-1][0], b, t, decay)
        else:
            out.append((a, b, t, decay))
    return out


BLOCK = 2 ** 16  # CPU: AdamW makes ~15 passes; over 256 KiB blocks they stay in cache (~2x faster)


def update(master, m, v, grad, pieces, hp):
    """AdamW on one range of a unit (the whole buffer, or this rank's chunk): grad is
    the reduced gradient sum there; master, m and v are updated in place. Elementwise,
    so on the CPU it runs block by block: the same bits, a fraction of the memory traffic."""
    grad = grad.to(master.device)  # (offloaded: the update runs on the host)
    coef = None if hp.coef is None else hp.coef.to(master.device)
    for a, b, t, decay in pieces:
        step = BLOCK if master.is_cpu else b - a  # (a GPU: one launch per op, whole)
        for lo in range(a, b, step):
            hi = min(b, lo + step)
            g = grad[lo:hi].to(torch.float32)
            g = g if hp.unscale == 1 else g * hp.unscale  # (x·1 is x: one rank, no loss scale)
            g = g if coef is None else g * coef
            adamw(master[lo:hi], g, m[lo:hi], v[lo:hi], t, hp.lr, *hp.betas, hp.eps, decay)


def reduce_grads(local, reduced, shards, replicas, last):
    """Every stage, every micro-batch: reduce-scatter the local gradient inside the shard
    group (each rank sends (S-1)/S·Ψ_u) and add this rank's shard to what earlier
    micro-batches reduced. Hybrid, after the last micro-batch: all-reduce that shard
    across the R replicas (2(R-1)/R·Ψ_u/S each, the only gradient bytes that leave the
    group, once per step). The rings fix the order of the sum: the same bits in every stage."""
    shard = reduce_scatter(local, shards)
    reduced = shard if reduced is None else reduced + shard
    return all_reduce(reduced, replicas, kind="all_reduce") if last and replicas.world_size > 1 else reduced


def ddp_reduce(local, reduced, shards, replicas, last, out=None):
    """Stage 0: DDP's all-reduce, cut in two around accumulation. Reduce-scatter every
    micro-batch (reduce_grads); after the last, all-gather the summed shard so every rank
    holds the whole reduced gradient ((S-1)/S·Ψ_u more). -> (reduced shard, whole or None).
    On torch's collectives one micro-batch is one native all-reduce instead (not hybrid).
    One rank: its gradient is the sum, and nothing moves (its bucket is overwritten only
    after the step)."""
    if shards.world_size == 1 and replicas.world_size == 1:
        reduced = (local if last else local.clone()) if reduced is None else reduced + local
        return reduced, (reduced if last else None)
    if last and reduced is None and shards.native and replicas.world_size == 1:
        full = all_reduce(local, shards)
        return full.view(shards.world_size, -1)[shards.rank], full
    reduced = reduce_grads(local, reduced, shards, replicas, last)
    return reduced, (all_gather(reduced, shards, out=out) if last else None)


def ddp_update(flat, master, m, v, full_grad, pieces, hp):
    """Stage 0: every rank holds the whole reduced gradient and the whole optimizer
    state, and updates the whole buffer. Nothing is sent."""
    update(master, m, v, full_grad, pieces, hp)
    if flat is not master:  # 16-bit compute: round the fp32 master into the params
        flat.copy_(master)


def zero_update(master, m, v, reduced, pieces, hp, shards, flat, shard):
    """Stages 1-3: each rank updates only its chunk, with its 1/N of the optimizer state,
    then shares it in its shard group (share_params). Hybrid: each replica of a chunk
    makes the same update from the same all-reduced gradient, so the copies stay equal."""
    update(master, m, v, reduced, pieces, hp)
    share_params(master, shards, flat, shard)


def share_params(master, shards, flat, shard):
    """Stages 1-2 keep whole params: all-gather the updated chunks into flat (each rank
    sends (S-1)/S·Ψ_u, inside the group). Stage 3 keeps only the 16-bit shard, which the
    next forward gathers: nothing is sent here."""
    if shard is None:
        all_gather(master.to(flat.device, flat.dtype), shards, out=flat)
    elif shard is not master:
        shard.copy_(master)


def gather_params(shard, flat, shards):
    """Stage 3, before a unit's forward and again before its backward: all-gather the
    shard group's 16-bit shards into the unit's flat buffer (each rank sends (S-1)/S·Ψ_u)."""
    return all_gather(shard.to(flat.device), shards, out=flat)  # (a shard offloaded to the host: copied in)


def release_params(flat):
    """Stage 3, after a unit's forward and after its backward: give the gathered memory
    back. flat keeps its shape, so tensors autograd saved see the data again once the
    storage is resized and regathered."""
    flat.untyped_storage().resize_(0)


def tensors(x):
    """Every tensor in x, also inside tuples, lists, dicts and dataclasses (model outputs)."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors(y)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from tensors(getattr(x, f.name))


def cast_floats(x, dtype):
    """x with every float tensor in dtype, also inside tuples, lists and dicts."""
    return map_tensors(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


def map_tensors(x, fn):
    """x with fn applied to every tensor, also inside tuples, namedtuples, lists and dicts."""
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(map_tensors(y, fn) for y in x))
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(y, fn) for y in x)
    if isinstance(x, dict):
        return type(x)((k, map_tensors(v, fn)) for k, v in x.items())
    return x


_T = torch.Tensor  # what may be asked of a released parameter: its metadata, never its values
_METADATA = {getattr(_T, n).__get__ for n in ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf",
                                                "grad_fn", "ndim", "layout", "is_meta", "is_cuda", "is_cpu")} | {
    _T.data.__set__, _T.grad.__set__, _T.requires_grad.__set__} | {
    getattr(_T, n) for n in ("size", "dim", "numel", "nelement", "element_size", "is_floating_point",
                             "requires_grad_", "register_hook", "register_post_accumulate_grad_hook")}


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter. Between uses its storage is released, and reading it would
    read freed memory, so any op on it then raises instead (its shape, dtype and numel
    stay readable). PyTorch itself turns UninitializedParameter into a Parameter by
    assigning __class__; the engine does the same, so the user's references stay valid."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            for a in tensors((args, kwargs)):
                if isinstance(a, ShardedParameter) and a.zero_released:
                    raise RuntimeError(
                        f"{a.zero_name} is sharded across ranks (ZeRO stage 3) and not gathered now: "
                        f"read parameters inside `with engine.gathered():` (every rank enters it), or take "
                        f"engine.full_state_dict() (a collective); the engine must still be alive")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def clip_coef(grad_shards, max_norm, shards):
    """torch's clip_grad_norm_ coefficient. The squared norm is summed per shard, then
    across the shard group in rank order, so it is the same number in every stage. Hybrid:
    the replicas hold the same reduced shards, so the group's sum is the whole norm (over
    the replicas too it would count each element R times)."""
    local = sum((g * g).sum() for g in grad_shards).reshape(1)
    per_rank = all_gather(local, shards, kind="clip")   # S floats: booked apart from Ψ
    total = per_rank[0]
    for x in per_rank[1:]:
        total = total + x
    return torch.clamp((total.sqrt() + 1e-6).reciprocal() * max_norm, max=1.0)  # (torch's max_norm / (...))


# -----------------------------------------------------------------------------
# 3. the formulas


def model_state_bytes(numel, world_size, stage, dtype=torch.bfloat16, offload=None, offload_params=False,
                      reduce_dtype=None):
    """Bytes of model state resident per rank, for numel (padded) parameters. 16-bit
    compute: params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 master, m, v); fp32: params 4Ψ,
    grads 4Ψ, optimizer 8Ψ (the params are the master). Each is cut N ways once it is
    sharded; a sharded grad is the reduced shard, in reduce_dtype. Offloaded state
    (offloaded_bytes) is not resident: 0 here. Hybrid: world_size is S, what a unit is cut over."""
    d = torch.finfo(dtype).bits // 8
    g = torch.finfo(reduce_dtype or dtype).bits // 8 if sharded(stage)["grads"] else d
    per = {"params": 0 if offload_params else d, "grads": g,
           "optimizer": 0 if offload else 8 + (4 if d != 4 else 0)}
    return {k: per[k] * numel // (world_size if cut else 1) for k, cut in sharded(stage).items()}


def offloaded_bytes(numel, world_size, stage, dtype=torch.bfloat16, offload=None, offload_params=False):
    """{where: bytes} of model state offloaded per rank: the optimizer's fp32 master, m
    and v (12Ψ/N, with fp32 compute too: the host keeps its own master) to "cpu" or
    "disk", and with offload_params the 16-bit shard to "cpu"."""
    out = {}
    if offload:
        out[offload] = 12 * numel // world_size
    if offload_params:
        out["cpu"] = out.get("cpu", 0) + torch.finfo(dtype).bits // 8 * numel // world_size
    return out


def comm_bytes_per_step(numel, world_size, stage, dtype=torch.bfloat16, grad_accum=1, reduce_dtype=None,
                        replicas=1):
    """Payload bytes one rank sends in one step, by the ledger's kinds: each ring collective
    over Ψ elements on N ranks sends (N-1)/N·Ψ. Gradients (in reduce_dtype) are
    reduce-scattered once per micro-batch; sharded params are gathered twice per micro-batch
    (forward and backward), whole ones once per step (the grads at stage 0, the updated
    params at 1-2). Hybrid: world_size is S, the shard group's ranks, and the reduced shard
    (Ψ/S) is also all-reduced across the R = replicas copies once per step, 2(R-1)/R·Ψ/S."""
    S, R = world_size, replicas
    per = lambda n, k, t: (n - 1) * (k // n) * (torch.finfo(t).bits // 8)  # noqa: E731
    grad, param = per(S, numel, reduce_dtype or dtype), per(S, numel, dtype)
    gathers = 2 * grad_accum * param if sharded(stage)["params"] else param if sharded(stage)["optimizer"] else grad
    out = {"reduce_scatter": grad * grad_accum, "all_gather": gathers,
           "all_reduce": 2 * per(R, numel // S, reduce_dtype or dtype)}
    return {k: v for k, v in out.items() if v}


def link_bytes_per_step(numel, world_size, stage, node_size, dtype=torch.bfloat16, grad_accum=1,
                        reduce_dtype=None, shard_size=None):
    """Payload bytes a node's ranks send in one step, nodes being node_size consecutive
    ranks -> {"intra": to ranks in the node, "inter": to other nodes, each the most any
    node sends; "busiest": the most one rank sends to other nodes}. A ring sends each
    rank's bytes to the next rank of its ring: the shard group's ring for the
    reduce-scatters and all-gathers, the replicas' ring for the all-reduce. Flat, one rank
    per node sends all it sends across; hybrid with S = node_size, every rank sends only
    its all-reduce across."""
    S = shard_size or world_size
    intra, inter = [0] * world_size, [0] * world_size  # per rank
    for kind, b in comm_bytes_per_step(numel, S, stage, dtype, grad_accum, reduce_dtype, world_size // S).items():
        for r in range(world_size):
            right = (r + S) % world_size if kind == "all_reduce" else r - r % S + (r + 1) % S
            (inter if right // node_size != r // node_size else intra)[r] += b
    node = lambda per_rank: max(sum(per_rank[n:n + node_size]) for n in range(0, world_size, node_size))  # noqa: E731
    return {"intra": node(intra), "inter": node(inter), "busiest": max(inter)}


def _nbytes(device, *ts):
    """Bytes of those of ts (None skipped) that live on device (Engine.memory and .offloaded)."""
    return sum(t.numel() * t.element_size() for t in ts if t is not None and t.device.type == device.type)


def peak_memory(device):
    """Measured peak bytes of this process: CUDA's max allocated on GPU, peak RSS on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


if __name__ == "__main__":  # the planner, consolidate and check: cli.py
    from cli import main
    main(sys.argv[1:])

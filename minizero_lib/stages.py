"""
The stage layer of minizero: DDP (stage 0) and ZeRO stages 1, 2 and 3 as functions over
explicit tensors. This file is what ZeRO computes, read top to bottom:

    1. the layout    every stage cuts the model's parameters the same way
    2. the stages    what each stage keeps, and the functions that reduce, update and gather
    3. the formulas  bytes kept and sent per rank, which the tests hold the engine to

engine.py wires these functions to autograd's hooks (minizero.Engine is that engine);
minizero.py, above them all, is the library's face and its command line.

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
gradient shard is the same bits in every stage; AdamW and SGD are elementwise, so updating
a shard gives the same bits as updating the whole buffer, and Muon and Adafactor gather the
whole tensors they read (optimizers.py). Hence every stage is bit-identical to DDP.
DESIGN.md has the whole argument.

Hybrid sharding (Engine(shard_size=S), FSDP2's HSDP): units are cut over groups of S
consecutive ranks (a node) and copied across the R = N/S groups; read N as S above, and
the reduced shard is also all-reduced across the R copies once per step (DESIGN.md §10).
"""
import dataclasses
import resource
from itertools import accumulate, chain

import torch
import torch.nn as nn

from ops import all_gather, all_reduce, broadcast, check_same, reduce_scatter
from minizero_lib.optimizers import GATHERED, WHOLE, state_keys, state_layout, update


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
    if cross and sharded_params:
        raise ValueError(f"{cross[0][0]} and {cross[0][1]} are one parameter tied across two units; stage 3 "
                         f"gathers one unit at a time, so put both modules in one unit (units=...) or use stage 0-2")
    return groups


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


class Unit:
    """One unit: its parameters flattened into `flat`, padded to a multiple of N, and
    everything this rank keeps for it. What the stage shards is held as chunk r, r this
    rank's place in `shards` (its shard group: all N ranks, or S of them when hybrid);
    `place` (offload.Place) says where its state lives."""

    def __init__(self, module, named, comm, shards, dtype, sharded, decay, kinds, options, place):
        N, S, r = comm.world_size, shards.world_size, shards.rank
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
        self.steps = [0] * len(self.params)         # per parameter: its optimizer's step count
        self.kinds = kinds                          # per parameter: the update it gets (optimizers.py)
        self.keys = [state_keys(k, p.shape, options) for k, p in zip(kinds, self.params)]  # ...its state's keys
        self.whole = next((k for k in kinds if k in WHOLE), None)  # an update that reads whole tensors, if any
        lo, hi = (r * self.shard_size, (r + 1) * self.shard_size) if sharded["optimizer"] else (0, self.padded)
        self.pieces, self.sizes = state_layout(self.offsets, [p.shape for p in self.params], kinds, self.keys,
                                               lo, hi)  # my range's parameters, and my state's size per key
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
        state = {k: torch.zeros(n, device=master.device) for k, n in self.sizes.items()}
        if place.state == "disk":  # master and the state live in a file (offload.py), not here
            place.disk.add(place.index, {"master": master, **state})
            master, state = None, None
        self.master = master                        # fp32 params the optimizer updates
        self.state = state                          # the optimizer's state of my range, {key: fp32} (pieces)
        self.grad = None if sharded["grads"] else torch.zeros_like(self.flat)  # stages 0-1: full bucket
        self.local = None                           # stages 2-3: that bucket, alive only until reduced
        self.reduced = None                         # the reduced gradient shard, summed over micro-batches:
                                                    # made by a step's first reduction, freed after its update
        self.full_grad = None                       # stage 0: the reduced gradient, all-gathered
        self.arrived = set()                        # parameters whose gradient came in this micro-batch
        self.sums = torch.zeros(len(self.params), device=self.flat.device)  # ...the fp32 sum of each (finite check)
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


def check_engine_args(model, stage, dtype, grad_accum):
    """Engine(...) arguments that cannot work: a ValueError naming the fix."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3; got {stage!r}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16; got {dtype}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1; got {grad_accum}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to train")
    devices = {str(t.device) for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    if len(devices) > 1:
        raise ValueError(f"parameters and buffers are on different devices {sorted(devices)}; "
                         f"move the model to one device (model.to(device)) first")


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
        full = all_reduce(local, shards, out=local)  # in the bucket, as DDP's
        return full.view(shards.world_size, -1)[shards.rank], full
    reduced = reduce_grads(local, reduced, shards, replicas, last)
    return reduced, (all_gather(reduced, shards, out=out) if last else None)


def ddp_update(flat, master, state, full_grad, steps, hp, whole=None):
    """Stage 0: every rank holds the whole reduced gradient and the whole optimizer
    state, and updates the whole buffer. Nothing is sent."""
    update(master, state, full_grad, steps, hp, whole)
    if flat is not master:  # 16-bit compute: round the fp32 master into the params
        flat.copy_(master)


def zero_update(master, state, reduced, steps, hp, shards, flat, shard, whole=None):
    """Stages 1-3: each rank updates only its chunk, with its 1/N of the optimizer state (what
    Muon and Adafactor read of whole tensors gathered in the shard group: gather_whole), then
    shares it in its shard group (share_params). Hybrid: each replica of a chunk makes the
    same update from the same all-reduced gradient, so the copies stay equal."""
    update(master, state, reduced, steps, hp, whole, gather_whole(shards, flat.device) if whole else None, flat.device)
    share_params(master, shards, flat, shard)


def gather_whole(shards, device):
    """What Muon and Adafactor read of whole tensors, all-gathered over the unit (each rank
    sends (S-1)/S·Ψ_u of it, kind "optimizer"), on the device: offloaded or not, the
    whole-tensor part runs where stage 0 runs it."""
    return lambda x: all_gather(x.to(device), shards, kind="optimizer")


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
    elif isinstance(x, (tuple, list, dict)):
        for y in x.values() if isinstance(x, dict) else x:
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
                      reduce_dtype=None, state=None):
    """Bytes of model state resident per rank, for numel (padded) parameters: params and
    grads in the compute dtype; the fp32 master (fp32 compute: the params are it) and the
    optimizer's `state` fp32 elements per rank (default AdamW's m and v, cut like master:
    16-bit AdamW keeps 2 + 2 + 12 bytes per parameter). Each is cut N ways once sharded; a
    sharded grad is the reduced shard, in reduce_dtype. Offloaded state: 0 here. Hybrid:
    world_size is S, what a unit is cut over."""
    d = torch.finfo(dtype).bits // 8
    g = torch.finfo(reduce_dtype or dtype).bits // 8 if sharded(stage)["grads"] else d
    cut = {k: world_size if c else 1 for k, c in sharded(stage).items()}
    state = 2 * numel // cut["optimizer"] if state is None else state
    opt = 0 if offload else (4 if d != 4 else 0) * numel // cut["optimizer"] + 4 * state
    return {"params": (0 if offload_params else d) * numel // cut["params"], "grads": g * numel // cut["grads"],
            "optimizer": opt}


def offloaded_bytes(numel, world_size, stage, dtype=torch.bfloat16, offload=None, offload_params=False,
                    state=None):
    """{where: bytes} of model state offloaded per rank: the optimizer's fp32 master and
    state (AdamW: 12Ψ/N, with fp32 compute too: the host keeps its own master) to "cpu"
    or "disk", and with offload_params the 16-bit shard to "cpu"."""
    out = {}
    if offload:
        out[offload] = 4 * numel // world_size + 4 * (2 * numel // world_size if state is None else state)
    if offload_params:
        out["cpu"] = out.get("cpu", 0) + torch.finfo(dtype).bits // 8 * numel // world_size
    return out


def comm_bytes_per_step(numel, world_size, stage, dtype=torch.bfloat16, grad_accum=1, reduce_dtype=None,
                        replicas=1, whole=None):
    """Payload bytes one rank sends in one step, by the ledger's kinds: each ring collective
    over Ψ elements on N ranks sends (N-1)/N·Ψ. Gradients (in reduce_dtype) are
    reduce-scattered once per micro-batch; sharded params are gathered twice per micro-batch
    (forward and backward), whole ones once per step (the grads at stage 0, the updated
    params at 1-2). Hybrid: world_size is S, the shard group's ranks, and the reduced shard
    (Ψ/S) is also all-reduced across the R = replicas copies once per step, 2(R-1)/R·Ψ/S.
    A sharded optimizer with whole-tensor updates gathers what they read ("optimizer",
    GATHERED bytes per element) of the units that have them: whole = {"muon"|"adafactor": Ψ}."""
    S, R = world_size, replicas
    per = lambda n, k, t: (n - 1) * (k // n) * (torch.finfo(t).bits // 8)  # noqa: E731
    grad, param = per(S, numel, reduce_dtype or dtype), per(S, numel, dtype)
    gathers = 2 * grad_accum * param if sharded(stage)["params"] else param if sharded(stage)["optimizer"] else grad
    out = {"reduce_scatter": grad * grad_accum, "all_gather": gathers,
           "all_reduce": 2 * per(R, numel // S, reduce_dtype or dtype)}
    if whole and sharded(stage)["optimizer"]:
        out["optimizer"] = sum((S - 1) * (n // S) * GATHERED[k] for k, n in whole.items())
    return {k: v for k, v in out.items() if v}


def held_bytes(units, device, sharded, dtype, reduce_dtype, offload=None, offload_params=False):
    """Measured: bytes of model state the units hold on `device` at a step's update, by
    category. Stages 2-3's reduced gradient shards live only from a step's first reduction
    to its update: between steps, count the ones the next step makes. On a CPU run what
    offload keeps in host memory is on "the device" too: offloaded_held counts it."""
    params = grads = opt = 0
    own = dtype != torch.float32  # a master apart from the params (an offloaded one is not here)
    cpu = device.type == "cpu"
    for u in units:
        params += 0 if cpu and offload_params else _nbytes(device, u.shard if sharded["params"] else u.flat)
        grad = u.reduced if sharded["grads"] else u.grad
        grads += _nbytes(device, grad) if grad is not None else u.shard_size * reduce_dtype.itemsize
        opt += 0 if cpu and offload else _nbytes(device, *(u.state or {}).values(), u.master if own else None)
    return {"params": params, "grads": grads, "optimizer": opt}


def offloaded_held(units, disk, offload=None, offload_params=False):
    """Measured: {where: bytes} of the units' state kept off the device: "cpu" or "disk"."""
    host = sum(_nbytes(torch.device("cpu"), *([u.master, *(u.state or {}).values()] if offload == "cpu" else []),
                       u.shard if offload_params else None) for u in units)
    return {**({"disk": disk.nbytes()} if disk else {}), **({"cpu": host} if host else {})}


def _nbytes(device, *ts):
    """Bytes of those of ts (None skipped) that live on device (Engine.memory and .offloaded)."""
    return sum(t.numel() * t.element_size() for t in ts if t is not None and t.device.type == device.type)


def peak_memory(device):
    """Measured peak bytes of this process: CUDA's max allocated on GPU, peak RSS on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


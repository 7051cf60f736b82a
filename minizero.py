"""
minizero: ZeRO, the Zero Redundancy Optimizer, in one file. DDP (stage 0) and ZeRO stages 1-3
as functions over explicit shard tensors, and the Engine that runs them from autograd's hooks.
Read ops.py first (the ring collectives), then this file top to bottom: 1. the layout, 2. the
stages, 3. the optimizer on a shard, 4. a unit and its moves, 5. the engine, and what it asks
of the user's model.

    engine = minizero.Engine(model, comm, stage=3, lr=3e-4, dtype=torch.bfloat16, grad_accum=4)
    loss = model(x, y)          # call the model as usual
    engine.backward(loss)       # once per micro-batch
    engine.step()               # after grad_accum of them

Every stage gives DDP's bits: one layout, gradients always summed by the same reduce-scatter,
and AdamW and SGD round once per element, so updating a shard is updating the whole buffer,
cut (DESIGN.md §1-2). Features (hybrid sharding, offload, hpZ, quantized communication, Muon,
Adafactor, fp16's loss scale, the trace; minizero_lib/features.py) plug in at one seam,
Engine.__new__: this file imports none of them, and a run that asks for none never loads them.
"""
import functools
import math
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from ops import Pending, all_gather, broadcast, reduce_scatter

# -----------------------------------------------------------------------------
# 1. the layout. The trainable parameters are grouped into units (each block of an
# nn.ModuleList, plus the root for the rest); each unit is flattened into one buffer padded to
# a multiple of the world size N, and rank r owns chunk r of it, at every stage.


def default_units(model):
    """The model is the root unit; every module held in an nn.ModuleList is a unit."""
    return [model] + [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml]


def group_params(model, units, sharded_params=False):
    """Each trainable parameter to the innermost unit that holds it, once (a tie to the first)
    -> per unit, [(name, param)]. Stage 3 gathers one unit at a time: a tie across two fails."""
    index = {id(m): i for i, m in enumerate(units)}
    if len(index) < len(units):
        raise ValueError("units lists a module twice; list each once")
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
    if any(id(m) not in seen for m in units):
        raise ValueError("units lists modules that are not part of the model")
    if cross and sharded_params:
        raise ValueError(f"{cross[0][0]} and {cross[0][1]} are one parameter tied across two "
                         "units; stage 3 gathers one unit at a time, so put both modules in one "
                         "unit (units=...) or use stage 0-2")
    return groups


class Layout(NamedTuple):
    offsets: list    # where each parameter starts in the unit's flat buffer
    numel: int       # Ψ_u, the unit's trainable elements
    padded: int      # ...plus zeros up to a multiple of N
    shard_size: int  # rank r of the shard group owns elements [r·shard_size, (r+1)·shard_size)


def layout(params, multiple, group_size):
    """A unit's flat layout, padded to a multiple of N, cut over its shard group's ranks."""
    sizes = [p.numel() for p in params]
    padded = -(-sum(sizes) // multiple) * multiple
    return Layout(list(accumulate(sizes, initial=0))[:-1], sum(sizes), padded, padded // group_size)


def chunk(x, shard_size, rank):
    """Rank `rank`'s chunk of a flat buffer: the elements it owns once something is sharded."""
    return x.view(-1, shard_size)[rank]


# -----------------------------------------------------------------------------
# 2. the stages, each named by what it shards (llm.c asks the same question: is this state
# sharded at this stage?), and what they do to explicit tensors.

SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}  # the first stage that shards each


def sharded(stage):
    """{"optimizer": bool, "grads": bool, "params": bool}: what a rank keeps 1/N of."""
    return {what: stage >= first for what, first in SHARDED_FROM.items()}


def reduce_grads(bucket, reduced, group):
    """Every stage, every micro-batch: reduce-scatter the local gradient (each rank sends
    (N-1)/N·Ψ_u) and add this rank's shard to the step's sum. The ring's order: same bits."""
    shard = reduce_scatter(bucket, group)
    return shard if reduced is None else reduced + shard


def ddp_gather_grads(reduced, group, out=None):
    """Stage 0, a step's last micro-batch: all-gather the summed shard ((N-1)/N·Ψ_u more), so
    every rank holds the whole gradient. With reduce_grads, DDP's all-reduce cut in two."""
    return all_gather(reduced, group, out=out)


def ddp_update(flat, master, state, full_grad, steps, hp):
    """Stage 0: every rank holds the whole reduced gradient and the whole optimizer state, and
    updates the whole buffer. Nothing is sent."""
    update(master, state, full_grad, steps, hp)
    if flat is not master:  # 16-bit compute: round the fp32 master into the params
        flat.copy_(master)


def zero_update(master, state, reduced, steps, hp, group, flat, shard):
    """Stages 1-3: each rank updates only its chunk, with its 1/N of the optimizer state, then
    shares it."""
    update(master, state, reduced, steps, hp)
    share_params(master, group, flat, shard)


def share_params(master, group, flat, shard):
    """After the update. Stages 1-2 keep whole params: all-gather the updated chunks into flat
    (each rank sends (N-1)/N·Ψ_u). Stage 3 keeps its 16-bit shard only: nothing is sent."""
    if shard is None:
        all_gather(master.to(flat.device, flat.dtype, non_blocking=True), group, out=flat)
    elif shard is not master:  # (fp32 compute: the shard is the master)
        shard.copy_(master, non_blocking=True)


def gather_params(shard, flat, group):
    """Stage 3, before a unit's forward and its backward: all-gather the shards into the
    unit's flat buffer (each rank sends (N-1)/N·Ψ_u)."""
    return all_gather(shard, group, out=flat)


def release_params(flat):
    """Stage 3, after a unit's forward and its backward: give the memory back. flat keeps its
    shape, so what autograd saved sees the data again once it is regathered."""
    flat.untyped_storage().resize_(0)


def clip_coef(grad_shards, max_norm, group):
    """torch's clip_grad_norm_ coefficient. The squared norm is summed per shard, then over
    the shard group in rank order (N floats, kind "clip"): the same number at every stage."""
    local = sum((g * g).sum() for g in grad_shards).reshape(1)
    per_rank = all_gather(local, group, kind="clip")
    total = per_rank[0]
    for x in per_rank[1:]:
        total = total + x
    return coef_of(total, max_norm)


def coef_of(norm_sq, max_norm):
    """torch's max_norm / (norm + 1e-6), at most 1, as the reciprocal times max_norm."""
    return torch.clamp((norm_sq.sqrt() + 1e-6).reciprocal() * max_norm, max=1.0)


# -----------------------------------------------------------------------------
# 3. the optimizer on a shard: torch's AdamW and SGD, elementwise. Each element is rounded once
# per operation wherever a range starts, so updating chunk r gives the bits of updating the
# whole buffer: stage 1 gives stage 0's bits.

# name -> its options besides lr and weight_decay: torch.optim's names and defaults
OPTIMIZERS = {"adamw": dict(betas=(0.9, 0.999), eps=1e-8),
              "sgd": dict(momentum=0.0, nesterov=False)}


def state_keys(rule, shape, options):
    """A parameter's optimizer state, {torch.optim's name: None}: one value per element."""
    if rule == "adamw":
        return {"m": None, "v": None}
    return {"momentum_buffer": None} if options["momentum"] else {}


class Piece(NamedTuple):
    """One parameter's part of a range [lo, hi) of its unit."""
    i: int         # the parameter's index in its unit
    rule: str      # the update it gets ("adamw", "sgd"; minizero_lib/optimizers.py: more)
    shape: tuple
    o: int         # where the whole parameter starts in the unit
    lo: int        # where the range starts in the unit
    a: int         # its elements inside the range: [a, b), relative to lo
    b: int
    at: dict       # key -> (c, d): its state inside the range's tensor of that key
    decays: tuple = ()  # the [a, b) parts that decay (runs)


def state_layout(offsets, shapes, rules, keys, lo, hi):
    """The parameters in elements [lo, hi) of a unit (a Piece each), and per key the size of
    the range's state. A key every parameter has spans the range, padding too (AdamW's m and v
    are the master's twins); one only some have holds theirs back to back; a whole-tensor key
    (an element count: Adafactor's) holds each parameter's whole state."""
    full = (set.intersection(*({k for k, w in ks.items() if w is None} for ks in keys))
            if keys else set())
    sizes = {k: (hi - lo if k in full else 0) for ks in keys for k in ks}
    pieces = []
    for i, (o, shape, rule, ks) in enumerate(zip(offsets, shapes, rules, keys)):
        a, b = max(o, lo) - lo, min(o + math.prod(shape), hi) - lo
        if a >= b:
            continue
        at = {}
        for k, count in ks.items():
            if k in full:
                at[k] = (a, b)
            else:
                c = sizes[k]
                at[k] = (c, c + (b - a if count is None else count))
                sizes[k] = at[k][1]
        pieces.append(Piece(i, rule, tuple(shape), o, lo, a, b, at))
    return pieces, sizes


class Hyper(NamedTuple):
    """A step's hyperparameters; the mean gradient is the reduced sum times unscale (1/N),
    times the clip coefficient."""
    lr: float
    weight_decay: float
    options: dict
    unscale: float
    coef: Optional[torch.Tensor]


def runs(u, hp):
    """The steps of the unit's range: (Piece, step count, weight decay) for each parameter some
    rank gave a gradient (torch skips a grad=None parameter). AdamW neighbours of one step count
    merge into one piece (its decay is a multiply of its own: Piece.decays says where); SGD's
    need one weight decay too (it enters the gradient)."""
    out = []
    for p in u.pieces:
        if not u.used[p.i]:
            continue
        t, wd = u.steps[p.i], hp.weight_decay if u.decays[p.i] else 0.0
        p = p._replace(decays=((p.a, p.b),) if wd else ())
        wd = hp.weight_decay if p.rule == "adamw" else wd
        q = out[-1][0] if out else None
        if q and p.rule in OPTIMIZERS and q.rule == p.rule and out[-1][1:] == (t, wd) \
                and q.b == p.a and all(q.at[k][1] == c for k, (c, _) in p.at.items()):
            join = q.decays and p.decays and q.decays[-1][1] == p.a  # both decay: one span
            decays = q.decays[:-1] + ((q.decays[-1][0], p.b),) if join else q.decays + p.decays
            out[-1] = (q._replace(b=p.b, at={k: (q.at[k][0], d) for k, (_, d) in p.at.items()},
                                  decays=decays), t, wd)
        else:
            out.append((p, t, wd))
    return out


BLOCK = 2 ** 16  # CPU: AdamW makes ~15 passes; over 256 KiB blocks they stay in cache (~2x faster)


def update(master, state, grad, steps, hp):
    """One AdamW or SGD step on a range of a unit (the whole buffer, or this rank's chunk):
    grad is the reduced gradient sum there; master and state are updated in place."""
    o = hp.options
    scratch = [torch.empty(BLOCK) for _ in range(3)] if master.is_cpu else [None] * 3
    for p, t, wd in steps:
        s = {k: state[k][c:d] for k, (c, d) in p.at.items()}
        if p.rule == "adamw":
            step = BLOCK if master.is_cpu else p.b - p.a  # (elementwise: block by block)
            decay = scalars(master.device, 1 - hp.lr * wd)[0]
            for lo in range(p.a, p.b, step):
                hi, i, j = min(p.b, lo + step), lo - p.a, min(p.b, lo + step) - p.a
                for a, b in p.decays:  # decoupled weight decay first: p·(1 - lr·wd)
                    if a < hi and lo < b:
                        master[max(a, lo):min(b, hi)].mul_(decay)
                tmp = scratch if scratch[0] is None or hi - lo == BLOCK \
                    else [x[:hi - lo] for x in scratch]
                g = mean_grad(grad[lo:hi], hp.unscale, hp.coef, tmp[2])
                adamw(master[lo:hi], g, s["m"][i:j], s["v"][i:j], t, hp.lr, *o["betas"],
                      o["eps"], out=tmp[:2])
        elif p.rule == "sgd":
            sgd(master[p.a:p.b], mean_grad(grad[p.a:p.b], hp.unscale, hp.coef),
                s.get("momentum_buffer"), t, hp.lr, o["momentum"], o["nesterov"], wd)


def mean_grad(grad, unscale, coef, out=None):
    """The reduced sum in fp32, times unscale, times the clip coefficient (x·1 is x)."""
    g = grad.to(torch.float32)
    if unscale != 1:
        g = torch.mul(g, unscale, out=out)
    return g if coef is None else torch.mul(g, coef, out=out)


def adamw(p, g, m, v, t, lr, beta1, beta2, eps, out=(None, None)):
    """One torch.optim.AdamW step after its decoupled decay: bias correction, eps outside the
    sqrt. Only + - * / sqrt, each rounded once, never fused, in the order of m·beta1 +
    g·(1-beta1), ...: a shard gives the whole buffer's bits, the host (offload) a GPU's (every
    divisor a tensor on p's device). Temporaries go into `out`."""
    tmp, tmp2 = out
    b1, c1, b2, c2, bc2, e, step = scalars(p.device, beta1, 1 - beta1, beta2, 1 - beta2,
                                           math.sqrt(1 - beta2 ** t), eps,
                                           lr / (1 - beta1 ** t))
    m.mul_(b1).add_(torch.mul(g, c1, out=tmp))
    v.mul_(b2).add_(torch.mul(g, g, out=tmp).mul_(c2))
    denom = torch.sqrt(v, out=tmp2).div_(bc2).add_(e)
    p.sub_(torch.div(m, denom, out=tmp).mul_(step))
    return p, m, v


def sgd(p, g, buf, t, lr, momentum, nesterov, weight_decay):
    """One torch.optim.SGD step (dampening 0): weight decay enters the gradient; the momentum
    buffer starts as the first gradient (t is the step count)."""
    if weight_decay:
        g = g.add(p, alpha=weight_decay)
    if buf is not None:
        buf.copy_(g) if t == 1 else buf.mul_(momentum).add_(g)
        g = g.add(buf, alpha=momentum) if nesterov else buf
    p.add_(g, alpha=-lr)


def scalars(device, *xs):
    """xs as 0-d fp32 tensors on device, made once (an op converts a Python number each call),
    the same values. On a GPU per stream: one made on another stream may not be ready."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    return _scalars(device, stream, *xs)


@functools.lru_cache(maxsize=64)
def _scalars(device, stream, *xs):
    return tuple(torch.full((), x, dtype=torch.float32, device=device) for x in xs)


scalars.cache_clear = _scalars.cache_clear


# -----------------------------------------------------------------------------
# 4. one unit: its flat buffer, what this rank keeps of it, and the moves that change that
# (FSDP2's FSDPParamGroup is the model; the engine decides when each move runs):
#     forward     stage 3: gather (all-gather the shards into flat), release after
#     backward    accumulate each gradient into the bucket; once all are in, reduce it
#     step        update this rank's range, then share it (stages 1-2) or keep the shard (3)

class Unit:
    """One unit; what the stage shards is held as chunk r, r this rank's place in `group`."""

    def __init__(self, index, module, named, comm, group, dtype, cut, decay, rules, keys,
                 bucket_dtype):
        r = group.rank
        self.index, self.module = index, module  # its number, and whose parameters these are
        self.cut = cut                           # what this stage shards: sharded(stage)
        self.names = [n for n, _ in named]       # the parameters' names in the model
        self.params = [p for _, p in named]      # the nn.Parameters: views into flat
        self.offsets, self.numel, self.padded, self.shard_size = layout(
            self.params, comm.world_size, group.world_size)
        self.decays = [decay is None or bool(decay(n, p)) for n, p in named]  # weight decay?
        self.used = [False] * len(self.params)   # a gradient this step, on any rank?
        self.steps = [0] * len(self.params)      # each parameter's optimizer step count
        self.rules, self.keys = rules, keys      # each parameter's update and state keys
        lo, hi = (r * self.shard_size, (r + 1) * self.shard_size) if cut["optimizer"] \
            else (0, self.padded)
        # my range's parameters, and my optimizer state's size per key
        self.pieces, self.sizes = state_layout(self.offsets, [p.shape for p in self.params],
                                               rules, keys, lo, hi)
        self.flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        for p, o in zip(self.params, self.offsets):
            self.flat[o:o + p.numel()].copy_(p.detach().view(-1))
        self.viewing = self.flat                 # the buffer the parameters view now
        self.point(self.flat)
        broadcast(self.flat, comm)               # as DDP: every rank starts from rank 0's values
        mine = self.chunk(self.flat, r) if cut["optimizer"] else self.flat
        self.shard = mine.clone() if cut["params"] else None  # stage 3: what forward gathers
        self.owned = mine if self.shard is None else self.shard  # the params my optimizer owns
        self.master = None                       # ...in fp32, as the optimizer updates them
        self.state = None                        # ...and its state of them, {key: fp32}
        self.bucket_dtype = bucket_dtype         # the local gradient's dtype
        # the local gradient, whole: kept at stages 0-1, as DDP keeps its buckets; at stages
        # 2-3 alive from the unit's first gradient to its reduction
        self.bucket = None if cut["grads"] else torch.zeros_like(self.flat, dtype=bucket_dtype)
        self.summing = False                     # the bucket holds earlier micro-batches' sum
        self.reduced = None                      # the reduced gradient shard, summed over a step
        self.reduced_full = None                 # stage 0: the reduced gradient, whole
        self.arrived = set()                     # params whose gradient came this micro-batch
        self.sums = torch.zeros(len(self.params), device=self.flat.device)  # ...each one's sum
        self.ready = False                       # its local gradient is complete
        self.done = False                        # reduced in this micro-batch
        self.pending = None                      # stage 3: its gather, in flight or done
        self.held = None                         # stage 3: engine.gathered()'s whole params
        if cut["params"]:  # released now: the model is never here twice
            release_params(self.flat)

    def own_state(self):
        """The fp32 master of the params this rank's optimizer owns (fp32 compute: the params
        themselves), and its zero state, beside them (offload.py puts them elsewhere)."""
        own = self.flat.dtype != torch.float32
        self.master = self.owned.float() if own else self.owned
        self.state = {k: torch.zeros(n, device=self.master.device) for k, n in self.sizes.items()}

    def chunk(self, x, rank):
        return chunk(x, self.shard_size, rank)

    def point(self, buf):
        """Make the parameters views into buf (flat, or what engine.gathered() holds)."""
        for p, o in zip(self.params, self.offsets):
            p.data = buf[o:o + p.numel()].view(p.shape)
        self.viewing = buf

    def mark(self, released):
        for p in self.params:  # stage 3: whether the parameters may be read now
            p.zero_released = released

    def fetch(self, submit, gather):
        """Stage 3: start gather() unless it is in flight, into memory allocated here, on the
        compute stream, so that reusing it is ordered after its last reader."""
        if self.pending is None:
            self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
            if self.viewing is not self.flat:
                self.point(self.flat)
            self.pending = submit(gather)
        return self.pending

    def release(self):
        if self.held is not None:  # inside gathered(): the unit stays as it is
            return
        if self.pending is not None:
            self.pending.wait()
        self.mark(released=True)
        release_params(self.flat)
        self.pending = None

    def local_bucket(self):  # (stages 2-3: made at the unit's first gradient)
        if self.bucket is None:
            self.bucket = torch.zeros(self.padded, dtype=self.bucket_dtype, device=self.flat.device)
        return self.bucket

    def accumulate(self, i, grad, sum_it):
        """Parameter i's local gradient into the bucket (sum_it: its fp32 sum too, while it is
        in cache: NaN or inf makes it so) -> whether every parameter's is in."""
        if self.done:
            raise RuntimeError(f"{self.names[i]} got a gradient after its unit was reduced in this "
                               "backward: a module used in two reentrant activation-checkpoint "
                               "regions does this; use checkpoint(..., use_reentrant=False) (torch "
                               "DDP needs that too)")
        dst = self.local_bucket()[self.offsets[i]:self.offsets[i] + grad.numel()]
        # Add a second reentrant region's part, or to the earlier micro-batches' sum; else copy.
        dst.add_(grad.view(-1)) if i in self.arrived or self.summing else dst.copy_(grad.view(-1))
        if sum_it:
            torch.sum(dst, 0, dtype=torch.float32, out=self.sums[i])
        self.arrived.add(i)
        self.used[i] = True
        return len(self.arrived) == len(self.params)

    def zero_missing(self):
        """The bucket, zero where a parameter got no gradient this micro-batch (as DDP), unless
        it holds earlier micro-batches' sum."""
        bucket = self.local_bucket()
        for i in set(range(len(self.params))) - self.arrived if not self.summing else ():
            bucket[self.offsets[i]:self.offsets[i] + self.params[i].numel()].zero_()
            self.sums[i] = 0
        return bucket

    def handed_off(self, keep_sum=False):
        """The micro-batch's gradient went to its reduction (keep_sum: it stays in the bucket,
        summed with the next micro-batches'); stages 2-3 then drop the bucket."""
        self.arrived, self.done, self.summing = set(), True, keep_sum
        if self.cut["grads"] and not keep_sum:
            self.bucket = None

    def update(self, hp, group):
        if self.cut["optimizer"]:
            zero_update(self.master, self.state, self.reduced, runs(self, hp), hp, group,
                        self.flat, self.shard)
        else:
            ddp_update(self.flat, self.master, self.state, self.reduced_full, runs(self, hp), hp)

    def drop_grads(self):  # after a step, as FSDP2's zero_grad(set_to_none=True)
        self.reduced, self.reduced_full, self.used = None, None, [False] * len(self.params)


# -----------------------------------------------------------------------------
# 5. the engine: it wires autograd's and the model's hooks to the units, and so decides when
# the moves run: reduce a unit once its last gradient is in, gather a stage-3 unit before use
# and prefetch the next, update after the last micro-batch. The methods marked "(a feature's)"
# are the moves minizero_lib/features.py's Engine, a subclass, does its own way.

class Engine:
    """Wraps a model for data-parallel training at a ZeRO stage: call the model as usual, then
    engine.backward(loss) per micro-batch and engine.step() every grad_accum of them. Keep the
    engine while you use the model. Other keywords ask for features (minizero_lib/features.py)."""

    def __new__(cls, *args, **kw):
        # The seam: a keyword beyond plain ZeRO's (fp16 needs its loss scale too) builds
        # minizero_lib/features.py's Engine, whose moves are its own; a plain run never loads it.
        optimizer, dtype = kw.get("optimizer", "adamw"), kw.get("dtype", torch.float32)
        extra = set(kw) - PLAIN - set(OPTIMIZERS.get(optimizer, ()))
        native = getattr(args[1] if len(args) > 1 else kw.get("comm"), "native", False)
        if cls is Engine and (extra or optimizer not in OPTIMIZERS or dtype == torch.float16
                              or native):  # (torch's collectives: started without waiting)
            cls = _lib("features").Engine
        return super().__new__(cls)

    def __init__(self, model, comm=None, stage=None, *, units=None, optimizer="adamw", lr=1e-3,
                 weight_decay=0.0, decay=None, dtype=torch.float32, grad_accum=1, clip=None,
                 reduce_dtype=None, overlap=True, broadcast_buffers=True, skip_limit=25,
                 **features):
        # What the engine asks of the user's model, checked (a first reading can skip them).
        _lib("user_model").check_args(model, comm, stage, dtype, grad_accum)
        self.model, self.comm = model, comm      # the user's module; its collectives (ops.py)
        self.stage, self.sharded = stage, sharded(stage)  # 0 = DDP, 1-3; what it keeps 1/N of
        self.dtype = dtype                       # compute dtype of params, grads, float inputs
        self.reduce_dtype = reduce_dtype or dtype  # the dtype gradients are summed in
        self.optimizer, self.decay = optimizer, decay  # the update; which params decay
        self.lr, self.weight_decay = lr, weight_decay  # lr may change between steps
        self.options = optimizer_options(optimizer, features)  # its other options (betas, ...)
        self.grad_accum, self.clip = grad_accum, clip  # backward()s per step; max norm or None
        self.skip_limit = skip_limit             # raise after this many skipped steps in a row
        self.skipped, self.skips_in_row = 0, 0   # steps skipped for non-finite gradients
        self.t, self.micro = 0, 0                # steps taken; backward()s since the last step
        self.in_backward = False                 # a forward now is a recomputation in backward
        self.writable = False                    # inside gathered(writable=True): loading may write
        self.closed = False                      # close() was called: the hooks refuse
        self.at_close = []                       # what features finish in close()
        self.next = 0                            # the next unit, in self.order, to reduce
        self.visits = 0                          # a hash of the units this rank gathered, reduced
        self.fwd_order, self.bwd_order = [], []  # stage 3: the first pass's order, to prefetch
        self._configure(features)                # (the features' options, checked)
        # First, as every later collective's size depends on it: every rank built this model.
        _lib("user_model").check_same_model(model, comm)
        self.group = self._shard_group()         # the ranks a unit is cut over: all N
        self.device = self._device()             # where the model lives
        modules = default_units(model) if units is None else list(units)
        groups = group_params(model, modules, self.sharded["params"])
        model.to(dtype)  # 16-bit compute: params, frozen params and buffers in the compute dtype
        self.units = [self._unit(i, m, named)
                      for i, (m, named) in enumerate((m, g) for m, g in zip(modules, groups) if g)]
        for u in self.units if self.sharded["params"] else ():  # (reading one released raises)
            _lib("user_model").mark_sharded(u.names, u.params)
        self.order = self.units[::-1]            # reduce order: the same on every rank
        # this rank's own gradients all finite? (the step's flags say which rank went bad)
        self.finite = torch.ones((), dtype=torch.bool, device=self.device)
        self.buffers = list(model.buffers()) if broadcast_buffers else []  # DDP's broadcast
        self.queue = CommQueue(comm, overlap)    # where collectives run
        for t in [p for p in model.parameters() if not p.requires_grad] + list(model.buffers()):
            broadcast(t.data, comm)  # frozen params and buffers start as rank 0's, too
        self._built()
        register_hooks(self)

    # ---- construction: the moves a feature changes

    def _configure(self, features):  # (a feature's: its keywords)
        assert not features, features

    def _shard_group(self):  # (a feature's: hybrid sharding)
        return self.comm

    def _device(self):  # (a feature's: a model built on the meta device)
        _lib("user_model").check_real(self.model)
        return next(self.model.parameters()).device

    def _unit(self, i, module, named):  # (a feature's: other optimizers, offload, meta)
        rules = [self.optimizer] * len(named)
        keys = [state_keys(k, p.shape, self.options) for k, (_, p) in zip(rules, named)]
        u = Unit(i, module, named, self.comm, self.group, self.dtype, self.sharded, self.decay,
                 rules, keys, self.dtype)
        u.own_state()
        return u

    def _built(self):  # (a feature's: pinned memory, the trace)
        pass

    def _submit(self, job, phase="", u=None):  # (a feature's: torch's collectives, started)
        return self.queue.submit(job, self._record(phase, u))

    def _record(self, phase, u):
        """A job's place, for the communicator's flight record (if a launcher attached one):
        (phase, unit, step, micro-batch, grad mode)."""
        grad = torch.is_grad_enabled() or phase == "gradient reduction"  # (the same collective)
        return phase, u.index if u else -1, self.t, self.micro, grad

    def _visit(self, u, what):  # (unit, gather or reduce) into visits, compared at step()
        self.visits = (self.visits * 1_000_003 + 2 * u.index + what + 1) % 2 ** 52

    def _loading(self, *_):
        if not self.writable:  # model.load_state_dict() would change the params, not the master
            raise RuntimeError("load weights inside `with engine.gathered(writable=True):` "
                               "(every rank enters it), so the fp32 master takes them too; or "
                               "use engine.load_checkpoint(), or load before Engine()")

    def _before_forward(self, module, args, kwargs):
        if self.buffers and torch.is_grad_enabled():  # as DDP: rank 0's running stats everywhere
            self._submit(lambda: broadcast_buffers(self.buffers, self.comm)).wait()
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)

    # ---- stage 3: gather a unit before use, release it right after, prefetch the next

    def _gather(self, u, *_):
        """Before u's forward, or backward: wait for its params (fetching them now if no
        prefetch did), then start fetching the unit that came after u last time in this pass."""
        if u.held is not None:  # inside gathered(): the unit stays as it is
            return
        order = self.bwd_order if self.in_backward else self.fwd_order
        self._fetch(u).wait()
        u.mark(released=False)
        if u not in order:
            order.append(u)  # the first pass records the order the next passes prefetch in
        i = order.index(u) + 1
        if self.queue.pool is not None and i < len(order):
            self._fetch(order[i])

    def _fetch(self, u):
        if u.pending is None:
            self._visit(u, 0)
        phase = "backward regather" if self.in_backward else "forward gather"
        return u.fetch(lambda job: self._submit(job, phase, u), self._gather_job(u))

    def _gather_job(self, u):  # (a feature's: hpZ, qwZ, offload_params)
        return lambda: gather_params(u.shard, u.flat, self.group)

    def _after_forward(self, u, module, args, out):
        if self.in_backward:  # a recomputation (activation checkpointing): backward still needs
            return            # the unit; it is released once its gradients are reduced
        if torch.is_grad_enabled():  # gather again when backward reaches this unit's outputs
            for t in tensors(out):
                if t.requires_grad:
                    t.register_hook(_hook(weakref.ref(self), "_gather", u))
        self._release(u, "forward" if torch.is_grad_enabled() else "eval")

    def _release(self, u, when):  # (a feature's: reshard_after_forward, hpZ)
        u.release()

    def _eval_done(self, *_):  # stage 3: an eval forward (no backward) leaves nothing gathered
        if not torch.is_grad_enabled():
            self.release_all()

    def release_all(self):
        """Stage 3, after a backward or an eval forward: nothing gathered or in flight."""
        for u in self.units:
            self._release(u, "backward")

    # ---- backward: collect local gradients, reduce each unit once it is complete

    def _on_grad(self, u, i, p):
        # its sum while in cache (one rank: its own gradient is the sum, _agree checks that)
        complete = u.accumulate(i, p.grad, sum_it=self.comm.world_size > 1)
        p.grad = None
        if complete:
            u.ready = True
            self._reduce_ready()

    def _reduce_ready(self):
        """Start the ready units' reductions in self.order, the same on every rank, so they pair
        up where ranks finish units in other orders: one ready early waits, as DDP's buckets."""
        while self.next < len(self.order) and self.order[self.next].ready:
            u, self.next = self.order[self.next], self.next + 1
            job = self._reduction(u, self.micro == 0, self.micro == self.grad_accum - 1)
            self._visit(u, 1)
            if self.comm.world_size > 1:  # which rank's own gradient went bad
                self.finite &= torch.isfinite(u.sums.sum())
            if job is not None:  # (None: nothing is sent now)
                self.queue.hold(self._submit(job, "gradient reduction", u))
            if self.sharded["params"]:
                self._release(u, "backward")

    def _reduction(self, u, first, last):  # (a feature's: qgZ, hybrid, one reduction a step)
        """u's reduction of this micro-batch, a job for the queue: reduce-scatter the bucket,
        add it to the step's sum; stage 0 at the last micro-batch also all-gathers the sum
        (into its bucket, where the dtypes agree)."""
        bucket = u.zero_missing()
        local, earlier = bucket.to(self.reduce_dtype), None if first else u.reduced
        out = None if u.cut["optimizer"] or bucket.dtype != local.dtype else bucket
        u.handed_off()

        def job():
            u.reduced = reduce_grads(local, earlier, self.group)
            if last and not u.cut["optimizer"]:
                u.reduced_full = ddp_gather_grads(u.reduced, self.group, out)
        return job

    def backward(self, loss):
        """Backward for one micro-batch, the loss times 1/grad_accum; returns once every unit's
        gradient is reduced."""
        if self.micro == self.grad_accum:
            raise RuntimeError(f"backward() called {self.micro + 1} times since the last step() "
                               f"with grad_accum={self.grad_accum}; call engine.step()")
        for u in self.units:
            u.ready = u.done = False
        self.next, self.in_backward = 0, True
        try:
            factor = self._loss_factor()  # (x·1 is x: no multiply, nor its backward)
            (loss.float() * factor if factor != 1 else loss.float()).backward()
        finally:
            self.in_backward = False
        for u in self.units:  # units whose parameters were not all used: reduce them now
            u.ready = True
        self._reduce_ready()
        self.queue.drain()
        if self.sharded["params"]:
            self.release_all()
        self.micro += 1

    def _loss_factor(self):  # (a feature's: fp16's loss scale)
        return 1.0 / self.grad_accum

    # ---- the step: each rank updates what it keeps

    def step(self):
        """Update after grad_accum backward() calls. False if a non-finite gradient on any rank
        skipped the step everywhere (params, moments and step counts unchanged)."""
        if self.micro != self.grad_accum:
            raise RuntimeError(f"step() after {self.micro} backward() calls; grad_accum="
                               f"{self.grad_accum} expects exactly that many before each step")
        self.micro = 0
        self.queue.drain()
        bad = self._agree()
        if bad is not None:
            return self._skip(bad)
        unscale = self._unscale()  # the mean over ranks
        coef = None if self.clip is None else self._clip_coef(unscale)
        hp = Hyper(self.lr, self.weight_decay, self.options, unscale, coef)
        self.comm.flight.ctx = ("parameter share", -1, self.t, 0, True)  # (the all-gathers below)
        for u in self.units:
            u.steps = [t + used for t, used in zip(u.steps, u.used)]
        self._update(hp)
        self.t, self.skips_in_row = self.t + 1, 0
        self.comm.flight.stepped(self.t)  # (the phase above is over)
        self._drop_grads()
        self._took_step()
        return True

    def _unscale(self):  # (a feature's: fp16's loss scale)
        return 1.0 / (self.comm.world_size * 1.0)

    def _clip_coef(self, unscale):
        return clip_coef([u.reduced.float() * unscale for u in self.units], self.clip, self.group)

    def _update(self, hp):  # (a feature's: Muon, Adafactor, offload)
        for u in self.units:
            u.update(hp, self.group)

    def _took_step(self):  # (a feature's: fp16's loss scale)
        pass

    def _agree(self):
        """The step's one agreement, an all-gather of flags (kind "flags", apart from Ψ) for
        three rules of torch's DDP and GradScaler: every rank gathered and reduced the same
        units; a parameter with a gradient on any rank is updated (DDP's unused-parameter rule);
        a non-finite gradient, a rank's own or the sum, skips the step everywhere. -> None, or
        the ranks whose own gradient was not finite (empty: the sum overflowed). The flags are
        the step's one host read of a device value (a GPU's queue drains there)."""
        units, comm, visits, self.visits = self.units, self.comm, self.visits, 0
        sums = torch.stack([u.reduced.sum(dtype=torch.float32) for u in units]).isfinite().all()
        own = self.finite if comm.world_size > 1 else sums
        bad = torch.stack([~own, ~sums]).double()  # on the device
        # Made on the host and queued to the device, not blocking (a GPU: pinned, §9.11).
        mine = torch.tensor([float(visits)] + [float(x) for u in units for x in u.used],
                            dtype=torch.float64, pin_memory=self.finite.is_cuda)
        mine = torch.cat([bad, mine.to(self.finite.device, non_blocking=True)])
        # per rank: (own gradient bad, sum bad, visits, each parameter's used flag...)
        flags = all_gather(mine, comm, kind="flags").view(comm.world_size, -1).tolist()
        if any(f[2] != flags[0][2] for f in flags):
            self._drop_grads()
            raise RuntimeError(
                f"step {self.t + 1}: the ranks gathered or reduced different units, so their "
                f"collectives paired up wrongly and nothing was updated. At stage 3 each rank "
                f"gathers the units its forward runs: a module that only some ranks run (an MoE "
                f"expert, a branch) must share a unit with modules every rank runs (units=[...], "
                f"e.g. a whole MoE layer as one unit), or use stage 0-2")
        used = iter(any(col) for col in zip(*(used for _, _, _, *used in flags)))
        for u in units:
            u.used = [next(used) for _ in u.params]
        self.finite.fill_(True)
        if any(own_bad or sum_bad for own_bad, sum_bad, *_ in flags):
            return [k for k, (own_bad, *_) in enumerate(flags) if own_bad]
        return None

    def _skip(self, bad):
        """Skip this step on every rank, as torch's GradScaler: the first skip warns on rank 0,
        skip_limit in a row raise."""
        self._drop_grads()
        where = f"rank(s) {bad}" if bad else "the sum over ranks (finite gradients overflowed)"
        self.skipped, self.skips_in_row = self.skipped + 1, self.skips_in_row + 1
        note = self._skipped_step()
        if self.skipped == 1 and self.comm.rank == 0:
            warnings.warn(f"minizero: step {self.t + 1} skipped on every rank: non-finite "
                          f"gradients on {where}; parameters, moments and step counts are "
                          f"unchanged{note}")
        if self.skips_in_row >= self.skip_limit:
            raise FloatingPointError(f"{self.skips_in_row} steps in a row skipped for non-finite "
                                     f"gradients (last seen on {where}); the model is as it was "
                                     f"after step {self.t}. Lower the learning rate, check the "
                                     f"data, or raise skip_limit")
        return False

    def _skipped_step(self):  # (a feature's: fp16 halves its loss scale) -> a note for the warning
        return ""

    def _drop_grads(self):
        for u in self.units:
            u.drop_grads()

    # ---- what leaves the engine

    def full_state_dict(self):
        """Collective: {name: fp32 tensor} for every name of model.state_dict(), each unit's
        master all-gathered (stages 1-3, kind "state_dict"), so a fresh model loads it strictly."""
        self.queue.drain()
        values = {}
        for u in self.units:
            master = self._master(u).to(self.device)
            full = all_gather(master, self.group,
                              kind="state_dict") if self.sharded["optimizer"] else master
            for p, o in zip(u.params, u.offsets):
                values[id(p)] = full[o:o + p.numel()].view(p.shape)
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            v = values[id(t)] if id(t) in values else t.detach()  # (a released param: never read)
            out[name] = (v.float() if v.is_floating_point() else v).clone()
        return out

    def _master(self, u):  # (a feature's: disk offload) -> u's fp32 master of my range
        return u.master

    def numel(self):
        """Ψ as laid out: trainable parameters plus padding."""
        return sum(u.padded for u in self.units)

    # What loads a module of minizero_lib on first use: the formulas, gathered(), checkpoints.

    def memory(self):
        """Model-state bytes this rank holds on its device in a step, by category."""
        return _lib("formulas").engine_held(self)

    def offloaded(self):
        """{where: bytes} of this rank's model state off its device: "cpu", or "disk"."""
        return _lib("formulas").engine_offloaded(self)

    def formula(self, offloaded=False, sent=False):
        """What memory() must be (offloaded=True: offloaded(); sent=True: the bytes one step
        sends, by the ledger's kinds): minizero's formulas for this layout and optimizer."""
        return _lib("formulas").engine_formula(self, offloaded, sent)

    def gathered(self, modules=None, writable=False):
        """Collective: inside, the params of `modules`' units (all by default) are whole and
        may be read; writable=True: on exit rank 0's values win, master and shard too."""
        return _lib("checkpoint").gathered(self, modules, writable)

    def save_checkpoint(self, path, meta=None, background=False):
        """Collective: a sharded checkpoint in directory `path`; background=True: returns after
        a host copy of this rank's shard, which a thread writes."""
        self.queue.drain()
        _lib("writer").save(self, path, meta, background)

    def load_checkpoint(self, path):
        """Collective: load a checkpoint saved at any world size and stage; returns its meta."""
        return _lib("checkpoint").load(self, path)

    def close(self):
        """Finish what features left open (a background save: collective), stop the
        communication thread; the model's hooks refuse from now on."""
        if not self.closed:
            self.queue.drain()
            for finish in self.at_close:  # (a failed save raises here; close() again closes)
                finish()
            self.closed = True
            self.queue.close()


# Engine's own keywords: any other (but the optimizer's options) asks for a feature.
PLAIN = {"units", "optimizer", "lr", "weight_decay", "decay", "dtype", "grad_accum", "clip",
         "reduce_dtype", "overlap", "broadcast_buffers", "skip_limit"}


class CommQueue:
    """Where one rank's collectives run, in the order the engine asks (so they pair up across
    ranks): on a communication thread of its own while autograd computes (overlap), or inline
    (overlap=False, one rank). It changes when bytes move, never how they are summed."""

    def __init__(self, comm, overlap):
        overlap = overlap and comm.world_size > 1
        self.comm = comm  # whose collectives run here
        self.pool = comm_thread(comm) if overlap else None  # one thread: jobs run in order
        # GPU: the thread's collectives run on a side stream, beside the compute stream
        self.side = torch.cuda.Stream(comm.device) if overlap and comm.device.type == "cuda" \
            else None
        self.reductions = []  # this micro-batch's reductions not yet waited for
        self.last = None      # the job submitted last: drain() waits for it

    def submit(self, job, record):
        """Run job() (its collectives recorded under `record`) -> a Pending."""
        job = self.comm.flight.within(record, job)
        if self.pool is None:
            out = job()
            return Pending(lambda: out)
        if self.side is not None:  # GPU: the side stream waits for the compute that made x
            ready, compute = torch.cuda.Event(), job
            ready.record()

            def job():
                with torch.cuda.stream(self.side):
                    self.side.wait_event(ready)
                    out = compute()
                    self.side.synchronize()
                    return out
        self.last = Pending(self.pool.submit(job).result)
        return self.last

    def hold(self, reduction):
        """Keep a gradient reduction until drain(). At most one waits behind the one sending:
        each holds a whole unit's gradient, and a slow link must not pile them up."""
        self.reductions.append(reduction)
        if len(self.reductions) > 2:
            self.reductions.pop(0).wait()

    def drain(self):  # wait until every job is done (a failed collective raises here)
        jobs = [j for j in (*self.reductions, self.last) if j is not None]
        self.reductions, self.last = [], None
        for job in jobs:
            job.wait()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


def comm_thread(comm):
    """The thread of a rank's communication jobs. On a GPU it makes the rank's device current
    first: a new thread starts on device 0 (a context there for every rank; NCCL's device)."""
    cuda = comm.device.type == "cuda"
    return ThreadPoolExecutor(1, f"minizero-comm{comm.rank}", torch.cuda.set_device if cuda
                              else None, (comm.device,) if cuda else ())


def register_hooks(engine):
    """The engine's hooks on the model; they hold it weakly, so a dropped engine goes (with its
    thread) instead of living on in a cycle through the parameters."""
    ref, model = weakref.ref(engine), engine.model
    for u in engine.units:
        for i, p in enumerate(u.params):
            p.register_post_accumulate_grad_hook(_hook(ref, "_on_grad", u, i))
        if engine.sharded["params"]:  # (each unit starts released)
            u.module.register_forward_pre_hook(outside_graphs(_hook(ref, "_gather", u)))
            u.module.register_forward_hook(outside_graphs(_hook(ref, "_after_forward", u)))
    model.register_forward_pre_hook(outside_graphs(_hook(ref, "_before_forward")),
                                    with_kwargs=True)
    model.register_load_state_dict_pre_hook(_hook(ref, "_loading"))
    if engine.sharded["params"]:
        model.register_forward_hook(outside_graphs(_hook(ref, "_eval_done")))


def outside_graphs(fn):
    """A module hook dynamo never traces, as FSDP2's: traced, it would cut a compiled block's
    graph at each collective and guard on the engine's state (DESIGN.md §14)."""
    return torch._dynamo.disable(fn, recursive=True)


def _hook(ref, method, *bound):
    """A hook that calls engine.method(*bound, *the hook's arguments)."""
    def hook(*args):
        engine = ref()
        if engine is None or engine.closed:
            raise RuntimeError("this model's minizero Engine is "
                               f"{'gone' if engine is None else 'closed'}; keep the engine (and "
                               "do not close it) for as long as you train or run the model")
        return getattr(engine, method)(*bound, *args)
    return hook


def _lib(name):
    """A module of minizero_lib, loaded on first use: the seam, formulas, checkpoints."""
    import importlib
    return importlib.import_module(f"minizero_lib.{name}")


# -----------------------------------------------------------------------------
# what the engine needs of the user's model: its options, float inputs in the compute dtype,
# the tensors in its outputs, DDP's buffers (the checks of the rest: minizero_lib/user_model.py)

def optimizer_options(optimizer, keywords):
    """AdamW's or SGD's options out of the Engine's keywords: torch.optim's defaults, the
    given ones over them."""
    o = {**OPTIMIZERS.get(optimizer, {}),
         **{k: keywords.pop(k) for k in OPTIMIZERS.get(optimizer, {}) if k in keywords}}
    if optimizer == "sgd" and o["nesterov"] and not o["momentum"]:
        raise ValueError("sgd: nesterov=True needs a momentum > 0 (torch.optim's rule)")
    return o


def broadcast_buffers(buffers, comm):
    """DDP's broadcast_buffers: rank 0's running stats everywhere, a broadcast per dtype
    (kind "buffers", apart from Ψ)."""
    for dtype in sorted({b.dtype for b in buffers}, key=str):
        group = [b for b in buffers if b.dtype == dtype]
        flat = broadcast(torch.cat([b.reshape(-1) for b in group]), comm, kind="buffers")
        for b, x in zip(group, flat.split([b.numel() for b in group])):
            b.copy_(x.view(b.shape))


def tensors(x):
    """Every tensor in x, also inside tuples, lists, dicts and dataclasses (model outputs)."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (tuple, list, dict)):
        for y in x.values() if isinstance(x, dict) else x:
            yield from tensors(y)
    elif hasattr(x, "__dataclass_fields__") and not isinstance(x, type):
        for name in x.__dataclass_fields__:
            yield from tensors(getattr(x, name))


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


def cast_floats(x, dtype):
    """x with every float tensor in dtype (the rest as it is)."""
    return map_tensors(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


# Names the package adds to this module's, loaded on first use (PEP 562): the proof as a
# tool, checkpoints, the formulas.
_LATER = {"check": "check", "consolidate": "checkpoint", "read_checkpoint": "checkpoint",
          "comm_bytes_per_step": "formulas", "model_state_bytes": "formulas",
          "offloaded_bytes": "formulas", "peak_memory": "formulas"}


def __getattr__(name):
    if name not in _LATER:
        raise AttributeError(f"module 'minizero' has no attribute {name!r}")
    return getattr(_lib(_LATER[name]), name)


if __name__ == "__main__":  # the planner, consolidate and check
    import sys
    _lib("cli").main(sys.argv[1:])

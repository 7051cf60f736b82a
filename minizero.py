"""
minizero: data-parallel training with the Zero Redundancy Optimizer, DDP (stage 0) and
ZeRO stages 1, 2 and 3, read top to bottom in three parts:

    1. the layout    every stage cuts the model's parameters the same way
    2. the stages    what each stage keeps, and the functions that reduce, update and gather
    3. the engine    the one stateful object: it wires those functions to autograd's hooks

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
"""
import argparse
import math
import os
import resource
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

import checkpoint
from checkpoint import consolidate, read_checkpoint  # noqa: F401  (minizero.consolidate, for users)
from ops import Pending, all_gather, all_reduce, broadcast, reduce_scatter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

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


class Unit:
    """One unit: its parameters flattened into `flat`, padded to a multiple of N, and
    everything this rank keeps for it. What the stage shards is held as rank r's chunk."""

    def __init__(self, module, named, comm, dtype, reduce_dtype, sharded, decays):
        N, r = comm.world_size, comm.rank
        self.module = module                        # the nn.Module whose parameters these are
        self.names = [n for n, _ in named]          # their names in the model, in registration order
        self.params = [p for _, p in named]         # the nn.Parameters: views into flat
        sizes = [p.numel() for p in self.params]
        self.offsets = list(accumulate(sizes, initial=0))[:-1]  # where each parameter starts in flat
        self.numel = sum(sizes)                     # Ψ_u, the unit's trainable elements
        self.padded = -(-self.numel // N) * N       # ...plus zeros up to a multiple of N
        self.shard_size = self.padded // N          # rank r owns elements [r·s, (r+1)·s)
        self.decays = decays                        # per parameter: does weight decay apply to it?
        self.flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)  # full params
        for p, o in zip(self.params, self.offsets):
            self.flat[o:o + p.numel()].copy_(p.detach().view(-1))
            p.data = self.flat[o:o + p.numel()].view(p.shape)
        broadcast(self.flat, comm)  # as DDP does: every rank starts from rank 0's values
        mine = self.chunk(self.flat, r) if sharded["optimizer"] else self.flat
        self.shard = mine.clone() if sharded["params"] else None  # stage 3: the 16-bit shard to gather
        mine = mine if self.shard is None else self.shard
        self.master = mine if dtype == torch.float32 else mine.float()  # fp32 params (fp32: the params)
        self.m = torch.zeros_like(self.master)      # AdamW's first moment, cut like master
        self.v = torch.zeros_like(self.master)      # ...and its second moment
        self.grad = None if sharded["grads"] else torch.zeros_like(self.flat)  # stages 0-1: full bucket
        self.local = None                           # stages 2-3: that bucket, alive only until reduced
        self.reduced = torch.zeros(self.shard_size, dtype=reduce_dtype, device=self.flat.device) \
            if sharded["grads"] else None           # the reduced gradient shard, summed over micro-batches
        self.full_grad = None                       # stage 0: the reduced gradient, all-gathered
        self.arrived = set()                        # parameters whose gradient came in this micro-batch
        self.flushed = False                        # reduce-scattered in this micro-batch?
        self.pending = None                         # stage 3: the gather in flight or done, or None

    def chunk(self, x, rank):
        return x.view(-1, self.shard_size)[rank]


# -----------------------------------------------------------------------------
# 2. the stages. Each stage is named by what it shards (llm.c asks the same question:
# is this state sharded at this stage?); the functions below take explicit tensors.

SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}  # the first stage that shards each


def sharded(stage):
    """{"optimizer": bool, "grads": bool, "params": bool}: what a rank keeps 1/N of."""
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
    whole buffer. p, m and v are updated in place (the same operations in the same order
    as p * decay, m * beta1 + g * (1 - beta1), ...): out of place, a step would need ten
    full-size temporaries."""
    p.mul_(decay)
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_(g.mul(g).mul_(1 - beta2))
    denom = v.sqrt().div_(math.sqrt(1 - beta2 ** t)).add_(eps)
    p.sub_(m.div(denom).mul_(lr / (1 - beta1 ** t)))
    return p, m, v


def runs(u, lo, hi, hp, t):
    """The pieces of the unit's parameters inside elements [lo, hi) of its layout, as
    (a, b, step count, decay factor) relative to lo; neighbours that agree are merged
    and padding is left out. Every stage cuts its range the same way, so the same
    elements see the same numbers."""
    out = []
    for o, p, d in zip(u.offsets, u.params, u.decays):
        a, b = max(o, lo) - lo, min(o + p.numel(), hi) - lo
        if a >= b:
            continue
        decay = 1 - hp.lr * hp.weight_decay if d and hp.weight_decay else 1.0
        if out and out[-1][1] == a and out[-1][2:] == (t, decay):
            out[-1] = (out[-1][0], b, t, decay)
        else:
            out.append((a, b, t, decay))
    return out


def update(master, m, v, grad, pieces, hp):
    """AdamW on one range of a unit (the whole buffer, or this rank's chunk): grad is
    the reduced gradient sum there; master, m and v are updated in place."""
    g = grad.float() * hp.unscale
    if hp.coef is not None:
        g = g * hp.coef
    for a, b, t, decay in pieces:
        adamw(master[a:b], g[a:b], m[a:b], v[a:b], t, hp.lr, *hp.betas, hp.eps, decay)


def reduce_grads(local, reduced, comm):
    """Every stage, every micro-batch: reduce-scatter the local gradient (each rank sends
    (N-1)/N·Ψ_u) and add this rank's shard to what earlier micro-batches reduced. The
    ring fixes the order of the sum, so the shard is the same bits in every stage."""
    shard = reduce_scatter(local, comm)
    return shard if reduced is None else reduced + shard


def ddp_reduce(local, reduced, comm, last, out=None):
    """Stage 0: DDP's all-reduce, cut in two around accumulation. Reduce-scatter every
    micro-batch; after the last, all-gather the summed shard so every rank holds the
    whole reduced gradient ((N-1)/N·Ψ_u more). -> (reduced shard, whole or None). On
    torch's collectives one micro-batch is one native all-reduce instead."""
    if last and reduced is None and comm.native:
        full = all_reduce(local, comm)
        return full.view(comm.world_size, -1)[comm.rank], full
    reduced = reduce_grads(local, reduced, comm)
    return reduced, (all_gather(reduced, comm, out=out) if last else None)


def ddp_update(flat, master, m, v, full_grad, pieces, hp):
    """Stage 0: every rank holds the whole reduced gradient and the whole optimizer
    state, and updates the whole buffer. Nothing is sent."""
    update(master, m, v, full_grad, pieces, hp)
    if flat is not master:  # 16-bit compute: round the fp32 master into the params
        flat.copy_(master)


def zero_update(master, m, v, reduced, pieces, hp, comm, flat, shard):
    """Stages 1-3: each rank updates only its chunk, with its 1/N of the optimizer state,
    then shares it. Stages 1-2 keep whole params: all-gather the updated chunks into
    flat (each rank sends (N-1)/N·Ψ_u). Stage 3 keeps only the 16-bit shard, which the
    next forward gathers: nothing is sent here."""
    update(master, m, v, reduced, pieces, hp)
    if shard is None:
        all_gather(master.to(flat.dtype), comm, out=flat)
    elif shard is not master:
        shard.copy_(master)


def gather_params(shard, flat, comm):
    """Stage 3, before a unit's forward and again before its backward: all-gather every
    rank's 16-bit shard into the unit's flat buffer (each rank sends (N-1)/N·Ψ_u)."""
    return all_gather(shard, comm, out=flat)


def release_params(flat):
    """Stage 3, after a unit's forward and after its backward: give the gathered memory
    back. flat keeps its shape, so tensors autograd saved see the data again once the
    storage is resized and regathered."""
    flat.untyped_storage().resize_(0)


def clip_coef(grad_shards, max_norm, comm):
    """torch's clip_grad_norm_ coefficient. The squared norm is summed per shard, then
    across ranks in rank order, so it is the same number in every stage."""
    local = sum((g * g).sum() for g in grad_shards).reshape(1)
    per_rank = all_gather(local, comm, kind="clip")   # N floats: booked apart from Ψ
    total = per_rank[0]
    for x in per_rank[1:]:
        total = total + x
    return torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)


def model_state_bytes(numel, world_size, stage, dtype=torch.bfloat16):
    """Bytes of model state per rank, for numel (padded) parameters. 16-bit compute:
    params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 master, m, v); fp32: params 4Ψ, grads 4Ψ,
    optimizer 8Ψ (the params are the master). Each is cut N ways once it is sharded."""
    d = torch.finfo(dtype).bits // 8
    per = {"params": d, "grads": d, "optimizer": 8 + (4 if d != 4 else 0)}
    return {k: per[k] * numel // (world_size if cut else 1) for k, cut in sharded(stage).items()}


def comm_bytes_per_step(numel, world_size, stage, dtype=torch.bfloat16, grad_accum=1):
    """Payload bytes one rank sends in one step: each ring collective over Ψ elements
    sends (N-1)/N·Ψ. Gradients are reduce-scattered once per micro-batch; sharded params
    are gathered twice per micro-batch (forward and backward), whole ones once per step
    (the grads at stage 0, the updated params at 1-2)."""
    per = (world_size - 1) * (numel // world_size) * (torch.finfo(dtype).bits // 8)
    if world_size == 1:
        return {}
    return {"reduce_scatter": per * grad_accum,
            "all_gather": per * (2 * grad_accum if sharded(stage)["params"] else 1)}


# -----------------------------------------------------------------------------
# 3. the engine: the one stateful object, because autograd's hooks need somewhere to
# keep what they see. It decides when each function above runs, never how.


class Engine:
    """Wraps a model for data-parallel training at a ZeRO stage. Call the model as usual,
    then engine.backward(loss) per micro-batch and engine.step() every grad_accum of them.
    Keep a reference to the engine while you use the model: its hooks point back to it."""

    def __init__(self, model, comm, stage, *, units=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, decay=None, dtype=torch.float32, grad_accum=1, clip=None,
                 reduce_dtype=None, loss_scale=2.0 ** 16, scale_window=1000, overlap=True, native=None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3; got {stage!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16; got {dtype}")
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1; got {grad_accum}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to train")
        devices = {str(t.device) for t in [*model.parameters(), *model.buffers()]}
        if len(devices) > 1:
            raise ValueError(f"parameters and buffers are on different devices {sorted(devices)}; "
                             f"move the model to one device (model.to(device)) first")
        if native is not None:
            comm.native = native  # torch's own collectives instead of the ring (ops.py)
        self.model = model                      # the user's module; its parameters live in the units
        self.comm = comm                        # send/recv and the byte ledger (ops.py)
        self.stage = stage                      # 0 = DDP, 1-3 = ZeRO
        self.sharded = sharded(stage)           # what this stage keeps 1/N of
        self.dtype = dtype                      # compute dtype of params, grads and float inputs
        self.reduce_dtype = reduce_dtype or dtype  # dtype the gradients are summed in
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay  # AdamW; lr may change
        self.grad_accum = grad_accum            # backward() calls per step()
        self.clip = clip                        # max gradient norm, or None
        self.scale = loss_scale if dtype == torch.float16 else 1.0  # fp16 dynamic loss scale
        self.scale_window = scale_window        # fp16: clean steps before the scale doubles
        self.clean_steps = 0                    # fp16: steps since the last overflow
        self.t = 0                              # optimizer steps taken
        self.micro = 0                          # backward() calls since the last step()
        self.jobs = []                          # this micro-batch's reductions in flight
        self.fwd_order, self.bwd_order = [], []  # stage 3: units in the order the first pass used them
        # one communication thread per rank runs collectives in the order they are asked
        # for, so they pair up across ranks while autograd goes on (on GPU, on a side stream)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"minizero-comm{comm.rank}") if overlap else None
        self.side = torch.cuda.Stream() if overlap and comm.device.type == "cuda" else None

        modules = default_units(model) if units is None else list(units)
        groups, cross = group_params(model, modules)
        if cross and self.sharded["params"]:
            a, b = cross[0]
            raise ValueError(f"{a} and {b} are one parameter tied across two units; stage 3 "
                             f"gathers one unit at a time, so put both modules in one unit "
                             f"(units=...) or use stage 0-2")
        model.to(dtype)  # 16-bit compute: params, frozen params and buffers in the compute dtype
        self.units = [Unit(m, g, comm, dtype, self.reduce_dtype, self.sharded,
                           [decay is None or bool(decay(n, p)) for n, p in g])
                      for m, g in zip(modules, groups) if g]
        self.device = self.units[0].flat.device  # where the model lives
        for t in [p for p in model.parameters() if not p.requires_grad] + list(model.buffers()):
            broadcast(t.data, comm)  # frozen params and buffers start as rank 0's, too

        # the hooks hold the engine weakly: drop the engine and it (and its thread) goes,
        # instead of living on in a cycle through the parameters
        ref = weakref.ref(self)
        for u in self.units:
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(_grad_hook(ref, u, i))
            if self.sharded["params"]:
                self._release(u)
                u.module.register_forward_pre_hook(_gather_hook(ref, u))
                u.module.register_forward_hook(_after_forward_hook(ref, u))
        model.register_forward_pre_hook(_cast_hook(ref))
        if self.sharded["params"]:
            model.register_forward_hook(_eval_done_hook(ref))

    # ---- communication runs on its own thread, in the order it is asked for

    def _submit(self, job):
        """Run job() on this rank's communication thread (overlap=True) while autograd
        computes. Every rank submits the same collectives in the same order, and one
        thread runs them in that order, so they pair up across ranks."""
        if self.pool is None:
            out = job()
            return Pending(lambda: out)
        if self.side is None:
            return Pending(self.pool.submit(job).result)
        ready = torch.cuda.Event()
        ready.record()  # GPU: the side stream waits for the compute that made the inputs

        def on_side_stream():
            with torch.cuda.stream(self.side):
                self.side.wait_event(ready)
                out = job()
                self.side.synchronize()
                return out
        return Pending(self.pool.submit(on_side_stream).result)

    def _drain(self):
        """Wait until the communication thread is idle: after this, collectives may run inline."""
        for job in self.jobs:
            job.wait()  # re-raises a failed collective here
        self.jobs = []
        if self.pool is not None:
            self.pool.submit(lambda: None).result()

    # ---- stage 3: gather a unit before it is used, release it right after, prefetch the next

    def _gather(self, u, order):
        """Wait for unit u's params (fetching them now if no prefetch did), then start
        fetching the unit that came after u last time in this pass (order)."""
        self._fetch(u).wait()
        if u not in order:
            order.append(u)  # the first pass records the order the next passes prefetch in
        i = order.index(u) + 1
        if self.pool is not None and i < len(order):
            self._fetch(order[i])

    def _fetch(self, u):
        """Start the unit's all-gather (unless one is in flight), into memory allocated
        here, on the compute stream, so that reusing it is ordered after its last reader."""
        if u.pending is None:
            u.flat.untyped_storage().resize_(u.padded * u.flat.element_size())
            u.pending = self._submit(lambda: gather_params(u.shard, u.flat, self.comm))
        return u.pending

    def _release(self, u):
        if u.pending is not None:
            u.pending.wait()
        release_params(u.flat)
        u.pending = None

    def _after_forward(self, u, out):
        if torch.is_grad_enabled():  # gather again when backward reaches this unit's outputs
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(_regather_hook(weakref.ref(self), u))
        self._release(u)

    def _release_all(self):
        for u in self.units:
            if u.pending is not None:
                self._release(u)

    def _cast_inputs(self, args):
        return tuple(a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                     for a in args)

    # ---- backward: collect local gradients, reduce-scatter each unit once it is complete

    def _bucket(self, u):
        """The unit's full local-gradient buffer: kept at stages 0-1 (u.grad); at stages
        2-3 alive only from the unit's first gradient to its reduce-scatter."""
        if u.grad is not None:
            return u.grad
        if u.local is None:
            u.local = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
        return u.local

    def _on_grad(self, u, i, p):
        """Parameter i of unit u has its local gradient: move it into the unit's bucket."""
        o = u.offsets[i]
        self._bucket(u)[o:o + p.numel()].copy_(p.grad.view(-1))
        p.grad = None
        u.arrived.add(i)
        if len(u.arrived) == len(u.params):
            self._reduce(u)

    def _reduce(self, u):
        """Reduce the unit's gradient on the communication thread; what each rank keeps
        of it, and when the rest goes, is the stage's (reduce_grads, ddp_reduce)."""
        bucket = self._bucket(u)
        for i in set(range(len(u.params))) - u.arrived:  # a parameter that got no gradient
            o = u.offsets[i]
            bucket[o:o + u.params[i].numel()].zero_()
        local, last = bucket.to(self.reduce_dtype), self.micro == self.grad_accum - 1
        reduced = u.reduced if self.micro else None  # the first micro-batch starts the sum

        def job():
            if self.sharded["optimizer"]:
                u.reduced = reduce_grads(local, reduced, self.comm)
            else:  # the whole optimizer on every rank needs the whole gradient
                out = u.grad if u.grad.dtype == local.dtype else None  # reuse the bucket
                u.reduced, u.full_grad = ddp_reduce(local, reduced, self.comm, last, out)
        self.jobs.append(self._submit(job))
        u.arrived, u.flushed, u.local = set(), True, None  # stage 2: the full gradient is gone
        if self.sharded["params"]:
            self._release(u)

    def backward(self, loss):
        """Backward for one micro-batch; scaled by 1/grad_accum (and the fp16 loss scale).
        Returns once every unit's gradient is reduced."""
        if self.micro == self.grad_accum:
            raise RuntimeError(f"backward() called {self.micro + 1} times since the last step() "
                               f"with grad_accum={self.grad_accum}; call engine.step()")
        for u in self.units:
            u.flushed = False
        (loss.float() * (self.scale / self.grad_accum)).backward()
        for u in self.units:  # units whose parameters were not all used: reduce them now
            if not u.flushed:
                self._reduce(u)
        self._drain()
        if self.sharded["params"]:
            self._release_all()
        self.micro += 1

    # ---- the step: each rank updates what it keeps (ddp_update or zero_update)

    def step(self):
        """Update after grad_accum backward() calls; False if fp16 overflow skipped it."""
        if self.micro != self.grad_accum:
            raise RuntimeError(f"step() after {self.micro} backward() calls; grad_accum="
                               f"{self.grad_accum} expects exactly that many before each step")
        self.micro = 0
        self._drain()
        unscale = 1.0 / (self.comm.world_size * self.scale)  # mean over ranks, undo the loss scale
        if self.dtype == torch.float16 and self._overflow():
            self.scale, self.clean_steps = self.scale / 2, 0
            self._drop_grads()
            return False
        coef = None
        if self.clip is not None:
            coef = clip_coef([u.reduced.float() * unscale for u in self.units], self.clip, self.comm)
        self.t += 1
        hp = Hyper(self.lr, self.betas, self.eps, self.weight_decay, unscale, coef)
        r = self.comm.rank
        for u in self.units:
            if self.sharded["optimizer"]:
                lo = r * u.shard_size
                zero_update(u.master, u.m, u.v, u.reduced, runs(u, lo, lo + u.shard_size, hp, self.t), hp,
                            self.comm, u.flat, u.shard)
            else:
                ddp_update(u.flat, u.master, u.m, u.v, u.full_grad, runs(u, 0, u.padded, hp, self.t), hp)
        self._drop_grads()
        if self.dtype == torch.float16:
            self.clean_steps += 1
            if self.clean_steps % self.scale_window == 0:
                self.scale *= 2
        return True

    def _drop_grads(self):
        """After a step: only a sharded gradient is kept between steps (what memory() counts)."""
        for u in self.units:
            u.full_grad = None
            if not self.sharded["grads"]:
                u.reduced = None

    def _overflow(self):
        """fp16: did any rank's gradient shard overflow? Then every rank skips the step."""
        bad = any(not torch.isfinite(u.reduced).all() for u in self.units)
        flags = all_gather(torch.tensor([float(bad)], device=self.device), self.comm, kind="overflow")
        return bool(flags.any())

    # ---- what leaves the engine

    def full_state_dict(self):
        """Collective. {name: fp32 tensor} for every name of model.state_dict(): tied
        names, frozen parameters and buffers included, so a fresh model loads it strictly."""
        values = {}
        self._drain()
        for u in self.units:
            full = all_gather(u.master, self.comm, kind="state_dict") if self.sharded["optimizer"] else u.master
            for p, o in zip(u.params, u.offsets):
                values[id(p)] = full[o:o + p.numel()].view(p.shape)
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            v = values.get(id(t), t.detach())
            out[name] = (v.float() if v.is_floating_point() else v).clone()
        return out

    def frozen(self):
        """{name: tensor} of the model's state that is not a trainable parameter."""
        trainable = {id(p) for u in self.units for p in u.params}
        return {n: t for n, t in self.model.state_dict(keep_vars=True).items() if id(t) not in trainable}

    def memory(self):
        """Bytes of the tensors this rank keeps between steps, by category."""
        def nbytes(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        params = grads = opt = 0
        for u in self.units:
            params += nbytes(u.shard if self.sharded["params"] else u.flat)
            grads += nbytes(u.reduced if self.sharded["grads"] else u.grad)
            opt += nbytes(u.m, u.v) + (nbytes(u.master) if self.dtype != torch.float32 else 0)
        return {"params": params, "grads": grads, "optimizer": opt}

    def numel(self):
        """Ψ as laid out: trainable parameters plus padding."""
        return sum(u.padded for u in self.units)

    def formula(self):
        return model_state_bytes(self.numel(), self.comm.world_size, self.stage, self.dtype)

    def save_checkpoint(self, path, meta=None):
        """Collective: a sharded checkpoint in directory `path` (checkpoint.py)."""
        self._drain()
        checkpoint.save(self, path, meta)

    def load_checkpoint(self, path):
        """Collective: load a checkpoint saved at any world size and stage; returns its meta."""
        return checkpoint.load(self, path)


# the hooks autograd and the model call: each holds the engine weakly and finds it here


def _engine(ref):
    engine = ref()
    if engine is None:
        raise RuntimeError("this model's minizero Engine is gone; keep a reference to the engine "
                           "for as long as you use the model")
    return engine


def _grad_hook(ref, u, i):
    return lambda p: _engine(ref)._on_grad(u, i, p)


def _gather_hook(ref, u):
    def hook(module, args):
        engine = _engine(ref)
        engine._gather(u, engine.fwd_order)
    return hook


def _after_forward_hook(ref, u):
    return lambda module, args, out: _engine(ref)._after_forward(u, out)


def _regather_hook(ref, u):
    def hook(grad):
        engine = _engine(ref)
        engine._gather(u, engine.bwd_order)
    return hook


def _cast_hook(ref):
    return lambda module, args: _engine(ref)._cast_inputs(args)


def _eval_done_hook(ref):
    """Stage 3: an eval forward (no backward follows) leaves nothing gathered or in flight."""
    return lambda *_: None if torch.is_grad_enabled() else _engine(ref)._release_all()


def _tensors(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def peak_memory(device):
    """Measured peak bytes of this process: CUDA's max allocated on GPU, peak RSS on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# -----------------------------------------------------------------------------
# the planner and checkpoint consolidation, from the command line:
#   python minizero.py --params 7.5e9 --world-size 64 [--dtype bf16] [--memory 80GB]
#   python minizero.py consolidate DIR OUT.pt


def plan(params, world_size, dtype=torch.bfloat16, memory=None):
    """Lines of the planner's table, from the same formulas the tests hold the engine to."""
    if not (math.isfinite(params) and params >= 1):
        raise ValueError(f"the parameter count must be a finite number >= 1, like --params 7.5e9; got {params}")
    if world_size < 1:
        raise ValueError(f"the world size must be at least 1 rank; got {world_size}")
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise ValueError(f"the memory per rank must be a positive size, like --memory 80GB; got {memory:.3g} B")
    numel = -(-int(params) // world_size) * world_size
    rows = [["stage", "params", "grads", "optimizer", "total/rank", "sent/step"]]
    for stage in range(4):
        b = model_state_bytes(numel, world_size, stage, dtype)
        sent = sum(comm_bytes_per_step(numel, world_size, stage, dtype).values())
        gb = [b["params"], b["grads"], b["optimizer"], sum(b.values()), sent]
        rows.append([str(stage)] + [f"{x / 1e9:.2f}" for x in gb])
        if memory:
            per_param = sum(model_state_bytes(world_size, world_size, stage, dtype).values()) / world_size
            rows[-1].append(f"{memory / per_param:.3g} parameters")
    if memory:
        rows[0].append("largest model that fits")
    widths = [2 + max(len(r[i]) for r in rows) for i in range(6)]  # so that numbers never run together
    title = (f"{params:.3g} parameters, {world_size} ranks, {str(dtype).replace('torch.', '')} compute "
             f"(GB = 1e9 bytes; model state only: activations and buffers come on top)")
    return [title] + [r[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(r[1:6], widths[1:]))
                      + "".join("  " + c for c in r[6:]) for r in rows]


BYTES = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,  # what people type after --memory
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text):
    """'80GB', '80GiB', '1TB', '512MB', '1.5TiB', or a bare number of GB -> bytes."""
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number):].lower() or "gb"
    if unit not in BYTES:
        raise ValueError(f"--memory {text!r}: the unit must be one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    try:
        return float(number) * BYTES[unit]
    except ValueError:
        raise ValueError(f"--memory {text!r} is not a size; give memory per rank like 80GB, 80GiB or 80 (GB)")


def main(argv):
    try:
        if argv[:1] == ["consolidate"]:
            return consolidate_cli(argv[1:])
        ap = argparse.ArgumentParser(description="ZeRO memory planner: model-state bytes per rank, per stage")
        ap.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7.5e9")
        ap.add_argument("--world-size", type=int, required=True)
        ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
        ap.add_argument("--memory", help="memory per rank, e.g. 80GB, 80GiB, 1TB (a bare number: GB): "
                                         "also print the largest model per stage")
        a = ap.parse_args(argv)
        memory = parse_bytes(a.memory) if a.memory is not None else None
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
        print("\n".join(plan(a.params, a.world_size, dtype, memory)))
    except (ValueError, OSError) as e:  # the user's input: one line, as argparse's own errors
        print(f"minizero.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def consolidate_cli(args):
    if len(args) != 2:
        raise ValueError("usage: python minizero.py consolidate CHECKPOINT_DIR OUT.pt")
    path, out = args
    folder = os.path.dirname(os.path.abspath(out))  # checked before the checkpoint is read
    if os.path.isdir(out):
        raise ValueError(f"OUT {out} is a directory; give a file name, like {os.path.join(out, 'model.pt')}")
    if not os.path.isdir(folder):
        raise ValueError(f"OUT {out}: the directory {folder} does not exist; create it first")
    state = consolidate(path)
    torch.save(state, out)
    print(f"wrote {len(state)} tensors to {out}; model.load_state_dict(torch.load(...)) takes them")


if __name__ == "__main__":
    main(sys.argv[1:])

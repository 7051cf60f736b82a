"""
minizero: data-parallel training with the Zero Redundancy Optimizer, DDP (stage 0) and
ZeRO stages 1, 2 and 3, in one small file.

Every stage uses the same layout: a model's trainable parameters are grouped into units
(each block of an nn.ModuleList, plus the root for the rest), and each unit is flattened
into one buffer padded to a multiple of the world size N. Rank r owns chunk r of it.
The stages differ only in what a rank keeps (Ψ = parameter count):

    stage   params  grads  optimizer   sends per step
    0 DDP   full    full   full        reduce-scatter grads + all-gather grads    2Ψ
    1       full    full   1/N         reduce-scatter grads + all-gather params   2Ψ
    2       full    1/N    1/N         same, reduce-scatter during backward       2Ψ
    3       1/N     1/N    1/N         all-gather fwd + bwd + reduce-scatter       3Ψ

Gradients are always reduced with the same ring reduce-scatter (ops.py), so the reduced
gradient shard is the same bits in every stage; AdamW is elementwise, so updating a shard
gives the same bits as updating the whole buffer. Hence every stage is bit-identical to DDP.
"""
import argparse
import hashlib
import io
import json
import math
import os
import resource
import sys
import weakref

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn

from ops import all_gather, all_reduce, broadcast, reduce_scatter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# -----------------------------------------------------------------------------
# the layout: units of parameters, each flattened into one padded buffer


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
    """One unit's parameters flattened into `flat` (padded to a multiple of N); the
    module's parameters become views into it. Also holds this rank's state for the unit."""

    def __init__(self, module, named, world_size, dtype):
        self.module = module
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.offsets, self.numel = [], 0
        for p in self.params:
            self.offsets.append(self.numel)
            self.numel += p.numel()
        self.padded = -(-self.numel // world_size) * world_size  # zeros up to a multiple of N
        self.shard_size = self.padded // world_size
        self.flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        for p, o in zip(self.params, self.offsets):
            self.flat[o:o + p.numel()].copy_(p.detach().view(-1))
            p.data = self.flat[o:o + p.numel()].view(p.shape)
        self.local = None       # this micro-batch's local gradient, full size
        self.arrived = set()    # which parameters' local gradients have arrived
        self.grad_shard = None  # reduced gradient shard, summed over micro-batches
        self.full_grad = None   # stage 0: the reduced gradient, all-gathered
        self.pending = None     # stage 3: the (future of the) gather that fills flat

    def chunk(self, x, rank):
        return x.view(-1, self.shard_size)[rank]


# -----------------------------------------------------------------------------
# the pieces that need no engine: AdamW on fp32 shards, clipping, the formulas


def adamw(p, g, m, v, t, lr, beta1, beta2, eps, decay):
    """One AdamW step, torch.optim.AdamW semantics: decoupled weight decay (decay is
    1 - lr·weight_decay, a float or a per-element tensor), bias correction, eps outside
    the sqrt. Elementwise, with only + - * / sqrt (each rounded once, never fused), so a
    shard gives the same bits as the whole buffer. p, m and v are updated in place (the
    same operations in the same order as p * decay, m * beta1 + g * (1 - beta1), ...):
    out-of-place, a step would need ten full-size temporaries."""
    p.mul_(decay)
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_(g.mul(g).mul_(1 - beta2))
    denom = v.sqrt().div_(math.sqrt(1 - beta2 ** t)).add_(eps)
    p.sub_(m.div(denom).mul_(lr / (1 - beta1 ** t)))
    return p, m, v


def decay_factor(unit, lo, hi, lr, weight_decay):
    """Per-element 1 - lr·wd for elements [lo, hi) of a unit: wd only where unit.decays."""
    if weight_decay == 0:
        return 1.0
    f = torch.ones(hi - lo, dtype=torch.float32, device=unit.flat.device)
    for o, p, d in zip(unit.offsets, unit.params, unit.decays):
        a, b = max(o, lo), min(o + p.numel(), hi)
        if d and a < b:
            f[a - lo:b - lo] = 1 - lr * weight_decay
    return f


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
    """DESIGN.md's table: bytes of model state per rank, for numel (padded) parameters.
    16-bit compute: params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 master, m, v);
    fp32: params 4Ψ, grads 4Ψ, optimizer 8Ψ (the params are the master)."""
    d = torch.finfo(dtype).bits // 8
    opt = 8 + (4 if d != 4 else 0)
    n = world_size
    return {"params": d * numel // (n if stage >= 3 else 1),
            "grads": d * numel // (n if stage >= 2 else 1),
            "optimizer": opt * numel // (n if stage >= 1 else 1)}


def comm_bytes_per_step(numel, world_size, stage, dtype=torch.bfloat16, grad_accum=1):
    """Payload bytes one rank sends in one step: each ring collective over Ψ elements
    sends (N-1)/N·Ψ. Gradients are reduce-scattered once per micro-batch; stage 3 also
    gathers the params twice per micro-batch (forward and backward), stages 0-2 gather
    once per step (grads at stage 0, params at 1-2)."""
    per = (world_size - 1) * (numel // world_size) * (torch.finfo(dtype).bits // 8)
    if world_size == 1:
        return {}
    return {"reduce_scatter": per * grad_accum,
            "all_gather": per * (2 * grad_accum if stage == 3 else 1)}


# -----------------------------------------------------------------------------
# the engine: the one stateful object, because autograd's hooks need somewhere to
# keep what they see. It drives the pieces above.


class Engine:
    """Wraps a model for data-parallel training at a ZeRO stage. Call the model as usual,
    then engine.backward(loss) per micro-batch and engine.step() every grad_accum of them.
    Keep a reference to the engine while you use the model: its hooks point back to it."""

    def __init__(self, model, comm, stage, *, units=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, decay=None, dtype=torch.float32, grad_accum=1, clip=None,
                 reduce_dtype=None, loss_scale=2.0 ** 16, scale_window=1000, overlap=True, fast=None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3; got {stage!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16; got {dtype}")
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1; got {grad_accum}")
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to train")
        devices = {str(p.device) for p in model.parameters()} | {str(b.device) for b in model.buffers()}
        if len(devices) > 1:
            raise ValueError(f"parameters and buffers are on different devices {sorted(devices)}; "
                             f"move the model to one device (model.to(device)) first")
        self.model, self.comm, self.stage, self.dtype = model, comm, stage, dtype
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.grad_accum, self.clip = grad_accum, clip
        self.reduce_dtype = reduce_dtype or dtype
        self.scale = loss_scale if dtype == torch.float16 else 1.0  # fp16 dynamic loss scaling
        self.scale_window, self.clean_steps = scale_window, 0
        self.t, self.micro = 0, 0  # optimizer steps taken; backward() calls since the last step
        if fast is not None:
            comm.fast = fast  # torch's own collectives instead of the ring (ops.py)
        self.overlap, self.jobs, self.fwd_order, self.bwd_order = overlap, [], [], []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"minizero-comm{comm.rank}") if overlap else None
        self.side = torch.cuda.Stream() if overlap and comm.device.type == "cuda" else None

        modules = default_units(model) if units is None else list(units)
        groups, cross = group_params(model, modules)
        if cross and stage == 3:
            a, b = cross[0]
            raise ValueError(f"{a} and {b} are one parameter tied across two units; stage 3 "
                             f"gathers one unit at a time, so put both modules in one unit "
                             f"(units=...) or use stage 0-2")
        model.to(dtype)  # 16-bit compute: params, frozen params and buffers in the compute dtype
        N, r = comm.world_size, comm.rank
        self.units = [Unit(m, g, N, dtype) for m, g in zip(modules, groups) if g]
        self.device = self.units[0].flat.device
        # as DDP does: every rank starts from rank 0's values (each rank sends ≤ Ψ once)
        for u in self.units:
            broadcast(u.flat, comm)
        for t in [p for p in model.parameters() if not p.requires_grad] + list(model.buffers()):
            broadcast(t.data, comm)

        # the model's hooks hold the engine weakly: when you drop the engine, it (and its
        # communication thread) goes, instead of living on in a cycle through the params
        me = weakref.proxy(self)
        for u in self.units:
            u.decays = [decay is None or bool(decay(n, p)) for n, p in zip(u.names, u.params)]
            mine = u.flat if stage == 0 else u.chunk(u.flat, r)
            if stage == 3:
                u.shard = mine.clone()  # the persistent 16-bit shard that gets gathered
                mine = u.shard
            # fp32 compute needs no master copy: the params (or their shard) are the master
            u.master = mine if dtype == torch.float32 else mine.float()
            u.m, u.v = torch.zeros_like(u.master), torch.zeros_like(u.master)
            if stage <= 1:  # the full gradient bucket that backward writes into
                u.grad = torch.zeros(u.padded, dtype=dtype, device=self.device)
            else:           # stages 2-3 keep only the reduced gradient shard
                u.grad = None
                u.grad_shard = torch.zeros(u.shard_size, dtype=self.reduce_dtype, device=self.device)
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(lambda p, u=u, i=i: me._on_grad(u, i, p))
            if stage == 3:
                self._release(u)
                u.module.register_forward_pre_hook(lambda mod, args, u=u: me._gather(u, me.fwd_order))
                u.module.register_forward_hook(lambda mod, args, out, u=u: me._after_forward(u, out))
        model.register_forward_pre_hook(lambda mod, args: me._cast_inputs(args))
        if stage == 3:  # an eval forward (no backward follows): leave nothing gathered or in flight
            model.register_forward_hook(lambda *_: None if torch.is_grad_enabled() else me._release_all())

    # ---- communication runs on its own thread, in the order it is asked for

    def _submit(self, job):
        """Run job() on this rank's communication thread (overlap=True) while autograd
        computes; return its future. Every rank submits the same collectives in the same
        order and one thread runs them in that order, so they pair up across ranks."""
        if self.pool is None:
            done = Future()
            done.set_result(job())
            return done
        if self.side is None:
            return self.pool.submit(job)
        ready = torch.cuda.Event()
        ready.record()  # GPU: the side stream waits for the compute that made the inputs

        def on_side_stream():
            with torch.cuda.stream(self.side):
                self.side.wait_event(ready)
                out = job()
                self.side.synchronize()
                return out
        return self.pool.submit(on_side_stream)

    def _drain(self):
        """Wait until the communication thread is idle: after this, collectives may run inline."""
        for f in self.jobs:
            f.result()  # re-raises a failed collective here
        self.jobs = []
        if self.pool is not None:
            self.pool.submit(lambda: None).result()

    # ---- stage 3: gather a unit before it is used, release it right after, prefetch the next

    def _gather(self, u, order):
        """Wait for unit u's params (fetching them now if no prefetch did), then start
        fetching the unit that came after u last time in this pass (order)."""
        self._fetch(u).result()
        if u not in order:
            order.append(u)  # the first pass records the order the next passes prefetch in
        i = order.index(u) + 1
        if self.overlap and i < len(order):
            self._fetch(order[i])

    def _fetch(self, u):
        """All-gather the unit's 16-bit shards into its flat buffer: sends (N-1)/N·Ψ_u."""
        if u.pending is None:
            u.flat.untyped_storage().resize_(u.padded * u.flat.element_size())  # allocate here,
            u.pending = self._submit(lambda: all_gather(u.shard, self.comm, out=u.flat))  # fill there
        return u.pending

    def _release(self, u):
        """Give the full parameters' memory back; the views stay, to be refilled later."""
        if u.pending is not None:
            u.pending.result()
        u.flat.untyped_storage().resize_(0)
        u.pending = None

    def _after_forward(self, u, out):
        if torch.is_grad_enabled():  # gather again when backward reaches this unit's outputs
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u, me=weakref.proxy(self): me._gather(u, me.bwd_order))
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
        """The unit's full local-gradient buffer: stages 0-1 keep one (u.grad); at stages
        2-3 it lives only from the unit's first gradient to its reduce-scatter."""
        if self.stage <= 1:
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
        """Reduce-scatter the unit's gradient: each rank sends (N-1)/N·Ψ_u and keeps its
        shard, summed over micro-batches in order (the same in every stage)."""
        bucket = self._bucket(u)
        for i in set(range(len(u.params))) - u.arrived:  # a parameter that got no gradient
            o = u.offsets[i]
            bucket[o:o + u.params[i].numel()].zero_()
        local, first = bucket.to(self.reduce_dtype), self.micro == 0
        # DDP can all-gather the reduced gradient now, while backward goes on (fp16 waits
        # for step()'s overflow check, so that a skipped step sends nothing more)
        gather = self.stage == 0 and self.micro == self.grad_accum - 1 and self.dtype != torch.float16

        def job():
            if gather and first and self.comm.fast:  # fast path, one micro-batch: DDP's all-reduce
                u.full_grad = all_reduce(local, self.comm)
                u.grad_shard = u.chunk(u.full_grad, self.comm.rank)
                return
            shard = reduce_scatter(local, self.comm)
            u.grad_shard = shard if first else u.grad_shard + shard
            if gather:
                u.full_grad = self._gather_grad(u)
        self.jobs.append(self._submit(job))
        u.arrived, u.reduced, u.local = set(), True, None  # stage 2: the full gradient is gone
        if self.stage == 3:
            self._release(u)

    def backward(self, loss):
        """Backward for one micro-batch; scaled by 1/grad_accum (and the fp16 loss scale).
        Returns once every unit's gradient is reduced."""
        if self.micro == self.grad_accum:
            raise RuntimeError(f"backward() called {self.micro + 1} times since the last step() "
                               f"with grad_accum={self.grad_accum}; call engine.step()")
        for u in self.units:
            u.reduced = False
        (loss.float() * (self.scale / self.grad_accum)).backward()
        for u in self.units:  # units whose parameters were not all used: reduce them now
            if not u.reduced:
                self._reduce(u)
        self._drain()
        if self.stage == 3:
            self._release_all()
        self.micro += 1

    # ---- the step: each stage updates what it keeps, then shares what the others need

    def step(self):
        """Update after grad_accum backward() calls; False if fp16 overflow skipped it."""
        if self.micro != self.grad_accum:
            raise RuntimeError(f"step() after {self.micro} backward() calls; grad_accum="
                               f"{self.grad_accum} expects exactly that many before each step")
        self.micro = 0
        self._drain()
        N, r, stage = self.comm.world_size, self.comm.rank, self.stage
        unscale = 1.0 / (N * self.scale)  # mean over ranks, undoing the fp16 loss scale
        if self.dtype == torch.float16 and self._overflow():
            self.scale, self.clean_steps = self.scale / 2, 0
            for u in self.units if stage <= 1 else []:
                u.grad_shard = None
            return False
        coef = None
        if self.clip is not None:
            coef = clip_coef([u.grad_shard.float() * unscale for u in self.units], self.clip, self.comm)
        self.t += 1
        b1, b2 = self.betas
        for u in self.units:
            if stage == 0:  # DDP: the all-gathered reduced grads (usually done in backward)
                g = u.full_grad if u.full_grad is not None else self._gather_grad(u)
                u.full_grad, lo, hi = None, 0, u.padded
            else:           # ZeRO: update my shard only
                g = u.grad_shard
                lo, hi = r * u.shard_size, (r + 1) * u.shard_size
            g = g.float() * unscale
            if coef is not None:
                g = g * coef
            decay = decay_factor(u, lo, hi, self.lr, self.weight_decay)
            adamw(u.master, g, u.m, u.v, self.t, self.lr, b1, b2, self.eps, decay)
            if stage == 0 and u.flat is not u.master:  # (fp32: the master is flat itself)
                u.flat.copy_(u.master)
            elif 1 <= stage <= 2:  # all-gather the updated params: each rank sends (N-1)/N·Ψ_u
                all_gather(u.master.to(self.dtype), self.comm, out=u.flat)
            elif stage == 3 and u.shard is not u.master:  # keep the shard for the next forward
                u.shard.copy_(u.master)
            if stage <= 1:
                u.grad_shard = None  # stages 0-1 keep gradients in the full bucket
        if self.dtype == torch.float16:
            self.clean_steps += 1
            if self.clean_steps % self.scale_window == 0:
                self.scale *= 2
        return True

    def _gather_grad(self, u):
        """Stage 0: all-gather the reduced gradient, (N-1)/N·Ψ_u, into the full bucket."""
        return all_gather(u.grad_shard, self.comm, out=u.grad if u.grad.dtype == u.grad_shard.dtype else None)

    def _overflow(self):
        """fp16: did any rank's gradient shard overflow? Then every rank skips the step."""
        bad = any(not torch.isfinite(u.grad_shard).all() for u in self.units)
        flags = all_gather(torch.tensor([float(bad)], device=self.device), self.comm, kind="overflow")
        return bool(flags.any())

    # ---- what leaves the engine

    def full_state_dict(self):
        """Collective. {name: fp32 tensor} for every name of model.state_dict(): tied
        names, frozen parameters and buffers included, so a fresh model loads it strictly."""
        values = {}
        self._drain()
        for u in self.units:
            full = u.master if self.stage == 0 else all_gather(u.master, self.comm, kind="state_dict")
            for p, o in zip(u.params, u.offsets):
                values[id(p)] = full[o:o + p.numel()].view(p.shape)
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            v = values.get(id(t), t.detach())
            out[name] = (v.float() if v.is_floating_point() else v).clone()
        return out

    def memory(self):
        """Bytes of the tensors this rank keeps between steps, by category."""
        def nbytes(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        params = grads = opt = 0
        for u in self.units:
            params += nbytes(u.shard if self.stage == 3 else u.flat)
            grads += nbytes(u.grad if self.stage <= 1 else u.grad_shard)
            opt += nbytes(u.m, u.v) + (nbytes(u.master) if self.dtype != torch.float32 else 0)
        return {"params": params, "grads": grads, "optimizer": opt}

    # ---- checkpoints: one shard file per rank, and a manifest written last

    def save_checkpoint(self, path, meta=None):
        """Collective. Each rank writes its shard (fp32 master, m, v of its chunk); once
        every rank reports its shard safely on disk, rank 0 writes the manifest, which
        alone makes the checkpoint complete. A crash anywhere before that leaves the
        previous manifest, and the shards it names, untouched. `meta` (JSON: the training
        step, say) rides in the manifest and comes back from load_checkpoint()."""
        if self.micro:
            raise RuntimeError("save_checkpoint() between backward() and step(); save after step()")
        comm, r = self.comm, self.comm.rank
        self._drain()
        os.makedirs(path, exist_ok=True)
        nonce = broadcast(torch.randint(0, 2**31, (1,), device=self.device), comm, kind="checkpoint")
        tag = f"{self.t:08d}-{int(nonce):08x}"  # new files never overwrite the complete checkpoint's
        shard = {"units": [{k: (u.chunk(getattr(u, k), r) if self.stage == 0 else getattr(u, k)).cpu()
                            for k in ("master", "m", "v")} for u in self.units]}
        if r == 0:  # frozen parameters and buffers, as full_state_dict gives them
            shard["extra"] = {n: (t.float() if t.is_floating_point() else t).detach().cpu().clone()
                              for n, t in self._frozen().items()}
        try:
            digest, error = _write_atomic(os.path.join(path, f"shard-{tag}-{r}.pt"), shard), ""
        except OSError as e:
            digest, error = bytes(32), str(e)
        report = torch.tensor([0 if error else 1, *digest], dtype=torch.int64, device=self.device)
        reports = all_gather(report, comm, kind="checkpoint").view(comm.world_size, -1).cpu()
        failed = [k for k in range(comm.world_size) if reports[k, 0] != 1]
        if failed:
            raise RuntimeError(f"checkpoint not saved: rank(s) {failed} could not write their shard "
                               f"({error or 'see that rank'}); the previous checkpoint in {path} is untouched")
        if r == 0:
            manifest = self._manifest(tag, [bytes(reports[k, 1:].tolist()).hex() for k in range(comm.world_size)])
            manifest["meta"] = meta
            _write_atomic(os.path.join(path, "manifest.json"), json.dumps(manifest, indent=1).encode())
            keep = {s["file"] for s in manifest["shards"]} | {"manifest.json"}
            for f in os.listdir(path):  # the previous checkpoint's shards and any half-written files
                if f not in keep and (f.startswith("shard-") or f.endswith(".tmp")):
                    os.remove(os.path.join(path, f))
        all_gather(torch.zeros(1, device=self.device), comm, kind="checkpoint")  # done, everywhere

    def _frozen(self):
        """{name: tensor} of the model's state that is not a trainable parameter."""
        trainable = {id(p) for u in self.units for p in u.params}
        return {n: t for n, t in self.model.state_dict(keep_vars=True).items() if id(t) not in trainable}

    def _manifest(self, tag, digests):
        aliases, state = {}, self.model.state_dict(keep_vars=True)
        for name, t in state.items():
            aliases.setdefault(id(t), []).append(name)
        return {"format": "minizero-1", "tag": tag, "step": self.t, "scale": self.scale,
                "clean_steps": self.clean_steps, "world_size": self.comm.world_size, "stage": self.stage,
                "dtype": str(self.dtype), "state_dict": list(state),
                "hparams": {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                            "weight_decay": self.weight_decay, "grad_accum": self.grad_accum, "clip": self.clip},
                "units": [{"numel": u.numel, "padded": u.padded,
                           "params": [{"name": n, "aliases": aliases[id(p)], "shape": list(p.shape), "offset": o}
                                      for n, p, o in zip(u.names, u.params, u.offsets)]} for u in self.units],
                "shards": [{"file": f"shard-{tag}-{k}.pt", "sha256": d} for k, d in enumerate(digests)]}

    def load_checkpoint(self, path):
        """Load a complete checkpoint saved at any world size and stage: the logical
        (unpadded) vectors are re-cut for this layout. Everything is read and checked
        before anything is changed, so a bad checkpoint leaves the engine as it was.
        Returns the `meta` given to save_checkpoint()."""
        manifest, params, extra = read_checkpoint(path)
        mine = {n: p for u in self.units for n, p in zip(u.names, u.params)}
        _check_same(path, {n: list(p.shape) for n, p in mine.items()},
                    {n: v["shape"] for n, v in params.items()}, "trainable parameter")
        frozen = self._frozen()
        _check_same(path, {n: list(t.shape) for n, t in frozen.items()},
                    {n: list(t.shape) for n, t in extra.items()}, "frozen parameter or buffer")
        r = self.comm.rank
        for u in self.units:
            full = {k: _assemble(u, params, k) for k in ("master", "m", "v")}
            if self.stage <= 2:
                u.flat.copy_(full["master"])  # the live parameters, all of them
            else:
                u.shard.copy_(u.chunk(full["master"], r))
            for k in ("master", "m", "v"):
                getattr(u, k).copy_(full[k] if self.stage == 0 else u.chunk(full[k], r))
        for n, t in frozen.items():
            t.data.copy_(extra[n])
        self.t, self.scale, self.clean_steps = manifest["step"], manifest["scale"], manifest["clean_steps"]
        return manifest.get("meta")

    def numel(self):
        """Ψ as laid out: trainable parameters plus padding."""
        return sum(u.padded for u in self.units)

    def formula(self):
        return model_state_bytes(self.numel(), self.comm.world_size, self.stage, self.dtype)


# -----------------------------------------------------------------------------
# checkpoint files: read without a process group (consolidation uses this too)


def _write_atomic(path, obj):
    """Write to a temporary name, fsync, then rename: the file is whole or absent."""
    data = obj if isinstance(obj, bytes) else _serialize(obj)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return hashlib.sha256(data).digest()


def _serialize(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def read_checkpoint(path):
    """-> (manifest, {name: {"master", "m", "v": fp32 tensor, "shape"}}, {name: tensor} of
    frozen parameters and buffers). Every shard is checked against the manifest's sha256."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.exists(mpath):
        raise FileNotFoundError(f"no complete checkpoint in {path}: {mpath} is missing "
                                f"(a save that never finished leaves no manifest)")
    with open(mpath) as f:
        manifest = json.load(f)
    shards = []
    for s in manifest["shards"]:
        fpath = os.path.join(path, s["file"])
        if not os.path.exists(fpath):
            raise FileNotFoundError(f"checkpoint {path} is missing its shard {fpath}")
        with open(fpath, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != s["sha256"]:
            raise ValueError(f"checkpoint shard {fpath} is truncated or corrupted "
                             f"({len(data)} bytes, sha256 differs from the manifest's)")
        shards.append(torch.load(io.BytesIO(data), weights_only=True))
    params = {}
    for i, unit in enumerate(manifest["units"]):
        full = {k: torch.cat([s["units"][i][k] for s in shards]) for k in ("master", "m", "v")}
        for p in unit["params"]:
            n = math.prod(p["shape"])
            params[p["name"]] = {k: full[k][p["offset"]:p["offset"] + n].view(p["shape"]) for k in full}
            params[p["name"]]["shape"] = p["shape"]
    return manifest, params, shards[0]["extra"]


def consolidate(path):
    """A checkpoint as one plain fp32 state_dict: every name of model.state_dict(),
    both names of a tied weight, frozen parameters and buffers."""
    manifest, params, extra = read_checkpoint(path)
    values = dict(extra)
    for unit in manifest["units"]:
        for p in unit["params"]:
            for alias in p["aliases"]:
                values[alias] = params[p["name"]]["master"].clone()
    return {n: values[n] for n in manifest["state_dict"]}


def _assemble(u, params, key):
    """One unit's padded fp32 vector of `key`, in this layout, from per-name values."""
    x = torch.zeros(u.padded, dtype=torch.float32, device=u.flat.device)
    for n, p, o in zip(u.names, u.params, u.offsets):
        x[o:o + p.numel()] = params[n][key].reshape(-1).to(x.device)
    return x


def _check_same(path, ours, theirs, what):
    for n in sorted(ours.keys() | theirs.keys()):
        if ours.get(n) != theirs.get(n):
            raise ValueError(f"checkpoint {path} is of another model: {what} {n} has shape "
                             f"{theirs.get(n, 'absent')} there and {ours.get(n, 'absent')} here")


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
    numel = -(-int(params) // world_size) * world_size
    lines = [f"{params:.3g} parameters, {world_size} ranks, {str(dtype).replace('torch.', '')} compute "
             f"(GB = 1e9 bytes; model state only: activations and buffers come on top)",
             f"{'stage':<8}{'params':>10}{'grads':>10}{'optimizer':>11}{'total/rank':>12}{'sent/step':>11}"
             + ("  largest model that fits" if memory else "")]
    for stage in range(4):
        b = model_state_bytes(numel, world_size, stage, dtype)
        sent = sum(comm_bytes_per_step(numel, world_size, stage, dtype).values())
        line = (f"{stage:<8}{b['params'] / 1e9:>10.2f}{b['grads'] / 1e9:>10.2f}{b['optimizer'] / 1e9:>11.2f}"
                f"{sum(b.values()) / 1e9:>12.2f}{sent / 1e9:>11.2f}")
        if memory:
            per_param = sum(model_state_bytes(world_size, world_size, stage, dtype).values()) / world_size
            line += f"  {memory / per_param:.3g} parameters"
        lines.append(line)
    return lines


def main(argv):
    if argv[:1] == ["consolidate"]:
        if len(argv) != 3:
            sys.exit("usage: python minizero.py consolidate CHECKPOINT_DIR OUT.pt")
        state = consolidate(argv[1])
        torch.save(state, argv[2])
        print(f"wrote {len(state)} tensors to {argv[2]}; model.load_state_dict(torch.load(...)) takes them")
        return
    ap = argparse.ArgumentParser(description="ZeRO memory planner: model-state bytes per rank, per stage")
    ap.add_argument("--params", type=float, required=True, help="parameter count, e.g. 7.5e9")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--memory", help="memory per rank, e.g. 80GB: also print the largest model per stage")
    a = ap.parse_args(argv)
    memory = float(a.memory.upper().removesuffix("GB")) * 1e9 if a.memory else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    print("\n".join(plan(a.params, a.world_size, dtype, memory)))


if __name__ == "__main__":
    main(sys.argv[1:])

"""
The engine: the one stateful object of minizero, because autograd's hooks need somewhere
to keep what they see. It decides *when* the functions of stages.py run (reduce a unit
once its last gradient is in, gather a stage-3 unit before it is used, prefetch the next,
update after the last micro-batch); *how* they sum, update and share is theirs.

    engine = Engine(model, comm, stage=3, lr=3e-4, dtype=torch.bfloat16, grad_accum=4)
    loss = model(x, y)          # call the model as usual
    engine.backward(loss)       # once per micro-batch
    engine.step()               # after grad_accum of them
"""
import contextlib
import os
import warnings
import weakref

import torch

from minizero_lib import checkpoint, writer
from minizero_lib.flight import Tracer
from minizero_lib.checkpoint import write_master
from minizero_lib.stages import (Unit, cast_floats, check_engine_args, check_same_model, clip_coef, comm_bytes_per_step,
                      ddp_reduce, ddp_update, default_units, gather_params, group_params, held_bytes, materialize,
                      meta_owners, model_state_bytes, offloaded_bytes, offloaded_held, reduce_grads, release_params,
                      sharded, tensors, zero_update)
from minizero_lib.offload import check_offload, disk_update, placement
from minizero_lib.optimizers import Hyper, choose_updates, optimizer_options, runs, state_numel, whole_numel
from ops import Pending, all_gather, broadcast, comm_thread, in_flight, split


class Engine:
    """Wraps a model for data-parallel training at a ZeRO stage. Call the model as usual,
    then engine.backward(loss) per micro-batch and engine.step() every grad_accum of them.
    Keep a reference to the engine while you use the model: its hooks point back to it."""

    def __init__(self, model, comm, stage, *, units=None, optimizer="adamw", lr=1e-3, weight_decay=0.0, decay=None,
                 dtype=torch.float32, grad_accum=1, clip=None, reduce_dtype=None, loss_scale=2.0 ** 16, init=None,
                 scale_window=1000, skip_limit=25, broadcast_buffers=True, offload=None, offload_dir=None,
                 offload_params=False, pin_memory=True, overlap=True, native=None, shard_size=None, trace=None,
                 **options):
        check_engine_args(model, stage, dtype, grad_accum)
        owners = meta_owners(model, init)  # None unless built (in part) on the meta device
        options = optimizer_options(optimizer, options)  # torch.optim's defaults, and names
        check_offload(stage, offload, offload_dir, offload_params)
        if native is not None:
            comm.native = native  # torch's own collectives instead of the ring (ops.py)
        check_same_model(model, comm)  # first: every later collective's size depends on it
        self.model = model                      # the user's module; its parameters live in the units
        self.comm = comm                        # send/recv and the byte ledger (ops.py)
        self.shards, self.replicas = split(comm, shard_size)  # units cut over S ranks, copied N/S times (hybrid)
        self.stage = stage                      # 0 = DDP, 1-3 = ZeRO
        self.sharded = sharded(stage)           # what this stage keeps 1/N of
        self.dtype = dtype                      # compute dtype of params, grads and float inputs
        self.reduce_dtype = reduce_dtype or dtype  # dtype the gradients are summed in
        self.optimizer = optimizer              # "adamw", "sgd", "adafactor" or "muon" (optimizers.py)
        self.lr, self.weight_decay = lr, weight_decay  # lr may change between steps
        self.options = options                  # the optimizer's other options (betas, momentum, muon_lr, ...)
        self.grad_accum = grad_accum            # backward() calls per step()
        self.clip = clip                        # max gradient norm, or None
        self.scale = loss_scale if dtype == torch.float16 else 1.0  # fp16 dynamic loss scale
        self.scale_window = scale_window        # fp16: clean steps before the scale doubles
        self.clean_steps = 0                    # fp16: steps since the last overflow
        self.skip_limit = skip_limit            # raise after this many skipped steps in a row
        self.skipped, self.skips_in_row = 0, 0  # steps skipped for non-finite gradients
        self.t = 0                              # optimizer steps taken
        self.micro = 0                          # backward() calls since the last step()
        self.in_backward = False                # a forward now is a recomputation inside backward
        self.writing = False                    # inside gathered(writable=True): loading weights is fine
        self.closed = False                     # close() was called: the hooks refuse
        self.jobs, self.last = [], None         # this micro-batch's reductions in flight; the job submitted last
        self.next = 0                           # the next unit, in self.order, to reduce
        self.trace = 0                          # a hash of the units this rank gathered and reduced
        self.fwd_order, self.bwd_order = [], []  # stage 3: units in the order the first pass used them
        # one communication thread per rank runs collectives in the order they are asked for, so they
        # pair up across ranks while autograd goes on (GPU: on a side stream); one rank sends nothing
        overlap = overlap and comm.world_size > 1
        self.pool = comm_thread(comm) if overlap else None
        self.side = torch.cuda.Stream(comm.device) if overlap and comm.device.type == "cuda" else None

        modules = default_units(model) if units is None else list(units)
        groups = group_params(model, modules, self.sharded["params"])
        model.to(dtype)  # 16-bit compute: params, frozen params and buffers in the compute dtype
        device = comm.device if owners else next(model.parameters()).device
        place = placement(device, offload, offload_dir, offload_params, pin_memory,
                          f"{os.getpid()}-{id(self):x}-rank{comm.rank}")
        self.offload, self.offload_params = place.state if place.state != "device" else None, place.params == "cpu"
        self.disk = place.disk                  # the files of disk offload (offload.py), or None
        self.units, kind = [], choose_updates(model, optimizer, options)
        for i, (m, g) in enumerate((m, g) for m, g in zip(modules, groups) if g):
            g = materialize(g, owners, device, init) if owners else g  # one unit at a time
            self.units.append(Unit(m, g, comm, self.shards, dtype, self.sharded, decay, [kind(n, p) for n, p in g],
                                   options, place._replace(index=i)))
        self.device = device                    # where the model lives
        self.order = self.units[::-1]           # reduce order: the same on every rank, backward's usual
        self.finite = torch.ones((), dtype=torch.bool, device=self.device)  # this rank's own gradients all finite?
        self.buffers = list(model.buffers()) if broadcast_buffers else []  # DDP's broadcast_buffers
        self.tracer = trace and Tracer(trace, comm, self.units, tensors)  # trace=DIR: a Chrome trace per rank
        for t in [p for p in model.parameters() if not p.requires_grad] + list(model.buffers()):
            broadcast(t.data, comm)  # frozen params and buffers start as rank 0's, too

        # the hooks hold the engine weakly: drop the engine and it (and its thread) goes,
        # instead of living on in a cycle through the parameters
        ref = weakref.ref(self)
        for u in self.units:
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(_hook(ref, "_on_grad", u, i))
            if self.sharded["params"]:  # (each unit starts released: Unit)
                u.module.register_forward_pre_hook(_hook(ref, "_gather", u))
                u.module.register_forward_hook(_hook(ref, "_after_forward", u))
        model.register_forward_pre_hook(_hook(ref, "_before_forward"), with_kwargs=True)
        model.register_load_state_dict_pre_hook(_hook(ref, "_loading"))
        if self.sharded["params"]:
            model.register_forward_hook(_hook(ref, "_eval_done"))

    # ---- communication, in the order it is asked for: on a thread of its own, or in flight

    def _submit(self, job, phase="", u=None):
        """Run job() while autograd computes: on this rank's communication thread (overlap=True),
        which runs jobs in the order submitted, so they pair up across ranks (flight.py records them).
        torch's own collectives start right here instead and finish at their wait (ops.in_flight,
        as DDP's and FSDP2's do), where each job is one collective whose result nothing reads
        before then: not accumulation's later micro-batches (they add to the sum), nor hybrid's,
        nor with headers (check=True), which make each start a round trip to the peers."""
        grad = torch.is_grad_enabled() or phase == "gradient reduction"  # (a reduction is the same collective
        job = self.comm.flight.within((phase, u.index if u else -1, self.t, self.micro, grad), job)  # in autograd or after)
        if self.pool is not None and self.comm.native and not getattr(self.comm, "check", False) \
                and self.replicas.world_size == 1 and self.micro == 0:
            with in_flight(self.comm) as pending:
                job()
            self.last = pending
            return pending
        if self.pool is None:
            out = job()
            return Pending(lambda: out)
        if self.side is not None:
            ready, compute = torch.cuda.Event(), job
            ready.record()  # GPU: the side stream waits for the compute that made the inputs

            def job():
                with torch.cuda.stream(self.side):
                    self.side.wait_event(ready)
                    out = compute()
                    self.side.synchronize()
                    return out
        self.last = Pending(self.pool.submit(job).result)
        return self.last

    def _drain(self):
        """Wait until the communication thread is idle (its last job is done): collectives may then run inline."""
        jobs, self.jobs, self.last = [j for j in (*self.jobs, self.last) if j is not None], [], None
        for job in jobs:
            job.wait()  # re-raises a failed collective here

    # ---- before every forward: DDP's buffer broadcast, inputs in the compute dtype

    def _loading(self, *_):
        """model.load_state_dict() would change the params but not the optimizer's master."""
        if not self.writing:
            raise RuntimeError("load weights inside `with engine.gathered(writable=True):` (every rank enters it), so the "
                               "fp32 master takes them too; or use engine.load_checkpoint(), or load before Engine()")

    def _before_forward(self, module, args, kwargs):
        if self.buffers and torch.is_grad_enabled():  # as DDP: rank 0's running stats, everywhere
            self._submit(self._broadcast_buffers).wait()  # (in line with stage 3's prefetches)
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)

    def _broadcast_buffers(self):
        for dtype in sorted({b.dtype for b in self.buffers}, key=str):  # one per dtype, apart from Ψ
            group = [b for b in self.buffers if b.dtype == dtype]
            flat = broadcast(torch.cat([b.reshape(-1) for b in group]), self.comm, kind="buffers")
            for b, x in zip(group, flat.split([b.numel() for b in group])):
                b.copy_(x.view(b.shape))

    # ---- stage 3: gather a unit before it is used, release it right after, prefetch the next

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
        if self.pool is not None and i < len(order):
            self._fetch(order[i])

    def _fetch(self, u):
        """Start the unit's all-gather (unless one is in flight), into memory allocated
        here, on the compute stream, so that reusing it is ordered after its last reader."""
        if u.pending is None:
            self._log(u, 0)
            u.flat.untyped_storage().resize_(u.padded * u.flat.element_size())
            if u.viewing is not u.flat:  # after gathered() they still view what it held
                u.point(u.flat)
            u.pending = self._submit(lambda: gather_params(u.shard, u.flat, self.shards),
                                     "backward regather" if self.in_backward else "forward gather", u)
        return u.pending

    def _release(self, u):
        if u.held is not None:
            return
        if u.pending is not None:
            u.pending.wait()
        u.mark(released=True)
        release_params(u.flat)
        u.pending = None

    def _after_forward(self, u, module, args, out):
        if self.in_backward:  # a recomputation (activation checkpointing): backward still needs
            return            # the unit; it is released once its gradients are reduced
        if torch.is_grad_enabled():  # gather again when backward reaches this unit's outputs
            for t in tensors(out):
                if t.requires_grad:
                    t.register_hook(_hook(weakref.ref(self), "_gather", u))
        self._release(u)

    def _eval_done(self, *_):
        """Stage 3: an eval forward (no backward follows) leaves nothing gathered or in flight."""
        return None if torch.is_grad_enabled() else self._release_all()

    def _release_all(self):
        for u in self.units:
            if u.pending is not None:
                self._release(u)

    @contextlib.contextmanager
    def gathered(self, modules=None, writable=False):
        """Collective: every rank enters it. Inside, the parameters of the units that hold
        `modules`' parameters (all units by default) are whole and may be read: stage 3
        all-gathers them into a buffer of their own (kind "gathered"), which lives on while
        anything still views it. With writable=True, on exit rank 0's values win: they are
        broadcast and written into every rank's fp32 master (and stage 3's shard), so every
        rank trains on what rank 0 wrote. DeepSpeed: GatheredParameters; FSDP: summon_full_params.
        Outside it, at stage 3, reading a parameter raises (see stages.ShardedParameter)."""
        want = None if modules is None else {id(p) for m in modules for p in m.parameters()}
        units = [u for u in self.units if want is None or any(id(p) in want for p in u.params)]
        self._drain()
        if self.sharded["params"]:
            self._release_all()
            for u in units:
                if u.held is not None:
                    raise RuntimeError("engine.gathered() is already open for these parameters; do not nest it")
                u.held = all_gather(u.shard.to(self.device), self.shards, kind="gathered")  # (offload_params: on the host)
                u.point(u.held)
                u.mark(released=False)
        self.writing = writable
        try:
            yield
        finally:
            self.writing = False
            for u in units:
                full = u.flat if u.held is None else u.held
                if writable:
                    write_master(self, u, broadcast(full, self.comm, kind="gathered"))
                if u.held is not None:  # the params keep viewing what was held, so a backward
                    u.mark(released=True)  # through a loss read in here still finds the values;
                    u.held = None          # the next gather points them at flat again

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
        if u.flushed:
            raise RuntimeError(f"{u.names[i]} got a gradient after its unit was reduced in this backward: "
                               f"a module used in two reentrant activation-checkpoint regions does this; use "
                               f"checkpoint(..., use_reentrant=False) (torch DDP needs that too)")
        o, g = u.offsets[i], p.grad.view(-1)
        dst = self._bucket(u)[o:o + p.numel()]
        dst.add_(g) if i in u.arrived else dst.copy_(g)  # add: a second reentrant region's part
        if self.comm.world_size > 1:  # its sum while in cache: NaN or inf anywhere makes it so (one rank: _agree's)
            torch.sum(dst, 0, dtype=torch.float32, out=u.sums[i])
        p.grad = None
        u.arrived.add(i)
        u.used[i] = True
        if len(u.arrived) == len(u.params):
            u.ready = True
            self._reduce_ready()

    def _reduce_ready(self):
        """Start the reductions of the ready units, in self.order. The order is the same on
        every rank, so collectives pair up even where ranks finish units in other orders
        (a branch that some ranks skip): a unit ready early waits, as DDP's buckets do."""
        while self.next < len(self.order) and self.order[self.next].ready:
            self._reduce(self.order[self.next])
            self.next += 1

    def _log(self, u, what):
        """Fold (unit, gather or reduce) into this rank's trace, compared across ranks at step()."""
        self.trace = (self.trace * 1_000_003 + 2 * u.index + what + 1) % 2 ** 52

    def _reduce(self, u):
        """Reduce the unit's gradient on the communication thread; what each rank keeps
        of it, and when the rest goes, is the stage's (reduce_grads, ddp_reduce)."""
        bucket = self._bucket(u)
        for i in set(range(len(u.params))) - u.arrived:  # no gradient here: zero, as in DDP
            bucket[u.offsets[i]:u.offsets[i] + u.params[i].numel()].zero_()
            u.sums[i] = 0
        local, last = bucket.to(self.reduce_dtype), self.micro == self.grad_accum - 1
        reduced = u.reduced if self.micro else None  # the first micro-batch starts the sum
        self._log(u, 1)
        if self.comm.world_size > 1:  # which rank's own gradient went bad (one rank: its own is the sum)
            self.finite &= torch.isfinite(u.sums.sum())

        def job():
            if self.sharded["optimizer"]:
                u.reduced = reduce_grads(local, reduced, self.shards, self.replicas, last)
            else:  # the whole optimizer on every rank needs the whole gradient
                out = u.grad if u.grad.dtype == local.dtype else None  # reuse the bucket
                u.reduced, u.full_grad = ddp_reduce(local, reduced, self.shards, self.replicas, last, out)
        self.jobs.append(self._submit(job, "gradient reduction", u))
        if len(self.jobs) > 2:  # at most one reduction queued behind the one sending: each holds a
            self.jobs.pop(0).wait()  # whole unit's gradient, and a slow link must not pile them up
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
            u.ready = u.flushed = False
        self.next = 0
        self.in_backward = True
        try:
            factor = self.scale / self.grad_accum  # (x·1 is x: no multiply, nor its backward)
            (loss.float() * factor if factor != 1 else loss.float()).backward()
        finally:
            self.in_backward = False
        for u in self.units:  # units whose parameters were not all used: reduce them now
            u.ready = True
        self._reduce_ready()
        self._drain()
        if self.sharded["params"]:
            self._release_all()
        self.micro += 1

    # ---- the step: each rank updates what it keeps (ddp_update or zero_update)

    def step(self):
        """Update after grad_accum backward() calls. False if a non-finite gradient on any
        rank skipped the step everywhere (params, moments and step counts unchanged)."""
        if self.micro != self.grad_accum:
            raise RuntimeError(f"step() after {self.micro} backward() calls; grad_accum="
                               f"{self.grad_accum} expects exactly that many before each step")
        self.micro = 0
        self._drain()
        bad = self._agree()
        if bad is not None:
            return self._skip(bad)
        unscale = 1.0 / (self.comm.world_size * self.scale)  # mean over ranks, undo the loss scale
        coef = None
        if self.clip is not None:
            coef = clip_coef([u.reduced.float() * unscale for u in self.units], self.clip, self.shards)
        hp = Hyper(self.lr, self.weight_decay, self.options, unscale, coef)
        self.comm.flight.ctx = ("parameter share", -1, self.t, 0, True)  # (flight.py: the all-gathers below)
        for u in self.units:
            u.steps = [t + used for t, used in zip(u.steps, u.used)]
        if self.disk is not None:  # (offload.py: streamed through the files, committed only if all wrote)
            disk_update(self, hp)
        else:
            for u in self.units:
                if self.sharded["optimizer"]:
                    zero_update(u.master, u.state, u.reduced, runs(u, hp), hp, self.shards, u.flat, u.shard,
                                u.whole)
                else:
                    ddp_update(u.flat, u.master, u.state, u.full_grad, runs(u, hp), hp, u.whole)
        self.t += 1
        self.comm.flight.stepped(self.t)  # (the phase above is over; Engine(trace=...) writes its file)
        self.skips_in_row = 0
        self._drop_grads()
        if self.dtype == torch.float16:
            self.clean_steps += 1
            if self.clean_steps % self.scale_window == 0:
                self.scale *= 2
        return True

    def _agree(self):
        """One small collective per step (kind "flags", booked apart from Ψ): whether every
        rank gathered and reduced the same units (else their collectives paired wrongly);
        which parameters got a gradient on any rank in any micro-batch (DDP's unused-parameter
        rule); whether any gradient went non-finite, in a rank's own gradient or in the sum.
        Returns None if all is finite, else the ranks whose own gradient was not. The
        flags are read once: the step's one host read of a device value (a GPU's queue drains)."""
        sums = torch.stack([u.reduced.sum(dtype=torch.float32) for u in self.units]).isfinite().all()
        bad = torch.stack([~(self.finite if self.comm.world_size > 1 else sums), ~sums]).double()  # on device
        mine = [float(self.trace)] + [float(x) for u in self.units for x in u.used]
        mine = torch.cat([bad, torch.tensor(mine, dtype=torch.float64, device=self.device)])
        flags, self.trace = all_gather(mine, self.comm, kind="flags").view(self.comm.world_size, -1).tolist(), 0
        if any(f[2] != flags[0][2] for f in flags):
            self._drop_grads()
            raise RuntimeError(
                f"step {self.t + 1}: the ranks gathered or reduced different units, so their collectives paired "
                f"up wrongly and nothing was updated. At stage 3 each rank gathers the units its forward runs: "
                f"a module that only some ranks run (an MoE expert, a branch) must share a unit with modules "
                f"every rank runs (units=[...], e.g. a whole MoE layer as one unit), or use stage 0-2")
        used = iter(any(col) for col in zip(*(f[3:] for f in flags)))
        for u in self.units:
            u.used = [next(used) for _ in u.params]
        self.finite.fill_(True)
        if any(f[0] or f[1] for f in flags):
            return [k for k, f in enumerate(flags) if f[0]]
        return None

    def _skip(self, bad):
        """Skip this step on every rank; fp16 halves its loss scale; raise after skip_limit in a row."""
        self._drop_grads()
        if self.dtype == torch.float16:
            self.scale, self.clean_steps = self.scale / 2, 0
        self.skipped, self.skips_in_row = self.skipped + 1, self.skips_in_row + 1
        where = f"rank(s) {bad}" if bad else "the sum over ranks (finite gradients overflowed)"
        if self.skipped == 1 and self.comm.rank == 0:
            warnings.warn(f"minizero: step {self.t + 1} skipped on every rank: non-finite gradients on {where}; "
                          f"parameters, moments and step counts are unchanged"
                          + (f" (fp16 loss scale now {self.scale:g})" if self.dtype == torch.float16 else ""))
        if self.skips_in_row >= self.skip_limit:
            raise FloatingPointError(f"{self.skips_in_row} steps in a row skipped for non-finite gradients "
                                     f"(last seen on {where}); the model is as it was after step {self.t}. "
                                     f"Lower the learning rate, check the data, or raise skip_limit")
        return False

    def _drop_grads(self):
        """After a step: no reduced gradient is kept to the next (FSDP2's zero_grad(set_to_none=True));
        stages 0-1 keep their whole-gradient bucket, as DDP keeps its buckets."""
        for u in self.units:
            u.reduced, u.full_grad, u.used = None, None, [False] * len(u.params)

    # ---- what leaves the engine

    def full_state_dict(self):
        """Collective. {name: fp32 tensor} for every name of model.state_dict(): tied
        names, frozen parameters and buffers included, so a fresh model loads it strictly."""
        self._drain()
        return checkpoint.full_state_dict(self)

    def memory(self):
        """Bytes of model state this rank holds on its device at a step's update, by category."""
        return held_bytes(self.units, self.device, self.sharded, self.dtype, self.reduce_dtype,
                          self.offload, self.offload_params)

    def offloaded(self):
        """{where: bytes} of this rank's model state off its device: "cpu", or "disk" (files: twice this)."""
        return offloaded_held(self.units, self.disk, self.offload, self.offload_params)

    def numel(self):
        """Ψ as laid out: trainable parameters plus padding."""
        return sum(u.padded for u in self.units)

    def formula(self, offloaded=False, sent=False):
        """What memory() (offloaded=True: offloaded(); sent=True: the bytes one step sends,
        by the ledger's kinds) must be: minizero's formulas, for this layout and optimizer."""
        layout, state = (self.numel(), self.shards.world_size, self.stage, self.dtype), state_numel(self.units)
        if sent:
            return comm_bytes_per_step(*layout, self.grad_accum, self.reduce_dtype, self.replicas.world_size,
                                       whole_numel(self.units))
        if offloaded:
            return offloaded_bytes(*layout, self.offload, self.offload_params, state)
        return model_state_bytes(*layout, self.offload, self.offload_params, self.reduce_dtype, state)

    def save_checkpoint(self, path, meta=None, background=False):
        """Collective: a sharded checkpoint in directory `path` (checkpoint.py); background=True:
        returns after a host copy of this rank's shard, a thread writes it (writer.py)."""
        self._drain()
        writer.save(self, path, meta, background)

    def load_checkpoint(self, path):
        """Collective: load a checkpoint saved at any world size and stage; returns its meta."""
        return checkpoint.load(self, path)

    def close(self):
        """Wait for a background save (collective then), stop the communication thread and
        remove disk offload's files. The model's hooks refuse from now on."""
        if not self.closed:
            self._drain()
            writer.wait(self)  # (if that save failed it raises here; close() again then closes)
            self.closed = True
            if self.pool is not None:
                self.pool.shutdown()
            if self.disk is not None:
                self.disk.close()


# the hooks autograd and the model call: each holds the engine weakly and finds it here


def _engine(ref):
    engine = ref()
    if engine is None or engine.closed:
        raise RuntimeError(f"this model's minizero Engine is {'gone' if engine is None else 'closed'}; keep the "
                           f"engine (and do not close it) for as long as you train or run the model")
    return engine


def _hook(ref, method, *bound):
    """A hook that calls engine.method(*bound, *the hook's arguments)."""
    return lambda *args: getattr(_engine(ref), method)(*bound, *args)

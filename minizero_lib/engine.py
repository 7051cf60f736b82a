"""
The engine: it wires autograd's and the model's hooks to the units (unit.py), and so decides
*when* stages.py's functions run: reduce a unit once its last gradient is in, gather a
stage-3 unit before it is used and prefetch the next, update after the last micro-batch.
*How* they sum, update and share is theirs; where a unit's tensors live is the unit's.

    engine = Engine(model, comm, stage=3, lr=3e-4, dtype=torch.bfloat16, grad_accum=4)
    loss = model(x, y)          # call the model as usual
    engine.backward(loss)       # once per micro-batch
    engine.step()               # after grad_accum of them
"""
import os
import weakref

import torch

from ops import broadcast, split
from minizero_lib import checkpoint, writer
from minizero_lib.agree import agree
from minizero_lib.compiled import outside_graphs
from minizero_lib.flight import Tracer
from minizero_lib.formulas import engine_formula, engine_held, offloaded_held
from minizero_lib.offload import check_offload, disk_update, pin_region, placement
from minizero_lib.optimizers import Hyper, choose_rules, optimizer_options
from minizero_lib.overlap import CommQueue
from minizero_lib.quantize import BLOCK, check_quant
from minizero_lib.scaler import LossScaler
from minizero_lib.stages import clip_coef, default_units, group_params, hpz_group, sharded
from minizero_lib.unit import Unit, release_all
from minizero_lib.user_model import (broadcast_buffers, cast_floats, check_engine_args,
                                     check_modes, check_same_model, materialize, meta_owners,
                                     tensors)


class Engine:
    """Wraps a model for data-parallel training at a ZeRO stage. Call the model as usual,
    then engine.backward(loss) per micro-batch and engine.step() every grad_accum of them.
    Keep a reference to the engine while you use the model: its hooks point back to it."""

    def __init__(self, model, comm, stage, *, units=None, optimizer="adamw", lr=1e-3,
                 weight_decay=0.0, decay=None, dtype=torch.float32, grad_accum=1, clip=None,
                 reduce_dtype=None, loss_scale=2.0 ** 16, init=None, scale_window=1000,
                 skip_limit=25, broadcast_buffers=True, offload=None, offload_dir=None,
                 offload_params=False, pin_memory=True, overlap=True, native=None, shard_size=None,
                 trace=None, reduce_every="micro_batch", reshard_after_forward=True,
                 quantize_weights=None, quantize_grads=None, quant_block=BLOCK, **options):
        check_engine_args(model, stage, dtype, grad_accum)
        check_modes(stage, reduce_every, reshard_after_forward, comm.world_size, shard_size)
        owners = meta_owners(model, init)  # None unless built (in part) on the meta device
        options = optimizer_options(optimizer, options)  # torch.optim's defaults, and names
        check_offload(stage, offload, offload_dir, offload_params)
        self.quant = check_quant(stage, quantize_weights, quantize_grads, quant_block)  # qwZ, qgZ
        if native is not None:
            comm.native = native  # torch's own collectives instead of the ring (ops.py)
        check_same_model(model, comm)  # first: every later collective's size depends on it
        # the user's module; its parameters live in the units
        self.model = model
        self.comm = comm                        # send/recv and the byte ledger (ops.py)
        # units cut over S ranks (shards), copied N/S times (replicas): hybrid sharding
        self.shards, self.replicas = split(comm, shard_size)
        self.stage = stage                      # 0 = DDP, 1-3 = ZeRO
        self.sharded = sharded(stage)           # what this stage keeps 1/N of
        self.dtype = dtype                      # compute dtype of params, grads and float inputs
        self.reduce_dtype = reduce_dtype or dtype  # dtype the gradients are summed in
        # "micro_batch", or "step": summed locally, reduced once; stage 3: True, False or G (hpZ)
        self.reduce_every, self.reshard_after_forward = reduce_every, reshard_after_forward
        self.hpz = hpz_group(comm, reshard_after_forward)  # hpZ: the G ranks backward gathers in
        self.optimizer = optimizer              # "adamw", "sgd", "adafactor" or "muon"
        self.lr, self.weight_decay = lr, weight_decay  # lr may change between steps
        self.options = options                  # the optimizer's other options (betas, ...)
        self.grad_accum = grad_accum            # backward() calls per step()
        self.clip = clip                        # max gradient norm, or None
        self.scaler = LossScaler(dtype, loss_scale, scale_window, skip_limit)  # fp16, skips
        self.t = 0                              # optimizer steps taken
        self.micro = 0                          # backward() calls since the last step()
        self.in_backward = False                # a forward now is a recomputation in backward
        self.writing = False                    # inside gathered(writable=True): loading is fine
        self.closed = False                     # close() was called: the hooks refuse
        self.saving = None                      # the background save not yet agreed on (writer.py)
        self.queue = CommQueue(comm, overlap)   # where collectives run: thread, in flight, inline
        self.next = 0                           # the next unit, in self.order, to reduce
        self.visits = 0                         # a hash of the units this rank gathered and reduced
        self.fwd_order, self.bwd_order = [], []  # stage 3: the order the first pass used units in

        modules = default_units(model) if units is None else list(units)
        groups = group_params(model, modules, self.sharded["params"])
        model.to(dtype)  # 16-bit compute: params, frozen params and buffers in the compute dtype
        device = comm.device if owners else next(model.parameters()).device
        place = placement(device, offload, offload_dir, offload_params, pin_memory,
                          f"{os.getpid()}-{id(self):x}-rank{comm.rank}")
        self.offload = place.state if place.state != "device" else None  # "cpu", "disk", None
        self.offload_params = place.params == "cpu"  # stage 3's shard in host memory
        self.disk = place.disk                  # the files of disk offload (offload.py), or None
        self.units, rule = [], choose_rules(model, optimizer, options)
        for i, (m, g) in enumerate((m, g) for m, g in zip(modules, groups) if g):
            g = materialize(g, owners, device, init) if owners else g  # one unit at a time
            self.units.append(Unit(i, m, g, comm, self.shards, dtype, self.sharded, decay,
                                   [rule(n, p) for n, p in g], options, place,
                                   self.reduce_dtype if reduce_every == "step" else dtype,
                                   self.quant))
        self.pinned = pin_region(self.units, place)  # the host state's one pinned region, or None
        self.device = device                    # where the model lives
        self.order = self.units[::-1]           # reduce order: the same on every rank
        # this rank's own gradients all finite? (the step's flags say which rank went bad)
        self.finite = torch.ones((), dtype=torch.bool, device=self.device)
        self.buffers = list(model.buffers()) if broadcast_buffers else []  # DDP's broadcast
        self.tracer = trace and Tracer(trace, comm, self.units, tensors)  # a Chrome trace per rank
        for t in [p for p in model.parameters() if not p.requires_grad] + list(model.buffers()):
            broadcast(t.data, comm)  # frozen params and buffers start as rank 0's, too

        _register_hooks(self)

    def _submit(self, job, phase="", u=None):
        """Queue a job of collectives, recorded under (phase, unit, step, micro-batch). Only a
        step's first micro-batch may fly (overlap.py), and never hybrid: later ones add to the
        sum, and hybrid's all-reduce runs behind the reduce-scatter."""
        grad = torch.is_grad_enabled() or phase == "gradient reduction"  # (the same collective)
        record = (phase, u.index if u else -1, self.t, self.micro, grad)
        return self.queue.submit(job, record, fly=self.micro == 0 and self.replicas.world_size == 1)

    def _log(self, u, what):
        """Fold (unit, gather or reduce) into the rank's visits, compared across ranks at step()."""
        self.visits = (self.visits * 1_000_003 + 2 * u.index + what + 1) % 2 ** 52

    # ---- before every forward: DDP's buffer broadcast, inputs in the compute dtype

    def _loading(self, *_):
        """model.load_state_dict() would change the params but not the optimizer's master."""
        if not self.writing:
            raise RuntimeError("load weights inside `with engine.gathered(writable=True):` (every "
                               "rank enters it), so the fp32 master takes them too; or use "
                               "engine.load_checkpoint(), or load before Engine()")

    def _before_forward(self, module, args, kwargs):
        if self.buffers and torch.is_grad_enabled():  # as DDP: rank 0's running stats everywhere
            # (in line with prefetches)
            self._submit(lambda: broadcast_buffers(self.buffers, self.comm)).wait()
        return cast_floats(args, self.dtype), cast_floats(kwargs, self.dtype)

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
        if self.queue.pool is not None and i < len(order):
            self._fetch(order[i])

    def _fetch(self, u):
        if u.pending is None:
            self._log(u, 0)
        phase = "backward regather" if self.in_backward else "forward gather"
        return u.fetch(lambda job: self._submit(job, phase, u), self.shards, self.hpz)

    def _after_forward(self, u, module, args, out):
        if self.in_backward:  # a recomputation (activation checkpointing): backward still needs
            return            # the unit; it is released once its gradients are reduced
        if torch.is_grad_enabled():  # gather again when backward reaches this unit's outputs
            for t in tensors(out):
                if t.requires_grad:
                    t.register_hook(_hook(weakref.ref(self), "_gather", u))
        u.reshard(self.reshard_after_forward, self.hpz, backward=torch.is_grad_enabled())

    def _eval_done(self, *_):
        """Stage 3: an eval forward (no backward follows) leaves nothing gathered or in flight."""
        return None if torch.is_grad_enabled() else release_all(self.units)

    def gathered(self, modules=None, writable=False):
        """Collective: every rank enters it. Inside, the parameters of the units that hold
        `modules`' parameters (all by default) are whole and may be read; writable=True: on
        exit rank 0's values win, master and shard included (checkpoint.gathered)."""
        return checkpoint.gathered(self, modules, writable)

    # ---- backward: collect local gradients, reduce each unit once it is complete

    def _on_grad(self, u, i, p):
        """Parameter i of unit u has its local gradient: move it into the unit's bucket."""
        # its sum while in cache (one rank: its own gradient is the sum, _agree checks it)
        complete = u.accumulate(i, p.grad, sum_it=self.comm.world_size > 1)
        p.grad = None
        if complete:
            u.ready = True
            self._reduce_ready()

    def _reduce_ready(self):
        """Start the reductions of the ready units, in self.order. The order is the same on
        every rank, so collectives pair up even where ranks finish units in other orders
        (a branch that some ranks skip): a unit ready early waits, as DDP's buckets do."""
        while self.next < len(self.order) and self.order[self.next].ready:
            self._reduce(self.order[self.next])
            self.next += 1

    def _reduce(self, u):
        """Reduce the unit's gradient on the communication queue (unit.reduction; None: kept)."""
        job = u.reduction(self.reduce_dtype, self.micro == 0, self.micro == self.grad_accum - 1,
                          self.shards, self.replicas, self.reduce_every)
        self._log(u, 1)
        if self.comm.world_size > 1:  # which rank's own gradient went bad
            self.finite &= torch.isfinite(u.sums.sum())
        if job is not None:
            self.queue.hold(self._submit(job, "gradient reduction", u))
        if self.sharded["params"]:
            u.release()

    def backward(self, loss):
        """Backward for one micro-batch; scaled by 1/grad_accum (and the fp16 loss scale).
        Returns once every unit's gradient is reduced."""
        if self.micro == self.grad_accum:
            raise RuntimeError(f"backward() called {self.micro + 1} times since the last step() "
                               f"with grad_accum={self.grad_accum}; call engine.step()")
        for u in self.units:
            u.ready = u.done = False
        self.next = 0
        self.in_backward = True
        try:
            factor = self.scaler.scale / self.grad_accum  # (x·1 is x: no multiply, nor backward)
            (loss.float() * factor if factor != 1 else loss.float()).backward()
        finally:
            self.in_backward = False
        for u in self.units:  # units whose parameters were not all used: reduce them now
            u.ready = True
        self._reduce_ready()
        self.queue.drain()
        if self.sharded["params"]:
            release_all(self.units)
        self.micro += 1

    # ---- the step: each rank updates what it keeps (unit.update)

    def step(self):
        """Update after grad_accum backward() calls. False if a non-finite gradient on any
        rank skipped the step everywhere (params, moments and step counts unchanged)."""
        if self.micro != self.grad_accum:
            raise RuntimeError(f"step() after {self.micro} backward() calls; grad_accum="
                               f"{self.grad_accum} expects exactly that many before each step")
        self.micro = 0
        self.queue.drain()
        visits, self.visits = self.visits, 0
        bad = agree(self.units, self.finite, visits, self.comm, self.t)
        if bad is not None:
            return self._skip(bad)
        # the mean over ranks, and the loss scale undone
        unscale = 1.0 / (self.comm.world_size * self.scaler.scale)
        coef = None if self.clip is None else clip_coef(
            [u.reduced.float() * unscale for u in self.units], self.clip, self.shards)
        hp = Hyper(self.lr, self.weight_decay, self.options, unscale, coef)
        self.comm.flight.ctx = ("parameter share", -1, self.t, 0, True)  # (the all-gathers below)
        for u in self.units:
            u.steps = [t + used for t, used in zip(u.steps, u.used)]
        if self.disk is None:
            for u in self.units:
                u.update(hp, self.shards)
        else:  # (offload.py: streamed through the files, committed only if every rank wrote)
            disk_update(self.units, self.disk, self.shards, self.device, hp, self.comm, self.t)
        self.t += 1
        self.comm.flight.stepped(self.t)  # (the phase above is over; trace=DIR writes its file)
        self._drop_grads()
        self.scaler.took_step()
        return True

    def _skip(self, bad):
        """Skip this step on every rank (scaler.py: fp16 halves its scale; too many raise)."""
        self._drop_grads()
        where = f"rank(s) {bad}" if bad else "the sum over ranks (finite gradients overflowed)"
        self.scaler.skipped_step(self.t, where, self.comm.rank)
        return False

    def _drop_grads(self):
        for u in self.units:
            u.drop_grads()

    # ---- what leaves the engine

    def full_state_dict(self):
        """Collective. {name: fp32 tensor} for every name of model.state_dict(): tied
        names, frozen parameters and buffers included, so a fresh model loads it strictly."""
        self.queue.drain()
        return checkpoint.full_state_dict(self)

    def memory(self):
        """Model-state bytes this rank holds on its device in a step, by category (formulas.py)."""
        return engine_held(self)

    def offloaded(self):
        """{where: bytes} of this rank's model state off its device: "cpu", or "disk"."""
        return offloaded_held(self.units, self.disk, self.offload, self.offload_params)

    def numel(self):
        """Ψ as laid out: trainable parameters plus padding."""
        return sum(u.padded for u in self.units)

    def formula(self, offloaded=False, sent=False):
        """What memory() (offloaded=True: offloaded(); sent=True: the bytes one step sends,
        by the ledger's kinds) must be: minizero's formulas, for this layout and optimizer."""
        return engine_formula(self, offloaded, sent)

    def save_checkpoint(self, path, meta=None, background=False):
        """Collective: a sharded checkpoint in directory `path` (checkpoint.py); background=True:
        returns after a host copy of this rank's shard, a thread writes it (writer.py)."""
        self.queue.drain()
        writer.save(self, path, meta, background)

    def load_checkpoint(self, path):
        """Collective: load a checkpoint saved at any world size and stage; returns its meta."""
        return checkpoint.load(self, path)

    def close(self):
        """Wait for a background save (collective then), stop the communication thread and
        remove disk offload's files. The model's hooks refuse from now on."""
        if not self.closed:
            self.queue.drain()
            writer.wait(self)  # (if that save failed it raises here; close() again then closes)
            self.closed = True
            self.queue.close()
            if self.disk is not None:
                self.disk.close()


# the hooks autograd and the model call: each holds the engine weakly and finds it there


def _register_hooks(engine):
    """The engine's hooks on the model. They hold the engine weakly: drop the engine and it
    (and its thread) goes, instead of living on in a cycle through the parameters. The
    module hooks run outside any graph torch.compile makes of the module (DESIGN.md §14);
    autograd's run in its engine, which no graph traces."""
    ref, model = weakref.ref(engine), engine.model
    for u in engine.units:
        for i, p in enumerate(u.params):
            p.register_post_accumulate_grad_hook(_hook(ref, "_on_grad", u, i))
        if engine.sharded["params"]:  # (each unit starts released: Unit)
            u.module.register_forward_pre_hook(outside_graphs(_hook(ref, "_gather", u)))
            u.module.register_forward_hook(outside_graphs(_hook(ref, "_after_forward", u)))
    model.register_forward_pre_hook(outside_graphs(_hook(ref, "_before_forward")),
                                    with_kwargs=True)
    model.register_load_state_dict_pre_hook(_hook(ref, "_loading"))
    if engine.sharded["params"]:
        model.register_forward_hook(outside_graphs(_hook(ref, "_eval_done")))


def _engine(ref):
    engine = ref()
    if engine is None or engine.closed:
        raise RuntimeError("this model's minizero Engine is "
                           f"{'gone' if engine is None else 'closed'}; keep the engine (and do not "
                           "close it) for as long as you train or run the model")
    return engine


def _hook(ref, method, *bound):
    """A hook that calls engine.method(*bound, *the hook's arguments)."""
    return lambda *args: getattr(_engine(ref), method)(*bound, *args)

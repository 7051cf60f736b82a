"""
The features, plugged into minizero.py at its seam: Engine(...) with a keyword beyond plain
ZeRO's (or fp16) builds this module's Engine, a subclass whose moves, the methods minizero.py
marks "(a feature's)", are its own; each falls back to plain ZeRO's where its feature is off.

    keyword                      feature                                  module
    shard_size=S                 hybrid sharding (HSDP): S ranks a shard  hybrid.py
    reduce_every="step"          one reduction per step (DDP's no_sync)   here
    reduce_order="tree"          the same bits at any world size          tree.py
    reshard_after_forward=F|G    stage 3 keeps units, or hpZ's G ranks    hybrid.py
    quantize_weights / _grads    ZeRO++'s qwZ / qgZ                       quantize.py
    offload="cpu"|"disk", ...    the optimizer state off the device       offload.py
    optimizer="muon"|"adafactor" updates that read whole tensors          optimizers.py
    loss_scale=, scale_window=   fp16's dynamic loss scale (any fp16 run) scaler.py
    native=True                  torch's own collectives (NCCL on GPU)    ops.py
    trace=DIR                    a Chrome trace of the first steps        flight.py
    init=fn                      a model built on the meta device         user_model.py
"""
import os

import minizero
from minizero import ddp_gather_grads, gather_params, reduce_grads, runs, share_params
from minizero_lib import hybrid, optimizers, quantize, tree
from minizero_lib.scaler import LossScaler
from minizero_lib.user_model import check_modes, materialize, meta_owners
from ops import all_gather, all_reduce, started

# every feature keyword, and the value that asks for nothing
KEYWORDS = dict(loss_scale=2.0 ** 16, scale_window=1000, init=None, offload=None, offload_dir=None,
                offload_params=False, pin_memory=True, native=None, shard_size=None, trace=None,
                reduce_every="micro_batch", reshard_after_forward=True, quantize_weights=None,
                quantize_grads=None, quant_block=quantize.BLOCK, reduce_order="ring")


class Engine(minizero.Engine):
    """minizero.Engine with its features: the fields below are options, checked before any
    collective, and what a feature keeps beside the units."""

    def _configure(self, kw):
        comm = self.comm
        given = {k: kw.pop(k) for k in list(kw) if k in KEYWORDS}
        opts = {**KEYWORDS, **given}
        # what is left are optimizer options: torch.optim's, checked (an unknown one raises)
        self.options = optimizers.optimizer_options(self.optimizer, {**self.options, **kw})
        check_modes(self.stage, opts["reduce_every"], opts["reshard_after_forward"],
                    comm.world_size, opts["shard_size"])
        self.owners = meta_owners(self.model, opts["init"])  # a model built on meta: its owners
        self.init = opts["init"]                 # fills a meta parameter once its unit exists
        self.offload = opts["offload"]           # the optimizer state: None, "cpu" or "disk"
        self.offload_params = opts["offload_params"]  # stage 3's shard in host memory
        if self.offload or self.offload_params:
            offload().check_offload(self.stage, self.offload, opts["offload_dir"],
                                    self.offload_params)
        self.offload_dir, self.pin_memory = opts["offload_dir"], opts["pin_memory"]
        self.quant = quantize.check_quant(self.stage, opts["quantize_weights"],  # qwZ, qgZ
                                          opts["quantize_grads"], opts["quant_block"])
        if opts["native"] is not None:
            comm.native = opts["native"]  # torch's own collectives instead of the ring (ops.py)
        self.shard_size = opts["shard_size"]     # hybrid: a unit is cut over this many ranks
        self.reduce_every = opts["reduce_every"]  # "micro_batch", or "step": summed locally
        self.reshard_after_forward = opts["reshard_after_forward"]  # stage 3: True, False or G
        self.scaler = LossScaler(self.dtype, opts["loss_scale"], opts["scale_window"])  # fp16
        self.trace = opts["trace"]               # where the trace's files go, or None
        self.rule_of = optimizers.choose_rules(self.model, self.optimizer, self.options)
        self.tree = check_tree(self, opts, given)  # reduce_order="tree": the same bits at any N
        self.leaves = {}                         # tree: unit index -> its LeafSum this step
        self.replicas = None                     # hybrid: this rank's copies of its shard group
        self.hpz = None                          # hpZ: the G ranks a unit's backward gathers in
        self.secondary = {}                      # hpZ: unit index -> my Ψ_u/G, kept for backward
        self.disk = None                         # disk offload: the files of the state
        self.pinned = None                       # the host state's one pinned region, or None
        self.tracer = None                       # trace=DIR: the Tracer (flight.py)

    # ---- construction

    def _shard_group(self):
        """Hybrid: units are cut over S ranks (shards) and copied N/S times (replicas)."""
        shards, self.replicas = hybrid.split(self.comm, self.shard_size)
        self.hpz = hybrid.hpz_group(self.comm, self.reshard_after_forward)
        return shards

    def _device(self):
        return self.comm.device if self.owners else super()._device()

    def _unit(self, i, module, named):
        """Unit i, with a model built on the meta device made real here (one unit at a time,
        filled by init(name, p)), Muon's and Adafactor's rules and state, reduce_every="step"'s
        sum in the bucket (in the reduce dtype), and its state where offload puts it."""
        if self.owners:
            named = materialize(named, self.owners, self.comm.device, self.init)
        rules = [self.rule_of(n, p) for n, p in named]
        keys = [optimizers.state_keys(k, p.shape, self.options) for k, (_, p) in zip(rules, named)]
        u = minizero.Unit(i, module, named, self.comm, self.group, self.dtype, self.sharded,
                          self.decay, rules, keys, self.reduce_dtype
                          if self.reduce_every == "step" and not self.tree else self.dtype)
        if not self.offload and not self.offload_params:
            u.own_state()
            return u
        if self.offload == "disk" and self.disk is None:
            self.disk = offload().DiskState(
                self.offload_dir, f"{os.getpid()}-{id(self):x}-rank{self.comm.rank}")
            self.at_close.append(self.disk.close)  # (its files go with the engine)
        offload().offload_unit(u, self.offload, self.offload_params, self.disk)
        return u

    def _built(self):
        if self.offload or self.offload_params:
            offload().warn_on_cpu(self.device, self.offload, self.offload_params)
            if self.pin_memory and self.units[0].flat.is_cuda:
                self.pinned = offload().pin_region(self.units, self.offload, self.offload_params)
        if self.trace:
            from minizero_lib.flight import Tracer
            self.tracer = Tracer(self.trace, self.comm, self.units, minizero.tensors)

    # ---- the moves

    def _submit(self, job, phase="", u=None):
        """torch's own collectives (native), a step's first micro-batch, never hybrid: started
        here and finished at their wait (ops.started), as DDP and FSDP2 run them; later
        micro-batches add to the sum, and hybrid's all-reduce runs behind the reduce-scatter.
        Not with headers either, which make each start a round trip."""
        q, comm = self.queue, self.comm
        if q.pool is None or self.micro != 0 or self.replicas.world_size > 1 or \
                not comm.native or comm.headers:
            return super()._submit(job, phase, u)
        with started(comm) as pending:
            comm.flight.within(self._record(phase, u), job)()
        q.last = pending
        return pending

    def _gather_job(self, u):
        """Stage 3's gather: from the secondary shard among hpZ's G ranks where a forward left
        one; qwZ's int8 all-gather; else plain ZeRO's, from the host with offload_params."""
        group, secondary, q = self.group, self.secondary.get(u.index), self.quant
        if secondary is not None:
            return lambda: hybrid.gather_secondary(secondary, u.flat, self.hpz)
        if q.weights:
            return lambda: quantize.gather_params(u.shard, u.flat, group, q)
        return lambda: gather_params(u.shard.to(u.flat.device, non_blocking=True), u.flat, group)

    def _release(self, u, when):
        """After a forward with a backward to follow, FSDP2's reshard_after_forward: True
        releases the unit; False keeps it gathered (its backward gathers nothing); G keeps
        this rank's secondary shard, which its backward gathers from. Else released, all."""
        if when != "forward":
            self.secondary.pop(u.index, None)
            return u.release()
        if self.reshard_after_forward is False or u.held is not None:
            return
        if self.hpz is not None and u.pending is not None:
            u.pending.wait()
            self.secondary[u.index] = hybrid.keep_secondary(u.flat, self.hpz)
        u.release()

    def _loss_factor(self):
        """The loss scale over grad_accum; tree: the loss scale alone (1/G comes after the sum:
        an fp16 leaf overflows, or not, whatever N)."""
        return self.scaler.scale if self.tree else self.scaler.scale / self.grad_accum

    def _reduction(self, u, first, last):
        """reduce_every="step": nothing before the step's last micro-batch (the bucket keeps
        the sum), then one reduction of it. Stage 0's one micro-batch as one all-reduce where
        it costs one collective (one rank; torch's own). Quantized (qgZ), and hybrid: the
        reduced shard all-reduced across the copies once per step."""
        q = self.quant
        if self.tree:
            return self._tree_reduction(u, last)
        if self.reduce_every == "step" and not last:
            u.zero_missing()
            return u.handed_off(keep_sum=True)
        first = first or self.reduce_every == "step"
        bucket = u.zero_missing()
        local, earlier = bucket.to(self.reduce_dtype), None if first else u.reduced
        out = None if u.cut["optimizer"] or bucket.dtype != local.dtype else bucket
        whole, shards, replicas = not u.cut["optimizer"], self.group, self.replicas
        one_all_reduce = replicas.world_size == 1 and (shards.world_size == 1 or shards.native)
        u.handed_off()

        def job():
            if whole and last and first and one_all_reduce and not q.grads:
                u.reduced, u.reduced_full = ddp_all_reduce(local, shards)
                return
            reduced = quantize.reduce_grads(local, earlier, shards, q) if q.grads else \
                reduce_grads(local, earlier, shards)
            if last and replicas.world_size > 1:  # hybrid: across the copies, once per step
                reduced = quantize.all_reduce_replicas(reduced, replicas, q) if q.grads else \
                    hybrid.all_reduce_replicas(reduced, replicas)
            u.reduced = reduced
            if whole and last:
                u.reduced_full = ddp_gather_grads(reduced, shards, out)
        return job

    def _tree_reduction(self, u, last):
        """reduce_order="tree": this micro-batch's gradient is a leaf of the rank's pairwise tree
        (tree.LeafSum, in the reduce dtype); after the step's last, one reduction of its sum:
        recursive halving over the shard group, then (hybrid) over the copies and an
        all-gather there (kind "all_reduce"), the upper levels of the same tree."""
        bucket = u.zero_missing()
        leaves = self.leaves.setdefault(u.index, tree.LeafSum(self.reduce_dtype))
        leaves.push(bucket)
        out = None if u.cut["optimizer"] or bucket.dtype != self.reduce_dtype else bucket
        u.handed_off()
        if not last:
            return None
        total, shards, replicas = leaves.result(), self.group, self.replicas
        del self.leaves[u.index]

        def job():
            reduced = tree.reduce_scatter_tree(total, shards)
            if replicas.world_size > 1:  # each rank sends 2(R-1)/R of its Ψ_u/S
                piece = tree.reduce_scatter_tree(reduced, replicas, kind="all_reduce")
                reduced = all_gather(piece, replicas, kind="all_reduce")
            u.reduced = reduced
            if not u.cut["optimizer"]:
                u.reduced_full = ddp_gather_grads(reduced, shards, out)
        return job

    def _unscale(self):
        """1/(N·loss scale); tree: 1/(G·loss scale), G = N·grad_accum leaves."""
        if self.tree:
            return 1.0 / (self.comm.world_size * self.grad_accum * self.scaler.scale)
        return 1.0 / (self.comm.world_size * self.scaler.scale)

    def _clip_coef(self, unscale):
        """tree: the norm summed as a tree whose shape no world size or padding changes."""
        if not self.tree:
            return super()._clip_coef(unscale)
        total = tree.norm_sq([u.reduced.float() * unscale for u in self.units], self.group)
        return minizero.coef_of(total, self.clip)

    def _update(self, hp):
        """Each unit's update, with Muon's and Adafactor's whole tensors gathered and the
        state where offload keeps it (disk: streamed through its files, committed only if
        every rank wrote)."""
        if self.disk is not None:
            return offload().disk_update(self.units, self.disk, self.group, self.device, hp,
                                         self.comm, self.t)
        for u in self.units:
            whole = optimizers.whole_rule(u)
            if u.cut["optimizer"]:
                gather = optimizers.gather_whole(self.group, u.flat.device) if whole else None
                optimizers.update(u.master, u.state, u.reduced, runs(u, hp), hp, whole, gather,
                                  u.flat.device)
                share_params(u.master, self.group, u.flat, u.shard)
                if u.shard is not None and u.shard is not u.master and u.master.is_cuda \
                        and not u.shard.is_cuda:  # (offload_params: read after an event)
                    optimizers.host_wait()
            else:
                optimizers.update(u.master, u.state, u.reduced_full, runs(u, hp), hp, whole)
                if u.flat is not u.master:
                    u.flat.copy_(u.master)

    def _took_step(self):
        self.scaler.took_step()

    def _skipped_step(self):
        return self.scaler.skipped_step()

    def _master(self, u):
        return u.master if self.disk is None else self.disk.state(u.index, 1)["master"]


def ddp_all_reduce(bucket, group):
    """Stage 0 with one micro-batch, where the split into two halves buys nothing: one rank
    (its gradient is the sum: nothing moves, and its bucket is overwritten only after the
    step), or torch's own all-reduce (one collective, in the bucket, as DDP's).
    -> (reduced shard, whole)."""
    full = bucket if group.world_size == 1 else all_reduce(bucket, group, out=bucket)
    return minizero.chunk(full, full.numel() // group.world_size, group.rank), full


def check_tree(e, opts, given):
    """Engine(reduce_order=...) that cannot work, before any collective: a ValueError naming
    the fix. -> whether the tree's order is asked for."""
    order = opts["reduce_order"]
    if order not in ("ring", "tree"):
        raise ValueError(f"reduce_order must be 'ring' (the default) or 'tree' (the same bits at "
                         f"any power-of-two world size); got {order!r}")
    if order == "ring":
        return False
    S = opts["shard_size"] or e.comm.world_size
    for what, n in (("the world size", e.comm.world_size), ("grad_accum", e.grad_accum),
                    ("shard_size", S)):
        if n & (n - 1):
            raise ValueError(f"reduce_order='tree' sums a balanced tree: {what} must be a power "
                             f"of two; got {n}")
    conflict = ("reduce_every='micro_batch'" if given.get("reduce_every") == "micro_batch"
                else "native=True" if opts["native"] else
                "quantize_grads" if opts["quantize_grads"] else None)
    if conflict:
        raise ValueError(f"reduce_order='tree' and {conflict} do not go together: the tree sums a "
                         "step's micro-batches once, on minizero's exact exchange (not torch's "
                         "collectives, which sum in an order of their own; nor quantized); drop "
                         f"{conflict.split('=')[0]}")
    return True


def offload():
    """offload.py, loaded only where asked for (it starts an I/O thread for disk offload)."""
    from minizero_lib import offload
    return offload

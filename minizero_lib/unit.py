"""
One unit: its parameters flattened into one padded buffer (stages.layout), everything this
rank keeps of it, and the moves that change that state: gather and release (stage 3),
accumulate a gradient, reduce, update. FSDP2's FSDPParamGroup is the model: the unit owns
its buffers and its moves, and engine.py only decides when each move runs.

What the stage shards is held as chunk r, r this rank's place in its shard group (all N
ranks, or S of them when hybrid). A unit's life in one step:

    forward     stage 3: gather (all-gather the shards into flat), release after
                (reshard_after_forward=False: keep it for backward; G: keep a secondary
                shard of Ψ_u/G, which backward gathers among G ranks)
    backward    accumulate each parameter's gradient into the bucket; once all are in,
                reduce (reduce-scatter the bucket; stage 0 also all-gathers the sum);
                reduce_every="step": only in the last micro-batch, the bucket the sum
    step        update this rank's range, then share it (stages 1-2) or keep the shard (3)
"""
import torch

from ops import all_gather, broadcast
from minizero_lib import quantize
from minizero_lib.optimizers import WHOLE, runs, state_keys, state_layout
from minizero_lib.stages import (all_reduce_replicas, chunk, ddp_all_reduce, ddp_gather_grads,
                                 ddp_update, gather_params, gather_secondary, keep_secondary,
                                 layout, reduce_grads, release_params, zero_update)
from minizero_lib.user_model import mark_sharded


class Unit:
    """One unit's buffers and moves. `cut` is sharded(stage); `place` (offload.Place) says
    where the optimizer state and stage 3's shard live; `rules` is each parameter's update
    (optimizers.py: "adamw", "sgd", "muon", "adafactor"); `bucket_dtype` the local gradient's
    dtype (the compute dtype; the reduce dtype under reduce_every="step", where it is a sum)."""

    def __init__(self, index, module, named, comm, group, dtype, cut, decay, rules, options,
                 place, bucket_dtype=None, quant=quantize.Quant()):
        N, S, r = comm.world_size, group.world_size, group.rank
        self.index = index                          # the unit's number, in the engine's list
        self.module = module                        # the nn.Module whose parameters these are
        self.cut = cut                              # what this stage shards: sharded(stage)
        self.names = [n for n, _ in named]          # their names in the model, in order
        self.params = [p for _, p in named]         # the nn.Parameters: views into flat
        self.offsets, self.numel, self.padded, self.shard_size = layout(self.params, N, S)
        # per parameter: weight decay?, a gradient this step (on any rank)?, its step count
        self.decays = [decay is None or bool(decay(n, p)) for n, p in named]
        self.used = [False] * len(self.params)
        self.steps = [0] * len(self.params)
        self.rules = rules                          # per parameter: the update it gets
        self.quant = quant                          # what its collectives quantize (quantize.py)
        self.keys = [state_keys(k, p.shape, options) for k, p in zip(rules, self.params)]
        self.whole_rule = next((k for k in rules if k in WHOLE), None)  # reads whole tensors
        lo, hi = (r * self.shard_size, (r + 1) * self.shard_size) if cut["optimizer"] \
            else (0, self.padded)
        # my range's parameters, and my optimizer state's size per key
        self.pieces, self.sizes = state_layout(self.offsets, [p.shape for p in self.params],
                                               rules, self.keys, lo, hi)
        self.flat = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        for p, o in zip(self.params, self.offsets):
            self.flat[o:o + p.numel()].copy_(p.detach().view(-1))
        self.point(self.flat)
        # as DDP does: every rank starts from rank 0's values
        broadcast(self.flat, comm)
        mine = self.chunk(self.flat, r) if cut["optimizer"] else self.flat
        # stage 3: the 16-bit shard the forward gathers
        self.shard = place.host(mine.clone(), place.params) if cut["params"] else None
        # fp32 params the optimizer updates, and its state of my range ({key: fp32}, pieces);
        # both None when they live on disk (offload.py)
        self.master, self.state = place.optimizer_state(
            index, mine if self.shard is None else self.shard, dtype, self.sizes)
        self.bucket_dtype = bucket_dtype or dtype  # the local gradient's dtype
        # the local gradient, whole: kept at stages 0-1, as DDP keeps its buckets; at stages
        # 2-3 alive only from the unit's first gradient to its reduce-scatter (reduce_every=
        # "step": to the step's last micro-batch's)
        self.bucket = None if cut["grads"] else torch.zeros_like(self.flat, dtype=self.bucket_dtype)
        self.summing = False                        # the bucket holds earlier micro-batches' sum
        self.secondary = None                       # hpZ: my Ψ_u/G of the unit, kept for backward
        # the reduced gradient shard, summed over micro-batches: made by a step's first
        # reduction, freed after its update
        self.reduced = None
        self.reduced_full = None                    # stage 0: the reduced gradient, whole
        self.arrived = set()                        # params whose gradient came in this micro-batch
        self.sums = torch.zeros(len(self.params), device=self.flat.device)  # ...fp32 sum of each
        # its local gradient is complete (this micro-batch)
        self.ready = False
        self.done = False                           # reduced in this micro-batch
        self.pending = None                         # stage 3: the gather in flight or done, or None
        # stage 3, in engine.gathered(): what is read there
        self.held = None
        self.viewing = self.flat                    # the buffer the parameters are views of now
        if cut["params"]:
            # a read of a released parameter is then an error, not freed memory
            mark_sharded(self.names, self.params)
            # now, not once every unit is built: the model is never here twice
            release_params(self.flat)

    def chunk(self, x, rank):
        return chunk(x, self.shard_size, rank)

    def point(self, buf):
        """Make the parameters views into buf (flat, or what engine.gathered() holds)."""
        for p, o in zip(self.params, self.offsets):
            p.data = buf[o:o + p.numel()].view(p.shape)
        self.viewing = buf

    def mark(self, released):
        """Stage 3: say whether the parameters may be read now."""
        for p in self.params:
            p.zero_released = released

    # ---- stage 3: gather before use, release after

    def fetch(self, submit, group, hpz=None):
        """Start the unit's all-gather (unless one is in flight), into memory allocated
        here, on the compute stream, so that reusing it is ordered after its last reader.
        Where a forward left a secondary shard (hpZ), from it, among hpz's G ranks."""
        if self.pending is None:
            self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
            if self.viewing is not self.flat:  # after gathered() they still view what it held
                self.point(self.flat)
            secondary, q = self.secondary, self.quant
            if secondary is not None:  # hpZ: from the secondary shard, among G ranks
                self.pending = submit(lambda: gather_secondary(secondary, self.flat, hpz))
            elif q.weights:  # qwZ: int8 codes and their scales move instead (quantize.py)
                self.pending = submit(lambda: quantize.gather_params(self.shard, self.flat, group,
                                                                     q))
            else:
                self.pending = submit(lambda: gather_params(self.shard, self.flat, group))
        return self.pending

    def release(self, keep_secondary=False):
        if self.held is not None:  # inside gathered(): the unit stays as it is
            return
        if self.pending is not None:
            self.pending.wait()
        self.mark(released=True)
        release_params(self.flat)
        self.pending = None
        if not keep_secondary:
            self.secondary = None

    def reshard(self, after_forward, hpz, backward):
        """Stage 3, after the unit's forward, as FSDP2's reshard_after_forward: True releases
        it; False keeps it gathered for its backward (which then gathers nothing); G keeps
        the secondary shard (hpz: this rank's group of G), which its backward gathers from.
        With no backward to follow (an eval forward), it is released."""
        if not backward:
            return self.release()
        if self.held is not None or after_forward is False:
            return
        if hpz is not None and self.pending is not None:
            self.pending.wait()
            self.secondary = keep_secondary(self.flat, hpz)
        self.release(keep_secondary=True)

    def hold(self, group, device):
        """Stage 3, in engine.gathered(): all-gather the params into a buffer of their own
        (kind "gathered"; offload_params: the shard comes from the host), which lives on while
        anything still views it."""
        if self.held is not None:
            raise RuntimeError("engine.gathered() is already open for these parameters; do not "
                               "nest it")
        self.held = all_gather(self.shard.to(device, non_blocking=True), group, kind="gathered")
        self.point(self.held)
        self.mark(released=False)

    def unhold(self):
        """Leaving gathered(): the params keep viewing what was held, so a backward through a
        loss read in there still finds the values; the next gather points them at flat again."""
        if self.held is not None:
            self.mark(released=True)
            self.held = None

    # ---- backward: accumulate the local gradients, reduce once all are in

    def local_bucket(self):
        """The bucket, made at the unit's first gradient in a micro-batch (stages 2-3)."""
        if self.bucket is None:
            self.bucket = torch.zeros(self.padded, dtype=self.bucket_dtype, device=self.flat.device)
        return self.bucket

    def accumulate(self, i, grad, sum_it):
        """Parameter i's local gradient into the bucket; sum_it: also its fp32 sum, while it
        is in cache (NaN or inf anywhere makes it so). True once every parameter's is in."""
        if self.done:
            raise RuntimeError(f"{self.names[i]} got a gradient after its unit was reduced in this "
                               "backward: a module used in two reentrant activation-checkpoint "
                               "regions does this; use checkpoint(..., use_reentrant=False) (torch "
                               "DDP needs that too)")
        o = self.offsets[i]
        dst = self.local_bucket()[o:o + grad.numel()]
        # add: a second reentrant region's part, or (reduce_every="step") to the earlier
        # micro-batches' sum, in the bucket's dtype, in micro-batch order
        dst.add_(grad.view(-1)) if i in self.arrived or self.summing else dst.copy_(grad.view(-1))
        if sum_it:
            torch.sum(dst, 0, dtype=torch.float32, out=self.sums[i])
        self.arrived.add(i)
        self.used[i] = True
        return len(self.arrived) == len(self.params)

    def reduction(self, reduce_dtype, first, last, shards, replicas, every="micro_batch"):
        """This micro-batch's reduction of the bucket, as a job for the communication queue;
        what each rank keeps of it, and when the rest goes, is the stage's. Then the bucket
        is free (stages 2-3: dropped). every="step": None before the last micro-batch (the
        bucket keeps the sum: keep_sum), then one reduction of the step's whole sum."""
        if every == "step" and not last:
            return self.keep_sum()
        first = first or every == "step"
        bucket = self.zero_missing()
        local, earlier = bucket.to(reduce_dtype), None if first else self.reduced
        # stage 0 gathers the whole sum into its bucket, where the dtypes agree
        out = None if self.cut["optimizer"] or bucket.dtype != local.dtype else bucket
        whole, q = not self.cut["optimizer"], self.quant  # q.grads: qgZ (quantize.py)

        def job():
            if whole and last and first and ddp_shortcut(shards, replicas) and not q.grads:
                self.reduced, self.reduced_full = ddp_all_reduce(local, shards)
                return
            reduced = quantize.reduce_grads(local, earlier, shards, q) if q.grads else \
                reduce_grads(local, earlier, shards)
            if last and replicas.world_size > 1:  # hybrid: across the copies, once per step
                reduced = quantize.all_reduce_replicas(reduced, replicas, q) if q.grads else \
                    all_reduce_replicas(reduced, replicas)
            self.reduced = reduced
            if whole and last:  # stage 0: the whole optimizer needs the whole gradient
                self.reduced_full = ddp_gather_grads(reduced, shards, out)

        self.arrived, self.done, self.summing = set(), True, False
        if self.cut["grads"]:  # stage 2: the full gradient is gone once reduced
            self.bucket = None
        return job

    def keep_sum(self):
        """reduce_every="step", before a step's last micro-batch: no reduction, nothing sent;
        the bucket keeps the sum so far (at stages 2-3 too: whole, to the last micro-batch)."""
        self.zero_missing()
        self.arrived, self.done, self.summing = set(), True, True

    def zero_missing(self):
        """The bucket, with zeros for parameters that got no gradient in this micro-batch (as
        DDP), unless it holds earlier micro-batches' sum: then they keep that."""
        bucket = self.local_bucket()
        for i in set(range(len(self.params))) - self.arrived if not self.summing else ():
            bucket[self.offsets[i]:self.offsets[i] + self.params[i].numel()].zero_()
            self.sums[i] = 0
        return bucket

    # ---- the step: update what this rank keeps

    def update(self, hp, group):
        """Stage 0 updates the whole buffer; stages 1-3 their chunk, then share it."""
        if self.cut["optimizer"]:
            zero_update(self.master, self.state, self.reduced, runs(self, hp), hp, group,
                        self.flat, self.shard, self.whole_rule)
        else:
            ddp_update(self.flat, self.master, self.state, self.reduced_full, runs(self, hp), hp,
                       self.whole_rule)

    def drop_grads(self):
        """After a step: no reduced gradient is kept to the next (FSDP2's zero_grad(set_to_none=
        True)); stages 0-1 keep their whole-gradient bucket, as DDP keeps its buckets."""
        self.reduced, self.reduced_full, self.used = None, None, [False] * len(self.params)


def ddp_shortcut(shards, replicas):
    """Stage 0's one micro-batch as one all-reduce (stages.ddp_all_reduce): on one rank, or
    on torch's own collectives; never hybrid, whose sum crosses two groups."""
    return replicas.world_size == 1 and (shards.world_size == 1 or shards.native)


def release_all(units):
    """Stage 3, after a backward or an eval forward: nothing gathered, in flight or kept."""
    for u in units:
        if u.pending is not None or u.secondary is not None:
            u.release()

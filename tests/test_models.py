"""
Models written the way users write them, each run at every stage through minizero.check
(bitwise across stages, stage 0 refereed by torch), and the engine's promises around
them: parameters read outside forward, state_dict at stage 3, a NaN on one rank, DDP's
rules for unused parameters and buffers (against torch's own DDP, on gloo), and ranks
whose models differ.
"""
import contextlib
import copy
import gc
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import minizero
from minizero_lib import launch
from minizero_lib.check import perturb

torch.set_num_threads(1)
V, D = 13, 8  # vocabulary and width of every model here


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


@dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor


class Users(nn.Module):
    """One model, many habits: keyword arguments, a dict or dataclass output, activation
    checkpointing (reentrant or not, one block or two per region), a block applied twice,
    a frozen base with LoRA adapters, and experts that some steps and ranks skip."""

    def __init__(self, ckpt=None, twice=False, lora=False, experts=0, output="dataclass", depth=3):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))
        self.head = nn.Linear(D, V)
        self.ckpt, self.twice, self.output = ckpt, twice, output
        if lora:  # the base is frozen; only the low-rank adapters A, B train
            self.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(D, 2) * 0.1)
            self.lora_b = nn.Parameter(torch.zeros(2, V))

    def forward(self, tokens, targets, *, route=None, extra=None):
        x = self.emb(tokens)
        blocks = list(self.blocks) + ([self.blocks[0]] if self.twice else [])
        if self.ckpt == "pairs":  # several blocks in one checkpointed region
            pair, blocks = nn.Sequential(blocks[0], blocks[1]), blocks[2:]
            x = checkpoint(pair, x, use_reentrant=False)
        for b in blocks:
            x = checkpoint(b, x, use_reentrant=self.ckpt == "reentrant") if self.ckpt else b(x)
        if route is not None:  # an expert per micro-batch; the others get no gradient
            x = x + self.experts[int(route)](x)
        if extra is not None:  # a float input inside a dict keyword: cast like positional ones
            x = x * extra["scale"]
        logits = self.head(x)
        if hasattr(self, "lora_a"):
            logits = logits + x @ self.lora_a @ self.lora_b
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return Out(logits, loss) if self.output == "dataclass" else {"logits": logits, "loss": loss}


def batch(step, rank, micro, route=None, extra=False):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    kw = dict(tokens=torch.randint(0, V, (2, 5), generator=g), targets=torch.randint(0, V, (2, 5), generator=g))
    if route is not None:
        kw["route"] = route(step, rank, micro)
    if extra:
        kw["extra"] = {"scale": torch.rand(2, 5, 1, generator=g) + 0.5}
    return kw


def build(**kw):
    """The same model on every thread: values from a generator of its own (threads share
    torch's global RNG, so manual_seed there would race)."""
    model, g = Users(**kw), torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3
    return model


def check(model_kw, batch_kw=None, world_sizes=(3,), **engine_kw):
    report = minizero.check(lambda: build(**model_kw), lambda s, r, m: batch(s, r, m, **(batch_kw or {})),
                            world_sizes=world_sizes, steps=2, **{**dict(lr=0.02, weight_decay=0.1, clip=1.0), **engine_kw})
    return report


@pytest.mark.parametrize("output", ["dataclass", "dict"])
def test_keyword_arguments_and_structured_outputs(output):
    report = check(dict(output=output), world_sizes=(1, 3))
    assert report.ok, report


@pytest.mark.parametrize("ckpt, early_stop", [("reentrant", True), ("reentrant", False), ("plain", True),
                                              ("plain", False), ("pairs", True), ("pairs", False)])
def test_activation_checkpointing(ckpt, early_stop):
    """Stage 3 regathers a unit whose forward runs again inside backward and keeps it."""
    with set_checkpoint_early_stop(early_stop):
        report = check(dict(ckpt=ckpt), grad_accum=2)
    assert report.ok, report


def test_a_block_applied_twice():
    """The same bits everywhere; stage 3 gathers the reused unit once more per pass,
    so it sends more than the formula's 3Ψ, and says so."""
    report = check(dict(twice=True))
    assert all(r.max_diff == 0 and r.memory_ok for r in report.rows)
    assert [r.first is None for r in report.rows] == [True, True, True, False]
    assert report.first.what == "bytes" and report.first.stage == 3 and report.first.ours > report.first.theirs


def test_reentrant_regions_sharing_a_block_is_a_clear_error():
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        launch.run_threads(_train_one, 2, 3, dict(twice=True, ckpt="reentrant"))


def _train_one(comm, stage, model_kw, engine_kw=None, steps=1, poison=None, route=None):
    model = build(**model_kw)
    engine = minizero.Engine(model, comm, stage, **(engine_kw or {}))
    out = []
    for step in range(steps):
        for micro in range(engine.grad_accum):
            loss = model(**batch(step, comm.rank, micro, route=route)).loss
            if poison == (step, comm.rank):
                loss = loss * float("nan")
            engine.backward(loss)
        out.append((engine.step(), engine.full_state_dict(), [list(u.steps) for u in engine.units],
                    engine.skipped))
    return out


def test_frozen_base_with_adapters():
    report = check(dict(lora=True), world_sizes=(2, 3))
    assert report.ok, report


def experts_route(step, rank, micro):
    """Expert 0 on rank 0, expert 1 on the others; expert 2 only in step 1's second micro-batch."""
    return 2 if (step, micro) == (1, 1) else min(rank, 1)


def test_parameters_skipped_on_some_steps_and_ranks():
    """DDP's rule: a gradient on any rank counts (the others add zero); none anywhere, and
    the parameter, its moments and its step count stay as they are (the referee is torch's
    AdamW, which skips a grad=None parameter)."""
    # stage 3 gathers what a rank's forward runs: the experts share the root's unit here
    report = check(dict(experts=3), dict(route=experts_route), grad_accum=2, units=lambda m: [m, *m.blocks])
    assert report.ok, report
    ranks = launch.run_threads(_train_one, 3, 2, dict(experts=3), dict(grad_accum=2, lr=0.02, weight_decay=0.1),
                               2, None, experts_route)
    (_, first, _, _), (_, second, steps, _) = ranks[0]
    assert torch.equal(first["experts.2.weight"], build(experts=3).experts[2].weight.detach())  # no decay either
    assert not torch.equal(second["experts.2.weight"], first["experts.2.weight"])
    expert_steps = [s for s in steps if len(s) == 2][-3:]  # the three expert units: weight and bias
    assert expert_steps == [[2, 2], [2, 2], [1, 1]]


def test_stage3_prefetches_the_next_unit_of_the_first_pass():
    """Stage 3 with overlap: from the second pass on, while a block runs, its unit and the
    next block's (prefetched in the order the first pass used them) are gathered or on their
    way, and the root's, which the whole forward runs in; the blocks before are released."""
    def body(comm):
        model = build()
        engine = minizero.Engine(model, comm, 3)
        seen = []
        for i, block in enumerate(model.blocks):  # (after the engine's own gather hook)
            block.register_forward_pre_hook(lambda m, args, i=i: seen.append(
                (i, [u.index for u in engine.units if u.pending is not None])))
        for step in range(2):
            engine.backward(model(**batch(step, comm.rank, 0)).loss)
            engine.step()
        return seen[3:], [[u.index for u in order] for order in (engine.fwd_order, engine.bwd_order)]
    for seen, orders in launch.run_threads(body, 2):
        assert seen == [(0, [0, 1, 2]), (1, [0, 2, 3]), (2, [0, 3])]
        assert orders == [[0, 1, 2, 3], [0, 3, 2, 1]]  # backward's own order: the root's loss first, then the blocks


def test_stage3_units_that_only_some_ranks_run_are_a_clear_error():
    """Each expert its own unit: rank 0 would gather expert 0 while the others gather expert 1 (the
    messages' flight tags differ: caught at that gather, before the step's own check of the units)."""
    with pytest.raises(RuntimeError, match=r"(?s)CollectiveMismatch.*rank 0: in #\d+ all_gather .* unit 4, forward "
                                           r"gather.*rank 1: in #\d+ all_gather .* unit 5.*a module only some ranks "
                                           r"run \(an MoE expert: at stage 3 it must share a unit"):
        launch.run_threads(_train_one, 3, 3, dict(experts=3), {}, 1, None, experts_route)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_on_one_rank_skips_the_step_everywhere(stage, dtype):
    kw = dict(dtype=dtype, lr=0.02, weight_decay=0.1)
    with pytest.warns(UserWarning, match=r"step 2 skipped on every rank: non-finite gradients on rank\(s\) \[1\]"):
        ranks = launch.run_threads(_train_one, 3, stage, {}, kw, 3, (1, 1))
    for (ok0, s0, t0, _), (ok1, s1, t1, k1), (ok2, s2, t2, k2) in ranks:
        assert (ok0, ok1, ok2) == (True, False, True) and (k1, k2) == (1, 1)
        assert all(torch.equal(s0[n], s1[n]) for n in s0) and t0 == t1  # nothing moved, not even t
        assert all(x == 2 for u in t2 for x in u)
    with pytest.raises(RuntimeError, match="2 steps in a row skipped"):
        launch.run_threads(_nan_every_step, 2, stage, dict(kw, skip_limit=2))


def test_skips_not_in_a_row_never_reach_the_limit():
    """skip_limit counts skips in a row: a step that runs resets the count, so a long fp16 run
    with an overflow now and then never dies of skips in all."""
    def body(comm):
        model = build()
        engine = minizero.Engine(model, comm, 2, skip_limit=2)
        for step in range(6):
            loss = model(**batch(step, comm.rank, 0)).loss
            engine.backward(loss * float("inf") if step % 2 == 0 else loss)
            engine.step()
        return engine.skipped, engine.t
    with pytest.warns(UserWarning, match="skipped on every rank"):
        assert launch.run_threads(body, 2) == [(3, 3)] * 2


def _nan_every_step(comm, stage, kw):
    model = build()
    engine = minizero.Engine(model, comm, stage, **kw)
    for step in range(3):
        engine.backward(model(**batch(step, comm.rank, 0)).loss * float("inf"))
        engine.step()


def test_float_inputs_in_keywords_are_cast_to_bf16():
    report = check({}, dict(extra=True), world_sizes=(2,), dtype=torch.bfloat16)
    assert report.ok, report


# -----------------------------------------------------------------------------
# parameters read outside forward, state_dict, and the model after its engine


def test_stage3_parameter_reads_raise_a_clear_error_never_a_segfault():
    def body(comm):
        model = build()
        engine = minizero.Engine(model, comm, 3)
        w = model.blocks[0].fc.weight
        errors = []
        for read in (lambda: w.norm().item(), lambda: w.data.clone(), lambda: model.state_dict(),
                     lambda: torch.save(model.head.weight, "/dev/null"), lambda: copy.deepcopy(model)):
            with pytest.raises(RuntimeError) as e:
                read()
            errors.append(str(e.value))
        assert w.shape == (D, D) and sum(p.numel() for p in model.parameters()) > 0  # metadata is fine
        with engine.gathered():
            sd = {k: v.clone() for k, v in model.state_dict().items()}
        full = engine.full_state_dict()
        assert all(torch.equal(sd[k].float(), full[k]) for k in sd)
        return errors
    for errors in launch.run_threads(body, 2):
        assert all("engine.gathered()" in e and "engine.full_state_dict()" in e for e in errors)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_loss_that_reads_parameters(stage):
    """An L2 penalty over model.parameters(): stage 3 reads them inside gathered() and
    gives stage 0's bits; outside it, a clear error."""
    def body(comm, stage, inside):
        model = build()
        engine = minizero.Engine(model, comm, stage, lr=0.05)
        for step in range(2):
            loss = model(**batch(step, comm.rank, 0)).loss
            with engine.gathered() if inside else contextlib.nullcontext():
                loss = loss + 0.01 * sum(p.pow(2).sum() for p in model.parameters())
            engine.backward(loss)
            engine.step()
        return engine.full_state_dict()
    ref = launch.run_threads(body, 2, 0, False)[0]
    got = launch.run_threads(body, 2, stage, True)[0]
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    if stage == 3:
        with pytest.raises(RuntimeError, match="gathered"):
            launch.run_threads(body, 2, 3, False)


def test_gathered_writable_takes_rank_0s_weights_into_the_master():
    def body(comm, stage):
        model = build()
        engine = minizero.Engine(model, comm, stage, dtype=torch.bfloat16)
        new = {k: torch.full_like(v, 0.25 + comm.rank) for k, v in build().state_dict().items()}
        with pytest.raises(RuntimeError, match="gathered\\(writable=True\\)"):
            model.load_state_dict(new)
        with engine.gathered(writable=True):
            model.load_state_dict(new)
        return engine.full_state_dict()
    for stage in (0, 2, 3):
        for state in launch.run_threads(body, 3, stage):
            assert all(torch.equal(v, torch.full_like(v, 0.25)) for v in state.values())  # rank 0 won


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_model_after_its_engine_is_gone(stage):
    def body(comm):
        model = build()
        engine = minizero.Engine(model, comm, stage)
        engine.close()
        with pytest.raises(RuntimeError, match="Engine is closed"):
            model(**batch(0, 0, 0))
        model2 = build()
        minizero.Engine(model2, comm, stage)  # dropped at once
        gc.collect()
        with pytest.raises(RuntimeError, match="Engine is gone"):
            model2(**batch(0, 0, 0))
        return True
    assert launch.run_threads(body, 2) == [True, True]


def test_ranks_that_build_different_models_are_named():
    def body(comm):
        model = Users(depth=3 if comm.rank != 1 else 2)
        minizero.Engine(model, comm, 1)
    with pytest.raises(RuntimeError, match=r"blocks.2.norm.weight \(8,\) float32 trainable' on rank 0 but "
                                           r"'head.weight \(13, 8\) float32 trainable' on rank 1"):
        launch.run_threads(body, 3)


# -----------------------------------------------------------------------------
# against torch's own DDP, on gloo processes (one world for all of it)


class Normed(nn.Module):
    """A BatchNorm between two layers: running statistics as buffers."""

    def __init__(self):
        super().__init__()
        self.inp, self.bn, self.out = nn.Linear(4, 6, bias=False), nn.BatchNorm1d(6), nn.Linear(6, 1)

    def forward(self, x, y):
        return F.mse_loss(self.out(torch.relu(self.bn(self.inp(x)))).squeeze(-1), y)


def _normed_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=g) * (1 + rank), torch.randn(8, generator=g)


def gloo_world(comm):
    torch.set_num_threads(1)
    mismatch = ""
    try:  # with check=False (no message headers) the fingerprint still catches it
        minizero.Engine(Users(depth=2 + comm.rank), comm, 0)
    except ValueError as e:
        mismatch = str(e)
    out = {"mismatch": mismatch}
    for name, make, step_batch in [("experts", lambda: build(experts=3), None), ("bn", _seeded_normed, None)]:
        ours = _ours_on(comm, name, make)
        theirs = _ddp_on(comm, name, make)
        out[name] = (ours, theirs)
    return out


def _seeded_normed():
    torch.manual_seed(0)
    return Normed()


def _inputs(name, step, rank):
    if name == "bn":
        x, y = _normed_batch(step, rank)
        return (x, y), {}
    return (), dict(batch(step, rank, 0, route=lambda s, r, m: 2 if s == 1 else min(r, 1)))


def _loss(name, model, args, kw):
    out = model(*args, **kw)
    return out if name == "bn" else out.loss


def _ours_on(comm, name, make):
    model = make()
    perturb(model, comm.rank)  # ranks built from other values: rank 0's win, as in DDP
    engine = minizero.Engine(model, comm, 0, lr=0.05, weight_decay=0.1)
    states = []
    for step in range(3):
        args, kw = _inputs(name, step, comm.rank)
        engine.backward(_loss(name, model, args, kw))
        engine.step()
        states.append(engine.full_state_dict())
    return states


def _ddp_on(comm, name, make):
    model = make()
    perturb(model, comm.rank)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=name == "experts")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    states = []
    for step in range(3):
        args, kw = _inputs(name, step, comm.rank)
        _loss(name, ddp, args, kw).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append({k: v.detach().float().clone() for k, v in model.state_dict().items()})
    return states


@pytest.fixture(scope="module")
def gloo():
    return launch.run_processes(gloo_world, 3, check=False)


def test_mismatched_models_on_gloo_without_headers(gloo):
    for rank in gloo:
        assert "the ranks built different models" in rank["mismatch"] and "on rank 1" in rank["mismatch"]


@pytest.mark.parametrize("name", ["experts", "bn"])
def test_stage0_matches_torch_ddp(gloo, name):
    """find_unused_parameters=True for the experts (expert 2 unused everywhere at step 0),
    broadcast_buffers for BatchNorm: the same parameters and running stats to float
    tolerance, on every rank."""
    for rank in gloo:
        ours, theirs = rank[name]
        for a, b in zip(ours, theirs):
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k].to(a[k].dtype), rtol=1e-4, atol=1e-5, msg=k)


# -----------------------------------------------------------------------------
# a model too big for one rank: built on the meta device, made real one unit at a time


def seeded_init(name, p):
    """An init that depends only on the parameter's name: the same values however built."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    with torch.no_grad():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _tied_net(meta):
    from test_equivalence import Net
    with torch.device("meta") if meta else contextlib.nullcontext():
        return Net(11, [6, 5, 6], tie=True)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_model_built_on_the_meta_device(stage):
    """Engine(init=...) makes each unit real in turn (ties follow): the same bits as the
    model built for real with the same init."""
    def body(comm, meta):
        model = _tied_net(meta)
        if not meta:
            for name, p in model.named_parameters():
                seeded_init(name, p)
        engine = minizero.Engine(model, comm, stage, lr=0.02, init=seeded_init if meta else None)
        assert model.head.weight is model.emb.weight and not model.emb.weight.is_meta
        for step in range(2):
            g = torch.Generator().manual_seed(step * 10 + comm.rank)
            x, y = torch.randint(0, 11, (2, 3), generator=g), torch.randint(0, 11, (2, 3), generator=g)
            engine.backward(model(x, y))
            engine.step()
        return engine.full_state_dict()
    real, meta = launch.run_threads(body, 3, False), launch.run_threads(body, 3, True)
    for a, b in zip(real, meta):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_meta_device_needs_init_and_real_buffers():
    with pytest.raises(RuntimeError, match="pass init="):
        launch.run_threads(lambda comm: minizero.Engine(_tied_net(True), comm, 3), 1)
    def with_meta_buffer(comm):
        model = _tied_net(False)
        model.register_buffer("scale", torch.empty(3, device="meta"))
        minizero.Engine(model, comm, 3, init=seeded_init)
    with pytest.raises(RuntimeError, match="scale .frozen, or a buffer. is on the meta device"):
        launch.run_threads(with_meta_buffer, 1)

"""
The proof: ZeRO stages 1, 2 and 3 give the same bits as stage 0 (DDP), on every rank,
after every step; and stage 0 is what torch itself computes (single-process AdamW on the
concatenated batch, and torch's DistributedDataParallel) to float tolerance.

Hypothesis draws the model (depth, widths smaller than and not divisible by the world
size, bias, a tied pair, a frozen layer), the world size, steps, gradient accumulation,
clipping, learning rate, weight decay and compute dtype. Ranks are threads (ops.run_threads),
so hundreds of examples run in seconds; a few fixed cases rerun on real gloo processes.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import minizero
import ops

torch.set_num_threads(1)  # ranks are threads: keep each one's kernels single-threaded
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Net(nn.Module):
    """Embedding -> a ModuleList of tanh layers (each one unit) -> LayerNorm -> head,
    optionally tied to the embedding, optionally with one frozen layer."""

    def __init__(self, vocab, widths, bias=True, tie=False, frozen=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, widths[0])
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))
        self.ln = nn.LayerNorm(widths[-1])
        self.head = nn.Linear(widths[-1], vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        if frozen is not None:
            self.layers[frozen].requires_grad_(False)

    def forward(self, x, y):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        logits = self.head(self.ln(h)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


@st.composite
def cases(draw, dtypes=("fp32", "bf16", "fp16")):
    world_size = draw(st.integers(1, 5))
    widths = draw(st.lists(st.integers(1, 9), min_size=2, max_size=5))
    tie = draw(st.booleans())
    if tie:
        widths[-1] = widths[0]
    c = dict(world_size=world_size, vocab=draw(st.integers(2, 13)), widths=widths,
             bias=draw(st.booleans()), tie=tie,
             frozen=draw(st.none() | st.integers(0, len(widths) - 2)),
             steps=draw(st.integers(1, 4)), grad_accum=draw(st.integers(1, 3)),
             batch=draw(st.integers(1, 3)), seq=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**16)),
             dtype=DTYPES[draw(st.sampled_from(dtypes))])
    c["engine"] = dict(lr=draw(st.floats(1e-3, 1e-1)), weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
                       clip=draw(st.none() | st.floats(0.01, 2.0)), grad_accum=c["grad_accum"], dtype=c["dtype"],
                       overlap=draw(st.booleans()))
    return c


def make(c):
    """The model (built once, so every stage and rank starts from the same values) and
    the batches: batches[step][micro][rank] = (x, y)."""
    g = torch.Generator().manual_seed(c["seed"])
    model = Net(c["vocab"], c["widths"], c["bias"], c["tie"], c["frozen"])
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    def tokens():
        return torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=g)
    batches = [[[(tokens(), tokens()) for _ in range(c["world_size"])]
                for _ in range(c["grad_accum"])] for _ in range(c["steps"])]
    return model, batches


def assert_released(engine):
    """Stage 3: no unit holds its gathered parameters between uses."""
    for u in engine.units:
        assert u.flat.untyped_storage().nbytes() == 0, "a stage-3 unit stayed gathered"


def train(comm, stage, model, batches, engine_kw):
    """One rank's run: returns, after every step, the fp32 state and the live params."""
    model = copy.deepcopy(model)
    engine = minizero.Engine(model, comm, stage, **engine_kw)
    history = []
    for micro_batches in batches:
        before = dict(comm.sent)
        for micro in micro_batches:
            x, y = micro[comm.rank]
            loss = model(x, y)
            if stage == 3:
                assert_released(engine)
            engine.backward(loss)
            if stage >= 2:  # no full gradient survives backward
                assert all(u.local is None for u in engine.units)
                assert all(p.grad is None for p in model.parameters())
        stepped = engine.step()  # False: an fp16 overflow skipped it, on every rank
        if stage == 3:
            assert_released(engine)
        sent = {k: comm.sent[k] - before.get(k, 0) for k in ("reduce_scatter", "all_gather")}
        live = [t.clone() for t in (model.state_dict().values() if stage < 3 else [])]
        history.append((engine.full_state_dict(), live, engine.memory(), sent, stepped))
    return history, engine.formula(), engine.numel()


def run_all_stages(c, model, batches, run=ops.run_threads):
    return {s: run(train, c["world_size"], s, model, batches, c["engine"]) for s in range(4)}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@settings(deadline=None)
@given(cases())
def test_stages_are_bit_identical_to_ddp(c):
    model, batches = make(c)
    runs = run_all_stages(c, model, batches)
    reference = runs[0][0][0]  # stage 0, rank 0
    for stage, ranks in runs.items():
        for history, formula, numel in ranks:
            for (state, live, memory, sent, stepped), (ref_state, ref_live, *_) in zip(history, reference):
                assert_same(state, ref_state)                      # same fp32 state
                assert all(torch.equal(a, b) for a, b in zip(live, ref_live))  # same live params
                assert memory == formula                           # DESIGN.md's table, exactly
                expect = minizero.comm_bytes_per_step(numel, c["world_size"], stage, c["dtype"], c["grad_accum"])
                if not stepped and stage in (1, 2):  # a skipped step gathers no params (stage 0
                    expect["all_gather"] = 0         # gathered its grads in backward, as DDP does)
                assert sent == {k: expect.get(k, 0) for k in sent}


@settings(deadline=None)
@given(cases(dtypes=("fp32",)))
def test_ddp_matches_torch_adamw(c):
    """Stage 0 against torch itself: one process, the concatenated batch, torch.optim.AdamW.
    Adam's first step is lr·g/(|g| + eps): a gradient that is zero up to rounding (a
    LayerNorm of width 1, a saturated tanh) turns a different summation order's rounding
    noise into a step of ±lr. eps = 1e-3 bounds that amplification at lr/eps, so a float
    tolerance is meaningful (1e-3 of a step per step taken): the gradients here are mostly
    far above eps, so a wrong mean, clip or decay moves a step by far more. A LayerNorm of
    width 1 or 2 is degenerate (its normalized output is constant, ±1), so the last
    width is at least 3."""
    c["engine"]["eps"] = 1e-3
    c["widths"][-1] = max(c["widths"][-1], 3)
    if c["tie"]:
        c["widths"][0] = c["widths"][-1]
    model, batches = make(c)
    ours = ops.run_threads(train, c["world_size"], 0, model, batches, c["engine"])[0][0]
    ref = copy.deepcopy(model)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    kw = c["engine"]
    opt = torch.optim.AdamW(trainable, lr=kw["lr"], weight_decay=kw["weight_decay"], eps=1e-3)
    for step, (micro_batches, (state, *_)) in enumerate(zip(batches, ours)):
        x = torch.cat([x for micro in micro_batches for x, _ in micro])
        y = torch.cat([y for micro in micro_batches for _, y in micro])
        ref(x, y).backward()
        if kw["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(trainable, kw["clip"])
        opt.step()
        opt.zero_grad()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5 + 1e-3 * kw["lr"] * (step + 1))


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("overlap", [True, False])
def test_native_path_agrees_with_the_ring(stage, overlap):
    """torch's own collectives sum in an order of their own: equal to float tolerance,
    with the same ledger (and, at stage 0 with one micro-batch, one native all-reduce)."""
    for c in FIXED:
        model, batches = make(c)
        ring = ops.run_threads(train, c["world_size"], stage, model, batches, c["engine"])
        native = ops.run_threads(train, c["world_size"], stage, model, batches,
                               dict(c["engine"], native=True, overlap=overlap))
        tol = 1e-5 if c["dtype"] == torch.float32 else 2e-2  # bf16: one rounding is 4e-3
        for (a, _, mem_a, sent_a, _), (b, _, mem_b, sent_b, _) in zip(ring[1][0], native[1][0]):
            assert mem_a == mem_b and sent_a == sent_b
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol)


# -----------------------------------------------------------------------------
# the same code on real processes (gloo), and torch's own DDP as a referee

FIXED = [dict(world_size=3, vocab=7, widths=[5, 4, 5], bias=True, tie=True, frozen=None, steps=2,
              grad_accum=2, batch=2, seq=3, seed=1, dtype=torch.float32),
         dict(world_size=3, vocab=5, widths=[3, 7, 2], bias=False, tie=False, frozen=0, steps=2,
              grad_accum=1, batch=1, seq=4, seed=2, dtype=torch.bfloat16)]
for c in FIXED:
    c["engine"] = dict(lr=0.05, weight_decay=0.1, clip=0.5, grad_accum=c["grad_accum"], dtype=c["dtype"])


def gloo_world(comm):
    """Everything the process tests need, in one spawned world."""
    torch.set_num_threads(1)
    ours = [[train(comm, s, *make(c), c["engine"]) for s in range(4)] for c in FIXED]
    return ours, torch_ddp(comm, FIXED[0])


def torch_ddp(comm, c):
    """Stage 0's case under torch.nn.parallel.DistributedDataParallel and torch AdamW."""
    model, batches = make(c)
    ddp = nn.parallel.DistributedDataParallel(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    kw = c["engine"]
    opt = torch.optim.AdamW(trainable, lr=kw["lr"], weight_decay=kw["weight_decay"])
    states = []
    for micro_batches in batches:
        for k, micro in enumerate(micro_batches):
            x, y = micro[comm.rank]
            if k < len(micro_batches) - 1:
                with ddp.no_sync():
                    (ddp(x, y) / len(micro_batches)).backward()
            else:
                (ddp(x, y) / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(trainable, kw["clip"])
        opt.step()
        opt.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


@pytest.fixture(scope="module")
def gloo_results():
    return ops.run_processes(gloo_world, 3)


def test_processes_equal_threads_bit_for_bit(gloo_results):
    for i, c in enumerate(FIXED):
        model, batches = make(c)
        threads = run_all_stages(c, model, batches)
        for rank, (ours, _) in enumerate(gloo_results):
            for stage in range(4):
                for (a, live_a, *_), (b, live_b, *_) in zip(ours[i][stage][0], threads[stage][rank][0]):
                    assert_same(a, b)
                    assert all(torch.equal(x, y) for x, y in zip(live_a, live_b))


def test_ddp_matches_torch_ddp_on_gloo(gloo_results):
    for ours, theirs in gloo_results:
        for (state, *_), ref in zip(ours[0][0][0], theirs):
            for name, value in ref.items():
                torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)


# -----------------------------------------------------------------------------
# bad input: a clear error that names the fix


def one_rank(fn):
    return ops.run_threads(lambda comm: fn(comm), 1)[0]


def test_bad_stage():
    with pytest.raises(RuntimeError, match="stage must be 0"):
        one_rank(lambda comm: minizero.Engine(Net(3, [2, 2]), comm, 4))


def test_no_trainable_parameters():
    with pytest.raises(RuntimeError, match="no trainable parameters"):
        one_rank(lambda comm: minizero.Engine(Net(3, [2, 2]).requires_grad_(False), comm, 1))


def test_parameters_on_two_devices():
    model = Net(3, [2, 2])
    model.layers[0].to("meta")
    with pytest.raises(RuntimeError, match="different devices"):
        one_rank(lambda comm: minizero.Engine(model, comm, 0))


def test_unit_list_that_misses_or_repeats():
    model = Net(3, [2, 2, 2])
    with pytest.raises(RuntimeError, match="in no unit"):
        one_rank(lambda comm: minizero.Engine(model, comm, 1, units=[model.layers[0]]))
    with pytest.raises(RuntimeError, match="twice"):
        one_rank(lambda comm: minizero.Engine(model, comm, 1, units=[model, model.layers[0], model.layers[0]]))
    with pytest.raises(RuntimeError, match="not part of the model"):
        one_rank(lambda comm: minizero.Engine(model, comm, 1, units=[model, nn.Linear(2, 2)]))


def test_tie_across_units():
    """A weight shared by two layers: an error at stage 3 naming both, fine at stages 0-2."""
    c = dict(FIXED[0], widths=[4, 4, 4], tie=False, world_size=2)
    model, batches = make(c)
    model.layers[1].weight = model.layers[0].weight
    with pytest.raises(RuntimeError, match="layers.0.weight and layers.1.weight"):
        ops.run_threads(train, 2, 3, model, batches, c["engine"])
    runs = {s: ops.run_threads(train, 2, s, model, batches, c["engine"]) for s in range(3)}
    for s in (1, 2):
        for (a, *_), (b, *_) in zip(runs[s][1][0], runs[0][0][0]):
            assert_same(a, b)


def test_step_and_backward_counts():
    def body(comm):
        model = Net(3, [2, 2])
        engine = minizero.Engine(model, comm, 2, grad_accum=2)
        x = torch.zeros(1, 2, dtype=torch.long)
        engine.backward(model(x, x))
        with pytest.raises(RuntimeError, match="step\\(\\) after 1 backward"):
            engine.step()
        engine.backward(model(x, x))
        with pytest.raises(RuntimeError, match="call engine.step"):
            engine.backward(model(x, x))
        return engine.step()
    assert one_rank(body) is True


def test_full_state_dict_loads_strictly():
    c = dict(FIXED[0], frozen=0)
    model, batches = make(c)
    model.register_buffer("counter", torch.tensor([3]))
    history = ops.run_threads(train, 3, 3, model, batches, c["engine"])[0][0]
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(history[-1][0], strict=True)
    assert torch.equal(fresh.head.weight, fresh.emb.weight)            # tie survives
    assert torch.equal(fresh.layers[0].weight, model.layers[0].weight)  # frozen untouched

"""
The proof: ZeRO stages 1, 2 and 3 give the same bits as stage 0 (DDP), on every rank,
after every micro-batch and every step; and stage 0 is what torch itself computes. Each
example is one call of minizero.check, the tool users run on their own models; this file
draws the models and worlds it is run on.

Hypothesis draws the model (depth, widths smaller than and not divisible by the world
size, bias, a tied pair, a pair tied across units, a frozen layer, a side layer that some
micro-batches and whole steps leave unused, buffers its forward reads and updates),
the units, the world size (1-5, mostly 2 and more), steps (mostly several), gradient
accumulation, clipping (mostly biting), learning rate, weight decay with or without a
decay mask, eps, compute dtype (fp16 with a loss scale that lets steps run, or one that
overflows), an fp32 reduction, overlap, random delays in the communication, torch's own
collectives, the optimizer (AdamW, SGD, Muon + AdamW, Adafactor, with their options) and its
state offloaded to disk or to host memory, one reduction per micro-batch or per step
(reduce_every), stage 3's reshard_after_forward (True, False, or G: hpZ), and whether the
thread ranks follow NCCL's point-to-point rules (strict_p2p). check starts
ranks 1.. from other values than rank 0. The CI profile runs 200 derandomized examples;
ranks are threads, so they take a minute or two. A few fixed cases rerun on real gloo
processes and must give the same bits, and stage 0 is held against torch's
DistributedDataParallel there, from ranks built with other values too.

MINIZERO_DEVICE=cuda runs the suite with every thread rank on one GPU, each on its own
stream (the gloo process tests are CPU ranks: they run with the default, cpu);
MINIZERO_STRICT_P2P=1 runs every example under NCCL's point-to-point rules.
"""
import copy
import tempfile
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st

import minizero
import ops
from minizero_lib import check, launch

torch.set_num_threads(1)  # ranks are threads: keep each one's kernels single-threaded
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCRATCH = tempfile.TemporaryDirectory(prefix="minizero-offload-")  # disk offload's files, while they live
DEVICE = torch.device(os.environ.get("MINIZERO_DEVICE", "cpu"))  # where the thread ranks compute
on_gloo = pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo processes are CPU ranks")


class Net(nn.Module):
    """Embedding -> a ModuleList of tanh layers (each one unit) -> LayerNorm -> head,
    optionally tied to the embedding, optionally with one frozen layer; optionally layer 1
    tied to layer 0 (two units), a side layer that runs only when the batch says so, and
    a running mean of the embeddings (buffers, as BatchNorm keeps) that the forward reads."""

    def __init__(self, vocab, widths, bias=True, tie=False, frozen=None, tie_layers=False, side=False,
                 stat=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, widths[0])
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))
        self.ln = nn.LayerNorm(widths[-1])
        self.head = nn.Linear(widths[-1], vocab, bias=False)
        self.side = nn.Linear(widths[-1], widths[-1]) if side else None
        if stat:
            self.register_buffer("mean", torch.zeros(widths[0]))
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        if tie:
            self.head.weight = self.emb.weight
        if tie_layers:  # (widths[0] == widths[1] == widths[2])
            self.layers[1].weight = self.layers[0].weight
        if frozen is not None:
            self.layers[frozen].requires_grad_(False)

    def forward(self, x, y, side=False):
        h = self.emb(x)
        if hasattr(self, "mean"):  # updated by every forward, and read by it: gradients depend on it
            self.mean.mul_(0.5).add_(h.detach().mean((0, 1)) * 0.5)
            self.seen += 1
            h = h - self.mean
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if side:
            h = h + self.side(h)
        logits = self.head(self.ln(h)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


UNITS = {"one": lambda m: [m], "some": lambda m: [m, *m.layers[::2]]}  # besides the default: a unit per layer


@st.composite
def cases(draw):
    world_size = draw(st.sampled_from([2, 3, 4, 1, 5, 3, 2]))  # (hypothesis favours both ends)
    widths = draw(st.lists(st.integers(1, 9), min_size=2, max_size=5))
    tie = draw(st.booleans())
    tie_layers = len(widths) >= 3 and draw(st.integers(0, 4)) == 0
    if tie_layers:
        widths[1] = widths[2] = widths[0]
    if tie:
        widths[-1] = widths[0]
    dtype = draw(st.sampled_from(["bf16", "fp32", "fp16", "bf16"]))
    c = dict(world_size=world_size, vocab=draw(st.integers(2, 13)), widths=widths,
             bias=draw(st.booleans()), tie=tie, tie_layers=tie_layers,
             frozen=draw(st.none() | st.integers(0, len(widths) - 2)),
             side=draw(st.sampled_from([None, 0.2, None, 0.5])),  # how often a micro-batch runs the side layer
             stat=draw(st.integers(0, 3)) == 0,
             steps=draw(st.sampled_from([2, 3, 1, 2])), grad_accum=draw(st.sampled_from([1, 2, 3, 1])),
             batch=draw(st.integers(1, 3)), seq=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**16)),
             dtype=DTYPES[dtype], jitter=draw(st.booleans()),
             strict_p2p=draw(st.booleans()))  # half the examples under NCCL's point-to-point rules
    # eps 1e-3 lets the referee see a missing mean over ranks (Adam is scale-invariant but for eps)
    c["engine"] = dict(lr=draw(st.floats(1e-3, 1e-1)), weight_decay=draw(st.sampled_from([0.0, 0.01, 0.1])),
                       eps=draw(st.sampled_from([1e-8, 1e-3])),
                       clip=draw(st.sampled_from([None, 2.0]) | st.floats(0.01, 0.3)),  # mostly biting
                       grad_accum=c["grad_accum"], dtype=c["dtype"], overlap=draw(st.booleans()))
    if draw(st.integers(0, 4)) == 0:  # (a feature: an example without one runs plain ZeRO's engine)
        c["engine"]["native"] = True
    c["engine"].update(draw(optimizers(c["engine"].pop("eps"))))
    if draw(st.booleans()):  # nanoGPT's rule: no decay for biases, norms and other vectors
        c["engine"]["decay"] = lambda name, p: p.dim() >= 2
    if dtype == "fp16":  # most loss scales let steps run; 2^16 overflows at first, and halves
        c["engine"].update(loss_scale=draw(st.sampled_from([1.0, 64.0, 1024.0, 2.0**16])),
                           scale_window=draw(st.sampled_from([1, 1000])))
    if dtype != "fp32" and draw(st.booleans()):
        c["engine"]["reduce_dtype"] = torch.float32
    units = draw(st.sampled_from([None, None, "one", "some"]))
    if units:
        c["engine"]["units"] = UNITS[units]
    offload = draw(st.sampled_from([None, None, None, "disk", "cpu"]))  # stages 1-3; stage 0 is the reference
    if offload:
        c["engine"].update(offload=offload, offload_dir=SCRATCH.name)
    # one reduction per step (DDP's no_sync); stage 3 kept gathered, or hpZ's G ranks ("hpz":
    # reshard()). Read off the drawn seed, not drawn: the CI's derandomized examples stay the
    # ones they were, each now in a mode
    if c["seed"] % 3 == 1:
        c["engine"]["reduce_every"] = "step"
    c["reshard"] = (True, False, True, "hpz")[c["seed"] // 3 % 4]
    return c


@st.composite
def optimizers(draw, eps):
    """One of the four optimizers, half the time AdamW, with its options. The Net's matrices
    (widths 1-9, world sizes 1-5) straddle shard boundaries and are often smaller than N:
    Muon's Newton-Schulz and Adafactor's row and column sums must still see each whole."""
    name = draw(st.sampled_from(["adamw", "adamw", "adamw", "sgd", "muon", "adafactor"]))
    if name == "sgd":
        momentum = draw(st.sampled_from([0.0, 0.9]))
        return dict(optimizer=name, momentum=momentum, nesterov=bool(momentum) and draw(st.booleans()))
    if name == "muon":  # Muon on the layers' weights (not the tied head), AdamW on the rest
        momentum = draw(st.sampled_from([0.0, 0.95]))
        return dict(optimizer=name, eps=eps, muon_lr=draw(st.floats(1e-3, 0.1)), momentum=momentum,
                    nesterov=bool(momentum) and draw(st.booleans()),
                    adjust_lr_fn=draw(st.sampled_from([None, "match_rms_adamw"])))
    if name == "adafactor":
        return dict(optimizer=name, d=draw(st.sampled_from([1.0, 1.5])), beta2_decay=draw(st.sampled_from([-0.8, -0.5])))
    return dict(eps=eps)


def make(c):
    """The model (built once: check starts rank 0 from it, and ranks 1.. from other values)
    and the batches: batches[step][micro][rank] = (x, y[, whether the side layer runs])."""
    g = torch.Generator().manual_seed(c["seed"])
    model = Net(c["vocab"], c["widths"], c["bias"], c["tie"], c["frozen"], c.get("tie_layers", False),
                c.get("side") is not None, c.get("stat", False))
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    def micro(side):
        x, y = (torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=g) for _ in range(2))
        return (x, y) if c.get("side") is None else (x, y, side)

    def ranks():  # each rank draws whether its side layer runs: a unit complete on some ranks only
        return [micro(c.get("side") is not None and float(torch.rand((), generator=g)) < c["side"])
                for _ in range(c["world_size"])]
    batches = [[ranks() for _ in range(c["grad_accum"])] for _ in range(c["steps"])]
    return model, batches


def reshard(c):
    """Stage 3's reshard_after_forward for case c: "hpz" is the least G dividing the shard group's
    size S with 1 < G < S (True if there is none; S is drawn after the case in test_hybrid)."""
    S = c["engine"].get("shard_size") or c["world_size"]
    return next((g for g in range(2, S) if S % g == 0), True) if c.get("reshard") == "hpz" \
        else c.get("reshard", True)


def run_check(c, **kw):
    model, batches = make(c)
    kw = {**({"reshard_after_forward": reshard(c)} if reshard(c) is not True else {}), **kw}
    apart = c.get("tie_layers") and c["engine"].get("units") is not UNITS["one"]  # tied across two units
    return minizero.check(lambda: model, lambda step, rank, micro: batches[step][micro][rank],
                          steps=c["steps"], jitter=c["jitter"], device=DEVICE, strict_p2p=c.get("strict_p2p", False),
                          **{"world_sizes": (c["world_size"],), "stages": (0, 1, 2) if apart else (0, 1, 2, 3),
                             **c["engine"], **kw})


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@given(cases())
def test_stages_are_bit_identical_to_ddp_and_ddp_is_torch(c):
    """Every stage: reduced grads and params (fp32 and 16-bit) the same bits as stage 0
    on every rank after every micro-batch and step; every rank as rank 0; memory and
    bytes as the formulas; stage 0 as torch (gradient and AdamW update), in every dtype."""
    report = run_check(c)
    assert report.ok, f"\n{report}"
    ref = report.rows[0]
    overflows = c["engine"].get("loss_scale") == 2.0**16  # (may skip every step: skips are checked, too)
    assert len(report.rows) >= 3 and ref.refereed + ref.skipped == c["steps"] and (ref.refereed or overflows)
    event(f"world size {c['world_size']}, {str(c['dtype'])[6:]}")  # pytest --hypothesis-show-statistics
    event(f"steps refereed {ref.refereed}, skipped {ref.skipped}")
    event(f"stages {len(report.rows)}")


@st.composite
def tree_cases(draw):
    """A case of cases() under reduce_order="tree", at two power-of-two world sizes: the same
    step of G leaves (rank r's micro-batch j is leaf r·A + j) at each, with grad_accum A a
    power of two at the larger one. Without buffers the forward updates (rank 0's, so N's)."""
    c = draw(cases())
    sizes = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=2, max_size=2, unique=True))
    A = draw(st.sampled_from([2, 1, 4, 2]))
    c.update(world_size=max(sizes), sizes=tuple(sorted(sizes)), grad_accum=A, stat=False,
             strict_p2p=False, reshard=c["reshard"] if c["reshard"] != "hpz" else True)
    c["engine"].update(grad_accum=A, reduce_order="tree")
    c["engine"].pop("native", None)  # (torch's collectives sum in an order of their own)
    return c


@settings(max_examples=max(5, settings().max_examples // 8))
@given(tree_cases())
def test_the_tree_gives_the_same_bits_at_every_world_size(c):
    """reduce_order="tree": the trained state after every step is the same bits at both world
    sizes, at every stage (every stage held to stage 0, every world size to the first)."""
    report = run_check(c, world_sizes=c["sizes"])
    assert report.ok, f"\n{report}"
    assert {r.world_size for r in report.rows} == set(c["sizes"])
    event(f"world sizes {c['sizes']}, grad_accum {c['grad_accum']}, {str(c['dtype'])[6:]}")


# -----------------------------------------------------------------------------
# fixed cases: torch's own collectives, and the same code on real processes (gloo)

FIXED = [dict(world_size=3, vocab=7, widths=[5, 4, 5], bias=True, tie=True, frozen=None, steps=2,
              grad_accum=2, batch=2, seq=3, seed=1, dtype=torch.float32, jitter=False),
         dict(world_size=3, vocab=5, widths=[3, 7, 2], bias=False, tie=False, frozen=0, steps=2,
              grad_accum=1, batch=1, seq=4, seed=2, dtype=torch.bfloat16, jitter=False)]
for c in FIXED:
    c["engine"] = dict(lr=0.05, weight_decay=0.1, clip=0.5, grad_accum=c["grad_accum"], dtype=c["dtype"])


@pytest.mark.parametrize("overlap", [True, False])
def test_native_collectives_keep_the_stages_equal(overlap):
    """torch's own collectives sum in an order of their own, but the same order in every
    stage: still the same bits across stages, and torch's answer at stage 0."""
    for c in FIXED:
        report = run_check(c, native=True, overlap=overlap)
        assert report.ok, f"\n{report}"


def test_native_overlap_starts_collectives_early_with_the_bits_of_waiting(monkeypatch):
    """On torch's collectives the engine starts each one itself, without waiting (ops.started:
    on threads its output is NaN until the wait), and gives the bits of overlap=False, where
    each finishes at once: nothing goes to the communication thread in a micro-batch whose jobs
    are one collective each (the first), the later ones of accumulation (adding to the sum) do."""
    jobs, real = [], minizero.CommQueue.submit

    def counted(queue, job, record):  # the communication thread's jobs, counted
        if queue.pool is not None:
            jobs.append(queue.comm.rank)
        return real(queue, job, record)
    monkeypatch.setattr(minizero.CommQueue, "submit", counted)
    model_spec = lambda **kw: dict(_spec(FIXED[0]), engine_kw=dict(FIXED[0]["engine"], native=True, **kw))  # noqa: E731
    for stage in (0, 3):
        for accum in (1, 2):
            jobs.clear()
            runs = [launch.run_threads(check.rank_run, 3, stage, model_spec(overlap=o, grad_accum=accum))
                    for o in (True, False)]
            assert (len(jobs) == 0) == (accum == 1), (stage, accum, len(jobs))
            for a, b in zip(*runs):
                for x, y in zip(a.history, b.history):
                    assert_same(x.state, y.state)


@pytest.mark.skipif(DEVICE.type == "cuda" and torch.cuda.device_count() < 2, reason="nccl needs a GPU per rank")
def test_check_on_processes():
    c = FIXED[0]
    report = minizero.check(_fixed_model, _fixed_batch, world_sizes=(2,), stages=(0, 3), steps=2,
                            processes=True, device=DEVICE, **c["engine"])
    assert report.ok, f"\n{report}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_world_and_stage_on_the_device(dtype):
    """The GPU check's core, and its CPU smoke test: world sizes 2-4, every stage, overlap
    and random delays on, the same bits across stages; stage 0 against torch."""
    c = dict(FIXED[0], world_size=4, dtype=dtype, jitter=True)
    model, batches = make(c)
    report = minizero.check(lambda: model, lambda step, rank, micro: batches[step][micro][rank],
                            world_sizes=(2, 3, 4), steps=2, jitter=True, device=DEVICE,
                            **dict(c["engine"], dtype=dtype, overlap=True))
    assert report.ok, f"\n{report}"
    assert len(report.rows) == 12 and all(r.referee is not None for r in report.rows if r.stage == 0)


@pytest.mark.parametrize("native", [False, True])
def test_collectives_see_what_the_sender_made(native):
    """Each rank's input comes out of slow work on its own stream (on a GPU), and every
    collective must read it whole: receivers wait for the sender's stream. The values
    are small integers, so every order of summation gives the exact sum."""
    n, size = 3, 3 << 19 if DEVICE.type == "cuda" else 96  # (a multiple of n)
    slow = torch.ones(4096, 4096) if DEVICE.type == "cuda" else torch.ones(8, 8)  # ~5 ms of GPU work

    def fn(comm):
        comm.native = native
        s = slow.to(comm.device)
        x = torch.arange(size, device=comm.device, dtype=torch.float32) % 7 + comm.rank + (s @ s @ s).sum() * 0
        return [t.cpu() for t in (ops.reduce_scatter(x, comm), ops.all_gather(x[:size // n], comm),
                                  ops.all_reduce(x, comm), ops.broadcast(x.clone(), comm, src=1))]
    base = torch.arange(size, dtype=torch.float32) % 7
    total = n * base + sum(range(n))
    for rank, (shard, gathered, reduced, sent) in enumerate(launch.run_threads(fn, n, device=DEVICE)):
        assert torch.equal(shard, total.view(n, -1)[rank])
        assert torch.equal(gathered, torch.cat([base[:size // n] + r for r in range(n)]))
        assert torch.equal(reduced, total) and torch.equal(sent, base + 1)


def _fixed_model():  # importable: processes build it themselves
    return make(FIXED[0])[0]


def _fixed_batch(step, rank, micro):
    return make(dict(FIXED[0], world_size=2))[1][step][micro][rank]


def gloo_world(comm):
    """Every stage of every fixed case (check's own per-rank run), and torch's DDP."""
    torch.set_num_threads(1)
    ours = [[check.rank_run(comm, s, _spec(c)) for s in range(4)] for c in FIXED]
    once = dict(FIXED[0], engine=dict(FIXED[0]["engine"], reduce_every="step"))
    return ours, torch_ddp(comm, FIXED[0]), check.rank_run(comm, 0, _spec(once))


def _spec(c):
    model, batches = make(c)
    return dict(model=model, make_batch=lambda step, rank, micro: batches[step][micro][rank],
                loss_fn=check.default_loss, steps=c["steps"], jitter=False, engine_kw=c["engine"])


def torch_ddp(comm, c):
    """Stage 0's case under torch.nn.parallel.DistributedDataParallel and torch AdamW, from
    ranks built with other values (as check.rank_run builds ours): DDP broadcasts rank 0's."""
    model, batches = make(c)
    check.perturb(model, comm.rank)
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
    return launch.run_processes(gloo_world, 3)


@on_gloo
def test_processes_equal_threads_bit_for_bit(gloo_results):
    for i, c in enumerate(FIXED):
        threads = {s: launch.run_threads(check.rank_run, 3, s, _spec(c)) for s in range(4)}
        for rank, (ours, *_) in enumerate(gloo_results):
            for s in range(4):
                for a, b in zip(ours[i][s].history, threads[s][rank].history):
                    assert_same(a.state, b.state)
                    assert all(torch.equal(x, y) for x, y in zip(a.live, b.live))
                    assert all(torch.equal(x, y) for m, n in zip(a.grads, b.grads) for x, y in zip(m, n))


@on_gloo
def test_ddp_matches_torch_ddp_on_gloo(gloo_results):
    for ours, theirs, _ in gloo_results:
        for h, ref in zip(ours[0][0].history, theirs):
            for name, value in ref.items():
                torch.testing.assert_close(h.state[name], value, rtol=1e-4, atol=1e-5)


@on_gloo
def test_one_reduction_per_step_matches_torch_ddp_under_no_sync(gloo_results):
    """reduce_every="step" is what DDP does under no_sync(): each rank sums its micro-batches'
    gradients, the sum is reduced once, then torch's AdamW steps."""
    for _, theirs, once in gloo_results:
        for h, ref in zip(once.history, theirs):
            for name, value in ref.items():
                torch.testing.assert_close(h.state[name], value, rtol=1e-4, atol=1e-5)


# -----------------------------------------------------------------------------
# bad input: a clear error that names the fix


def one_rank(fn):
    return launch.run_threads(lambda comm: fn(comm), 1)[0]


def test_bad_stage():
    with pytest.raises(RuntimeError, match="stage must be 0"):
        one_rank(lambda comm: minizero.Engine(Net(3, [2, 2]), comm, 4))


def test_no_trainable_parameters():
    with pytest.raises(RuntimeError, match="no trainable parameters"):
        one_rank(lambda comm: minizero.Engine(Net(3, [2, 2]).requires_grad_(False), comm, 1))


def test_meta_parameters_without_init():
    model = Net(3, [2, 2])
    model.layers[0].to("meta")  # built in part on the meta device, and nothing to fill it with
    with pytest.raises(RuntimeError, match="layers.0.weight is on the meta device: pass init=fn"):
        one_rank(lambda comm: minizero.Engine(model, comm, 0))


def test_model_on_another_device_than_the_ranks():
    with pytest.raises(RuntimeError, match="the model is on cpu, but this rank's communicator works on meta"):
        launch.run_threads(lambda comm: minizero.Engine(Net(3, [2, 2]), comm, 0), 1, device=torch.device("meta"))


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
        launch.run_threads(lambda comm: minizero.Engine(copy.deepcopy(model), comm, 3), 2)
    report = minizero.check(lambda: model, lambda s, r, m: batches[s][m][r], world_sizes=(2,), stages=(0, 1, 2),
                            steps=2, device=DEVICE, **c["engine"])
    assert report.ok, f"\n{report}"


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

    def body(comm):
        m = copy.deepcopy(model)
        engine = minizero.Engine(m, comm, 3, **c["engine"])
        for micro in batches[0]:
            engine.backward(m(*micro[comm.rank]))
        engine.step()
        return engine.full_state_dict()
    state = launch.run_threads(body, 3)[0]
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh.head.weight, fresh.emb.weight)            # tie survives
    assert torch.equal(fresh.layers[0].weight, model.layers[0].weight)  # frozen untouched

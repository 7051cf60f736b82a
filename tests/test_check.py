"""
minizero.check must find bugs, and name the right place: a model that is not
deterministic, engine bugs planted by monkeypatching (one stage's decay, one rank's
micro-batch, and the four stage-0 bugs its torch referee exists for), ranks whose
models drift apart; and its command line answers 0, 1 or 2.
"""
import collections
import os
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import minizero
from minizero_lib import check, cli, optimizers
from minizero_lib.report import to_device

torch.set_num_threads(1)


class Small(nn.Module):
    """Embedding -> two tanh layers (units) -> head; a scalar `gate` on the side, whose
    gradient nothing else depends on; optionally a BatchNorm (buffers), and an embedding
    that renormalizes, in place, the rows its forward looks up (max_norm)."""

    def __init__(self, noisy=False, bn=False, max_norm=None):
        super().__init__()
        self.emb = nn.Embedding(11, 6, max_norm=max_norm)
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.bn = nn.BatchNorm1d(6) if bn else None
        self.head = nn.Linear(6, 11)
        self.gate = nn.Parameter(torch.ones(()))
        self.noisy = noisy

    def forward(self, x, y):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        loss = F.cross_entropy(self.head(h).flatten(0, 1).float(), y.flatten())
        # the global RNG: threads of every stage draw from it in turn, so no two runs agree
        noise = torch.rand(()) if self.noisy else torch.ones(())
        return loss + (self.gate * noise).float()


def make_model(**kw):
    torch.manual_seed(3)
    return Small(**kw)


def make_batch(step, rank, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, 11, (3, 4), generator=g), torch.randint(0, 11, (3, 4), generator=g)


KW = dict(lr=0.02, weight_decay=0.1, clip=0.5, eps=1e-3)


def run(world_sizes=(3,), stages=(0, 1, 2, 3), model=None, **kw):
    return minizero.check(lambda: make_model(**(model or {})), make_batch, world_sizes=world_sizes,
                          stages=stages, steps=2, **{**KW, **kw})


def test_a_correct_engine_passes():
    report = run(world_sizes=(1, 3), grad_accum=2)
    assert report.ok, report.first
    assert all(r.max_diff == 0 for r in report.rows) and "all stages agree" in str(report)
    assert report.refereed == 4 and "referee saw 2 of 2 steps at world size 1, 2 of 2 steps at world size 3" \
        in str(report)


def test_a_decay_mask_is_held_to_torchs_param_groups(monkeypatch):
    """decay=fn (nanoGPT's rule: matrices decay, biases and vectors do not): torch's AdamW with
    a weight_decay=0 group referees it, so an engine that decays everything is found."""
    decay = dict(decay=lambda name, p: p.dim() >= 2, weight_decay=0.5)
    assert run(world_sizes=(2,), **decay).ok
    real = minizero.Unit
    monkeypatch.setattr(minizero, "Unit", lambda index, module, named, comm, group, dtype, cut, decay, *rest:
                        real(index, module, named, comm, group, dtype, cut, None, *rest))
    first = run(world_sizes=(2,), stages=(0,), **decay).first
    assert first.what == "referee-update" and first.name in ("gate", "layers.0.bias", "head.bias", "layers.1.bias")


def test_ranks_start_from_rank_0s_values(monkeypatch):
    """check builds ranks 1.. from other values (every parameter and buffer plus the rank):
    without the unit's initial broadcast (DDP's), the ranks train apart."""
    # (Small has no frozen parameters or buffers: the engine's broadcasts are the units')
    monkeypatch.setattr(minizero, "broadcast", lambda x, comm, src=0, kind="broadcast": x)
    first = run(world_sizes=(2,), stages=(0, 1)).first
    assert (first.what, first.stage, first.rank, first.step) == ("initial", 0, 1, 0)
    assert first.ours == first.theirs + 1  # rank 1's own value: rank 0's plus one


def test_a_nan_that_torch_does_not_share(monkeypatch):
    """AdamW without eps: 0/0 where a gradient is exactly zero (embedding rows no batch
    looks up). Every stage shares the NaN, torch (with eps) does not: a finding, not
    'all stages agree'; and the steps skipped after it leave the parameters as they were."""
    real = minizero.adamw
    monkeypatch.setattr(minizero, "adamw", lambda p, g, m, v, t, lr, b1, b2, eps, **kw:
                        real(p, g, m, v, t, lr, b1, b2, 0.0, **kw))
    report = run(world_sizes=(2,), eps=1e-8)
    first = report.first
    assert (first.what, first.step, first.name) == ("referee-update", 0, "emb.weight") and first.ours != first.ours
    assert [r.first is None for r in report.rows] == [False, True, True, True]  # the stages agree, NaN and all
    assert (report.rows[0].refereed, report.rows[0].skipped) == (1, 1)
    assert "referee saw 1 of 2 steps at world size 2 (1 skipped: non-finite gradients)" in str(report)


def test_a_skipped_step_must_leave_the_parameters(monkeypatch):
    real = minizero.Engine._skip

    def skips_but_decays(self, bad):
        for u in self.units:
            u.master.mul_(0.5)
        return real(self, bad)
    monkeypatch.setattr(minizero.Engine, "_skip", skips_but_decays)
    first = run(world_sizes=(1,), stages=(0,), dtype=torch.float16, loss_scale=2.0**40).first
    # Every parameter moved: the first named is the state's first, the root unit's own gate,
    # whatever the hash seed.
    assert (first.what, first.step, first.name) == ("referee-skip", 0, "gate")


def test_moments_and_step_counts_are_compared_across_stages(monkeypatch):
    """AdamW's m, v and per-parameter step counts are held to stage 0's after every step: a
    stage whose count runs ahead is found at that step, before a later bias correction shows."""
    real = minizero.Engine._drop_grads

    def counts_ahead(self):
        if self.stage == 2:
            for u in self.units:
                u.steps = [t + 1 for t in u.steps]
        return real(self)
    monkeypatch.setattr(minizero.Engine, "_drop_grads", counts_ahead)
    first = run(world_sizes=(2,)).first
    assert (first.what, first.step, first.stage, first.name) == ("optimizer", 0, 2, "gate (AdamW step count)")


def test_grads_reduced_in_fp32_under_bf16_match_the_formulas():
    # the reduced shards (memory at stages 2-3) and every gradient collective are fp32, the params bf16
    report = run(world_sizes=(3,), dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert report.ok, report.first
    assert all(r.memory_ok and r.bytes_ok for r in report.rows)


def test_a_model_that_draws_from_the_global_rng():
    """Thread ranks share torch's RNG, so such runs cannot be compared: a clear stop, never
    'diverges' (test_flight.py: with dropout, on processes, a real verdict)."""
    with pytest.raises(ValueError, match=r"draws random numbers in forward \(\(the model\): Small\).*--processes"):
        run(model=dict(noisy=True))


def test_a_wrong_decay_on_stage_3s_shards(monkeypatch):
    real = minizero.Unit.update

    def decays_twice(self, hp, group):
        if self.shard is not None:  # stage 3 only
            self.master.mul_(1 - hp.lr * hp.weight_decay)
        return real(self, hp, group)
    monkeypatch.setattr(minizero.Unit, "update", decays_twice)
    report = run()
    first = report.first
    assert (first.what, first.step, first.stage, first.name) == ("params", 0, 3, "gate")  # the root's own, first
    assert [r.first is None for r in report.rows] == [True, True, True, False]


def test_a_wrong_param_all_gather_on_stages_1_and_2(monkeypatch):
    """The fp32 master is right, the 16-bit params forward reads are not: found at once."""
    real = minizero.Unit.update

    def gathers_wrong(self, hp, group):
        real(self, hp, group)
        if self.cut["optimizer"] and self.shard is None:
            self.flat[-1] += 1.0  # each unit's last element; the root's is head.bias[10]
    monkeypatch.setattr(minizero.Unit, "update", gathers_wrong)
    report = run(stages=(0, 1, 2), dtype=torch.bfloat16)  # (in fp32 the master is flat itself)
    first = report.first
    assert (first.what, first.step, first.stage, first.name, first.index) == ("params", 0, 1, "head.bias", 10)
    assert [r.first is None for r in report.rows] == [True, False, False]


def test_a_micro_batch_skipped_on_one_rank(monkeypatch):
    real = minizero.Engine._reduction

    def forgets(self, u, first, last):
        if self.stage == 2 and self.comm.rank == 1 and self.micro == 1:
            u.bucket.zero_()  # rank 1's second micro-batch never reaches the sum
        return real(self, u, first, last)
    monkeypatch.setattr(minizero.Engine, "_reduction", forgets)
    first = run(grad_accum=2).first
    assert (first.what, first.step, first.micro, first.stage, first.rank) == ("grads", 0, 1, 2, 0)
    assert first.name == "gate"  # rank 0 owns the first chunk of the root unit, which starts with its own gate


def test_ranks_that_drift_apart():
    """nn.Embedding(max_norm=...) rescales, in place, the rows each rank's batch looks up:
    under DDP every rank then holds other weights (and stage 3 renorms a copy it drops)."""
    first = run(model=dict(max_norm=0.5)).first
    assert (first.what, first.step, first.stage, first.rank, first.name) == ("ranks", 0, 0, 1, "emb.weight")


def test_batchnorm_agrees_with_the_buffer_broadcast(monkeypatch):
    assert run(model=dict(bn=True)).ok  # rank 0's running stats, broadcast before every forward
    monkeypatch.setattr(minizero, "broadcast_buffers", lambda buffers, comm: None)
    first = run(model=dict(bn=True)).first  # each rank's forward reads its own: the ranks part
    assert (first.what, first.step, first.rank, first.name) == ("ranks", 1, 1, "bn.running_mean (as forward read it)")


# the bugs the torch referee exists for: each leaves the stages equal (they share the code)
# but moves stage 0 away from torch


def no_mean_over_ranks(monkeypatch):
    real = minizero.Hyper
    monkeypatch.setattr(minizero, "Hyper", lambda lr, wd, options, unscale, coef:
                        real(lr, wd, options, unscale * 3, coef))


def decay_twice(monkeypatch):
    real = minizero.adamw
    monkeypatch.setattr(minizero, "adamw", lambda p, g, m, v, t, lr, b1, b2, eps, **kw:
                        real(p.mul_(1 - lr * KW["weight_decay"]), g, m, v, t, lr, b1, b2, eps, **kw))


def clip_on_the_squared_norm(monkeypatch):
    real = minizero.all_gather
    monkeypatch.setattr(minizero, "all_gather", lambda x, comm, out=None, kind="all_gather":
                        real(x * x if kind == "clip" else x, comm, out, kind))


def no_bias_correction(monkeypatch):
    real = minizero.adamw
    monkeypatch.setattr(minizero, "adamw", lambda p, g, m, v, t, lr, b1, b2, eps, **kw:
                        real(p, g, m, v, 1e9, lr, b1, b2, eps, **kw))


@pytest.mark.parametrize("plant", [no_mean_over_ranks, decay_twice, clip_on_the_squared_norm, no_bias_correction])
def test_the_referee_finds_stage_0_bugs(monkeypatch, plant):
    plant(monkeypatch)
    report = run(stages=(0,), clip=0.05)  # a clip that bites, so its norm matters
    assert report.first is not None and report.first.what.startswith("referee"), report
    assert report.first.stage == 0 and report.first.name in dict(make_model().named_parameters())


# -----------------------------------------------------------------------------
# the command line


def write(tmp_path, body):
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


USER = """
    import torch, torch.nn as nn
    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    def make_batch(step, rank, micro):
        g = torch.Generator().manual_seed(step * 10 + rank)
        return (torch.randn(5, 4, generator=g),)
    def loss_fn(model, batch):
        return model(*batch).pow(2).mean() {extra}
    ENGINE = dict(lr=0.01)
"""


@pytest.mark.parametrize("extra, code", [("", 0), ("* (1 + torch.rand(()))", 1)])
def test_cli_exit_status(tmp_path, capsys, extra, code):
    path = write(tmp_path, USER.format(extra=extra))
    assert cli.check_main([path, "--world-sizes", "1,2", "--steps", "2"]) == code
    out = capsys.readouterr().out
    assert ("all stages agree" in out) == (code == 0) and ("first divergence: grads differ" in out) == (code == 1)


@pytest.mark.parametrize("body, says", [
    ("import torch\ndef make_model(): return torch.nn.Linear(2, 2)\n", "no function make_batch()"),
    (USER.format(extra="+ undefined_name"), "the model failed to run"),
])
def test_cli_bad_input_is_one_line_and_2(tmp_path, capsys, body, says):
    assert cli.check_main([write(tmp_path, body), "--world-sizes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_cli_device(tmp_path, capsys):
    """--device cpu is the default spelled out; --device cuda without a GPU is one line and 2."""
    path = write(tmp_path, USER.format(extra=""))
    assert cli.check_main([path, "--world-sizes", "2", "--steps", "1", "--device", "cpu"]) == 0
    if not torch.cuda.is_available():
        assert cli.check_main([path, "--world-sizes", "2", "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert "sees no CUDA GPU" in err and len(err.splitlines()) == 1


def test_processes_on_cuda_need_a_gpu_per_rank():
    with pytest.raises(ValueError, match="one nccl process per GPU"):
        minizero.check(make_model, make_batch, world_sizes=(64,), processes=True, device="cuda")


def test_batches_in_containers_reach_the_device():
    """check moves every tensor of a batch, floats and ints, inside tuples, namedtuples,
    lists and dicts (here with a function that marks them, as the CPU cannot move them)."""
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"a": (torch.zeros(2), [torch.zeros(1, dtype=torch.long)]), "b": Pair(torch.ones(1), 3), "c": "text"}
    out = minizero.map_tensors(batch, lambda t: t + 1)
    assert type(out["b"]) is Pair and out["b"].y == 3 and out["c"] == "text"
    assert torch.equal(out["a"][0], torch.ones(2)) and torch.equal(out["b"].x, torch.full((1,), 2.0))
    assert torch.equal(out["a"][1][0], torch.ones(1, dtype=torch.long))  # ints too
    assert to_device(batch, "cpu")["a"][0].device == torch.device("cpu")


# -----------------------------------------------------------------------------
# the optimizers beyond AdamW: a whole-tensor update that sees only the local shard must
# part stages 1-3 from stage 0; each optimizer's stage-0 bug must be the referee's finding

OPTIM = {k: v for k, v in KW.items() if k != "eps"}  # (eps is AdamW's, or Adafactor's pair)


def run_optim(stages=(0, 1, 2, 3), **kw):
    return minizero.check(make_model, make_batch, world_sizes=(3,), stages=stages, steps=2, **OPTIM, **kw)


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_whole_tensor_updates_on_the_local_shard_only(monkeypatch, optimizer):
    """DeepSpeed's Muon ran Newton-Schulz on the part of a matrix a rank holds (#7807);
    here each rank sees its own chunk and zeros for the rest of every matrix."""
    def local_only(comm, device):
        return lambda x: torch.cat([x if r == comm.rank else torch.zeros_like(x) for r in range(comm.world_size)])
    monkeypatch.setattr(optimizers, "gather_whole", local_only)
    report = run_optim(optimizer=optimizer)
    first = report.first
    assert (first.what, first.step, first.stage) == ("params", 0, 1), report
    assert [r.first is None for r in report.rows] == [True, False, False, False]


def sgd_decoupled_decay(monkeypatch):
    real = minizero.sgd
    monkeypatch.setattr(minizero, "sgd", lambda p, g, buf, t, lr, momentum, nesterov, wd:
                        real(p.mul_(1 - lr * wd), g, buf, t, lr, momentum, nesterov, 0.0))


def muon_lr_not_adjusted(monkeypatch):  # the head is 11 x 6: torch steps it sqrt(11/6) times further
    monkeypatch.setattr(optimizers, "muon_lr", lambda lr, fn, shape: lr)


def adafactor_without_beta2_decay(monkeypatch):  # the second step averages g² as if it were the first
    real = optimizers.adafactor
    monkeypatch.setattr(optimizers, "adafactor", lambda p, g, state, t, lr, beta2_decay, eps1, eps2, d:
                        real(p, g, state, t, lr, 0.0, eps1, eps2, d))


@pytest.mark.parametrize("plant, options, step", [  # step: the first that tells them apart
    (sgd_decoupled_decay, dict(optimizer="sgd", momentum=0.9), 1),  # (the first: (1 - lr·wd)p - lr·g either way)
    (muon_lr_not_adjusted, dict(optimizer="muon", muon_lr=0.02), 0),
    (adafactor_without_beta2_decay, dict(optimizer="adafactor"), 1)])
def test_the_referee_finds_each_optimizers_stage_0_bug(monkeypatch, plant, options, step):
    assert run_optim(stages=(0,), **options).ok  # the optimizer right: torch agrees
    plant(monkeypatch)
    report = run_optim(stages=(0,), **options)
    assert report.first is not None and report.first.what == "referee-update", report
    assert report.first.step == step


def test_check_on_cuda_runs_deterministic_kernels_only(monkeypatch):
    """check(device="cuda"), and each rank it spawns before it builds its model: torch's
    deterministic kernels, where a kernel without one is an error (not a warning), and
    cuBLAS's setting in the environment (spawned ranks inherit it). Recorded: no GPU needed."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    restore = check.deterministic(torch.device("cuda"))
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        restore()
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before
    seen = []
    monkeypatch.setattr(check, "deterministic", seen.append)

    def make_model():  # a spawned rank: it builds its own model, after the switch
        raise LookupError(list(seen))
    with pytest.raises(LookupError, match=r"\[device\(type='cuda'\)\]"):
        check.rank_run(SimpleNamespace(device=torch.device("cuda")), 0, dict(make_model=make_model))


def test_cli_modes_reach_check(tmp_path, monkeypatch, capsys):
    """--reduce-every, --reshard-after-forward and --quantize-grads are the Engine's modes,
    checked as the flags give them (over the file's ENGINE); a bad value is one line and 2."""
    from minizero_lib import check as check_module
    seen, real = [], check_module.check
    monkeypatch.setattr(check_module, "check", lambda *a, **kw: (seen.append(kw), real(*a, **kw))[1])
    path = write(tmp_path, USER.format(extra=""))
    assert cli.check_main([path, "--world-sizes", "2", "--steps", "2", "--grad-accum", "2",
                           "--reduce-every", "step", "--reshard-after-forward", "false"]) == 0
    assert cli.check_main([path, "--world-sizes", "2", "--steps", "1", "--quantize-grads", "8"]) == 0
    assert [{k: kw.get(k) for k in ("reduce_every", "reshard_after_forward", "quantize_grads", "lr")}
            for kw in seen] == [dict(reduce_every="step", reshard_after_forward=False, quantize_grads=None, lr=0.01),
                                dict(reduce_every=None, reshard_after_forward=None, quantize_grads=8, lr=0.01)]
    assert cli.check_main([path, "--reshard-after-forward", "sometimes"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--reshard-after-forward must be true, false or a number of ranks" in err and len(err.splitlines()) == 1

"""
Mixed precision and accounting: fp16 loss scaling skips a step everywhere when any rank
overflows; an fp32 reduction keeps the stages bit-identical; the planner prints what the
formula function (the one the engine is tested against) computes.
"""
import copy

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import minizero
import ops
from minizero_lib import launch, optimizers, planner
from test_equivalence import FIXED, assert_same, make

torch.set_num_threads(1)


def run(comm, stage, model, batches, kw, poison=None):
    """Train; on (step, rank) == poison, rank's loss is multiplied by inf. Returns per step
    (stepped, scale, full state, moments of unit 0)."""
    model = copy.deepcopy(model)
    engine = minizero.Engine(model, comm, stage, **kw)
    out = []
    for step, micro_batches in enumerate(batches):
        for micro in micro_batches:
            x, y = micro[comm.rank]
            loss = model(x, y)
            if poison == (step, comm.rank):
                loss = loss * float("inf")
            engine.backward(loss)
        stepped = engine.step()
        u = engine.units[0]
        out.append((stepped, getattr(engine, "scaler", None) and engine.scaler.scale, engine.full_state_dict(),
                    ops.all_gather(u.state["m"], comm) if stage else u.state["m"].clone(), engine.t))
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage):
    c = dict(FIXED[0], steps=4, grad_accum=1)
    kw = dict(FIXED[0]["engine"], dtype=torch.float16, grad_accum=1, loss_scale=1024.0, scale_window=2)
    model, batches = make(c)
    ranks = launch.run_threads(run, 3, stage, model, batches, kw, (2, 1))
    for hist in ranks:
        assert [h[0] for h in hist] == [True, True, False, True]   # step 2 skipped on every rank
        assert [h[1] for h in hist] == [1024.0, 2048.0, 1024.0, 1024.0]  # x2 after 2 clean, /2 on overflow
        assert [h[4] for h in hist] == [1, 2, 2, 3]                  # AdamW's step count too
        assert_same(hist[2][2], hist[1][2])                          # params untouched
        assert torch.equal(hist[2][3], hist[1][3])                   # moments untouched
        assert_same(hist[3][2], ranks[0][3][2])


def test_fp32_reduction_keeps_stages_identical():
    c = dict(FIXED[0], steps=2)
    kw = dict(FIXED[0]["engine"], dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, batches = make(c)
    runs = {s: launch.run_threads(run, 3, s, model, batches, kw) for s in range(4)}
    for s in (1, 2, 3):
        for a, b in zip(runs[s][0], runs[0][0]):
            assert_same(a[2], b[2])
    bf16 = launch.run_threads(run, 3, 0, model, batches, dict(kw, reduce_dtype=None))
    assert not all(torch.equal(bf16[0][-1][2][k], runs[0][0][-1][2][k]) for k in bf16[0][-1][2])


def test_engine_casts_float_inputs_to_the_compute_dtype():
    class Regress(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            assert x.dtype == torch.bfloat16
            return self.lin(x).float().pow(2).mean()

    def body(comm):
        model = Regress()
        engine = minizero.Engine(model, comm, 3, dtype=torch.bfloat16)
        engine.backward(model(torch.ones(2, 3)))
        return engine.step(), model.lin.weight.dtype
    assert launch.run_threads(body, 2) == [(True, torch.bfloat16)] * 2


def test_planner_prints_the_formula():
    lines = planner.plan(7.5e9, 64, torch.bfloat16, memory=80e9)
    for stage, line in enumerate(lines[2:]):
        b = minizero.model_state_bytes(7.5e9, 64, stage)
        assert f"{sum(b.values()) / 1e9:.2f}" in line
    # the ZeRO paper's Figure 1: 7.5B parameters on 64 GPUs, 120 / 31.4 / 16.6 / 1.9 GB
    assert [line.split()[4] for line in lines[2:]] == ["120.00", "31.41", "16.64", "1.88"]
    assert minizero.model_state_bytes(64, 64, 3, torch.float32) == {"params": 4, "grads": 4, "optimizer": 8}


# -----------------------------------------------------------------------------
# the update rounds the same on the host (offload) as on a GPU (DESIGN.md §2)

ALLOWED = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "sqrt", "full", "to", "__getitem__", "__get__"}


class Recorder(TorchFunctionMode):
    """Every torch call made inside it, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((getattr(func, "__name__", str(func)), args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("coef", [None, 0.5])
def test_the_update_divides_only_by_tensors_on_its_device(coef):
    """CUDA divides by a Python (or CPU) scalar as a multiply by its reciprocal, which may lose
    a bit; the CPU divides. Offload's update on the host would then part from stage 0's on the
    GPU. So every division in the update is by a tensor on the update's own device, and every
    operation is one DESIGN.md §2 allows. Run on the meta device: a CPU scalar shows up there
    as a tensor of another device, a Python one as a number."""
    meta = torch.device("meta")
    master, m, v = (torch.empty(8, device=meta) for _ in range(3))
    grad = torch.empty(8, device=meta, dtype=torch.bfloat16)
    hp = minizero.Hyper(1e-2, 0.1, {"betas": (0.9, 0.999), "eps": 1e-8}, 0.25,
                        None if coef is None else torch.full((), coef, device=meta))
    pieces = minizero.state_layout([0, 3], [(3,), (5,)], ["adamw"] * 2, [{"m": None, "v": None}] * 2, 0, 8)[0]
    with Recorder() as rec:
        optimizers.update(master, {"m": m, "v": v}, grad, [(pieces[0], 2, 0.1), (pieces[1], 1, 0.0)], hp)
    divisions = [(name, args) for name, args in rec.calls if "div" in name]
    assert len(divisions) == 4  # two per piece: by the bias correction, by the denominator
    for name, (x, y, *_) in divisions:
        x, y = (y, x) if name.startswith("__r") else (x, y)  # (2 / t: t is the divisor)
        assert torch.is_tensor(y) and y.device == x.device, f"{name} divides a tensor on {x.device} by {y!r}"
    used = {name for name, _ in rec.calls}
    assert used <= ALLOWED, f"the update uses {sorted(used - ALLOWED)}, which DESIGN.md §2 does not allow"

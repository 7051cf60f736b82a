"""
Quantized communication (quantize.py, ZeRO++'s qwZ and qgZ): the codes' bound per element,
the values that must come back exact, the dtypes kept, the padding; the quantized all-gather
and all-to-all reduce-scatter against their bounds on thread ranks (and once on gloo);
the engine's stages bit-identical to each other under quantize_grads with the ledger equal
to the formula (check()); qwZ's gathered weights within their bound while the master stays
exact; the planner, the DeepSpeed keys and the errors.
"""
import copy
import sys

import pytest
import torch
import torch.nn as nn

import minizero
from minizero_lib import launch, planner
from minizero_lib.ds_config import check_quantized, parse_ds_config
from minizero import Engine
from minizero_lib.quantize import (QMAX, Quant, dequantize, gather_params, packed_bytes,
                                   quantize, reduce_scatter)

sys.path.insert(0, ".")
import example_check as ex  # noqa: E402
from test_equivalence import FIXED, run_check  # noqa: E402

torch.set_num_threads(1)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32's own rounding inside quantize and dequantize, relative to a block's amax
FP32_SLACK = 2.0 ** -20


def bound(x, bits, block):
    """Per element of x: amax over its block / (2Q), the quantization bound (fp32 slack too)."""
    n = x.numel()
    blocks = torch.zeros(-(-n // block) * block, dtype=torch.float64)
    blocks[:n] = x.double()
    amax = blocks.view(-1, block).abs().amax(1)
    return (amax * (1 / (2 * QMAX[bits]) + FP32_SLACK)).repeat_interleave(block)[:n]


def drawn(n, dtype, seed):
    """Values with an outlier per 100 and a block of zeros: what gradients look like."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.where(torch.rand(n, generator=g) < 0.01, 50.0, 1.0)
    x[:min(n // 3, 64)] = 0
    return x.to(dtype)


# -----------------------------------------------------------------------------
# the codes

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1000, 256), (7, 4), (300, 64), (5, 2)])
def test_codes_stay_within_the_bound_and_pad_never_drops(bits, dtype, n, block):
    x = drawn(n, dtype, n + bits)
    message = quantize(x, bits, block)
    assert message.dtype == torch.uint8 and message.numel() == packed_bytes(n, bits, block)
    back = dequantize(message, bits, block, n)
    # every value comes back, the padded last block's too
    assert back.shape == (n,) and back.dtype == torch.float32
    err = (back.double() - x.double()).abs()
    assert (err <= bound(x, bits, block)).all(), float((err - bound(x, bits, block)).max())
    # and the bound is not loose: some element uses a good part of it
    assert n < 300 or float((err / bound(x, bits, block).clamp_min(1e-30)).max()) > 0.3


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_and_one_value_come_back_exact(bits, dtype):
    """A block of zeros, a block of one value (±amax: code ±Q, and Q/Q is 1.0), a padded one."""
    block = 8
    one = torch.full((block,), -3.140625)
    signs = torch.tensor([1.0, -1, 0, 1, 1, 0, -1, -1]) * 6.5e-3  # values in {-amax, 0, amax}
    x = torch.cat([torch.zeros(block), one, -one, signs, torch.tensor([2.5, 2.5, 2.5])]).to(dtype)
    back = dequantize(quantize(x, bits, block), bits, block, x.numel())
    assert torch.equal(back.to(dtype), x)


def test_nonfinite_values_stay_nonfinite():
    """An overflowed gradient must not come back finite: the step's flags skip it."""
    x = torch.tensor([1.0, float("inf"), 2.0, 3.0])
    for bits in (8, 4):
        assert not dequantize(quantize(x, bits, 4), bits, 4, 4).isfinite().all()


# -----------------------------------------------------------------------------
# the collectives on thread ranks (and gloo once)

def _locals(n, dtype, size, seed=0):
    return [drawn(size, dtype, seed + 7 * r) for r in range(n)]


def _reduce_scatter(comm, bits, block, xs):
    sent = comm.sent["reduce_scatter"]
    out = reduce_scatter(xs[comm.rank].clone(), comm, bits, block, kind="reduce_scatter")
    return out, comm.sent["reduce_scatter"] - sent


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_error_is_the_sum_of_the_senders_bounds(bits, dtype):
    """Rank r's chunk against the exact sum (fp64): within the sum over senders s != r of
    their pieces' bounds (its own piece never moved), plus one rounding to the dtype."""
    n, block, size = 4, 32, 4 * 150
    xs = _locals(n, dtype, size)
    outs = launch.run_threads(_reduce_scatter, n, bits, block, xs)
    exact = sum(x.double() for x in xs).view(n, -1)
    pieces = [x.view(n, -1) for x in xs]
    for r, (out, sent) in enumerate(outs):
        assert out.dtype == dtype and out.shape == (size // n,)
        assert sent == (n - 1) * packed_bytes(size // n, bits, block)
        allowed = sum(bound(pieces[s][r], bits, block) for s in range(n) if s != r)
        allowed = allowed + exact[r].abs() * torch.finfo(dtype).eps
        err = (out.double() - exact[r]).abs()
        assert (err <= allowed).all()
        assert float(err.max()) > 0  # (the test sees quantization at all)


def test_all_to_all_is_exact_for_equal_ranks_of_exact_blocks():
    """All-equal ranks whose blocks are zeros, one value, or values in {-a, 0, a}: exact."""
    n, block = 4, 8
    x = torch.cat([torch.zeros(block), torch.full((block,), 0.75),
                   torch.tensor([1.0, -1, 0, 1, 1, 0, -1, -1]) * 0.375])
    x = x.repeat(n)  # n chunks
    for bits in (8, 4):
        for out, _ in launch.run_threads(_reduce_scatter, n, bits, block, [x] * n):
            assert torch.equal(out, n * x.view(n, -1)[0])


def _gather(comm, shard_of, dtype, block):
    shard = shard_of[comm.rank].to(dtype)
    flat = torch.empty(shard.numel() * comm.world_size, dtype=dtype)
    sent = comm.sent["all_gather"]
    out = gather_params(shard, flat, comm, Quant(8, None, block))
    return out.clone(), comm.sent["all_gather"] - sent


@pytest.mark.parametrize("dtype", DTYPES)
def test_gathered_weights_are_the_same_bits_everywhere_and_within_the_bound(dtype):
    """qwZ: every rank holds the same bits, each chunk the dequantization of its owner's codes,
    in the compute dtype (DeepSpeed #7775 returned fp16 under bf16), within amax/254 plus one
    rounding to the dtype."""
    n, block, size = 3, 16, 100  # 100 values: 7 blocks, the last padded
    shards = _locals(n, dtype, size, seed=5)
    outs = launch.run_threads(_gather, n, shards, dtype, block)
    for out, sent in outs:
        assert out.dtype == dtype and torch.equal(out, outs[0][0])
        assert sent == (n - 1) * packed_bytes(size, 8, block)
    for r, w in enumerate(shards):
        got = outs[0][0][r * size:(r + 1) * size]
        assert torch.equal(got, dequantize(quantize(w, 8, block), 8, block, size).to(dtype))
        allowed = bound(w, 8, block) + got.double().abs() * torch.finfo(dtype).eps
        assert ((got.double() - w.double()).abs() <= allowed).all()


def test_quantized_collectives_on_gloo_processes():
    """The int8 and uint8 messages over gloo (with headers), as on threads."""
    xs = _locals(2, torch.bfloat16, 2 * 40)
    threads = launch.run_threads(_reduce_scatter, 2, 4, 16, xs)
    procs = launch.run_processes(_reduce_scatter, 2, 4, 16, xs)
    for (a, sa), (b, sb) in zip(threads, procs):
        assert torch.equal(a, b) and sa == sb


# -----------------------------------------------------------------------------
# the engine: stages bit-identical, bytes = formula (check), qwZ's weights and master

def test_stages_are_bit_identical_under_quantize_grads():
    """check() on example_check.py's model (blocks of 256): every stage's reduced gradients,
    params and optimizer state equal stage 0's, to the bit, on every rank, and each rank's
    bytes equal the quantized formula."""
    report = minizero.check(ex.make_model, ex.make_batch, loss_fn=ex.loss_fn, world_sizes=(3,),
                            steps=2, referee=False, quantize_grads=4, **ex.ENGINE)
    assert report.ok, report.first
    assert all(r.bytes_ok for r in report.rows)


@pytest.mark.parametrize("case,kw", [(0, dict(quantize_grads=8)), (1, dict(quantize_grads=4)),
                                     (0, dict(quantize_grads=4, native=True)),
                                     (0, dict(quantize_grads=4, shard_size=2, world_size=4))])
def test_stages_are_bit_identical_under_quantize_grads_small_blocks(case, kw):
    """The same on test_equivalence's fixed models (fp32 with accumulation and ties, bf16 with
    a frozen layer) in blocks of 6 values, most padded; native: stage 0's one all-reduce
    shortcut must give way to the quantized reduce-scatter; hybrid: in the group, then
    across the copies."""
    kw = dict(kw)
    report = run_check(dict(FIXED[case], world_size=kw.pop("world_size", 3)), quant_block=6, **kw)
    assert report.ok, report.first
    assert all(r.bytes_ok for r in report.rows)


def test_quantized_grads_change_the_bits():
    """The quantized run is not the exact one (else the checks above prove nothing). (Its error
    is not small against the sum: ranks' gradients cancel, the bound is each sender's amax.)"""
    def run(comm, kw):
        model = ex.make_model()
        e = Engine(model, comm, 2, **{**ex.ENGINE, **kw})
        e.backward(ex.loss_fn(model, ex.make_batch(0, comm.rank, 0)))
        return torch.cat([u.reduced for u in e.units])
    exact, quantized = (launch.run_threads(run, 3, kw)[0] for kw in ({}, dict(quantize_grads=4)))
    assert not torch.equal(exact, quantized) and quantized.isfinite().all()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(40, 40) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.pow(2).mean()


def _qwz(comm, model, dtype, native):
    """Stage 3 with qwZ: what each forward read, and this rank's exact shard then."""
    model = copy.deepcopy(model)
    e = Engine(model, comm, 3, lr=0.1, dtype=dtype, quantize_weights=8, quantize_grads=4,
               quant_block=32, native=native)
    seen = []
    for u in e.units:
        # (after the engine's own pre-hook, which gathers; its forward hook releases)
        u.module.register_forward_pre_hook(
            lambda m, a, u=u: seen.append((u.flat.clone(), u.shard.clone())))
    for step in range(2):
        before = dict(comm.sent)
        x = torch.randn(4, 40, generator=torch.Generator().manual_seed(step + comm.rank))
        e.backward(model(x))
        e.step()
    sent = {k: comm.sent[k] - before.get(k, 0) for k in ("all_gather", "reduce_scatter")}
    masters = [(u.master.clone(), u.shard.clone()) for u in e.units]
    formula = e.formula(sent=True)
    e.close()
    return seen, sent, formula, masters


@pytest.mark.parametrize("dtype,native", [(torch.bfloat16, False), (torch.float16, False),
                                          (torch.float32, False), (torch.bfloat16, True)])
def test_qwz_forward_reads_dequantized_weights_and_the_master_stays_exact(dtype, native):
    """Every forward reads, on every rank, the same bits: each chunk its owner's exact shard
    dequantized, in the compute dtype, within amax/254 plus one rounding; the shard the
    next gather quantizes is the fp32 master rounded, never codes; bytes = the formula.
    native: torch's all-gather, which the engine starts in flight (its bytes are read here)."""
    n = 3
    outs = launch.run_threads(_qwz, n, Tiny(), dtype, native)
    for seen, sent, formula, masters in outs:
        assert sent == formula
        assert all(torch.equal(s, m.to(dtype)) for m, s in masters)
    for i, (flat, _) in enumerate(outs[0][0]):
        exact = torch.cat([out[0][i][1] for out in outs])  # every rank's shard at that forward
        assert flat.dtype == dtype and all(torch.equal(flat, out[0][i][0]) for out in outs)
        for r, w in enumerate(exact.view(n, -1)):
            got = flat.view(n, -1)[r]
            assert torch.equal(got, dequantize(quantize(w, 8, 32), 8, 32, w.numel()).to(dtype))
            allowed = bound(w, 8, 32) + got.double().abs() * torch.finfo(dtype).eps
            assert ((got.double() - w.double()).abs() <= allowed).all()


@pytest.mark.parametrize("stage,kw,says", [(2, dict(quantize_weights=8), "use stage=3"),
                                            (1, dict(quantize_grads=2), "8 or 4"),
                                            (1, dict(quantize_grads=4, quant_block=7), "even")])
def test_engine_refuses_bad_quantization(stage, kw, says):
    with pytest.raises(Exception) as e:
        launch.run_threads(lambda c: Engine(Tiny(), c, stage, **kw), 1)
    assert isinstance(e.value.__cause__, ValueError) and says in str(e.value.__cause__)


def test_check_refuses_quantize_weights():
    with pytest.raises(ValueError, match="stage 3"):
        minizero.check(ex.make_model, ex.make_batch, world_sizes=(2,), quantize_weights=8)


# -----------------------------------------------------------------------------
# the planner, DeepSpeed's keys, the demo's flags

def test_planner_prints_zeropp_beside_zero3():
    params, N, G, units = 1024 * 32 * 1000, 1024, 8, 32
    links = planner.Links(900e9 / 8, 400e9 / 8, 5e-6)
    lines = planner.plan_zeropp(params, N, G, links, units)
    rows = {ln[:26].strip(): [float(v) for v in ln[26:].split()] for ln in lines[2:]}
    zero3, ours = rows["ZeRO-3"], rows["qwZ + qgZ (minizero)"]
    zeropp = rows["qwZ + qgZ + hpZ (ZeRO++)"]
    # ZeRO-3's row is the hybrid table's flat stage 3 (the ledger-tested formula)
    flat = planner.link_bytes_per_step(params, N, 3, G)
    assert zero3[0] == round(flat["busiest"] / 1e9, 2) and zero3[1] == round(flat["inter"] / 1e9, 2)
    # ZeRO++ sends about a quarter of ZeRO-3 across per node (0.75 of 3 Ψ), and is faster
    assert 0.24 < zeropp[1] / zero3[1] < 0.27 and zeropp[2] < ours[2] < zero3[2]


def test_deepspeed_keys_and_the_demo_flags():
    ds = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                "zero_quantized_gradients": True}}
    assert parse_ds_config(ds) == {"stage": 3, "quantize_weights": 8, "quantize_grads": 4}
    with pytest.raises(ValueError, match="zero_quantized_weights"):
        parse_ds_config({"zero_optimization": {"zero_quantized_weights": 8}})
    with pytest.raises(ValueError, match="--stage 3"):
        check_quantized(dict(stage=2, quantize_weights=8, quantize_grads=None))
    with pytest.raises(ValueError, match="8 or 4"):
        check_quantized(dict(stage=3, quantize_weights=None, quantize_grads=2))

"""
Tests of ops.py and launch.py: the ring collectives, their documented reduction order (DESIGN.md,
invariant 2), the byte ledger, the native path, both transports, and failure handling.

The reference for the ring is computed here, directly from the contract: chunk c of the
sum is x_{c+1}[c] + x_{c+2}[c] + ... + x_c[c] (rank indices mod N), each add rounded to
the dtype. The ring must match it bit for bit; the native path only to float tolerance.

Process worlds are expensive (~2-3 s each), so there are three: one runs every fixed case
and ends with a planted mismatch, one has a rank raise, one has a rank die hard. The
GPU's rules, modelled on threads, are test_gpu_rules.py's.
"""
import os
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ops
from minizero_lib import hybrid, launch

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64,
            torch.bfloat16: torch.int16, torch.float16: torch.int16}


# -----------------------------------------------------------------------------
# helpers: deterministic inputs, the documented reference order, bitwise equality

def make_input(rank, numel, dtype, seed):
    """Rank's input, from (rank, seed) only: randn times powers of two from 2^-8 to 2^8,
    so that partial sums of different magnitude make the rounding order matter.
    A private generator: rank threads share torch's global RNG."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    scale = torch.exp2(torch.randint(-8, 9, (numel,), generator=g).double())
    return (x * scale).to(dtype)


def ring_reference(xs, c):
    """Chunk c of the sum, in the documented order: x_{c+1}, then + x_{c+2}, ..., + x_c."""
    n = len(xs)
    parts = [x.view(n, -1)[c] for x in xs]
    acc = parts[(c + 1) % n].clone()
    for j in range(2, n + 1):
        acc = acc + parts[(c + j) % n]
    return acc


def naive_reference(xs, c):
    """Chunk c summed left to right over ranks 0, 1, ..., N-1 (not the contract)."""
    n = len(xs)
    parts = [x.view(n, -1)[c] for x in xs]
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    va, vb = a.contiguous().view(INT_VIEW.get(a.dtype, a.dtype)), b.contiguous().view(INT_VIEW.get(b.dtype, b.dtype))
    bad = (va != vb).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} elements differ, first at {bad[0].item()}: " \
                             f"{a[bad[0]].item()!r} vs {b[bad[0]].item()!r}"


def assert_sum_close(got, xs, c, dtype):
    """got is chunk c of the sum, however ordered: any order of N-1 rounded adds lies within
    N * eps * sum|x| of any other (plus a little for fp16 / bf16 subnormals)."""
    n, fi = len(xs), torch.finfo(dtype)
    parts = torch.stack([x.view(n, -1)[c].double() for x in xs])
    ref, tol = parts.sum(0), n * fi.eps * parts.abs().sum(0) + n * fi.tiny
    err = (got.double() - ref).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item()} over tolerance"


def sent(comm):
    return {k: v for k, v in comm.sent.items() if v}


def ledger_delta(before, after):
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def expected_ledger(kinds, n, chunk, dtype):
    if n == 1:
        return {}
    return {k: (n - 1) * chunk * torch.empty((), dtype=dtype).element_size() for k in kinds}


# -----------------------------------------------------------------------------
# 1. the ring on threads: documented order bit for bit, exact gather, ledger

def _ring_cases(comm, chunk, dtype, seed):
    n, r = comm.world_size, comm.rank
    x = make_input(r, n * chunk, dtype, seed)
    shard = make_input(r + 100, chunk, dtype, seed)
    out, ledgers = {}, {}
    for name, op in [("rs", lambda: ops.reduce_scatter(x, comm)),
                     ("ag", lambda: ops.all_gather(shard, comm)),
                     ("ar", lambda: ops.all_reduce(x, comm)),
                     ("ag_of_rs", lambda: ops.all_gather(out["rs"], comm))]:
        before = sent(comm)
        out[name] = op()
        ledgers[name] = ledger_delta(before, sent(comm))
    return out, ledgers, sent(comm)


@settings(deadline=None)
@given(n=st.integers(1, 6), chunk=st.integers(1, 50), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**20), strict_p2p=st.booleans())
def test_ring_is_the_documented_order_bit_for_bit(n, chunk, dtype, seed, strict_p2p):
    results = launch.run_threads(_ring_cases, n, chunk, dtype, seed, strict_p2p=strict_p2p)
    xs = [make_input(r, n * chunk, dtype, seed) for r in range(n)]
    shards = [make_input(r + 100, chunk, dtype, seed) for r in range(n)]
    want = [ring_reference(xs, c) for c in range(n)]
    full = torch.cat(want)
    one = expected_ledger(["x"], n, chunk, dtype).get("x")
    for r, (out, ledgers, total) in enumerate(results):
        assert_bits_equal(out["rs"], want[r])
        assert_bits_equal(out["ag"], torch.cat(shards))
        assert_bits_equal(out["ar"], full)
        assert_bits_equal(out["ar"], out["ag_of_rs"])
        assert ledgers["rs"] == expected_ledger(["reduce_scatter"], n, chunk, dtype)
        assert ledgers["ag"] == expected_ledger(["all_gather"], n, chunk, dtype)
        assert ledgers["ar"] == expected_ledger(["reduce_scatter", "all_gather"], n, chunk, dtype)
        assert ledgers["ag_of_rs"] == expected_ledger(["all_gather"], n, chunk, dtype)
        if n == 1:
            assert total == {}
        else:
            assert total == {"reduce_scatter": 2 * one, "all_gather": 3 * one}


def test_ring_order_is_observable_in_bf16():
    """The bit-for-bit test above could fail: for bf16 at N >= 3 the ring's order gives
    other bits than a left-to-right sum over ranks 0..N-1."""
    # by hand: N = 3, chunk 0 is x1 + x2 + x0 on the ring, x0 + x1 + x2 naively.
    xs = [torch.tensor([1.0, 0, 0], dtype=torch.bfloat16),
          torch.tensor([2.0**-8, 0, 0], dtype=torch.bfloat16),
          torch.tensor([2.0**-8, 0, 0], dtype=torch.bfloat16)]
    assert ring_reference(xs, 0).item() == 1 + 2.0**-7   # 2^-8 + 2^-8 is exact, then + 1
    assert naive_reference(xs, 0).item() == 1.0          # 1 + 2^-8 rounds to even, twice
    got = launch.run_threads(lambda comm: ops.reduce_scatter(xs[comm.rank], comm), 3)
    assert got[0].item() == 1 + 2.0**-7

    # and with the property test's own inputs: the first seed where they differ.
    n, chunk = 3, 16
    for seed in range(100):
        xs = [make_input(r, n * chunk, torch.bfloat16, seed) for r in range(n)]
        diff = [c for c in range(n) if not torch.equal(ring_reference(xs, c), naive_reference(xs, c))]
        if diff:
            break
    else:
        pytest.fail("no seed in 0..99 where the ring order differs from the naive order")
    got = launch.run_threads(lambda comm: ops.reduce_scatter(xs[comm.rank], comm), n)
    c = diff[0]
    assert_bits_equal(got[c], ring_reference(xs, c))
    assert not torch.equal(got[c], naive_reference(xs, c))


# -----------------------------------------------------------------------------
# 2. broadcast

@pytest.mark.parametrize("strict_p2p", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_broadcast_copies_rank0(n, strict_p2p):
    src_f = torch.linspace(-3, 3, 7)
    src_b = torch.tensor([True, False, False, True, True])

    def fn(comm):
        if comm.rank == 0:
            f, b = src_f.clone(), src_b.clone()
        else:
            f, b = torch.full((7,), float(comm.rank)), torch.tensor([False, True, True, False, comm.rank % 2 == 0])
        rf, rb = ops.broadcast(f, comm), ops.broadcast(b, comm)
        assert rf is f and rb is b  # in place
        return f, b

    for f, b in launch.run_threads(fn, n, strict_p2p=strict_p2p):
        assert_bits_equal(f, src_f)
        assert b.dtype == torch.bool and torch.equal(b, src_b)


# -----------------------------------------------------------------------------
# 3. the native path on threads: same results to tolerance, same ledger

def _ring_and_native(comm, chunk, dtype, seed, with_all_reduce=False):
    """reduce_scatter, all_gather (and all_reduce, also in place) on the ring and on the
    native path: {native: (results..., ledger deltas...)}."""
    n, r = comm.world_size, comm.rank
    x, shard = make_input(r, n * chunk, dtype, seed), make_input(r + 100, chunk, dtype, seed)
    calls = [lambda: ops.reduce_scatter(x, comm), lambda: ops.all_gather(shard, comm)]
    calls += [lambda: ops.all_reduce(x, comm), lambda: (ops.all_reduce(y := x.clone(), comm, out=y), y)[1]] \
        if with_all_reduce else []
    out = {}
    for native in (False, True):
        comm.native = native
        results, deltas = [], []
        for call in calls:
            before = sent(comm)
            results.append(call())
            deltas.append(ledger_delta(before, sent(comm)))
        out[native] = (*results, *deltas)
    with ops.started(comm) as pending:  # the native calls again, all started before any finishes
        started = [call() for call in calls]
    pending.wait()
    out["in flight"] = started
    return out


@settings(deadline=None)
@given(n=st.integers(1, 6), chunk=st.integers(1, 50), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**20))
def test_native_path_matches_ring_on_threads(n, chunk, dtype, seed):
    xs = [make_input(r, n * chunk, dtype, seed) for r in range(n)]
    shards = [make_input(r + 100, chunk, dtype, seed) for r in range(n)]
    for r, out in enumerate(launch.run_threads(_ring_and_native, n, chunk, dtype, seed)):
        (rs, ag, l_rs, l_ag), (frs, fag, fl_rs, fl_ag) = out[False], out[True]
        assert frs.dtype == dtype and frs.shape == rs.shape
        assert_sum_close(frs, xs, r, dtype)
        assert_bits_equal(fag, torch.cat(shards))  # a gather is a copy: exact on any path
        assert (fl_rs, fl_ag) == (l_rs, l_ag)
        assert fl_rs == expected_ledger(["reduce_scatter"], n, chunk, dtype)
        assert fl_ag == expected_ledger(["all_gather"], n, chunk, dtype)
        for a, b in zip(out["in flight"], (frs, fag)):  # torch's async_op: the same sums, at the wait
            assert_bits_equal(a, b)


# -----------------------------------------------------------------------------
# 5 (threads). failure is an error naming the rank, never a hang

def _expect_failure(run, *match, within=20.0):
    t = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run()
    elapsed = time.monotonic() - t
    assert elapsed < within, f"took {elapsed:.1f}s to fail"
    for m in match:
        assert m in str(info.value), f"{m!r} not in {str(info.value)[:500]!r}"
    return info.value


@pytest.mark.parametrize("native", [False, True])
def test_planted_exception_on_threads(native):
    def fn(comm):
        comm.native = native
        ops.all_reduce(torch.ones(8), comm)
        if comm.rank == 2:
            raise KeyError("planted on rank 2")
        return ops.all_reduce(torch.ones(8), comm)  # the others wait on rank 2

    err = _expect_failure(lambda: launch.run_threads(fn, 4), "rank 2 failed", "KeyError", "planted on rank 2")
    assert isinstance(err.__cause__, KeyError)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("case", ["kind", "size"])
def test_mismatched_collectives_on_threads(case, native):
    def fn(comm):
        comm.native = native
        if comm.rank == 0:
            return ops.reduce_scatter(torch.ones(4), comm)
        if case == "kind":
            return ops.all_gather(torch.ones(2), comm)
        return ops.reduce_scatter(torch.ones(6), comm)

    err = _expect_failure(lambda: launch.run_threads(fn, 2), "mismatched")
    assert isinstance(err.__cause__, ValueError)


def test_recv_timeout_on_threads():
    def fn(comm):
        if comm.rank == 1:
            comm.exchange(None, None, torch.empty(3), 0)  # rank 0 never sends

    err = _expect_failure(lambda: launch.run_threads(fn, 2, timeout=1.0),
                          "rank 1 failed", "no message from rank 0 within 1.0s", within=10.0)
    assert isinstance(err.__cause__, ops.PeerFailed)


def test_bad_shapes_raise_value_error():
    def fn(comm):
        errors = []
        for call in [lambda: ops.reduce_scatter(torch.ones(5), comm),        # 5 % 2 != 0
                     lambda: ops.all_reduce(torch.ones(7), comm),
                     lambda: ops.reduce_scatter(torch.ones(2, 4), comm),     # not 1-D
                     lambda: ops.all_gather(torch.ones(2), comm, out=torch.empty(5))]:
            with pytest.raises(ValueError, match="multiple of the world size"):
                call()
            errors.append(True)
        return errors  # every rank raised before sending: the world is still usable

    assert launch.run_threads(fn, 2) == [[True] * 4] * 2
    err = _expect_failure(lambda: launch.run_threads(lambda comm: ops.reduce_scatter(torch.ones(7), comm), 3),
                          "rank 0 failed", "ValueError")
    assert isinstance(err.__cause__, ValueError)


def test_thread_ranks_take_a_device():
    """device="cpu" is the default spelled out: comm.device says it, the bits are the same."""
    xs = [make_input(r, 12, torch.bfloat16, 5) for r in range(3)]

    def fn(comm):
        return comm.device, ops.reduce_scatter(xs[comm.rank], comm), ops.all_gather(xs[comm.rank][:4], comm)
    default, cpu = launch.run_threads(fn, 3), launch.run_threads(fn, 3, device="cpu")
    for (d0, rs0, ag0), (d1, rs1, ag1) in zip(default, cpu):
        assert d0 == d1 == torch.device("cpu")
        assert_bits_equal(rs0, rs1)
        assert_bits_equal(ag0, ag1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_thread_ranks_on_a_missing_gpu():
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        launch.run_threads(lambda comm: None, 2, device="cuda")


# -----------------------------------------------------------------------------
# 4 and 5 (processes). Functions run by run_processes must be top-level here.

PROC_N = 3
PROC_CASES = [(torch.float32, 7, 11), (torch.bfloat16, 5, 12), (torch.float16, 6, 13), (torch.float32, 1, 14)]


def _fixed_cases(comm, save_dir=None):
    """Every fixed case, on either transport. On processes, the results go to save_dir
    and the world then ends with a ring mismatch that run_processes must report."""
    n, r = comm.world_size, comm.rank
    out = []
    for dtype, chunk, seed in PROC_CASES:
        out.append(_ring_and_native(comm, chunk, dtype, seed, with_all_reduce=True))
    comm.native = False
    f = torch.arange(5.0) if r == 0 else torch.zeros(5)
    b = torch.tensor([True, False, True]) if r == 0 else torch.zeros(3, dtype=torch.bool)
    ops.broadcast(f, comm), ops.broadcast(b, comm)
    out.append((f, b))
    out.append(_headers(comm))
    # a mismatch on the native path is caught by the header check before any payload
    # moves, on every rank, so the world stays usable afterwards.
    comm.native = True
    try:
        if r == 0:
            ops.reduce_scatter(torch.ones(n * 4), comm)
        else:
            ops.all_gather(torch.ones(4), comm)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    comm.native = False
    out.append(ops.all_reduce(torch.ones(n), comm))  # still usable
    if save_dir is None:
        return out
    torch.save(out, os.path.join(save_dir, f"rank{r}.pt"))
    # the ring's mismatch (rank 0 reduce-scatters, the others gather) breaks the world
    if r == 0:
        ops.reduce_scatter(torch.ones(n * 4), comm)
    else:
        ops.all_gather(torch.ones(4), comm)
    return "no error"


def _headers(comm):
    """comm.headers, a Group's (its comm's, read live), and on processes the same after
    check=False (the constructor's name for it): what the engine asks before it starts
    torch's collectives in flight."""
    group = hybrid.Group(comm, [comm.rank])
    seen = [comm.headers, group.headers]
    if isinstance(comm, ops.ProcessComm):
        comm.check = False
        seen += [comm.headers, group.headers, comm.check]
        comm.check = True
    return seen


def _planted(comm):
    ops.all_reduce(torch.ones(4), comm)
    if comm.rank == 1:
        raise KeyError("planted on rank 1")
    return ops.all_reduce(torch.ones(4), comm)  # rank 0 waits on rank 1


def _dies_hard(comm):
    ops.all_reduce(torch.ones(4), comm)
    if comm.rank == 1:
        time.sleep(0.3)
        os._exit(3)
    return ops.all_reduce(torch.ones(4), comm)  # rank 0 waits on rank 1


def test_processes_match_threads(tmp_path):
    err = _expect_failure(lambda: launch.run_processes(_fixed_cases, PROC_N, str(tmp_path)),
                          "mismatched collectives", within=60.0)
    # the ranks part at the ring's mismatch: rank 0, the one that reduce-scatters, is named
    assert str(err).startswith("rank 0 failed: CollectiveMismatch") and "rank 0 went its own way" in str(err)
    procs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(PROC_N)]
    threads = launch.run_threads(_fixed_cases, PROC_N)
    for r in range(PROC_N):
        p, t = procs[r], threads[r]
        for (dtype, chunk, seed), pc, tc in zip(PROC_CASES, p, t):
            xs = [make_input(q, PROC_N * chunk, dtype, seed) for q in range(PROC_N)]
            for a, b in zip(pc[False], tc[False]):  # the ring: same bits, same ledger
                if isinstance(a, torch.Tensor):
                    assert_bits_equal(a, b)
                else:
                    assert a == b
            assert_bits_equal(pc[False][0], ring_reference(xs, r))
            frs, fag, far, far_in_place = pc[True][:4]
            assert_sum_close(frs, xs, r, dtype)
            assert_bits_equal(fag, tc[True][1])
            for c in range(PROC_N):
                assert_sum_close(far.view(PROC_N, -1)[c], xs, c, dtype)
            assert_bits_equal(far_in_place, far)  # out=x: the same sum, in x
            for a, b in zip(pc["in flight"], pc[True][:4]):  # started together (async_op), the same sums
                assert_bits_equal(a, b)
            assert_bits_equal(pc[False][3], pc[False][2])
            assert pc[True][4:] == tc[True][4:] == pc[False][4:]
            assert pc[False][4:] == (expected_ledger(["reduce_scatter"], PROC_N, chunk, dtype),
                                     expected_ledger(["all_gather"], PROC_N, chunk, dtype),
                                     *[expected_ledger(["reduce_scatter", "all_gather"], PROC_N, chunk, dtype)] * 2)
        f, b = p[len(PROC_CASES)]
        assert_bits_equal(f, torch.arange(5.0))
        assert b.dtype == torch.bool and b.tolist() == [True, False, True]
        assert p[len(PROC_CASES) + 1] == [True, True, False, False, False]  # check=True, then False
        assert t[len(PROC_CASES) + 1] == [False, False]  # a thread's message checks itself, free
        assert "mismatched" in p[-2] and "mismatched" in t[-2]
        assert_bits_equal(p[-1], torch.full((PROC_N,), float(PROC_N)))


def test_planted_exception_on_processes():
    _expect_failure(lambda: launch.run_processes(_planted, 2),
                    "rank 1 failed: KeyError", "planted on rank 1")


def test_hard_death_on_processes():
    err = _expect_failure(lambda: launch.run_processes(_dies_hard, 2), "rank 1")
    assert "rank 1 died with exit code 3" in str(err)

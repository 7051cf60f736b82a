"""
Tests of minizero_lib/tree.py: sums whose bits do not depend on the world size.

The references are computed here: tree_sum's shape is read off symbols, and everything else
must equal tree_sum over the leaves bit for bit (compared as integers, so -0.0 is not +0.0).
The key property: G leaves summed on N ranks (A = G/N each, rank r holding leaves r·A ..
r·A+A-1) give the same bits for every power-of-two N, and so does the clipping norm.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import minizero
import ops
from minizero_lib import hybrid, launch, tree
from minizero_lib.flight import OP
from minizero_lib.tree import LeafSum, norm_sq, reduce_scatter_tree, tree_sum

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


# -----------------------------------------------------------------------------
# helpers: inputs whose sums round differently in every order, and bitwise equality

NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def make_input(seed, i, numel, dtype, nans=False):
    """Leaf or rank i's input, from (seed, i) only: randn times powers of two from 2^-8 to 2^8
    (partial sums of different magnitude make the order matter), with some -0.0 and +0.0, and
    with nans=True some NaNs (each with a payload of its own), which must stay where they are.
    A private generator: rank threads share torch's global RNG."""
    g = torch.Generator().manual_seed(seed * 1009 + i)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-8, 9, (numel,), generator=g).double())
    zero = torch.randint(0, 16, (numel,), generator=g)
    x = torch.where(zero == 0, -0.0, torch.where(zero == 1, 0.0, x)).to(dtype)
    if nans:
        nan = torch.tensor(NAN[dtype] | (i % 31 + 1), dtype=INT_VIEW[dtype]).view(dtype)
        x = torch.where(zero == 2, nan, x)
    return x


def same_bits(a, b):
    """The same bits, but for a NaN's payload: NaN in the same places is enough. (torch's CPU
    add in bf16 gives 0xFFFF for a NaN in its vectorized body, 0x7FC0 in its scalar tail: a NaN's
    bits depend on its place in the tensor, which the world size moves.)"""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    ints = [t.masked_fill(t.isnan(), 0).view(INT_VIEW[t.dtype]) for t in (a, b)]
    return torch.equal(*ints)


class Sym:
    """A leaf that records the additions made of it, to read a sum's shape."""

    def __init__(self, text):
        self.text = text

    def __add__(self, other):
        return Sym(f"({self.text}+{other.text})")


# -----------------------------------------------------------------------------
# tree_sum and LeafSum

@pytest.mark.parametrize("n, shape", [(1, "0"), (2, "(0+1)"), (3, "((0+1)+2)"),
                                      (4, "((0+1)+(2+3))"), (6, "(((0+1)+(2+3))+(4+5))"),
                                      (8, "(((0+1)+(2+3))+((4+5)+(6+7)))")])
def test_tree_sum_shape(n, shape):
    assert tree_sum([Sym(str(i)) for i in range(n)]).text == shape


def test_tree_sum_pads_with_minus_zero():
    # -0.0 is the identity: three -0.0 leaves sum to -0.0, which a +0.0 pad would make +0.0.
    z = torch.tensor([-0.0])
    assert same_bits(tree_sum([z, z, z]), z)
    with pytest.raises(ValueError, match="no leaves"):
        tree_sum([])


@pytest.mark.parametrize("dtype", DTYPES)
def test_leaf_sum_is_tree_sum(dtype):
    # Every count, not only powers of two; and leaves kept in fp32 (the reduce dtype) too.
    for reduce in {dtype, torch.float32}:
        for count in range(1, 18):
            leaves = [make_input(count, i, 64, dtype) for i in range(count)]
            acc = LeafSum(reduce)
            for i, leaf in enumerate(leaves):
                acc.push(leaf)
                alive = sum(p is not None for p in acc.partial)
                assert alive == bin(i + 1).count("1") <= (i + 1).bit_length()
            # Pushed leaves are copies: writing into one afterwards changes nothing.
            leaves[0].add_(1.0)
            expect = tree_sum([make_input(count, i, 64, dtype).to(reduce) for i in range(count)])
            assert acc.count == count and same_bits(acc.result(), expect), (reduce, count)


def test_leaf_sum_own_keeps_the_leaf():
    acc, leaf = LeafSum(torch.float32), torch.ones(4)
    acc.push(leaf, own=True)
    assert acc.result().data_ptr() == leaf.data_ptr()  # (no copy)
    with pytest.raises(ValueError, match="before any push"):
        LeafSum().result()


# -----------------------------------------------------------------------------
# reduce_scatter_tree: the balanced tree over ranks, with the ring's bytes

def _scatter(comm, xs):
    """Rank r's reduce_scatter_tree of xs[r], the bytes it booked, and its flight record's op."""
    x = xs[comm.rank].clone()
    out = reduce_scatter_tree(x, comm)
    assert same_bits(x, xs[comm.rank])  # the input is left as it was
    return out, dict(comm.sent), set(comm.sent_to), comm.flight.records[-1][OP]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_reduce_scatter_tree(n, dtype):
    xs = [make_input(n, r, n * 24, dtype, nans=True) for r in range(n)]
    expect = tree_sum(xs).view(n, -1)
    for r, (out, sent, peers, op) in enumerate(launch.run_threads(_scatter, n, xs)):
        assert same_bits(out, expect[r]) and op == "reduce_scatter_tree"
        # The ring's (N-1)/N of x, to the log2 N partners at distance 1, 2, 4, ... only.
        assert sent == ({"reduce_scatter": (n - 1) * 24 * xs[0].element_size()} if n > 1 else {})
        assert peers == {r ^ (1 << k) for k in range(n.bit_length() - 1)}


def test_ring_order_is_not_the_tree():
    # What the tree is for: the ring sums each chunk in another order, so other bits.
    n, dtype = 4, torch.bfloat16
    xs = [make_input(7, r, n * 256, dtype) for r in range(n)]
    ring = launch.run_threads(lambda comm: ops.reduce_scatter(xs[comm.rank], comm), n)
    assert not same_bits(torch.cat(ring), tree_sum(xs))


def test_reduce_scatter_tree_strict_p2p_and_groups():
    # Under NCCL's point-to-point rules each step's exchange meets its partner's.
    n = 8
    xs = [make_input(3, r, n * 4, torch.float32) for r in range(n)]
    outs = launch.run_threads(_scatter, n, xs, strict_p2p=True)
    assert same_bits(torch.cat([o[0] for o in outs]), tree_sum(xs))

    # In a group of 4 consecutive ranks (hybrid sharding's), the tree over the group's ranks.
    def in_group(comm):
        shards, _ = hybrid.split(comm, 4)
        return reduce_scatter_tree(xs[comm.rank][:16].clone(), shards)
    outs = launch.run_threads(in_group, n)
    for g in (0, 4):
        assert same_bits(torch.cat(outs[g:g + 4]), tree_sum([x[:16] for x in xs[g:g + 4]]))


def test_reduce_scatter_tree_errors():
    with pytest.raises(RuntimeError, match="power of two"):
        launch.run_threads(lambda comm: reduce_scatter_tree(torch.ones(6), comm), 3)
    with pytest.raises(RuntimeError, match="multiple of the world size"):
        launch.run_threads(lambda comm: reduce_scatter_tree(torch.ones(6), comm), 4)


def _on_processes(comm):
    xs = [make_input(5, r, comm.world_size * 8, torch.float16) for r in range(comm.world_size)]
    return reduce_scatter_tree(xs[comm.rank], comm), tree_sum(xs).view(comm.world_size, -1)


def test_reduce_scatter_tree_on_gloo():
    # Processes on gloo, with headers: each step is one exchange, as on any transport.
    for r, (out, expect) in enumerate(launch.run_processes(_on_processes, 4)):
        assert same_bits(out, expect[r])


# -----------------------------------------------------------------------------
# the key property: a step's sum is the same bits at every power-of-two world size

def _step(comm, leaves, reduce, every_micro):
    """Rank r's chunk of the step's sum. Reducing once a step: its leaves r·A .. r·A+A-1 in a
    LeafSum, then the tree over ranks. Reducing every micro-batch: leaf j·N + r is its j-th,
    reduced over ranks at once, the shards summed in a LeafSum."""
    n, r = comm.world_size, comm.rank
    a = len(leaves) // n
    acc = LeafSum(reduce)
    if every_micro:
        for j in range(a):
            acc.push(reduce_scatter_tree(leaves[j * n + r].to(reduce), comm), own=True)
        return acc.result()
    for leaf in leaves[r * a:(r + 1) * a]:
        acc.push(leaf)
    return reduce_scatter_tree(acc.result(), comm)


@settings(max_examples=30)
@given(log_g=st.integers(0, 4), dtype=st.sampled_from(DTYPES), fp32_reduce=st.booleans(),
       rows=st.integers(1, 4), seed=st.integers(0, 2**16), data=st.data())
def test_step_sum_is_the_same_at_every_world_size(log_g, dtype, fp32_reduce, rows, seed, data):
    g = 2 ** log_g
    reduce = torch.float32 if fp32_reduce else dtype
    leaves = [make_input(seed, i, 8 * rows, dtype, nans=True) for i in range(g)]
    expect = tree_sum([leaf.to(reduce) for leaf in leaves])
    sizes = [2 ** k for k in range(min(log_g, 3) + 1)]
    for n in (data.draw(st.sampled_from(sizes)), data.draw(st.sampled_from(sizes))):
        for every_micro in (False, True):
            chunks = launch.run_threads(_step, n, leaves, reduce, every_micro)
            assert same_bits(torch.cat(chunks), expect), (n, every_micro)


# -----------------------------------------------------------------------------
# norm_sq: the clipping norm, the same bits at every world size and padding

def _norm(comm, units, n_b):
    """Rank r's norm_sq over its chunk of every unit, padded with zeros to a multiple of N·B."""
    n, r = comm.world_size, comm.rank
    shards = []
    for u in units:
        padded = torch.cat([u, u.new_zeros(-u.numel() % (n * n_b))])
        shards.append(padded.view(n, padded.numel() // n)[r])
    return norm_sq(shards, comm), comm.sent["clip"], [s.numel() for s in shards]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_norm_sq_is_the_same_at_every_world_size(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 400, (6,), generator=g).tolist() + [0]
    units = [make_input(seed, i, m, dtype) for i, m in enumerate(lengths)]
    # The documented tree: each unit's squares in order, then the units.
    expect = tree_sum([tree_sum(list(u.float() * u.float())) if u.numel() else
                       torch.zeros(()) for u in units])
    close = sum((u.double() ** 2).sum() for u in units)
    for n_b in (1, 8):
        for n in (1, 2, 4, 8):
            for out, sent, sizes in launch.run_threads(_norm, n, units, n_b):
                assert out.dtype == torch.float32 and same_bits(out, expect), (n_b, n)
                # One fp32 per whole subtree of 2^t elements, 2^t the largest dividing C.
                assert sent == (n - 1) * sum(c // (c & -c) for c in sizes if c) * 4
                assert sent <= (n - 1) * sum(sizes) // n_b * 4
    assert torch.allclose(expect.double(), close, rtol=1e-5)


# -----------------------------------------------------------------------------
# the engine's reduce_order="tree" (features.py): bad input, and check() across world sizes

def _build(comm, kw):
    """Engine(...) on a small model -> (its error, the bytes this rank sent before it)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    try:
        minizero.Engine(model, comm, 1, **kw)
    except ValueError as e:
        return str(e), dict(comm.sent)
    return None, dict(comm.sent)


@pytest.mark.parametrize("n, kw, says", [
    (2, dict(reduce_order="spiral"), "reduce_order must be 'ring'"),
    (3, dict(reduce_order="tree"), "the world size must be a power of two; got 3"),
    (2, dict(reduce_order="tree", grad_accum=3), "grad_accum must be a power of two; got 3"),
    (4, dict(reduce_order="tree", shard_size=4, grad_accum=2), None),
    (2, dict(reduce_order="tree", reduce_every="micro_batch"), "reduce_every='micro_batch'"),
    (2, dict(reduce_order="tree", native=True), "native=True"),
    (2, dict(reduce_order="tree", quantize_grads=8), "quantize_grads")])
def test_the_trees_bad_input_is_named_before_any_collective(n, kw, says):
    for error, sent in ops.run_threads(_build, n, kw):
        if says is None:
            assert error is None
        else:
            assert says in error and sent == {}, (error, sent)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.head = torch.nn.Linear(6, 11)

    def forward(self, x, y):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return torch.nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())


def _make_model():
    torch.manual_seed(0)
    return _Net()


def _make_batch(step, rank, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, 11, (2, 4), generator=g), torch.randint(0, 11, (2, 4), generator=g)


def test_check_holds_every_world_size_to_the_first(monkeypatch):
    """check(reduce_order="tree") at world sizes 1, 2, 4: the same G leaves each step, and the
    same bits; the ring's reduce-scatter planted in the tree's place (every stage alike, so no
    stage-against-stage finding) is named as world size 4 parting from world size 1 (at two
    ranks the ring is the tree: one add)."""
    kw = dict(world_sizes=(1, 2, 4), steps=2, lr=0.05, clip=0.3, grad_accum=2,
              dtype=torch.bfloat16, reduce_order="tree")
    report = minizero.check(_make_model, _make_batch, **kw)
    assert report.ok and len(report.rows) == 12, report
    monkeypatch.setattr(tree, "reduce_scatter_tree", lambda x, comm, kind="reduce_scatter":
                        ops.reduce_scatter(x, comm, kind=kind))
    first = minizero.check(_make_model, _make_batch, **kw).first
    assert (first.what, first.world_size, first.stage) == ("world sizes", 4, 0), first

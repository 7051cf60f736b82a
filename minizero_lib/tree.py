"""
Sums whose bits do not depend on the world size N: every sum of a step is one balanced binary
tree over the step's micro-batches (its leaves), and only a tree's shape fixes its bits.

Why the ring's bits depend on N: ops.reduce_scatter sums chunk c as the chain c+1, c+2, ..., c,
each add rounded to the dtype, and grad accumulation chains a rank's A micro-batches too. IEEE
addition is commutative (a + b == b + a, exactly) but not associative, so the G = N·A leaves of
a step summed as N chains of A, then one chain over ranks, round differently for every N.

The convention: rank r's j-th micro-batch of a step is leaf r·A + j (A = grad_accum). A rank
sums its A leaves pairwise (LeafSum: ((g0 + g1) + (g2 + g3)) for A = 4), then
reduce_scatter_tree sums the ranks' partials by recursive halving with partners at distance
1, 2, 4, ...: the balanced tree over ranks 0..N-1 in rank order. With N and A powers of two the
two trees make the balanced tree over leaves 0..G-1 at any N: four leaves are
((g0 + g1) + (g2 + g3)) whether one rank holds them all or four ranks hold one each. (Reducing
every micro-batch instead, the convention is leaf j·N + r: reduce_scatter_tree, then LeafSum
over the shards.) tree_sum is the reference; norm_sq is the clipping norm as such a tree.
The same bits, but for a NaN's payload: torch's CPU kernels give a bf16 NaN other bits in the
vectorized body of a tensor than in its tail, and the world size moves where an element sits.

What it costs: log2 N messages per reduce-scatter instead of N-1, each rank sending the same
(N-1)/N of the buffer (half of it in the first message, then a quarter, ...); the chunks a
rank sends are every other row of what it holds, copied into one contiguous message; and up to
log2 A + 1 partial sums alive instead of one accumulated buffer (the pushed leaf's included).

What else a whole training step needs to be the same bits at every N (the engine's part):
- each micro-batch's backward is scaled by the loss scale only, and the mean's 1/G is applied
  once, after the sum: a per-micro-batch 1/A differs with N, and in fp16 it may round into the
  subnormals; so an fp16 overflow happens in the same leaf, or the same node, at any N;
- the data: leaf i is the same micro-batch at every N (the sampler's order);
- the clipping norm is norm_sq's, never (g*g).sum() per shard then added in rank order;
- AdamW is per element, already independent of N given the same grads and state;
- buffers updated in forward (BatchNorm's running stats) are rank 0's, which saw rank 0's
  micro-batches only: they depend on N, and so does whatever reads them.
"""
import torch

from ops import _chunks, _recorded, all_gather


def _power_of_two(n, what):
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two for a balanced tree; got {n}")


def tree_sum(xs):
    """The balanced binary tree over xs in order: pairs (0, 1), (2, 3), ..., then pairs of those.
    Any length: an odd one out passes up a level unchanged, as if xs were padded with -0.0
    leaves to a power of two (-0.0 is IEEE addition's exact identity; +0.0 is not: -0 + +0 = +0)."""
    xs = list(xs)
    if not xs:
        raise ValueError("tree_sum of no leaves")
    while len(xs) > 1:
        pairs = [xs[i] + xs[i + 1] for i in range(0, len(xs) - 1, 2)]
        xs = pairs + xs[-1:] if len(xs) % 2 else pairs
    return xs[0]


def _pairwise(x):
    """tree_sum over x's last dimension, all rows at once: elementwise adds of its even and odd
    halves, each correctly rounded on any device (torch.sum's order is its kernel's choice)."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    # Padded with -0.0 leaves to a power of two, the exact identity, as tree_sum pads.
    pad = (1 << (n - 1).bit_length()) - n
    if pad:
        x = torch.cat([x, x.new_full((*x.shape[:-1], pad), -0.0)], -1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


class LeafSum:
    """A rank's leaves (its micro-batches' grads) summed in the pairwise tree as they arrive: a
    binary counter, whose partial[l] is a subtree of 2^l leaves or None; a push carries equal
    subtrees upwards as binary addition carries bits, so at most log2(count) + 1 are alive.
    result() is tree_sum(leaves) bit for bit, for any count; to be the same bits at every world
    size the count (grad_accum) must be a power of two."""

    def __init__(self, dtype=None):
        self.dtype = dtype  # the reduce dtype: every leaf is kept and summed in it (None: its own)
        self.partial = []   # partial[l]: the sum of the subtree of 2^l leaves, or None
        self.count = 0      # leaves pushed

    def push(self, leaf, own=False):
        """Add a leaf. It is copied (into dtype), unless own=True hands over a leaf that is
        already in dtype: autograd accumulates into a .grad it finds, so a kept .grad would
        change under the sum."""
        carry = leaf.detach().to(self.dtype or leaf.dtype, copy=not own)
        for level, subtree in enumerate(self.partial):
            if subtree is None:
                self.partial[level] = carry
                break
            # Two subtrees of 2^level leaves make one of 2^(level+1), the earlier on the left,
            # in the earlier's memory (a + b is b + a, exactly): log2 A + 1 alive at the most.
            carry = subtree.add_(carry)
            self.partial[level] = None
        else:
            self.partial.append(carry)
        self.count += 1

    def result(self):
        """The tree sum of every leaf pushed: the subtrees, smallest (the latest leaves) first,
        each joined on the left of what follows it, as tree_sum's odd ones out are."""
        subtrees = [s for s in self.partial if s is not None]
        if not subtrees:
            raise ValueError("LeafSum.result() before any push()")
        acc = subtrees[0]
        for s in subtrees[1:]:
            acc = s + acc
        return acc


@_recorded("reduce_scatter_tree")
def reduce_scatter_tree(x, comm, kind="reduce_scatter"):
    """Sum x over ranks; rank r returns chunk r, summed as the balanced binary tree over ranks
    0..N-1 in rank order (N a power of two), in x's dtype rounded at every add as the ring is.
    Each rank sends (N-1)/N of x, as the ring does, in log2 N exchanges. It always runs on the
    exchange: torch's own collectives (comm.native) sum in an order of their own."""
    n, r = comm.world_size, comm.rank
    _power_of_two(n, "the world size")
    held = _chunks(x, n)
    if n == 1:
        return held[0].clone()
    # Before step k, row i of held is the partial sum of chunk (r mod 2^k) + i·2^k over the 2^k
    # ranks whose numbers agree with r above bit k-1. At step k the partner r ^ 2^k holds the
    # same chunks summed over the neighbouring 2^k ranks: each keeps the rows whose chunk has
    # its own bit k (every other row) and sends the others, half of what it holds, so each rank
    # sends x/2, x/4, ..., x/N: (N-1)/N of x in all. After log2 N steps it holds chunk r.
    for k in range(n.bit_length() - 1):
        mine, partner = (r >> k) & 1, r ^ (1 << k)
        # The partner's rows are strided in held: one contiguous message.
        send = held[1 - mine::2].contiguous()
        got = torch.empty_like(send)
        comm.exchange(send, partner, got, partner, kind)
        # Each row joins two subtrees of 2^k ranks, the lower ranks' on the left as in tree_sum
        # (for numbers a + b == b + a: only a NaN's payload could tell).
        keep = held[mine::2]
        held = keep + got if mine == 0 else got + keep
    return held[0]


def norm_sq(shards, comm):
    """The squared L2 norm of a gradient laid out as units, each a flat buffer padded with zeros
    to a multiple of N and cut into N chunks: shards is this rank's chunk r of every unit, in
    unit order, squared in fp32. Returns a 0-d fp32 tensor, the same on every rank, and the same
    bits at any N and any zero padding: the balanced tree over each unit's squares in order
    (padded with zeros to a power of two: x + 0.0 is x for any sum of squares), then the
    balanced tree over the units.

    A chunk of C elements starts at r·C, so it is made of whole subtrees of 2^t elements, 2^t
    the largest power of two dividing C: each rank sums those itself and all-gathers their sums
    (kind "clip"), sending (N-1)·C/2^t·4 bytes per unit. The engine should pad each unit to a
    multiple of N·B in this mode (B = 256, say): then 2^t >= B and a rank sends at most
    (N-1)·C/B·4 bytes per unit. Not for torch.compile: a fused multiply-add rounds once, where
    the square and the add here round once each."""
    squares = [g * g for g in (s.detach().float() for s in shards)]
    # Each chunk as rows of 2^t elements (none for an empty chunk), summed row by row.
    rows = [sq.view(-1, sq.numel() & -sq.numel()) if sq.numel() else sq.view(0, 1)
            for sq in squares]
    mine = [_pairwise(x) for x in rows]
    device = shards[0].device if shards else comm.device
    local = torch.cat(mine) if mine else torch.zeros(0, device=device)
    # Each rank sends (N-1)/N of the gathered subtree sums (one fp32 per 2^t of its elements).
    every = all_gather(local, comm, kind="clip").view(comm.world_size, -1)
    units, at = [], 0
    for x in mine:
        # The unit's subtree sums in order are rank 0's, then rank 1's, ...: its tree goes on.
        units.append(_pairwise(every[:, at:at + x.numel()].reshape(-1)))
        at += x.numel()
    return tree_sum(units) if units else torch.zeros((), device=device)

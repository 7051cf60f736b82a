"""
Quantized communication, ZeRO++'s qwZ and qgZ: what crosses the wire is blockwise integer
codes and one fp32 scale per block, never what the master or the optimizer keep.

    quantize(x, bits, block) -> message    codes and scales of x, as one uint8 tensor
    dequantize(message, bits, block, n)    the n fp32 values it stands for
    gather_params(shard, flat, group, q)   qwZ: stage 3's all-gather of int8 messages
    reduce_scatter(x, comm, bits, block)   qgZ: the reduce-scatter as an all-to-all of int8/int4
                                           messages, summed in fp32 in rank order on the receiver
    reduce_grads, all_reduce_replicas      the two gradient moves (minizero, hybrid), quantized

A block of `block` values is cut at amax = max|x| over the block: code = round(x/amax·Q)
with Q = 127 (int8) or 7 (int4, two codes per byte), and back as code/Q·amax. The scale
is amax itself, so a value equal to ±amax comes back exact (code/Q is 1.0), and with it a
block of one value; a block of zeros has amax 0 and codes 0. Every other value moves by
at most amax/(2Q) (int8: amax/254, int4: amax/14), up to fp32's rounding (DESIGN.md §15).
A piece whose size does not divide the block is padded with zeros to whole blocks: the
padding moves (the ledger and the formula count it), nothing is dropped.

Where nothing moves (a group of one rank) nothing is quantized. The messages travel on
comm.exchange and ops.all_gather on every transport, native or not (torch's all_to_all is
not in ops.py's native table).
"""
from typing import NamedTuple

import torch

from minizero import chunk
from minizero import gather_params as exact_gather_params
from ops import _chunks, _recorded, all_gather

# The largest code per width: symmetric, so -Q..Q (int8 leaves -128 unused).
QMAX = {8: 127, 4: 7}
# Values per scale (DESIGN.md §15): 4 bytes of scale per 256 codes is 1.6% on int8, 3.1% on
# int4, and an outlier widens the step of 255 neighbours only; every unit's shard in the
# demo's GPT is a few blocks or more.
BLOCK = 256


class Quant(NamedTuple):
    """Engine(quantize_weights=, quantize_grads=, quant_block=), checked: bits or None."""
    weights: int = None   # stage 3's parameter all-gather: 8, or None (exact)
    grads: int = None     # the gradient reduce-scatter: 8 or 4, or None (exact)
    block: int = BLOCK    # values per scale


def check_quant(stage, weights, grads, block):
    """The Engine's quantization options -> a Quant; a ValueError naming the fix."""
    if weights not in (None, 8):
        raise ValueError(f"quantize_weights must be 8 (int8 codes) or None; got {weights!r}")
    if weights and stage != 3:
        raise ValueError(f"quantize_weights quantizes stage 3's parameter all-gather, and stage "
                         f"{stage} gathers no parameters before use: use stage=3, or drop it")
    if grads not in (None, 8, 4):
        raise ValueError(f"quantize_grads must be 8 or 4 (int8 or int4 codes) or None; "
                         f"got {grads!r}")
    if type(block) is not int or block < 2 or block % 2:
        raise ValueError(f"quant_block must be an even number of values per scale (int4 packs two "
                         f"codes per byte), like {BLOCK}; got {block!r}")
    return Quant(weights, grads, block)


def packed_bytes(n, bits, block):
    """Bytes of the message for n values: whole blocks of codes, and a 4-byte scale each."""
    blocks = -(-n // block)
    return blocks * (block * bits // 8 + 4)


# -----------------------------------------------------------------------------
# one message: the scales (fp32, as bytes), then the codes (int8, or int4 two per byte)

def quantize(x, bits, block):
    """x (1-D, any float dtype) -> its message, a uint8 tensor of packed_bytes(x.numel())."""
    n, q = x.numel(), QMAX[bits]
    blocks = torch.zeros(-(-n // block) * block, dtype=torch.float32, device=x.device)
    blocks[:n] = x
    blocks = blocks.view(-1, block)
    amax = blocks.abs().amax(1)
    # x/amax is in [-1, 1], exactly ±1 at the block's largest value; a block of zeros: 0/1.
    codes = torch.round(blocks / torch.where(amax > 0, amax, 1.0)[:, None] * q).view(-1)
    if bits == 8:
        codes = codes.to(torch.int8).view(torch.uint8)
    else:
        # int4: code + 8 in 1..15, the even one in the low nibble
        pairs = (codes + 8).to(torch.uint8).view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    return torch.cat([amax.view(torch.uint8), codes])


def dequantize(message, bits, block, n):
    """The n fp32 values a message stands for: code/Q·amax per block (padding cut off)."""
    blocks = -(-n // block)
    amax = message[:4 * blocks].clone().view(torch.float32)
    body = message[4 * blocks:]
    if bits == 8:
        codes = body.view(torch.int8).float()
    else:
        codes = torch.stack([body & 15, body >> 4], 1).view(-1).float() - 8
    return ((codes.view(blocks, block) / QMAX[bits]) * amax[:, None]).view(-1)[:n]


# -----------------------------------------------------------------------------
# the quantized collectives

def gather_params(shard, flat, group, quant):
    """qwZ, stage 3 before a unit's forward and its backward: each rank quantizes its 16-bit
    shard to int8 and the ranks all-gather the messages (each sends (N-1)·packed_bytes(Ψ_u/N),
    about half the exact gather); every rank, the shard's owner too, dequantizes every
    rank's message into its chunk of flat, rounded once to the compute dtype: every rank
    holds the same bits. The shard itself, and the master behind it, stay exact."""
    if group.world_size == 1:
        return exact_gather_params(shard.to(flat.device, non_blocking=True), flat, group)
    n, bits = shard.numel(), quant.weights
    message = quantize(shard.to(flat.device), bits, quant.block)
    # Dequantizing reads the bytes: torch's all-gather, which the engine may start without
    # waiting (ops.started), finishes here.
    unfinished, group.unfinished = group.unfinished, None
    try:
        every = all_gather(message, group, kind="all_gather")
    finally:
        group.unfinished = unfinished
    for r, message in enumerate(every.view(group.world_size, -1)):
        chunk(flat, n, r).copy_(dequantize(message, bits, quant.block, n))
    return flat


@_recorded("all_to_all")
def reduce_scatter(x, comm, bits, block, kind="reduce_scatter"):
    """Sum x over ranks; rank r returns chunk r, in x's dtype. Rank r quantizes chunk c for
    every other rank c and sends it there, one exchange per shift k = 1..N-1 (to r+k, from
    r-k): (N-1)·packed_bytes(|x|/N) bytes. The receiver dequantizes the N-1 it got and sums
    them with its own chunk (exact: it never moved) in fp32, in rank order 0..N-1, then
    rounds once to x's dtype. No partial sum is requantized on the way, so the error is
    each sender's quantization error, once, whatever N: at most the sum over senders s != r
    of amax_s/(2Q) per block (DESIGN.md §15)."""
    n, r = comm.world_size, comm.rank
    chunks = _chunks(x, n)
    if n == 1:
        return chunks[0].clone()
    size = chunks.shape[1]
    got = [None] * n
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        message = quantize(chunks[dst], bits, block)
        # (every message has the same size: every chunk has `size` values)
        got[src] = torch.empty_like(message)
        comm.exchange(message, dst, got[src], src, kind)
    total = torch.zeros(size, dtype=torch.float32, device=x.device)
    for s in range(n):
        total += chunks[r].float() if s == r else dequantize(got[s], bits, block, size)
    return total.to(x.dtype)


def reduce_grads(bucket, reduced, group, quant):
    """stages.reduce_grads with the quantized reduce-scatter: every micro-batch, this rank's
    shard of the sum, added to what earlier micro-batches reduced (in the reduce dtype)."""
    shard = reduce_scatter(bucket, group, quant.grads, quant.block, kind="reduce_scatter")
    return shard if reduced is None else reduced + shard


def all_reduce_replicas(reduced, replicas, quant):
    """Hybrid, after a step's last micro-batch (inside the shard group first, then across
    the R copies): the reduced shard's quantized reduce-scatter across the replicas, then
    an exact all-gather of the summed pieces, so every copy holds the same bits; both
    halves booked as "all_reduce", (R-1)·(packed_bytes(Ψ_u/(SR)) + Ψ_u/(SR) values)."""
    piece = reduce_scatter(reduced, replicas, quant.grads, quant.block, kind="all_reduce")
    return all_gather(piece, replicas, kind="all_reduce")

"""
The stage functions of minizero.py, called directly on explicit shard tensors: no Engine,
no model, no hooks. Each rank of a thread world holds a padded flat buffer and a local
gradient; the test runs what each stage does at its sync points and checks it against
the ZeRO table: what every rank holds afterwards, and the bytes it sent, to which peer.
Hybrid sharding (S < N) cuts over a shard group of S ranks and all-reduces across the
N/S replicas: read N as S in the table, plus the all-reduce.
"""
import pytest
import torch

import minizero as mz
from minizero_lib import formulas, hybrid, launch

torch.set_num_threads(1)
LR, WD = 0.05, 0.1


def pieces(lo, hi, numel, t=1):
    """What minizero.runs gives for one AdamW parameter of numel elements: its part of [lo, hi)."""
    layout = mz.state_layout([0], [(numel,)], ["adamw"], [{"m": None, "v": None}], lo, hi)[0]
    return [(p, t, WD) for p in layout]


def rank_world(comm, numel, dtype, S):
    N = comm.world_size
    shards, replicas = hybrid.split(comm, S)
    r = shards.rank  # this rank's chunk
    padded = -(-numel // N) * N
    s = padded // S
    g = torch.Generator().manual_seed(7)
    params = torch.zeros(padded, dtype=dtype)
    params[:numel] = torch.randn(numel, generator=g).to(dtype)       # the same on every rank
    g.manual_seed(100 + r)
    local = torch.zeros(padded, dtype=dtype)
    local[:numel] = torch.randn(numel, generator=g).to(dtype)        # this rank's own gradient
    hp = mz.Hyper(LR, WD, {"betas": (0.9, 0.999), "eps": 1e-8}, 1.0 / N, None)
    master = (lambda x: x if dtype == torch.float32 else x.float())  # fp32 needs no separate master
    out, sent = {}, {}

    def ledger(key, fn):  # what fn sent, by kind and by peer
        before, before_to = dict(comm.sent), dict(comm.sent_to)
        result = fn()
        sent[key] = {k: v - before.get(k, 0) for k, v in comm.sent.items() if v != before.get(k, 0)}
        sent[key, "to"] = {k: v - before_to.get(k, 0) for k, v in comm.sent_to.items() if v != before_to.get(k, 0)}
        return result

    def reduce():  # every stage: reduce-scatter in the group; hybrid: then across the copies
        red = mz.reduce_grads(local, None, shards)
        return hybrid.all_reduce_replicas(red, replicas) if replicas.world_size > 1 else red

    def ddp_reduce():  # stage 0 also all-gathers the sum: DDP's all-reduce, in two halves
        red = reduce()
        return red, mz.ddp_gather_grads(red, shards)

    # stage 0 (DDP): all-reduce = reduce-scatter + all-gather; everyone updates everything
    flat0 = params.clone()
    m0, v0, p0 = torch.zeros(padded), torch.zeros(padded), master(flat0)
    red0, full = ledger("ddp_reduce", ddp_reduce)
    mz.ddp_update(flat0, p0, {"m": m0, "v": v0}, full, pieces(0, padded, numel), hp)
    out[0] = dict(flat=flat0, m=m0, v=v0, reduced=red0)

    # stages 1-2: reduce-scatter, update my chunk (1/N of m and v), all-gather the params
    flat1 = params.clone()
    p1 = master(flat1.view(S, s)[r]) if dtype == torch.float32 else flat1.view(S, s)[r].float()
    m1, v1 = torch.zeros(s), torch.zeros(s)
    red1 = ledger("reduce_grads", reduce)
    ledger("zero_update_12", lambda: mz.zero_update(p1, {"m": m1, "v": v1}, red1, pieces(r * s, (r + 1) * s, numel), hp,
                                                    shards, flat1, None))
    out[1] = dict(flat=flat1, m=m1, v=v1, reduced=red1, master=p1)

    # stage 3: only a 16-bit shard is kept; gather it for use, release it after
    shard = params.view(S, s)[r].clone()
    p3 = master(shard)
    m3, v3 = torch.zeros(s), torch.zeros(s)
    flat3 = torch.empty(padded, dtype=dtype)
    gathered = ledger("gather_params", lambda: mz.gather_params(shard, flat3, shards).clone())
    mz.release_params(flat3)
    red3 = reduce()
    ledger("zero_update_3", lambda: mz.zero_update(p3, {"m": m3, "v": v3}, red3, pieces(r * s, (r + 1) * s, numel), hp,
                                                   shards, flat3, shard))
    out[3] = dict(shard=shard, m=m3, v=v3, reduced=red3, gathered=gathered,
                  released=flat3.untyped_storage().nbytes())
    return out, sent, params


@pytest.mark.parametrize("N, S", [(1, 1), (2, 2), (3, 3), (5, 5), (4, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("numel", [1, 7, 16])  # smaller than, not divisible by, divisible by N
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_functions_hold_and_send_what_the_table_says(N, S, numel, dtype):
    ranks = launch.run_threads(rank_world, N, numel, dtype, S)
    R, s = N // S, -(-numel // N) * N // S
    item = torch.empty((), dtype=dtype).element_size()
    one = (S - 1) * s * item  # one ring collective over Ψ in the group: each rank sends (S-1)/S·Ψ
    across = {"all_reduce": 2 * (R - 1) * (s // R) * item} if R > 1 else {}  # the replicas' all-reduce of Ψ/S
    ddp = ranks[0][0][0]
    for rank, (out, sent, params) in enumerate(ranks):
        r, right, replica = rank % S, rank - rank % S + (rank + 1) % S, (rank + S) % N
        # the reduced gradient shard is the same bits whichever stage asked for it
        assert torch.equal(out[0]["reduced"], out[1]["reduced"]) and torch.equal(out[1]["reduced"], out[3]["reduced"])
        # every rank of DDP ends with the same whole buffer, and full-size optimizer state
        assert torch.equal(out[0]["flat"], ddp["flat"]) and out[0]["m"].numel() == S * s
        # stages 1-2: whole params, bit-identical to DDP's; m and v are this rank's 1/S
        assert torch.equal(out[1]["flat"], ddp["flat"])
        assert out[1]["m"].numel() == s and torch.equal(out[1]["m"], ddp["m"].view(S, s)[r])
        assert torch.equal(out[1]["v"], ddp["v"].view(S, s)[r])
        # stage 3: only the shard, DDP's chunk r; the gathered buffer was the full params, then freed
        assert torch.equal(out[3]["shard"], ddp["flat"].view(S, s)[r])
        assert torch.equal(out[3]["gathered"], params) and out[3]["released"] == 0
        assert torch.equal(out[3]["m"], ddp["m"].view(S, s)[r])
        # bytes: the table's column, collective by collective, and to whom: the group's ring
        # sends to the next rank of the group, the replicas' ring to the same place one group on
        if N == 1:
            assert all(v == {} for v in sent.values())
            continue
        ring = lambda b: {right: b} if b else {}  # noqa: E731
        assert sent["ddp_reduce"] == {k: v for k, v in {"reduce_scatter": one, "all_gather": one, **across}.items() if v}
        assert sent["reduce_grads"] == {k: v for k, v in {"reduce_scatter": one, **across}.items() if v}
        assert sent["reduce_grads", "to"] == {**ring(one), **({replica: across["all_reduce"]} if across else {})}
        assert sent["zero_update_12"] == ({"all_gather": one} if one else {})   # 2Ψ in all
        assert sent["gather_params"] == ({"all_gather": one} if one else {})    # x2 per step: 3Ψ
        assert sent["gather_params", "to"] == ring(one)
        assert sent["zero_update_3"] == {}                                     # nothing


def test_sharded_names_what_each_stage_cuts():
    assert [mz.sharded(s) for s in range(4)] == [
        {"optimizer": False, "grads": False, "params": False},
        {"optimizer": True, "grads": False, "params": False},
        {"optimizer": True, "grads": True, "params": False},
        {"optimizer": True, "grads": True, "params": True}]
    # the table for Ψ = 4 parameters at N = 4, bf16 (2 + 2 + 12 bytes each): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
    assert [sum(formulas.model_state_bytes(4, 4, s).values()) for s in range(4)] == [64, 8 + 8 + 12, 8 + 2 + 12, 2 + 2 + 12]

"""
Hybrid sharding, Engine(shard_size=S) (FSDP2's HSDP): each unit is sharded over groups of
S consecutive ranks and copied across the R = N/S groups. Proven as the flat engine is:
at one S, stages 1-3 give stage 0's bits on every rank, and stage 0 at S is what torch
computes (the check's referee; torch's DDP on gloo). Then what silently goes wrong
with a 2-D mesh (a clipping norm over the wrong group, replicas that never all-reduce)
is shown caught; the ledger by peer is held to the bytes formulas inside and across
nodes; checkpoints move between any (N, S) and stage.
"""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minizero
from minizero_lib import check, cli, hybrid, launch, planner
from test_checkpoint import case, logical, train
from test_equivalence import FIXED, Net, assert_same, cases, make, on_gloo, run_check

torch.set_num_threads(1)
PAIRS = [(n, s) for n in range(1, 9) for s in range(1, n + 1) if n % s == 0]  # (N, S): S divides N


@st.composite
def hybrid_cases(draw):
    """test_equivalence's drawn models (uneven widths, ties, frozen layers, dtypes,
    accumulation, clipping, delays, disk offload), on a drawn (N, S)."""
    c = draw(cases())
    c["world_size"], c["engine"]["shard_size"] = draw(st.sampled_from(PAIRS))
    return c


@settings(max_examples=max(1, settings.default.max_examples // 16))  # N up to 8: a few costly examples
@given(hybrid_cases())
def test_every_stage_at_a_shard_size_is_stage_0s_bits_and_stage_0_is_torch(c):
    report = run_check(c)
    assert report.ok, f"\n{report}"
    assert len(report.rows) >= 3 and report.rows[0].referee is not None  # (stages 0-2 for a tie across units)


def test_shard_size_of_the_whole_world_is_plain_zero():
    """S = N takes today's path: the shard group is the world itself, nothing is copied."""
    def body(comm):
        shards, replicas = hybrid.split(comm, comm.world_size)
        return shards is comm and replicas.world_size == 1
    assert all(launch.run_threads(body, 3))


def test_a_shard_size_that_does_not_divide_the_world():
    with pytest.raises(RuntimeError, match=r"shard_size must divide the world size 6 .* use one of \[1, 2, 3, 6\]"):
        launch.run_threads(lambda comm: minizero.Engine(Net(3, [2, 2]), comm, 1, shard_size=4), 6)
    with pytest.raises(ValueError, match=r"shard_size=2 must divide every world size.*world_sizes=\(2, 4\)"):
        minizero.check(lambda: Net(3, [2, 2]), lambda s, r, m: None, world_sizes=(1, 2), shard_size=2)


# -----------------------------------------------------------------------------
# the silent bugs of a 2-D mesh, planted: the check names them

BUG = dict(FIXED[0], world_size=4)
BUG["engine"] = dict(FIXED[0]["engine"], shard_size=2)


def test_a_clipping_norm_summed_over_the_replicas_too(monkeypatch):
    """Every stage makes the same mistake, so only the referee (torch's clip_grad_norm_)
    can see it: the norm counts each element R times."""
    real = minizero.clip_coef
    monkeypatch.setattr(minizero, "clip_coef", lambda g, max_norm, shards: real(g, max_norm, shards.comm))
    report = run_check(BUG, stages=(0,))
    assert report.first.what == "referee-update", f"\n{report}"


def test_replicas_that_never_all_reduce(monkeypatch):
    """An (n, 1) mesh's bug: each group trains on its own ranks' gradients only."""
    alone = lambda replicas: hybrid.Group(replicas.comm, [replicas.comm.rank])  # noqa: E731
    real = hybrid.all_reduce_replicas
    monkeypatch.setattr(hybrid, "all_reduce_replicas", lambda reduced, replicas: real(reduced, alone(replicas)))
    report = run_check(BUG, stages=(0, 3))
    assert report.rows[1].first is not None and not report.rows[1].bytes_ok, f"\n{report}"
    assert report.rows[1].first.what in ("grads", "bytes", "ranks"), f"\n{report}"


def test_native_collectives_in_groups_on_threads():
    """torch's own order (threads: rank order, in shared memory) inside each group and
    across: still the same bits in every stage, and torch's answer at stage 0."""
    report = run_check(BUG, native=True)
    assert report.ok, f"\n{report}"


def test_gathered_params_are_whole_and_writable_on_every_copy():
    def body(comm):
        model, _ = make(BUG)
        e = minizero.Engine(model, comm, 3, shard_size=2)
        with e.gathered(writable=True):
            whole = model.head.weight.clone()
            if comm.rank == 0:
                model.head.weight.data.fill_(comm.rank + 2.0)
        return whole, e.full_state_dict()["head.weight"]
    ranks = launch.run_threads(body, 4)
    for whole, after in ranks:
        assert torch.equal(whole, make(BUG)[0].head.weight.detach()) and bool((after == 2.0).all())


# -----------------------------------------------------------------------------
# the ledger by peer: bytes inside a node and across nodes, against the formula


def one_step(comm, stage, c):
    model, batches = make(c)
    e = minizero.Engine(model, comm, stage, **c["engine"])
    sent, to = dict(comm.sent), dict(comm.sent_to)
    for micro in batches[0]:
        e.backward(model(*micro[comm.rank]))
    e.step()
    flags = comm.sent["flags"] - sent.get("flags", 0)  # the step's one small collective, over the world
    to = {peer: b - to.get(peer, 0) for peer, b in comm.sent_to.items() if b != to.get(peer, 0)}
    to[(comm.rank + 1) % comm.world_size] -= flags
    return {peer: b for peer, b in to.items() if b}, e.numel()


@pytest.mark.parametrize("N, S, node", [(4, 2, 2), (4, 4, 2), (6, 3, 3), (6, 2, 3), (8, 2, 4), (4, 1, 2)])
def test_bytes_inside_and_across_nodes_are_the_formulas(N, S, node):
    c = dict(FIXED[1], world_size=N, grad_accum=2)
    c["engine"] = dict(FIXED[1]["engine"], clip=None, grad_accum=2, shard_size=S)
    for stage in range(4):
        ranks = launch.run_threads(one_step, N, stage, c)
        numel = ranks[0][1]
        intra, inter = [], []  # per node: what its ranks sent inside it and to other nodes
        for first in range(0, N, node):
            sent = [(r, peer, b) for r in range(first, first + node) for peer, b in ranks[r][0].items()]
            intra.append(sum(b for r, peer, b in sent if peer // node == r // node))
            inter.append(sum(b for r, peer, b in sent if peer // node != r // node))
        busiest = max(sum(b for peer, b in to.items() if peer // node != r // node) for r, (to, _) in enumerate(ranks))
        expect = planner.link_bytes_per_step(numel, N, stage, node, c["dtype"], 2, None, S)
        assert {"intra": max(intra), "inter": max(inter), "busiest": busiest} == expect, stage


# -----------------------------------------------------------------------------
# checkpoints: any (N, S) and stage to any other


@pytest.mark.parametrize("saved_at, loaded_at", [((4, 2, 3), (2, 1, 1)), ((4, 2, 0), (3, 3, 2)),
                                                 ((6, 3, 2), (4, 2, 3)), ((2, 1, 1), (4, 2, 0))])
def test_checkpoints_move_between_meshes(tmp_path, saved_at, loaded_at):
    """Saved at (N, S, stage), loaded at (N', S', stage'): the loaded state is the saved one
    (saved again at once, it reads back the same), and stage' trains on as stage 0 does."""
    (n, s, stage), (n2, s2, stage2) = saved_at, loaded_at
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    c = case("bf16", steps=2, world_size=max(n, n2))
    model, batches = make(c)
    kw = lambda S: dict(c["engine"], shard_size=S)  # noqa: E731
    saved = launch.run_threads(train, n, stage, model, batches, kw(s), 1, None, first)[0][-1]

    def reload(comm):
        e = minizero.Engine(copy.deepcopy(model), comm, stage2, **kw(s2))
        e.load_checkpoint(first)
        state = e.full_state_dict()
        e.save_checkpoint(second)
        return state
    for state in launch.run_threads(reload, n2):
        assert_same(state, saved)
    a, b = logical(first), logical(second)
    assert a.keys() == b.keys() and all(assert_same(a[k], b[k]) is None for k in a)
    go = {t: launch.run_threads(train, n2, t, model, batches, kw(s2), None, True, first) for t in {0, stage2}}
    for x, y in zip(go[stage2][-1], go[0][0]):
        assert_same(x, y)


# -----------------------------------------------------------------------------
# real processes: the same bits as threads, and torch's process groups on the native path
# (stage 0 at S against torch: the check's referee, above)


def gloo_world(comm):
    torch.set_num_threads(1)
    spec = _spec(BUG)
    ring = [check.rank_run(comm, s, spec) for s in (0, 3)]
    # reduce-scatter and all-gather in each group, all-reduce across: on torch's process groups
    native = [check.rank_run(comm, s, _spec(BUG, native=True)) for s in (0, 3)]
    # and while the world is up, plain ZeRO on torch's collectives without headers (as on NCCL):
    # micro-batch 0's start without waiting (ops.started, gloo's async works), micro-batch 1's add to
    # the sum on the thread; overlap=False waits each
    comm.check = False
    started = [check.rank_run(comm, s, _spec(BUG, native=True, shard_size=None, overlap=o)) for s, o in
              ((0, True), (3, True), (0, False))]
    return ring, native, started


def _spec(c, **kw):
    model, batches = make(c)
    return dict(model=model, make_batch=lambda step, rank, micro: batches[step][micro][rank],
                loss_fn=check.default_loss, steps=c["steps"], jitter=False, engine_kw=dict(c["engine"], **kw))


@on_gloo
def test_processes_at_a_shard_size():
    results = launch.run_processes(gloo_world, 4)
    threads = [launch.run_threads(check.rank_run, 4, s, _spec(BUG)) for s in (0, 3)]
    for rank, (ring, native, started) in enumerate(results):
        for i in range(2):
            for a, b in zip(ring[i].history, threads[i][rank].history):
                assert_same(a.state, b.state)
        for a, b in zip(native[0].history, native[1].history):  # torch's order, the same in both stages
            assert_same(a.state, b.state)
        for run in started[1:]:
            for a, b in zip(started[0].history, run.history):
                assert_same(a.state, b.state)


# -----------------------------------------------------------------------------
# the planner: the ring model by hand on a small machine, and its command line


def test_ring_model_by_hand():
    """4 ranks on 2 nodes of 2, Ψ = 4000 bf16, 1 unit, 1 s per hop, 100 B/s inside a node, 10 across."""
    links = planner.Links(intra=100.0, inter=10.0, latency=1.0)
    # hybrid 2x2: reduce-scatter and all-gather of Ψ inside a node, 2000 elements = 4000 B each at
    # 100 B/s, 1 hop each; the all-reduce of Ψ/2 between the nodes, 4000 B at 10 B/s, 2 hops
    assert planner.ring_seconds(4000, 4, 0, 2, 2, links, 1) == (40 + 40 + 400, 1 + 1 + 2)
    # flat: one ring over both nodes, as slow as its slowest hop: 6000 B twice at 10 B/s, 3 hops each
    assert planner.ring_seconds(4000, 4, 0, 2, 4, links, 1) == (1200, 6)
    # stage 3 gathers twice per micro-batch: 3 collectives inside the node, per unit (5 units)
    assert planner.ring_seconds(4000, 4, 3, 2, 2, links, 5) == (40 * 3 + 400, 5 * 3 + 5 * 2)


def test_planner_at_1024_gpus(capsys):
    cli.main("--params 7.5e9 --world-size 1024 --gpus-per-node 8".split())
    rows = {tuple(line.split()[:2]): line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[1:2] in (["flat"], ["hybrid"])}
    flat, hybrid = rows["3", "flat"][2:], rows["3", "hybrid"][3:]  # (hybrid's name is two words: "hybrid 8x128")
    psi = 7.5e9 * 2 / 1e9  # GB of bf16 params
    assert float(hybrid[3]) == round(2 * 127 / 128 * psi / 8, 2)  # a rank's share of the all-reduce: all that leaves
    assert float(flat[3]) == round(3 * 1023 / 1024 * psi, 2)  # one rank per node sends its 3Ψ across
    assert float(hybrid[0]) == 7.5e9 * 16 / 8 / 1e9  # 16 bytes per parameter over 8 ranks
    assert float(hybrid[4]) < float(flat[4])  # less time per step


def test_planner_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main("--params 7.5e9 --world-size 1024 --gpus-per-node 8 --shard-size 3".split())
    assert e.value.code == 2 and "--shard-size 3 must divide the world size 1024" in capsys.readouterr().err

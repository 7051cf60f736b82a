"""
Fewer bytes per step: reduce_every="step" (each rank sums its micro-batches, one reduction per
step, as DDP under no_sync) and stage 3's reshard_after_forward (False: a unit stays gathered
from its forward to its backward; G: ZeRO++ hpZ's secondary shard, the backward gathered among
G ranks). Measured against the formulas to the byte, against each other's bits, hpZ's gathers
inside their group, the planner, the demo's flags, and bad input. check() and the property
(test_equivalence.py) hold the modes to stage 0 and torch on drawn models too.
"""
import copy
import re

import pytest
import torch

import minizero
import train_gpt as tg
from minizero_lib import cli, launch
from minizero_lib.ds_config import parse_ds_config
from minizero_lib.report import SENT_KINDS
from test_equivalence import FIXED, make

N, K = 4, 4  # ranks, micro-batches per step
# (stage, reduce_every, reshard_after_forward): every stage in both reductions, stage 3's others
MODES = [(s, every, True) for every in ("micro_batch", "step") for s in range(4)] + \
        [(3, every, rf) for rf in (False, 2) for every in ("micro_batch", "step")]


def run_modes(comm, modes=MODES, steps=2):
    """One rank: each mode of `modes` for `steps` steps of the fixed model -> {mode: the
    bytes its last step sent by kind, the formula's, memory() after a forward, after a
    backward and at the update, the formula's, what a forward kept, the state after}."""
    c = dict(FIXED[0], world_size=comm.world_size, grad_accum=K, steps=steps)
    model, batches = make(c)
    out = {}
    for stage, every, rf in modes:
        m = copy.deepcopy(model)
        e = minizero.Engine(m, comm, stage, **dict(c["engine"], grad_accum=K, reduce_every=every,
                                                     reshard_after_forward=rf))
        memory, kept = [], set()
        for step in range(steps):
            before = dict(comm.sent)
            for micro in range(K):
                loss = m(*batches[step][micro][comm.rank])
                memory.append(e.memory())  # between forward and backward: all a mode keeps
                kept |= {(u.flat.untyped_storage().nbytes() // u.flat.element_size(),
                          None if u.index not in getattr(e, "secondary", {})
                          else e.secondary[u.index].numel() * G(rf))
                         for u in e.units} if stage == 3 else set()
                e.backward(loss)
                memory.append(e.memory())  # between micro-batches: reduce_every="step"'s bucket
            memory.append(e.memory())
            e.step()
        sent = {k: comm.sent[k] - before.get(k, 0) for k in SENT_KINDS}
        sent = {k: b for k, b in sent.items() if b}
        padded = [u.padded for u in e.units]
        out[stage, every, rf] = dict(sent=sent, sent_formula=e.formula(sent=True), memory=memory,
                                     memory_formula=e.formula(), kept=kept, padded=padded,
                                     state=e.full_state_dict())
        e.close()
    return out


def G(rf):
    return rf if type(rf) is int else 1


@pytest.fixture(scope="module")
def ranks():
    return launch.run_threads(run_modes, N)


def test_bytes_and_memory_are_the_formulas_in_every_mode(ranks):
    for rank in ranks:
        for mode, r in rank.items():
            assert r["sent"] == r["sent_formula"], mode
            assert all(m == r["memory_formula"] for m in r["memory"]), mode


def test_one_reduction_per_step_sends_one_micro_batch_of_gradients(ranks):
    """At any grad_accum, "step" reduce-scatters 1/K of "micro_batch"'s gradient bytes; the
    gathers are the same. Stages 2-3 keep a whole bucket per unit for it: +Ψ in memory."""
    r = ranks[0]
    for stage in range(4):
        micro, step = r[stage, "micro_batch", True], r[stage, "step", True]
        assert step["sent"]["reduce_scatter"] * K == micro["sent"]["reduce_scatter"] > 0
        assert step["sent"]["all_gather"] == micro["sent"]["all_gather"]
        extra = step["memory_formula"]["grads"] - micro["memory_formula"]["grads"]
        assert extra == (sum(r[0, "step", True]["padded"]) * 4 if stage >= 2 else 0), stage


def test_reshard_after_forward_gathers_once_or_inside_the_group(ranks):
    r = ranks[0]
    for every in ("micro_batch", "step"):
        true, false, hpz = (r[3, every, rf]["sent"] for rf in (True, False, 2))
        assert false["all_gather"] * 2 == true["all_gather"] == hpz["all_gather"] * 2
        # the backward's gather among 2 ranks: (G-1)/G of Ψ against the forward's (N-1)/N
        assert hpz["hpz_gather"] * 3 == hpz["all_gather"] * 2
        assert "hpz_gather" not in true and "hpz_gather" not in false


def test_what_a_forward_keeps(ranks):
    """After forward: True keeps nothing gathered, False every unit whole, G a secondary shard
    of Ψ_u/G (kept holds (gathered elements, secondary elements · G) per unit)."""
    r = ranks[0]
    assert {g for g, s in r[3, "step", True]["kept"]} == {0}
    assert {s for g, s in r[3, "step", True]["kept"]} == {None}
    assert {g for g, s in r[3, "step", False]["kept"]} == set(r[3, "step", False]["padded"])
    assert {s for g, s in r[3, "step", 2]["kept"]} == set(r[3, "step", 2]["padded"])


def test_every_stage_and_reshard_the_same_bits(ranks):
    for rank in ranks:
        for (stage, every, rf), r in rank.items():
            ref = rank[0, every, True]["state"]
            assert all(torch.equal(r["state"][k], ref[k]) for k in ref), (stage, every, rf)
    # (the two reductions sum in other orders: both are held to torch by check(), not to each other)


def test_hpz_backward_gather_stays_inside_its_group():
    """reshard_after_forward=2 on 4 ranks: in a backward that reduces nothing (reduce_every=
    "step", not the last micro-batch) every byte a rank sends goes to its partner in its
    group of 2 consecutive ranks, as kind hpz_gather."""
    def body(comm):
        c = dict(FIXED[0], world_size=N, grad_accum=2)
        model, batches = make(c)
        e = minizero.Engine(model, comm, 3, **dict(c["engine"], grad_accum=2, reduce_every="step",
                                                   reshard_after_forward=2))
        loss = model(*batches[0][0][comm.rank])
        to, kinds = dict(comm.sent_to), dict(comm.sent)
        e.backward(loss)
        moved = {p: b - to.get(p, 0) for p, b in comm.sent_to.items() if b != to.get(p, 0)}
        kinds = {k: b - kinds.get(k, 0) for k, b in comm.sent.items() if b != kinds.get(k, 0)}
        e.close()
        return moved, kinds
    for rank, (moved, kinds) in enumerate(launch.run_threads(body, N)):
        assert list(moved) == [rank ^ 1] and list(kinds) == ["hpz_gather"], (rank, moved, kinds)
        assert moved[rank ^ 1] == kinds["hpz_gather"] > 0


@pytest.mark.parametrize("kw, match", [
    (dict(reduce_every="never"), 'reduce_every must be "micro_batch"'),
    (dict(reshard_after_forward=False, stage=2), "is for stage 3"),
    (dict(reshard_after_forward=3), r"use one of \[2\]"),
    (dict(reshard_after_forward=4), r"use one of \[2\]"),
    (dict(reshard_after_forward=2, shard_size=2), "True or False, as no such G"),
    (dict(reshard_after_forward="yes"), "must be True, False or a number of ranks")])
def test_bad_modes_are_named_before_any_collective(kw, match):
    def body(comm):
        kw2 = dict(kw)
        try:
            minizero.Engine(make(dict(FIXED[0], world_size=N))[0], comm, kw2.pop("stage", 3), **kw2)
        except ValueError as e:
            return str(e), sum(comm.sent.values())
    for message, sent in launch.run_threads(body, N):
        assert sent == 0
        assert re.search(match, message), message


def test_check_takes_the_modes_and_refuses_a_g_that_cannot_divide():
    c = dict(FIXED[0], world_size=4, grad_accum=2)
    model, batches = make(c)
    kw = dict(c["engine"], grad_accum=2, reduce_every="step", reshard_after_forward=2)
    report = minizero.check(lambda: model, lambda s, r, m: batches[s][m][r], world_sizes=(4,),
                            steps=2, **kw)
    assert report.ok and len(report.rows) == 4 and report.rows[0].refereed == 2, f"\n{report}"
    with pytest.raises(ValueError, match="reshard_after_forward=2 must divide every shard group"):
        minizero.check(lambda: model, lambda s, r, m: batches[s][m][r], world_sizes=(2, 4), **kw)


def test_planner_shows_each_mode(capsys):
    cli.main("--params 7.5e9 --world-size 1024 --gpus-per-node 8 --grad-accum 16".split())
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        w = line.split()
        if len(w) > 8 and w[0].isdigit() and w[1] in ("micro_batch", "step"):
            # memory, inside, across a node, across a rank, seconds (then "(bw + latency)")
            rows[w[0], w[1], w[2], w[3]] = [float(x) for x in w[-8:-3]]
    assert len(rows) == 22
    across = {k: v[2] for k, v in rows.items()}  # GB a node sends to other nodes per step
    psi = 7.5e9 * 2 / 1e9  # GB of bf16 params (and gradients)
    # flat stage 0: DDP's all-reduce, 16 times (micro_batch) or once (step)
    assert across["0", "micro_batch", "-", "flat"] == round((16 + 1) * 1023 / 1024 * psi, 2)
    assert across["0", "step", "-", "flat"] == round(2 * 1023 / 1024 * psi, 2)
    # hpZ over a node: the backward's gathers stay inside it; False drops them altogether
    hpz, false, true = (across["3", "step", *rf] for rf in (("hpZ", "8"), ("False", "flat"),
                                                            ("True", "flat")))
    assert hpz == false < true
    # the shard and the secondary shard, the reduced shard and the whole bucket, AdamW's 12 bytes
    assert rows["3", "step", "hpZ", "8"][0] == round(psi / 1024 + psi / 8 + psi / 1024 + psi
                                                     + 12 * 7.5e9 / 1024 / 1e9, 2)
    # hybrid already reduces across nodes once per step: "step" saves inside the node only
    hybrid = [k for k in rows if k[3] == "hybrid" and k[0] == "1"]
    assert len(hybrid) == 2 and {across[k] for k in hybrid} == {round(2 * 127 / 128 * psi, 2)}


def test_demo_flags_and_the_ds_key():
    flags = "--reduce-every step --reshard-after-forward false".split()
    cfg = tg.check_config(tg.parse_args(flags))
    assert (cfg["reduce_every"], tg.reshard_arg(cfg["reshard_after_forward"])) == ("step", False)
    assert tg.parse_args(["--preset", "gpt2"])["reduce_every"] == "step"  # as a DDP user expects
    given = tg.parse_args("--preset gpt2 --reduce-every micro_batch".split())
    assert given["reduce_every"] == "micro_batch"
    def hpz(g):
        return parse_ds_config({"zero_optimization": {"zero_hpz_partition_size": g}})
    assert hpz(8) == {"reshard_after_forward": 8} and hpz(1) == {"reshard_after_forward": "true"}
    with pytest.raises(ValueError, match="must be true, false or a number of ranks"):
        tg.check_config(tg.parse_args(["--reshard-after-forward", "maybe"]))
    with pytest.raises(ValueError, match="is for stage 3"):
        tg.check_config(tg.parse_args("--reshard-after-forward 2 --stage 1 --world-size 4".split()))

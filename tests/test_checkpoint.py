"""
Checkpoints: resume is bit-identical to never stopping; a checkpoint loads at another
world size and stage; consolidation gives a plain state_dict; bad files fail loudly,
and a save that dies half-way leaves the previous checkpoint whole.
"""
import copy
import errno
import json
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero_lib import cli
from minizero_lib import checkpoint
from minizero_lib import launch
import minizero
from test_equivalence import DTYPES, FIXED, Net, assert_same, make

torch.set_num_threads(1)


def train(comm, stage, model, batches, engine_kw, save_after=None, load=None, path=None):
    """Optionally load `path` first; train on `batches`; save after step `save_after`.
    Returns full_state_dict() after every step and, last, the reloaded logical state."""
    model = copy.deepcopy(model)
    engine = minizero.Engine(model, comm, stage, **engine_kw)
    if load:
        engine.load_checkpoint(path)
    states = []
    for i, micro_batches in enumerate(batches):
        for micro in micro_batches:
            x, y = micro[comm.rank % len(micro)]  # a world of another size reuses the batches
            engine.backward(model(x, y))
        engine.step()
        if i == save_after:
            engine.save_checkpoint(path)
        states.append(engine.full_state_dict())
    return states


def logical(path):
    """The unpadded fp32 master and optimizer state (by key) of every parameter in a checkpoint."""
    return {n: {k: v[k] for k in ("master", *v["state"])} for n, v in minizero.read_checkpoint(path)[1].items()}


OPTIMIZERS = {"adamw": {}, "sgd": dict(optimizer="sgd", momentum=0.9), "muon": dict(optimizer="muon", muon_lr=0.02),
              "adafactor": dict(optimizer="adafactor")}  # Muon's and Adafactor's state: not cut like master


def case(dtype, grad_accum=1, steps=4, world_size=3, optimizer="adamw"):
    c = dict(FIXED[0], dtype=DTYPES[dtype], steps=steps, world_size=world_size, grad_accum=grad_accum)
    c["engine"] = dict(FIXED[0]["engine"], dtype=c["dtype"], grad_accum=grad_accum, **OPTIMIZERS[optimizer])
    return c


@settings(deadline=None)
@given(stage=st.integers(0, 3), world_size=st.integers(1, 4), before=st.integers(1, 2),
       after=st.integers(1, 2), dtype=st.sampled_from(list(DTYPES)), grad_accum=st.integers(1, 2),
       optimizer=st.sampled_from(list(OPTIMIZERS)))
def test_resume_equals_uninterrupted(tmp_path_factory, stage, world_size, before, after, dtype, grad_accum,
                                     optimizer):
    path = str(tmp_path_factory.mktemp("ckpt"))
    c = case(dtype, grad_accum, before + after, world_size, optimizer)
    model, batches = make(c)
    whole = launch.run_threads(train, world_size, stage, model, batches, c["engine"], before - 1, None, path)
    resumed = launch.run_threads(train, world_size, stage, model, batches[before:], c["engine"], None, True, path)
    for rank in range(world_size):
        for a, b in zip(whole[rank][before:], resumed[rank]):
            assert_same(a, b)


@settings(deadline=None, max_examples=20)
@given(stage=st.integers(0, 3), world_size=st.integers(1, 4), new_stage=st.integers(0, 3),
       new_world_size=st.integers(1, 4), dtype=st.sampled_from(list(DTYPES)),
       optimizer=st.sampled_from(list(OPTIMIZERS)))
def test_reshard_to_another_world_size_and_stage(tmp_path_factory, stage, world_size, new_stage,
                                                  new_world_size, dtype, optimizer):
    """Save at N ranks and stage s; load at M ranks and stage t: the loaded state is the
    saved state exactly (saved again at once, it reads back the same: Adafactor's whole
    rows and columns too), and training on equals an M-rank stage-0 run from that state,
    bit for bit."""
    first, second = str(tmp_path_factory.mktemp("a")), str(tmp_path_factory.mktemp("b"))
    c = case(dtype, steps=2, world_size=world_size, optimizer=optimizer)
    model, batches = make(c)
    saved = launch.run_threads(train, world_size, stage, model, batches, c["engine"], 1, None, first)[0][-1]
    # load at M ranks and stage t, save again before any step: the same logical state
    def reload(comm):
        engine = minizero.Engine(copy.deepcopy(model), comm, new_stage, **c["engine"])
        engine.load_checkpoint(first)
        state = engine.full_state_dict()
        engine.save_checkpoint(second)
        return state
    assert_same(launch.run_threads(reload, new_world_size)[new_world_size - 1], saved)
    a, b = logical(first), logical(second)
    assert a.keys() == b.keys() and all(assert_same(a[n], b[n]) is None for n in a)
    # go on training at M ranks: stage t equals stage 0
    go = {s: launch.run_threads(train, new_world_size, s, model, batches, c["engine"], None, True, first)
          for s in {0, new_stage}}
    for x, y in zip(go[new_stage][-1], go[0][0]):
        assert_same(x, y)


@pytest.mark.parametrize("stage", [0, 3])
def test_consolidate_equals_full_state_dict_and_loads(tmp_path, stage):
    c = dict(case("bf16"), frozen=0)
    model, batches = make(c)
    model.register_buffer("counter", torch.tensor([7]))
    states = launch.run_threads(train, 3, stage, model, batches, c["engine"], 3, None, str(tmp_path))
    cli.main(["consolidate", str(tmp_path), str(tmp_path / "model.pt")])
    state = torch.load(tmp_path / "model.pt")
    assert list(state) == list(model.state_dict())
    assert_same(state, states[0][3])
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.head.weight, state["head.weight"])


# -----------------------------------------------------------------------------
# what goes wrong: each a clear error naming the file and the mismatch


@pytest.fixture
def saved(tmp_path):
    c = case("fp32", steps=2)
    model, batches = make(c)
    states = launch.run_threads(train, 3, 2, model, batches, c["engine"], 0, None, str(tmp_path))
    return str(tmp_path), c, model, batches, states


def load_into(model, c, path, stage=2, world_size=3):
    def body(comm):
        engine = minizero.Engine(copy.deepcopy(model), comm, stage, **c["engine"])
        engine.load_checkpoint(path)
        return engine.full_state_dict()
    return launch.run_threads(body, world_size)[0]


def shard_files(path):
    return sorted(f for f in os.listdir(path) if f.startswith("shard-"))


def test_checkpoint_of_another_optimizer(saved):
    """Another optimizer's state never loads as this one's: the error names both."""
    path, c, model, *_ = saved
    for other, says in [(dict(optimizer="muon"), "saved with optimizer 'adamw', and this engine trains with 'muon'"),
                        (dict(optimizer="sgd", momentum=0.9), "with optimizer 'adamw'.*'sgd'")]:
        with pytest.raises(RuntimeError, match=says):
            load_into(model, dict(c, engine=dict(c["engine"], **other)), path)
    sgd = str(os.path.join(path, "sgd"))
    c_sgd = dict(c, engine=dict(c["engine"], optimizer="sgd", momentum=0.9))
    launch.run_threads(train, 3, 2, model, saved[3][:1], c_sgd["engine"], 0, None, sgd)
    with pytest.raises(RuntimeError, match="by sgd with state \\['momentum_buffer'\\] there, and by sgd with \\[\\] here"):
        load_into(model, dict(c, engine=dict(c["engine"], optimizer="sgd")), sgd)  # momentum 0: no buffer


def test_truncated_shard(saved):
    path, c, model, *_ = saved
    victim = os.path.join(path, shard_files(path)[1])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(RuntimeError, match=f"{shard_files(path)[1]} is truncated or corrupted"):
        load_into(model, c, path)


def test_missing_shard_and_missing_manifest(saved):
    path, c, model, *_ = saved
    os.remove(os.path.join(path, shard_files(path)[2]))
    with pytest.raises(RuntimeError, match="is missing its shard"):
        load_into(model, c, path)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(RuntimeError, match="no complete checkpoint"):
        load_into(model, c, path)


def test_checkpoint_of_another_model(saved):
    path, c, model, *_ = saved
    other = Net(c["vocab"], [5, 6, 5], tie=True)  # layers.0 is 5->6 here, 5->4 there
    with pytest.raises(RuntimeError, match="another model: trainable parameter layers.0.bias"):
        load_into(other, c, path)
    renamed = copy.deepcopy(model)
    renamed.extra = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="extra.bias has shape absent there"):
        load_into(renamed, c, path)


def test_nothing_half_loaded(saved):
    """A failed load leaves the engine exactly as it was."""
    path, c, model, *_ = saved
    os.remove(os.path.join(path, shard_files(path)[2]))
    def body(comm):
        engine = minizero.Engine(copy.deepcopy(model), comm, 1, **c["engine"])
        before = engine.full_state_dict()
        with pytest.raises(FileNotFoundError):
            engine.load_checkpoint(path)
        assert_same(engine.full_state_dict(), before)
        return engine.t
    assert launch.run_threads(body, 3) == [0, 0, 0]


@pytest.mark.parametrize("dies_at", ["shard", "manifest"])
def test_interrupted_save_keeps_previous_checkpoint(saved, monkeypatch, dies_at):
    """The second save dies (a rank's shard write, or rank 0's manifest write): the
    first checkpoint is still complete, loads, and holds the state after step 1."""
    path, c, model, batches, states = saved
    real = checkpoint.write_atomic
    def dying(p, obj):
        if (dies_at == "manifest" and p.endswith("manifest.json")) or (dies_at == "shard" and p.endswith("-1.pt")):
            with open(p + ".tmp", "wb") as f:  # half a file, then the crash
                f.write(b"partial")
            raise OSError("disk full (simulated)")
        return real(p, obj)
    monkeypatch.setattr(checkpoint, "write_atomic", dying)
    with pytest.raises(RuntimeError, match="disk full|could not write their shard"):
        launch.run_threads(train, 3, 2, model, batches, c["engine"], 1, None, path)
    monkeypatch.setattr(checkpoint, "write_atomic", real)
    assert_same(load_into(model, c, path), states[0][0])


def edit_manifest(path, change):
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    change(m)
    with open(mpath, "w") as f:
        json.dump(m, f)


# a damaged manifest -> the field its error must name
DAMAGED = {
    "no step": (lambda m: m.pop("step"), "step is missing"),
    "no scale": (lambda m: m.pop("scale"), "scale is missing"),
    "no clean_steps": (lambda m: m.pop("clean_steps"), "clean_steps is missing"),
    "step of another type": (lambda m: m.update(step="3"), "step is '3', not int"),
    "unknown format": (lambda m: m.update(format="minizero-9"), "format is 'minizero-9', and this minizero reads"),
    "param without steps": (lambda m: m["units"][0]["params"][0].pop("steps"), "units[0].params[0].steps is missing"),
    "fewer shards": (lambda m: m["shards"].pop(), "shards lists 2 files for world_size 3"),
    "shard without file": (lambda m: m["shards"][1].pop("file"), "shards[1].file is missing"),
    "unit without padded": (lambda m: m["units"][0].pop("padded"), "units[0].padded is missing"),
    "padding not a multiple": (lambda m: m["units"][0].update(padded=m["units"][0]["padded"] + 1),
                               "units[0].padded is"),
    "param outside its unit": (lambda m: m["units"][0]["params"][0].update(offset=10**6), "units[0].params[0]"),
    "state not an object": (lambda m: m["units"][0]["params"][0].update(state=["m", "v"]), "has update 'adamw' and state"),
    "param without shape": (lambda m: m["units"][-1]["params"][0].pop("shape"), "params[0].shape is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_damaged_manifest_is_named_and_nothing_is_loaded(saved, damage):
    """load() checks the manifest whole before it changes anything; read_checkpoint and
    consolidate name the file and the field (not a KeyError or a reshape error)."""
    path, c, model, *_ = saved
    change, says = DAMAGED[damage]
    edit_manifest(path, change)
    mpath = os.path.join(path, "manifest.json")
    for read in (minizero.read_checkpoint, minizero.consolidate):
        with pytest.raises(ValueError, match=f"^checkpoint manifest {mpath}: .*{re.escape(says)}"):
            read(path)
    def body(comm):
        engine = minizero.Engine(copy.deepcopy(model), comm, 2, **c["engine"])
        before = engine.full_state_dict()
        with pytest.raises(ValueError, match=re.escape(says)):
            engine.load_checkpoint(path)
        assert_same(engine.full_state_dict(), before)
        return engine.t, engine.skipped
    assert launch.run_threads(body, 3) == [(0, 0)] * 3


def test_format_1_loads_with_every_parameter_at_the_step(saved):
    """minizero-1 kept one AdamW step count for all parameters: they all took every step."""
    path, c, model, *_ = saved
    def to_format_1(m):
        m["format"] = "minizero-1"
        for u in m["units"]:
            for p in u["params"]:
                assert p.pop("steps") == m["step"] == 1
    edit_manifest(path, to_format_1)
    def body(comm):
        engine = minizero.Engine(copy.deepcopy(model), comm, 1, **c["engine"])
        engine.load_checkpoint(path)
        return {t for u in engine.units for t in u.steps}
    assert launch.run_threads(body, 3) == [{1}] * 3


def test_manifest_that_is_not_json(saved):
    path, *_ = saved
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write('{"format": "minizero-1",\n  oops')
    with pytest.raises(ValueError, match=f"manifest {os.path.join(path, 'manifest.json')} is not JSON .line 2"):
        minizero.consolidate(path)


@pytest.mark.parametrize("fails_at", ["-1.pt", "manifest.json"])
def test_failed_save_leaves_no_files_and_the_next_save_succeeds(saved, monkeypatch, fails_at):
    """The disk is full when the second save renames a rank's shard or the manifest into
    place: the save fails naming what it could not write, leaves no file of its own behind
    (not even .tmp), the first checkpoint still loads, and once there is space a save works."""
    path, c, model, batches, states = saved
    before = sorted(os.listdir(path))
    real = os.replace
    def full(src, dst):
        if dst.endswith(fails_at):
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        return real(src, dst)
    monkeypatch.setattr(os, "replace", full)
    says = "could not write its manifest " + os.path.join(path, "manifest.json") if fails_at == "manifest.json" \
        else "rank\\(s\\) \\[1\\] could not write their shard"
    with pytest.raises(RuntimeError, match=f"^rank {0 if fails_at == 'manifest.json' else 1} failed: "
                                           f"RuntimeError: checkpoint not saved: {says}.*No space left on device"):
        launch.run_threads(train, 3, 2, model, batches, c["engine"], 1, None, path)
    assert sorted(os.listdir(path)) == before
    assert_same(load_into(model, c, path), states[0][0])
    monkeypatch.setattr(os, "replace", real)
    again = launch.run_threads(train, 3, 2, model, batches, c["engine"], 1, None, path)
    assert_same(load_into(model, c, path), again[0][1])
    assert len(shard_files(path)) == 3 and not [f for f in os.listdir(path) if f.endswith(".tmp")]


def _everything(comm, stage, model, batches, kw, path):
    """Train with accumulation and overlap (stage 3: prefetches); read the params inside
    gathered(), after the first step write them (rank 0's win); save a checkpoint, load it
    at the end. Returns full_state_dict() and the norm read inside, after every step."""
    model = copy.deepcopy(model)
    engine = minizero.Engine(model, comm, stage, **kw)
    states = []
    for i, micro_batches in enumerate(batches):
        for micro in micro_batches:
            engine.backward(model(*micro[comm.rank]))
        engine.step()
        with engine.gathered(writable=i == 0):
            norm = sum(p.detach().float().pow(2).sum() for p in model.parameters())
            if i == 0:
                model.head.weight.data.mul_(0.5 + comm.rank)
        if i == 0:
            engine.save_checkpoint(path)
        states.append((engine.full_state_dict(), norm))
    engine.load_checkpoint(path)
    states.append((engine.full_state_dict(), None))
    engine.close()
    return states


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_strict_p2p_gives_the_same_bits(tmp_path, stage):
    """Under NCCL's point-to-point rules (launch.run_threads(strict_p2p=True)) every collective
    the engine makes pairs up, and gives the same bits as in the default thread world."""
    c = case("bf16", grad_accum=2, steps=3)
    model, batches = make(c)
    kw = dict(c["engine"], overlap=True)
    runs = [launch.run_threads(_everything, 3, stage, model, batches, kw, str(tmp_path / str(strict)),
                               strict_p2p=strict)
            for strict in (False, True)]
    for a, b in zip(*runs):
        for (state_a, norm_a), (state_b, norm_b) in zip(a, b):
            assert_same(state_a, state_b)
            assert norm_a is None and norm_b is None or torch.equal(norm_a, norm_b)

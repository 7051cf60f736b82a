"""
Offload (features.py, offload.py): the optimizer's shard on disk gives the same bits as in
memory, shows where it went, survives checkpoints both ways, leaves no files behind, and
a disk that fills mid-step changes nothing. (Bit identity is also drawn in the hypothesis
suite, test_equivalence.py.)
"""
import copy
import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from minizero_lib import checkpoint
from minizero_lib import planner
import minizero
from minizero_lib import offload
from minizero_lib import launch
from test_checkpoint import case, train
from test_equivalence import assert_same, make

torch.set_num_threads(1)


def offload_files(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".offload"))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_disk_offload_is_bit_identical_and_shows_where_it_went(tmp_path, stage, dtype):
    c = case(dtype, grad_accum=2, steps=3)
    model, batches = make(c)
    report = minizero.check(lambda: model, lambda s, r, m: batches[s][m][r], world_sizes=(3,), stages=(0, stage),
                            steps=3, offload="disk", offload_dir=str(tmp_path), **c["engine"])
    assert report.ok, f"\n{report}"

    def body(comm):
        engine = minizero.Engine(copy.deepcopy(model), comm, stage, offload="disk", offload_dir=str(tmp_path),
                                 **c["engine"])
        out = engine.memory(), engine.offloaded(), engine.formula(offloaded=True), engine.numel(), \
            [f for f in offload_files(tmp_path) if f"rank{comm.rank}-" in f], len(engine.units)
        engine.close()
        return out
    for memory, offloaded, formula, numel, files, units in launch.run_threads(body, 3):
        assert memory["optimizer"] == 0                                # nothing of AdamW's stays resident
        assert offloaded == formula == {"disk": 12 * numel // 3}       # fp32 master, m, v of 1/N
        assert [f.split("-")[-1] for f in files] == [f"unit{i}.offload" for i in range(units)]  # one a unit
    assert offload_files(tmp_path) == []  # close() removed them


def test_offloaded_bytes_formula():
    """12 bytes per parameter per rank leave (the host keeps its own fp32 master, fp32 compute too)."""
    assert minizero.offloaded_bytes(64, 4, 3, torch.float32, "disk") == {"disk": 12 * 16}
    assert minizero.model_state_bytes(64, 4, 3, torch.float32, "disk") == {"params": 64, "grads": 64, "optimizer": 0}
    assert minizero.offloaded_bytes(64, 4, 3, torch.bfloat16, "cpu", True) == {"cpu": 12 * 16 + 2 * 16}


def test_bad_offload_options_are_clear_errors(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model, _ = make(case("fp32"))
    for kw, says in [(dict(stage=0, offload="cpu"), "stage 0 .DDP. keeps the whole state"),
                     (dict(stage=2, offload="disk"), "needs offload_dir="),
                     (dict(stage=2, offload="nvme"), "must be None, 'cpu' or 'disk'"),
                     (dict(stage=2, offload_params=True), "use stage 3"),
                     (dict(stage=2, offload="disk", offload_dir=str(blocker / "sub")), "cannot be written")]:
        stage = kw.pop("stage")
        with pytest.raises(RuntimeError, match=says):
            launch.run_threads(lambda comm: minizero.Engine(copy.deepcopy(model), comm, stage, **kw), 1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_cpu_offload_runs_its_host_path_on_a_cpu_run(dtype):
    """On a CPU run offload="cpu" (and stage 3's offload_params) still keep the state in host
    memory of its own and update it there, as on a GPU: the same bits as stage 0 in every
    stage, memory() and offloaded() as the formulas, and the master a copy of its own."""
    c = case(dtype, grad_accum=2, steps=2)
    model, batches = make(c)
    kw = dict(c["engine"], loss_scale=64.0)
    for stages, extra in [((1, 2, 3), {}), ((3,), dict(offload_params=True))]:
        with pytest.warns(UserWarning, match="frees nothing"):
            report = minizero.check(lambda: model, lambda s, r, m: batches[s][m][r], world_sizes=(1, 3), stages=stages,
                                    steps=2, offload="cpu", **extra, **kw)
        assert report.ok, f"\n{report}"
        assert report.refereed == 4  # (2 steps at 2 world sizes: none skipped)

    def body(comm):  # (check held memory() and offloaded() to the formulas: optimizer and params 0 here)
        engine = minizero.Engine(copy.deepcopy(model), comm, 3, offload="cpu", offload_params=True, **kw)
        return [(u.master.data_ptr(), u.shard.data_ptr(), u.flat.data_ptr()) for u in engine.units]
    with pytest.warns(UserWarning, match="frees nothing"):
        for units in launch.run_threads(body, 3):
            assert all(len(set(ptrs)) == 3 for ptrs in units)  # master, shard and params: three copies


def test_a_disk_that_fills_mid_step_changes_nothing(tmp_path, monkeypatch):
    """Rank 1's second unit cannot be written: every rank raises, naming rank 1 and the
    error; params, moments and step counts are as before; with room again, training goes on."""
    c = case("bf16", steps=3)
    model, batches = make(c)
    real = offload.pwrite
    full = {"on": False}

    def pwrite(fd, t, pos):
        if full["on"] and os.readlink(f"/proc/self/fd/{fd}").endswith("rank1-unit1.offload"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, t, pos)
    monkeypatch.setattr(offload, "pwrite", pwrite)

    def body(comm):
        engine = minizero.Engine(copy.deepcopy(model), comm, 3, offload="disk", offload_dir=str(tmp_path),
                                 **c["engine"])
        m = engine.model
        def step(k):
            for micro in batches[k]:
                engine.backward(m(*micro[comm.rank]))
            return engine.step()
        step(0)
        before = engine.full_state_dict(), [checkpoint.read_state(engine, u)["v"].clone() for u in engine.units], \
            [list(u.steps) for u in engine.units], engine.t
        full["on"] = True
        comm_error = None
        try:
            step(1)
        except RuntimeError as e:
            comm_error = str(e)
        full["on"] = False
        after = engine.full_state_dict(), [checkpoint.read_state(engine, u)["v"] for u in engine.units], \
            [list(u.steps) for u in engine.units], engine.t
        assert_same(before[0], after[0])
        assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])) and before[2:] == after[2:]
        went_on = step(2) and engine.t == 2 and not torch.equal(engine.full_state_dict()["emb.weight"],
                                                                 before[0]["emb.weight"])
        engine.close()
        return comm_error, went_on
    errors = launch.run_threads(body, 3)
    for error, went_on in errors:
        assert "rank(s) [1] could not write the offloaded optimizer state" in error and went_on
    assert "No space left on device" in errors[1][0]  # the rank that failed says why
    assert offload_files(tmp_path) == []


@pytest.mark.parametrize("first, then", [("disk", None), (None, "disk")])
def test_resume_with_offload_on_or_off_is_bit_for_bit(tmp_path, first, then):
    c = case("bf16", steps=4)
    model, batches = make(c)
    ckpt, scratch = str(tmp_path / "ckpt"), str(tmp_path / "scratch")
    kw = lambda how: dict(c["engine"], offload=how, offload_dir=scratch) if how else c["engine"]  # noqa: E731
    whole = launch.run_threads(train, 3, 2, model, batches, kw(None), None, None, ckpt)
    launch.run_threads(train, 3, 2, model, batches[:2], kw(first), 1, None, ckpt)
    resumed = launch.run_threads(train, 3, 2, model, batches[2:], kw(then), None, True, ckpt)
    for a, b in zip(whole[0][2:], resumed[0]):
        assert_same(a, b)
    assert offload_files(scratch) == [] and "manifest.json" not in os.listdir(scratch)  # scratch is no checkpoint


def test_offload_files_go_at_normal_exit(tmp_path):
    script = textwrap.dedent(f"""
        import torch, minizero
        from minizero_lib import launch
        keep = []  # every rank's engine, alive until the interpreter exits: no close() is called
        def body(comm):
            keep.append(minizero.Engine(torch.nn.Linear(4, 4), comm, 2, offload="disk", offload_dir={str(tmp_path)!r}))
            mine = f"rank{{comm.rank}}-"
            return len([f for f in __import__("os").listdir({str(tmp_path)!r}) if mine in f])
        print(launch.run_threads(body, 2))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1, 1]"  # each rank had its one unit's file while it ran
    assert offload_files(tmp_path) == []


def _killed_with_offload_files(comm, folder):  # (top-level: run_processes imports it)
    engine = minizero.Engine(torch.nn.Linear(4, 4), comm, 1, offload="disk", offload_dir=folder)
    assert offload_files(folder) and engine, "the engine made no offload file"
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no finalizer, no exit handler


def test_a_killed_rank_leaves_no_offload_files(tmp_path):
    """A spawned rank that is killed (or leaves by os._exit, as every rank does) runs none of
    its cleanup: run_processes removes the files its ranks listed (launch.remove_at_end)."""
    with pytest.raises(RuntimeError, match="rank 0 was killed by signal 9"):
        launch.run_processes(_killed_with_offload_files, 1, str(tmp_path))
    assert offload_files(tmp_path) == []


def test_planner_prints_what_stays_resident():
    lines = planner.plan(7.5e9, 64, torch.bfloat16, memory=80e9, offload="disk")
    rows = {line.split()[0]: line.split() for line in lines if line[:1].isdigit()}
    # the ZeRO paper's 7.5B on 64 GPUs: stage 3 keeps 2 + 2 bytes of the 16 per parameter, / 64
    assert rows["3"][1:7] == ["0.23", "0.23", "0.00", "0.47", "44.30", "1.41"]
    assert rows["0"][3] == "90.00" and rows["0"][6] == "0.00"  # DDP keeps everything, offloads nothing

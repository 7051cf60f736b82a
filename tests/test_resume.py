"""
Surviving kills: a background save writes what the state was at the call and raises a failed
write at the next save; the newest complete checkpoint is the one a restart takes, the older
ones and dead saves are pruned; train_gpt.py --resume starts fresh or trains on to the bit
(dropout's RNG too); its bad input is one line; and, under torchrun --max-restarts, a run
killed at random moments (tests/chaos.py) ends with the same bits as one never killed.
"""
import copy
import errno
import os
import re
import shutil
import sys
import time

import pytest
import torch

import chaos
import minizero
import train_gpt as tg
from minizero_lib import checkpoint, launch, resume
from test_checkpoint import case
from test_equivalence import make
from test_faults import TINY, files, one_line_error  # noqa: F401  (files: a fixture)

SMALL = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, batch_size=2, eval_iters=1,
             sample_tokens=1)


def _saves(comm, stage, model, batches, kw, root, background):
    """Train on `batches`, saving after every step into root/step-i; close."""
    model = copy.deepcopy(model)
    engine = minizero.Engine(model, comm, stage, **kw)
    for i, micro_batches in enumerate(batches):
        for micro in micro_batches:
            engine.backward(model(*micro[comm.rank % len(micro)]))
        engine.step()
        engine.save_checkpoint(checkpoint.step_dir(root, i), {"step": i}, background=background)
    engine.close()


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_background_save_holds_the_state_at_the_call(tmp_path, monkeypatch, stage):
    """Each write is held back 0.1 s, so training goes on (changes the state) while it is in
    flight: every checkpoint is still the one a blocking save writes, bit for bit."""
    c = case("fp32")
    model, batches = make(c)
    blocking, background = str(tmp_path / "blocking"), str(tmp_path / "background")
    launch.run_threads(_saves, 3, stage, model, batches, c["engine"], blocking, False)
    real = checkpoint.write_atomic
    monkeypatch.setattr(checkpoint, "write_atomic", lambda p, obj: time.sleep(0.1) or real(p, obj))
    launch.run_threads(_saves, 3, stage, model, batches, c["engine"], background, True)
    for i in range(len(batches)):
        a, b = (checkpoint.consolidate(checkpoint.step_dir(d, i)) for d in (blocking, background))
        assert same(a, b), i
    files = os.listdir(checkpoint.step_dir(background, 0))
    assert not [f for f in files if f.endswith("sha256")]  # (the digests beside the shards: gone)


@pytest.mark.parametrize("fails, raised_at", [(0, "the next save"), (3, "close")])
def test_a_failed_background_write_raises_at_the_next_save_or_close(tmp_path, monkeypatch, fails,
                                                                     raised_at):
    c = case("fp32")
    model, batches = make(c)
    bad = checkpoint.step_dir(str(tmp_path), fails)
    real = checkpoint.write_atomic

    def full(path, obj):
        if path.startswith(bad) and path.endswith("-1.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, obj)
    monkeypatch.setattr(checkpoint, "write_atomic", full)
    says = (rf"^rank 1 failed: RuntimeError: checkpoint not saved: rank\(s\) \[1\] could not write "
            rf"their shard in {re.escape(bad)} .*No space left on device.*a background save, found "
            rf"at the next save or close")
    with pytest.raises(RuntimeError, match=says):
        launch.run_threads(_saves, 3, 2, model, batches, c["engine"], str(tmp_path), True)
    assert os.listdir(bad) == []  # every rank removed its files
    before = [checkpoint.step_dir(str(tmp_path), i) for i in range(fails)]
    assert checkpoint.checkpoints(str(tmp_path)) == before[::-1]


def _counters(comm, path, load):
    """The fp16 loss scale and step and skip counts: set and saved, or loaded."""
    engine = minizero.Engine(tg.GPT(tg.GPTConfig(1, 1, 8, 8)), comm, 1, dtype=torch.float16)
    if load:
        engine.load_checkpoint(path)
    else:
        engine.t, engine.scaler.scale, engine.scaler.clean_steps = 5, 512.0, 3
        engine.skipped, engine.skips_in_row = 4, 2
        engine.save_checkpoint(path, background=True)
        engine.close()
    return engine.t, engine.scaler.scale, engine.scaler.clean_steps, engine.skipped, engine.skips_in_row


def test_the_loss_scale_and_skip_counts_come_back(tmp_path):
    saved = launch.run_threads(_counters, 2, str(tmp_path), False)
    loaded = launch.run_threads(_counters, 2, str(tmp_path), True)
    assert loaded == saved == [(5, 512.0, 3, 4, 2)] * 2


def test_the_newest_complete_checkpoint_and_pruning(tmp_path):
    c = case("fp32", steps=4)
    model, batches = make(c)
    root = str(tmp_path)
    launch.run_threads(_saves, 1, 0, model, batches, c["engine"], root, False)
    at = lambda *steps: [checkpoint.step_dir(root, s) for s in steps]  # noqa: E731
    assert checkpoint.checkpoints(root) == at(3, 2, 1, 0)
    os.remove(os.path.join(at(1)[0], "manifest.json"))  # a save that died before its manifest
    shard = next(f for f in os.listdir(at(3)[0]) if f.startswith("shard-"))
    os.remove(os.path.join(at(3)[0], shard))  # a shard lost: not complete either
    os.makedirs(at(5)[0])  # a save in flight
    assert checkpoint.checkpoints(root) == at(2, 0)
    checkpoint.prune(root, keep=1)
    # the newer ones stay: they may be saves in flight
    assert sorted(os.listdir(root)) == [os.path.basename(p) for p in at(2, 3, 5)]
    assert checkpoint.checkpoints(str(tmp_path / "missing")) == []


def test_resume_is_bitwise_with_dropout_and_starts_fresh_without_a_checkpoint(tmp_path, capsys):
    """One rank (a thread world's ranks would share torch's RNG): a run resumed from its
    step-3 checkpoint trains steps 3-5 with the very losses and dropout masks of the run never
    stopped. With no complete checkpoint in --out-dir, --resume starts fresh and says so."""
    cfg = {**SMALL, "steps": 6, "save_interval": 3, "eval_interval": 3, "dropout": 0.3}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    whole = launch.run_threads(tg.train, 1, {**cfg, "out_dir": a, "resume": True})[0]
    assert f"no complete checkpoint in {a}: starting fresh" in capsys.readouterr().out
    os.makedirs(b)
    shutil.copytree(checkpoint.step_dir(a, 3), checkpoint.step_dir(b, 3))
    again = launch.run_threads(tg.train, 1, {**cfg, "out_dir": b, "resume": True})[0]
    assert again["train"] == whole["train"][3:] and again["val"] == whole["val"][1:]
    assert same(*(checkpoint.consolidate(checkpoint.checkpoints(d)[0]) for d in (a, b)))
    assert [r["step"] for r in resume.read_log(b) if "loss" in r] == [3, 4, 5]
    assert sorted(os.listdir(a)) == ["log.jsonl", "step-00000003", "step-00000006"]  # the last two


def test_bad_out_dir_and_save_interval_are_one_line(tmp_path, capsys, files):  # noqa: F811
    d = str(tmp_path / "d")
    launch.run_threads(tg.train, 1, {**SMALL, "steps": 2, "eval_interval": 2, "out_dir": d})
    capsys.readouterr()
    def files_of():
        return {f: open(os.path.join(r, f), "rb").read() for r, _, fs in os.walk(d) for f in fs}
    before = files_of()
    argv = ["--out-dir", d, "--world-size", "1", *TINY]
    for extra, says in [
            (["--save-interval", "0"], "--save-interval must be at least 1; got 0"),
            (["--resume", "--n-embd", "16"],
             f"--out-dir {d} holds a checkpoint of another model or optimizer (n_embd=8 there, "
             "n_embd=16 here); give another"),
            (["--resume", "--optimizer", "sgd"], "(optimizer=adamw there, optimizer=sgd here)"),
            ([], f"--out-dir {d} already holds a checkpoint at step 2; add --resume to train on"),
            (["--resume", "--world-size", "3"],
             "trained at a global batch of 2 sequences, not a multiple of --batch-size 2 x 3 "
             "ranks; give a number of ranks that divides it, or a --config whose train_batch_size is one")]:
        assert says in one_line_error(capsys, tg.main, [*argv, *extra], "train_gpt.py")
    assert files_of() == before  # (another run's checkpoint: never overwritten)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
def test_killed_under_torchrun_ends_with_the_same_bits(tmp_path, capsys):
    """tests/chaos.py, small: 2 ranks at stage 3 under torchrun --max-restarts 2, killed twice
    (once in a save), against the same run in a thread world (the same bits: the ring sums in
    one order), never killed and saving blocking."""
    a = chaos.parse(["--kills", "2", "--stage", "3", "--steps", "16", "--save-interval", "3",
                     "--eval-interval", "4", "--dropout", "0", "--seed", "1"])
    a.tmp = str(tmp_path)
    data = tmp_path / "data.txt"
    data.write_bytes(tg.stdlib_corpus(50_000))
    ref = str(tmp_path / "reference")
    cfg = tg.check_config(tg.parse_args(chaos.demo_args(a, ref, str(data), background=False)))
    launch.run_threads(tg.train_entry, 2, cfg)  # (it sets the threads per rank as a worker does)
    assert chaos.chaos(a, str(data), ref), capsys.readouterr().out
    out = capsys.readouterr().out
    assert "kills survived 2/2, final state bitwise equal: yes" in out, out
    assert "during the save of step-" in out, out

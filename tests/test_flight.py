"""
The flight record (flight.py): ranks whose collectives part, or a rank that never
arrives, are named with where each rank is and why, on thread ranks and on gloo
processes (never a hang, never gloo's abort); minizero.check on a model with dropout;
Engine(trace=DIR)'s Chrome trace; python -m bench --plot without matplotlib.
"""
import json
import re
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import minizero
from bench import figures
from minizero_lib import launch
import ops
from train_gpt import GPT, GPTConfig

torch.set_num_threads(1)
EVAL_LINE = "model(x)  # evaluation on rank 0 only"


def tiny_gpt():
    return GPT(GPTConfig(2, 2, 16, 8, 256, True), torch.Generator().manual_seed(0))


def stage3(comm, what):
    """Two stage-3 steps; what="eval": rank 0 then runs a forward the others do not (the
    classic ZeRO-3 hang); what="stall": rank 1 arrives late at the second step."""
    model = tiny_gpt()
    engine = minizero.Engine(model, comm, 3, lr=1e-3)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(comm.rank))
    for step in range(2):
        if what == "stall" and step == 1 and comm.rank == 1:
            time.sleep(6.0)  # a stuck data loader
        _, loss = model(x, x)
        engine.backward(loss)
        engine.step()
        if what == "eval" and comm.rank == 0:
            with torch.no_grad():
                model(x)  # evaluation on rank 0 only
    return "finished"


def assert_names_the_eval(message, world_size):
    head = re.search(r"the ranks part at collective #(\d+); rank 0 went its own way", message)
    assert head, message
    assert f"rank 0: in #{head[1]} all_gather" in message and "forward gather (no grad)" in message
    for r in range(1, world_size):  # the others: the same collective number, their training forward
        assert re.search(rf"rank {r}: in #{head[1]} all_gather of [\d,]+ float32, unit 0, forward gather, step 1",
                         message)
    assert EVAL_LINE in message and "_, loss = model(x, x)" in message  # each rank's call site
    assert "likely cause: rank 0 ran a forward the others did not" in message and "evaluation on one rank" in message


def test_a_forward_on_one_rank_is_named_on_threads():
    with pytest.raises(RuntimeError) as info:
        launch.run_threads(stage3, 3, "eval", timeout=10.0)
    assert str(info.value).startswith("rank 0 failed: CollectiveMismatch")
    assert_names_the_eval(str(info.value), 3)
    assert isinstance(info.value.__cause__, ops.CollectiveMismatch) and info.value.__cause__.culprit == 0


def test_a_rank_that_never_arrives_is_named_on_threads():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        launch.run_threads(stage3, 3, "stall", timeout=1.0)
    message = str(info.value)
    assert time.monotonic() - t0 < 5.0  # the timeout, the snapshot, 2 s for the sleeper: not its 6 s
    assert message.startswith("rank 1 failed: CollectiveStall: rank 1 never arrived at collective #")
    assert re.search(r"rank 1: in no collective; its last was #\d+ all_gather \(flags\)", message), message
    assert "time.sleep(6.0)  # a stuck data loader" in message  # where rank 1 is
    assert "rank 0: in #" in message and "forward gather" in message and "a rank that never arrived" in message


def test_a_mismatch_stops_before_the_payload_on_threads():
    """Same kind and size, another phase: the record tags differ, so nothing is summed."""
    def fn(comm):
        comm.flight.ctx = ("gradient reduction" if comm.rank else "forward gather", 1, 0, 0, True)
        return ops.all_gather(torch.ones(3), comm)
    with pytest.raises(RuntimeError, match="rank 0: in #0 all_gather of 3 float32, unit 1, forward gather"):
        launch.run_threads(fn, 2)


def test_a_forward_on_one_rank_is_named_on_gloo():
    """One small world: the classic hang, as a user writes it. Every message's header carries
    the record's tag, so the ranks stop before any payload moves (before this, gloo aborted rank
    1 with `op.preamble.length <= op.nbytes` and the launcher blamed it)."""
    with pytest.raises(RuntimeError) as info:
        launch.run_processes(stage3, 2, "eval", timeout=20.0)
    message = str(info.value)
    assert message.startswith("rank 0 failed: CollectiveMismatch") and "SIGABRT" not in message
    assert_names_the_eval(message, 2)


def test_a_rank_that_never_arrives_is_named_on_gloo():
    """The stalled rank is busy in its own code: its watcher thread answers through the store."""
    with pytest.raises(RuntimeError) as info:
        launch.run_processes(stage3, 2, "stall", timeout=3.0)
    message = str(info.value)
    assert message.startswith("rank 1 failed: CollectiveStall: rank 1 never arrived at collective #"), message
    assert "(waited 3s)" in message and "time.sleep(6.0)  # a stuck data loader" in message


# -----------------------------------------------------------------------------
# check on a model that draws random numbers (dropout, as every HF model has by default)

class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(32, 8), drop=nn.Dropout(0.1)))
        self.head = nn.Linear(8, 32)

    def forward(self, x, y):
        h = self.transformer.drop(self.transformer.wte(x))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def make_dropped():
    torch.manual_seed(0)
    return Dropped()


def make_batch(step, rank, micro):
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    x = torch.randint(0, 32, (2, 6), generator=g)
    return x, x.roll(1, 1)


def test_check_on_dropout_stops_on_threads_and_judges_on_processes(capsys):
    with pytest.raises(ValueError, match=r"\(transformer.drop: Dropout\(p=0.1, inplace=False\)\).*--processes.*"
                                         r"model.eval\(\).*dropout 0"):
        minizero.check(make_dropped, make_batch, world_sizes=(2,), steps=1)
    eval_mode = lambda: make_dropped().eval()  # noqa: E731 (no randomness: a verdict on threads)
    assert minizero.check(eval_mode, make_batch, world_sizes=(2,), stages=(0, 3), steps=1).ok
    # processes: each rank seeded per step and micro-batch, the referee too: a real verdict
    report = minizero.check(make_dropped, make_batch, world_sizes=(2,), stages=(0, 3), steps=2, processes=True)
    assert report.ok, report.first
    assert report.rows[0].referee[0] < 1e-5  # torch's gradient with the same dropout masks


# -----------------------------------------------------------------------------
# the trace of a step, and the pictures

def traced(comm, path):
    model = tiny_gpt()
    engine = minizero.Engine(model, comm, 3, lr=1e-3, trace=path)
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(comm.rank))
    for _ in range(4):
        _, loss = model(x, x)
        engine.backward(loss)
        engine.step()
    return [(u.index, u.padded) for u in engine.units], list(engine.comm.flight.records)


def test_trace_is_a_chrome_trace_per_rank(tmp_path):
    units, records = launch.run_threads(traced, 2, str(tmp_path))[0]
    assert {p.name for p in tmp_path.iterdir()} == {"rank0.json", "rank1.json"}
    events = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {(e["tid"], e["name"]) for e in spans}
    for i, padded in units:  # each unit's forward and backward on track 0, its collectives on track 1
        assert {(0, f"forward unit {i}"), (0, f"backward unit {i}"), (1, f"all_gather unit {i}"),
                (1, f"reduce_scatter unit {i}")} <= names
        gathers = [e["args"] for e in spans if e["name"] == f"all_gather unit {i}"]
        assert {a["phase"] for a in gathers} == {"forward gather", "backward regather"}
        assert all(a["bytes"] == padded * 4 and a["kind"] == "all_gather" for a in gathers)
    assert {e["args"]["step"] for e in spans} == {0, 1, 2}  # the first three steps, then no more
    assert all(e["dur"] >= 0 for e in spans) and {"compute", "collectives"} <= \
        {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    # the flight record itself: the collectives in order, with phase, unit, step and micro-batch
    seqs, last = [r[0] for r in records], records[-1]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and 0 < len(seqs) <= 64
    assert (last[1], last[2], last[5], last[7], last[8]) == ("all_gather", "flags", "flags", 3, 0)  # the 4th step's


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert figures.plot(str(tmp_path), quick=True) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install -e ".[plot]"' in err and not list(tmp_path.iterdir())

"""
The stream and host rules of the GPU path (DESIGN.md §9.8), held on the CPU by recording or
faking the device calls: a fake CUDA stream per thread (its queue of work, the events
recorded on it and waited for), recorders on Work.wait, on Tensor.to / copy_ / torch.tensor
(their non_blocking, and the phase they run in) and on pinning. No GPU is needed: what runs
is the CPU's arithmetic, and what is checked is the order of the calls a GPU would queue.
"""
import collections
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from minizero_lib import engine as engine_module
from minizero_lib import launch, nccl_model, offload, optimizers
from minizero import Engine
import ops

torch.set_num_threads(1)


# -----------------------------------------------------------------------------
# fake CUDA streams: each thread has one; its log is the order a GPU would run its work in

class FakeStream:
    def __init__(self, name):
        self.name = name  # the rank thread's name
        self.log = []     # ("stack" | "copy" | "wait" | "record" | "synchronize", detail)

    def wait_event(self, event):
        self.log.append(("wait", event))

    def synchronize(self):
        self.log.append(("synchronize", None))


class FakeEvent:
    def __init__(self, *args, **kw):
        self.where = None  # (stream, its log's length when recorded)
        self.waited = 0    # host waits on this event (Event.synchronize)

    def record(self, stream=None):
        stream = stream or _STREAMS.stream()
        self.where = (stream, len(stream.log))
        stream.log.append(("record", self))

    def synchronize(self):
        self.waited += 1

    def query(self):
        return True


class _Streams(threading.local):
    def stream(self, *args):
        if not hasattr(self, "s"):
            self.s = FakeStream(threading.current_thread().name)
            ALL.append(self.s)
        return self.s


_STREAMS = _Streams()
ALL = []  # every thread's fake stream, in order of first use


@pytest.fixture
def fake_streams(monkeypatch):
    """Every tensor counts as a GPU's (nccl_model._cuda), each thread computes on a fake
    stream of its own, and torch.stack / Tensor.copy_ are logged on the calling thread's."""
    ALL.clear()
    monkeypatch.setattr(nccl_model, "_cuda", lambda t: True)
    monkeypatch.setattr(torch.cuda, "current_stream", _STREAMS.stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    stack, copy = torch.stack, torch.Tensor.copy_

    def logged_stack(ts, *a, **kw):
        _STREAMS.stream().log.append(("stack", None))
        return stack(ts, *a, **kw)

    def logged_copy(dst, src, *a, **kw):
        _STREAMS.stream().log.append(("copy", dst.data_ptr()))
        return copy(dst, src, *a, **kw)
    monkeypatch.setattr(torch, "stack", logged_stack)
    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    yield ALL
    ALL.clear()


def _ordered_after_every_read(log, write, streams):
    """Whether, in a stream's log, before index `write`, it waited for an event that every
    other stream recorded after its last read (stack) before that event."""
    waited = [e for kind, e in log[:write] if kind == "wait"]
    for other in streams:
        if other.log is log:
            continue
        reads = [k for k, (kind, _) in enumerate(other.log) if kind == "stack"]
        if not any(e.where and e.where[0] is other and reads and e.where[1] > reads[0] for e in waited):
            return False
    return True


# -----------------------------------------------------------------------------
# 1. a native collective in place on thread ranks: no rank writes x before every rank has run its read

def _in_place(comm):
    comm.native = True
    x = torch.full((6,), comm.rank + 1.0)
    ops.all_reduce(x, comm, out=x)
    return x.data_ptr(), x


def test_a_native_collective_in_place_waits_for_every_ranks_read_on_the_stream(fake_streams):
    """launch.ThreadWorld.meet with out is x: a host barrier after torch.stack passes once the
    stack is queued, not run; a peer's copy_ into its x on its own stream could overwrite it
    first. Each rank's stream must wait, before its write, for an event every peer recorded
    after its read; and no host synchronize is needed for it."""
    results = launch.run_threads(_in_place, 3)
    streams = [s for s in fake_streams if s.name != threading.main_thread().name]
    assert len(streams) == 3
    for (ptr, x), s in zip(results, sorted(streams, key=lambda s: s.name)):
        assert torch.equal(x, torch.full((6,), 6.0))
    for ptr, _ in results:
        s = next(s for s in streams if any(e == ("copy", ptr) for e in s.log))
        write = s.log.index(("copy", ptr))
        assert _ordered_after_every_read(s.log, write, streams), s.log
        assert ("synchronize", None) not in s.log, "a host synchronize in a native collective"


# -----------------------------------------------------------------------------
# 2. no cached tensor shared across rank threads' streams: optimizers.scalars

def test_cached_scalars_are_per_stream(monkeypatch, fake_streams):
    """optimizers.scalars caches 0-d tensors by device and values; on one GPU shared by
    thread ranks, the first rank's torch.full is queued on its stream and another rank
    reading it on its own stream has no event between: each stream gets its own."""
    full = torch.full
    monkeypatch.setattr(torch, "full", lambda size, x, dtype=None, device=None: full(size, x, dtype=dtype))
    optimizers.scalars.cache_clear()
    cuda = torch.device("cuda", 0)
    got = {}

    def rank(r):
        got[r] = (optimizers.scalars(cuda, 0.5, 0.25), optimizers.scalars(cuda, 0.5, 0.25))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0][0] is got[0][1] and got[1][0] is got[1][1]  # a cache, per stream
    assert all(a is not b for a, b in zip(got[0][0], got[1][0])), "one cached tensor on two streams"
    optimizers.scalars.cache_clear()

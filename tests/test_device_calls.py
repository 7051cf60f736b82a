"""
The stream and host rules of the GPU path (DESIGN.md §9.11), held on the CPU by recording or
faking the device calls: a fake CUDA stream per thread (its queue of work, the events
recorded on it and waited for), recorders on Work.wait, on Tensor.to / copy_ / torch.tensor
(their non_blocking, and the phase they run in) and on pinning. No GPU is needed: what runs
is the CPU's arithmetic, and what is checked is the order of the calls a GPU would queue.
"""
import collections
import os
import sys
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import minizero
import ops
from minizero import Engine
from minizero_lib import launch, offload, optimizers

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
        _STREAMS.stream().log.append(("host_wait", self))

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
    """Every tensor counts as a GPU's (Tensor.is_cuda), each thread computes on a fake
    stream of its own, and torch.stack / Tensor.copy_ are logged on the calling thread's."""
    ALL.clear()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.cuda, "current_stream", _STREAMS.stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: None)
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
        if not reads or not any(e.where and e.where[0] is other and e.where[1] > reads[0] for e in waited):
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
# 2. no cached tensor shared across rank threads' streams: minizero.scalars

def test_cached_scalars_are_per_stream(monkeypatch, fake_streams):
    """minizero.scalars caches 0-d tensors by device and values; on one GPU shared by
    thread ranks, the first rank's torch.full is queued on its stream and another rank
    reading it on its own stream has no event between: each stream gets its own."""
    full = torch.full
    monkeypatch.setattr(torch, "full", lambda size, x, dtype=None, device=None: full(size, x, dtype=dtype))
    minizero.scalars.cache_clear()
    cuda = torch.device("cuda", 0)
    got = {}

    def rank(r):
        got[r] = (minizero.scalars(cuda, 0.5, 0.25), minizero.scalars(cuda, 0.5, 0.25))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0][0] is got[0][1] and got[1][0] is got[1][1]  # a cache, per stream
    assert all(a is not b for a, b in zip(got[0][0], got[1][0])), "one cached tensor on two streams"
    minizero.scalars.cache_clear()


# -----------------------------------------------------------------------------
# 3. no NCCL wait with a host timeout; 4. headers built on the host, sent without blocking

class Recorder:
    """Recorded device calls: Tensor.to to a GPU (non_blocking, from pinned memory?),
    torch.tensor with a device, pin_memory's sizes, copy_ (non_blocking), Work.wait's args;
    each with the phase the calling thread is in (phase.now)."""

    def __init__(self, monkeypatch):
        self.calls = collections.defaultdict(list)  # call -> [(phase, details...)]
        self.pinned = []                             # (start, end, a weak reference or None): pinned memory
        self.phase = threading.local()
        real_to, real_tensor, real_copy = torch.Tensor.to, torch.tensor, torch.Tensor.copy_

        def to(t, *args, **kw):
            device = next((a for a in args if isinstance(a, (torch.device, str))), kw.get("device"))
            if device is None or not (torch.device(device).type == "cuda" or self.is_pinned(t)):
                return real_to(t, *args, **kw)
            # A move to the GPU (or from pinned host memory to the device): a new tensor there.
            self.add("to", bool(kw.get("non_blocking")), self.is_pinned(t))
            args = tuple(a for a in args if not isinstance(a, (torch.device, str)))
            kw.pop("device", None)
            return real_to(t.clone(), *args, **kw)

        def tensor(data, *args, **kw):
            if kw.get("device") is not None:
                self.add("tensor", str(kw["device"]))
            kw.pop("device", None)
            pin = kw.pop("pin_memory", False)
            t = real_tensor(data, *args, **kw)
            if pin:
                self.pin(t, None)
            return t

        def copy(dst, src, non_blocking=False):
            if self.is_pinned(dst) or self.is_pinned(src):
                self.add("copy", non_blocking)
            return real_copy(dst, src, non_blocking)
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch, "tensor", tensor)
        monkeypatch.setattr(torch.Tensor, "copy_", copy)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: self.pin(t))

    def pin(self, t, call="pin_memory"):
        """Mark t pinned (call: as torch's pinned cache pins it; None: say nothing)."""
        if call:
            self.add(call, t.numel() * t.element_size())
        self.pinned.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), weakref.ref(t)))
        return t

    def is_pinned(self, t):
        p = t.data_ptr()
        return t.device.type == "cpu" and any(a <= p < b and (r is None or r() is not None)
                                              for a, b, r in self.pinned)

    def add(self, call, *details):
        """One call, with its phase, details and the line of minizero that made it."""
        f = sys._getframe(2)
        ours = lambda name: "minizero_lib" in name or name.endswith("ops.py")  # noqa: E731
        while f and not ours(f.f_code.co_filename):
            f = f.f_back
        where = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f else "?"
        self.calls[call].append((getattr(self.phase, "now", "other"), *details, where))


class FakeWork:
    def __init__(self, waits):
        self.waits = waits

    def wait(self, *args, **kw):
        self.waits.append(args + tuple(kw.values()))
        return True


def _process_comm(monkeypatch, device, headers):
    """A ProcessComm of rank 0 of 2 without a process group: torch.distributed's calls are
    fakes that deliver a send to the receive of the same group (a loopback), recording waits."""
    waits = []

    def batch(p2p):
        sends = [t for op, t, _ in p2p if op is dist.isend]
        for op, t, _ in p2p:
            if op is dist.irecv and sends:
                t.copy_(sends[0])
        return [FakeWork(waits) for _ in p2p]

    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer: (op, t, peer))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, async_op=False: FakeWork(waits))
    monkeypatch.setitem(ops._NATIVE, "all_gather",
                        lambda out, x, group=None, async_op=False: (out.copy_(x.repeat(2)), FakeWork(waits))[1])
    comm = object.__new__(ops.ProcessComm)
    ops.Comm.__init__(comm, 0, 2, torch.device(device), headers, False)
    comm.timeout, comm.groups, comm.store = ops.timedelta(seconds=120), {}, None
    return comm, waits


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_nccl_waits_have_no_host_timeout_and_headers_are_made_on_the_host(monkeypatch, device):
    """Work.wait(timeout) on NCCL polls the host in a sleep loop until the GPU is done (every
    ring hop, every native collective): on NCCL the wait is the stream's, a stall is the
    process group's timeout and the flight record's watcher; gloo's waits keep the timeout.
    A header is made on the host and moves to the GPU from pinned memory, not blocking."""
    rec = Recorder(monkeypatch)
    comm, waits = _process_comm(monkeypatch, device, headers=True)
    x, got = torch.arange(4.0), torch.empty(4)
    comm.exchange(x, 1, got, 1, "reduce_scatter")
    assert torch.equal(got, x)
    comm.native = True
    ops.all_reduce(x, comm)
    assert len(waits) == 2 + 2 + 1 + 1  # the hop's headers and payload, send and receive; the native pair
    timed = [w for w in waits if w]
    assert timed == ([] if device == "cuda" else [(comm.timeout,)] * len(waits)), waits
    assert rec.calls["tensor"] == [], "a header made on the device: a blocking copy per hop"
    moves = rec.calls["to"]
    assert all(nb and pinned for _, nb, pinned, _ in moves) and len(moves) == (2 if device == "cuda" else 0), moves


# -----------------------------------------------------------------------------
# 4. offload's copies queued, not blocking; 5. one pinned region per rank, offloaded()'s bytes

def _offloaded_run(monkeypatch, world_size, stage, kw, steps=2):
    """Train on thread ranks with the host state pinned as on a GPU (cudaHostRegister
    recorded: every tensor outside pinned memory counts as the GPU's, Tensor.is_cuda), each
    thread on a fake stream; -> (recorder, engines, registered)."""
    from test_host_reads import train
    rec, registered, engines = Recorder(monkeypatch), [], []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: not rec.is_pinned(t)))

    def staging(t):
        _STREAMS.stream().log.append(("staged", None))
        return rec.pin(torch.empty(t.shape, dtype=t.dtype), "staged")
    monkeypatch.setattr(optimizers, "pinned_like", staging, raising=False)

    def register(ptr, size, flags):
        registered.append(size)
        rec.pinned.append((ptr, ptr + size, None))
        return 0
    cudart = SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=lambda ptr: 0,
                             cudaError=SimpleNamespace(success=0))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    real_init = Engine.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        engines.append(self)
    monkeypatch.setattr(Engine, "__init__", init)
    kw = dict(kw, offload="cpu", offload_params=stage == 3)
    launch.run_threads(train, world_size, stage, kw, steps, rec.phase)
    return rec, engines, registered


@pytest.mark.parametrize("stage,optimizer", [(3, "adamw"), (1, "adamw"), (3, "muon"), (2, "adafactor")])
def test_offload_copies_are_queued_and_read_after_an_event(monkeypatch, fake_streams, stage, optimizer):
    """An offloaded run makes no blocking host<->device copy in forward, backward or step:
    stage 3's shard comes in from pinned memory not blocking (features' gather); the step's
    flags are made on the host (Engine._agree: torch.tensor(..., device=cuda) is a blocking
    copy); the update's copies to and from the pinned state are queued (optimizers.update),
    and what comes to the host (the reduced gradient, Muon's and Adafactor's results) goes
    through pinned staging, read only after an event's host wait."""
    rec, engines, _ = _offloaded_run(monkeypatch, 2, stage, dict(optimizer=optimizer))
    hot = ("forward", "backward", "step")
    made_on_device = [c for c in rec.calls["tensor"] if c[0] in hot]
    assert made_on_device == [], f"torch.tensor(..., device=) in {made_on_device[:3]}"
    moves = [c for call in ("to", "copy") for c in rec.calls[call] if c[0] in hot]
    blocking = [c for c in moves if not c[1]]
    assert moves and blocking == [], f"{len(blocking)} blocking copies, e.g. {blocking[:3]}"
    staged = [c for c in rec.calls["staged"] if c[0] == "step"]
    assert len(staged) >= 2 * len(engines[0].units), "the reduced gradient comes over through pinned staging"
    for s in fake_streams:
        order = [k for k, _ in s.log if k in ("staged", "host_wait")]
        # every staging copy is followed by the host's wait on its event before the next
        assert all(b == "host_wait" for a, b in zip(order, order[1:] + ["end"]) if a == "staged"), order


@pytest.mark.parametrize("stage", [1, 3])
def test_one_exact_pinned_region_per_rank(monkeypatch, fake_streams, stage):
    """Each master, state and shard pinned on its own (torch's pinned cache rounds every block
    up to a power of two) costs up to twice the formula: a rank pins one region, registered
    once, of exactly offloaded()'s host bytes, which is the formula; torch's cache pins no state."""
    rec, engines, registered = _offloaded_run(monkeypatch, 2, stage, dict(dtype=torch.bfloat16), steps=1)
    assert rec.calls["pin_memory"] == [], rec.calls["pin_memory"][:3]
    want = [e.offloaded()["cpu"] for e in engines]
    assert sorted(registered) == sorted(want) and want == [e.formula(offloaded=True)["cpu"] for e in engines]
    for e in engines:
        held = [t for u in e.units for t in (u.master, *u.state.values(), u.shard if stage == 3 else None)
                if t is not None]
        assert all(rec.is_pinned(t) for t in held)


# -----------------------------------------------------------------------------
# 6. a rank's result comes back to the launcher on the host

def test_results_come_back_on_the_host(monkeypatch):
    """run_processes pickles each rank's result: a CUDA tensor would come back on that rank's
    GPU in the launcher (a context per rank there). Tensors off the host (meta stands in for
    a GPU's, with .cpu() recorded) cross as host tensors, inside any object."""
    import pickle
    moved, real = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t: (moved.append(t.shape), torch.zeros(t.shape))[1]
                        if t.is_meta else real(t))
    out = pickle.loads(launch._dumps([SimpleNamespace(w=torch.empty(3, device="meta")), {"b": torch.ones(2)}]))
    assert moved == [torch.Size([3])] and out[0].w.device.type == "cpu" and torch.equal(out[1]["b"], torch.ones(2))


def test_disk_offload_makes_its_state_on_the_host(monkeypatch):
    """Disk offload's master and zero state go straight to the file: made on the host, never
    first on the GPU (meta stands in for a GPU here, its copy to the host recorded)."""
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: torch.zeros(t.shape, dtype=t.dtype)
                        if t.is_meta and "cpu" in map(str, a) else real(t, *a, **k))
    added = []
    disk = SimpleNamespace(add=lambda i, state: added.append(state))
    u = SimpleNamespace(index=0, owned=torch.empty(8, device="meta"), shard=None, sizes={"m": 8, "v": 8},
                        flat=torch.empty(16, dtype=torch.bfloat16, device="meta"))
    offload.offload_unit(u, "disk", False, disk)
    assert (u.master, u.state) == (None, None)
    assert {k: t.device.type for k, t in added[0].items()} == {"master": "cpu", "m": "cpu", "v": "cpu"}


# -----------------------------------------------------------------------------
# 6. the trace times the GPU's work, not its launches

class TimedEvent(FakeEvent):
    """A timing event of a fake GPU that runs far behind the host: each event recorded runs a
    second after the one recorded before it, and has run only once the host synchronized."""
    recorded = []  # every event recorded, in order

    def __init__(self, enable_timing=False, **kw):
        super().__init__()
        self.timing = enable_timing  # elapsed_time() needs Event(enable_timing=True)
        self.gpu = self.ran = None   # the second it runs at; whether it has run

    def record(self, stream=None):
        super().record(stream)
        self.recorded.append(self)
        self.gpu, self.ran = len(self.recorded), False

    def elapsed_time(self, end):
        assert self.timing and end.timing, "an event made without enable_timing=True"
        assert self.ran and end.ran, "elapsed_time() of an event the GPU has not run: CUDA raises"
        return (end.gpu - self.gpu) * 1e3


def test_the_trace_times_the_gpus_work_not_its_launches(monkeypatch, fake_streams, tmp_path):
    """On a GPU a hook runs when its work is queued, so the host's clock there times launches:
    each time in the trace is an event on the calling thread's stream, read as seconds after
    one synchronize per traced step. On a fake GPU whose events run a second apart, every
    span of the trace (compute and collectives) starts and ends on a whole second."""
    import json
    from test_flight import traced
    Recorder(monkeypatch)  # (pinned memory on a CPU build)
    monkeypatch.setattr(optimizers, "pinned_like", lambda t: torch.empty(t.shape, dtype=t.dtype), raising=False)
    TimedEvent.recorded = []
    syncs = []

    def synchronize(device=None):
        syncs.append(threading.current_thread().name)
        for e in TimedEvent.recorded:
            e.ran = True
    monkeypatch.setattr(torch.cuda, "Event", TimedEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    launch.run_threads(traced, 2, str(tmp_path))
    events = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"compute", "collective"} and len(spans) > 20
    origin = min(e["ts"] for e in spans)
    off = [e for e in spans if abs((e["ts"] - origin) / 1e6 - round((e["ts"] - origin) / 1e6)) > 1e-3
           or abs(e["dur"] / 1e6 - round(e["dur"] / 1e6)) > 1e-3]
    assert off == [], f"{len(off)} of {len(spans)} spans timed on the host, e.g. {off[:2]}"
    assert all(e["dur"] >= 0 for e in spans)
    # one synchronize per rank at the start and per traced step, none more (3 steps of 4)
    assert len(syncs) == 2 * (1 + 3), syncs


def _demo_steps(comm, steps, phase):
    """The demo's train_step on a small GPT as if its device were a GPU (the model stays on
    the host), with the phases marked: forward, backward, the step, and after it."""
    import train_gpt
    torch.set_num_threads(1)
    model = train_gpt.GPT(train_gpt.GPTConfig(2, 2, 16, 8, 256, True), torch.Generator().manual_seed(0))
    engine = Engine(model, comm, 3, lr=1e-2, grad_accum=3)
    model.register_forward_pre_hook(lambda m, a: setattr(phase, "now", "forward"))
    backward, step = engine.backward, engine.step
    engine.backward = lambda loss: (setattr(phase, "now", "backward"), backward(loss))[1]
    engine.step = lambda: (setattr(phase, "now", "step"), step(), setattr(phase, "now", "after"))[1]
    g = torch.Generator().manual_seed(comm.rank)
    batches = [[(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 256, (3, 2, 9), generator=g)]
               for _ in range(steps)]
    losses = [train_gpt.train_step(model, engine, b, torch.device("cuda")) for b in batches]
    engine.close()
    return losses


def test_the_demo_sends_batches_pinned_and_reads_the_loss_once_per_step(monkeypatch):
    """train_gpt.train_step: to a GPU each micro-batch goes from pinned memory, not blocking
    (a pageable copy is staged by CUDA at once); the loss is summed on the device and read
    once, after the step: a read per micro-batch (loss.item()) would drain the GPU's queue in
    every micro-batch, and the step's time, so the MFU, would count the host's waits."""
    from test_host_reads import recorded
    rec = Recorder(monkeypatch)
    steps, accum = 2, 3
    with recorded() as (counts, phase):
        losses = launch.run_threads(_demo_steps, 1, steps, phase)[0]
    assert counts["forward"] + counts["backward"] == 0, counts
    # the engine's one read in the step (its flags), the demo's loss after it
    assert counts["step"] == steps and counts["after"] == steps, counts
    moves = rec.calls["to"]
    assert len(moves) == 2 * steps * accum and all(nb and pinned for _, nb, pinned, _ in moves), moves[:3]
    assert len(rec.calls["pin_memory"]) == 2 * steps * accum
    assert all(isinstance(x, float) and 0 < x < 10 for x in losses), losses

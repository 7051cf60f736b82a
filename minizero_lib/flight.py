"""
The flight record: each rank's last collectives, and what they say when ranks disagree.

Every collective of ops.py (reduce_scatter, all_gather, all_reduce, broadcast) is one
record on its communicator's Flight: a sequence number, the kind the ledger books it
under, dtype and size, the phase and unit the engine was in (forward gather, backward
regather, gradient reduction, parameter share, ...), step, micro-batch, start and end.
A record is a short list and a clock read: cheap enough to be always on (python -m bench
measures it). torch's NCCL flight recorder is the model; minizero's ranks compare theirs
while the collective runs, not after the fact:

  mismatch  every message carries the sender's record tag (sequence number, kind, phase,
            unit, size); a receiver whose own tag differs stops before the payload moves
  stall     a rank that waits longer than the communicator's timeout stops

Either way the rank collects every rank's snapshot (its records and the line of user code
it is at: shared memory for thread ranks, the process group's store for processes) and
raises one error that names each rank's collective and call site, the first sequence
number where they differ, and the likely cause. Engine(trace=DIR) writes the same
records, with each unit's forward and backward, as a Chrome trace per rank.
"""
import atexit
import faulthandler
import json
import linecache
import os
import pickle
import re
import tempfile
import threading
import time
import zlib
from collections import deque

import torch

from minizero import outside_graphs
from ops import FAILED, CollectiveMismatch, CollectiveStall, PeerFailed, ProcessComm

# a record's fields
SEQ, OP, KIND, DTYPE, NUMEL, PHASE, UNIT, STEP, MICRO, GRAD, T0, T1, OUTER = range(13)
KIND_PHASE = {"clip": "clipping", "flags": "flags", "fingerprint": "fingerprint",
              "checkpoint": "checkpoint",
              "offload": "checkpoint", "buffers": "buffers", "gathered": "gathered()",
              "state_dict": "state dict"}
_CODES = {}  # kind -> a code every process computes alike (crc32, not Python's salted hash)
# minizero's own files: the package, and ops.py and minizero.py beside it (by path: a user's
# engine.py is the user's)
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
OURS = {os.path.join(os.path.dirname(_PACKAGE), f) for f in ("ops.py", "minizero.py")}


def code(kind):
    """A kind's or phase's number in message headers."""
    c = _CODES.get(kind)
    if c is None:
        c = _CODES[kind] = zlib.crc32(kind.encode()) & 0x7FFFFFFF
    return c


class Flight:
    """One communicator's record: its last `size` collectives, the one now running, and
    the context (phase, unit, step, micro-batch, grad mode) the engine sets before each."""

    def __init__(self, rank, size=64):
        self.rank = rank
        self.records = deque(maxlen=size)  # the last collectives, oldest first
        self.seq = 0                       # collectives started so far
        self.current = None                # the innermost record still running
        self.tag = (0, 0, 0, -1, 1, 0)     # what messages carry: the current record's identity
        self.ctx = ("", -1, 0, 0, True)    # (phase, unit, step, micro, grad) set by the engine
        # once the world is broken: the error every collective raises
        self.failed = None
        # the thread that runs the rank's code: its line is the call site
        self.owner = threading.get_ident()
        # that line, kept once this rank has failed (its thread may end)
        self.site = None
        # tracing: every record and compute span, not just the last
        self.spans = None
        # time the previous collective ended (a stalled rank's last sign)
        self.idle = None
        self.tracer = None                 # Engine(trace=DIR)'s Tracer: told when a step is done

    def start(self, op, kind, t):
        if self.failed is not None:  # the world is broken: no new message may be posted
            raise self.failed
        phase, unit, step, micro, grad = self.ctx
        if kind in KIND_PHASE:  # a collective of its own, not the engine's current phase
            phase, unit, grad = KIND_PHASE[kind], -1, True
        rec = [self.seq, op, kind, t.dtype, t.numel(), phase, unit, step, micro, grad,
               time.perf_counter(), None,
               self.current]  # (OUTER: the record this one runs inside, as all_reduce's halves do)
        self.seq += 1
        self.records.append(rec)
        if self.spans is not None:
            self.spans.append(rec)
            self.tracer.mark(rec, T0)
        self.current = rec
        self.tag = _tag(rec)
        return rec

    def within(self, ctx, job):
        """job, to run later (on the engine's communication thread) in context ctx."""
        def run():
            self.ctx = ctx
            return job()
        return run

    def stepped(self, t):
        """The engine's step t is done: back to no phase; a tracer writes its file."""
        self.ctx = ("", -1, t, 0, True)
        if self.tracer is not None:
            self.tracer.step(t)

    def end(self, rec, done=True):
        """rec's collective is over; done=False: it was started and runs on (ops.started), and
        this rank goes on outside it until its wait, which resumes it and ends it."""
        if done:
            rec[T1] = self.idle = time.perf_counter()
            if self.spans is not None:
                self.tracer.mark(rec, T1)
        self.current, rec[OUTER] = rec[OUTER], None  # (no chain of finished records)
        if self.current is not None:
            self.tag = _tag(self.current)

    def resume(self, rec):
        """Waiting for rec, a collective in flight: it is the rank's current one again (a stall
        names it)."""
        rec[OUTER], self.current, self.tag = self.current, rec, _tag(rec)

    def diagnose(self, comm, reason, incident, timeout=None):
        """A process rank's error when the world breaks (ops.ProcessComm): every rank's record,
        collected through the process group's store under `incident`, compared."""
        snaps = exchange_snapshots(comm.store, self, comm.world_size, incident)
        return diagnose(snaps, comm.world_size, reason, comm.rank, timeout)

    def snapshot(self):
        """Plain data for the other ranks: the records, the current one, and the call site."""
        recs = [tuple(r[:T1 + 1]) for r in list(self.records)]
        return dict(rank=self.rank,
                    records=[(*r[:DTYPE], str(r[DTYPE]).replace("torch.", ""), *r[NUMEL:])
                                             for r in recs],
                    current=None if self.current is None else self.current[SEQ],
                    site=self.site or call_site(self.owner),
                    now=time.perf_counter(), idle=self.idle)


def _tag(rec):
    """A record's identity, as messages carry it: (sequence number, kind, phase, unit, grad mode,
    size)."""
    return rec[SEQ], code(rec[KIND]), code(rec[PHASE]), rec[UNIT], int(rec[GRAD]), rec[NUMEL]


def call_site(ident):
    """The innermost line of the thread's stack outside minizero, torch and the standard
    library's threading: the user's line that led to the collective."""
    site = None
    for f, lineno, name in stack(ident):
        if os.path.dirname(os.path.abspath(f)) != _PACKAGE and os.path.abspath(f) not in OURS and \
                f"{os.sep}torch{os.sep}" not in f and f"{os.sep}concurrent{os.sep}" not in f and \
                not f.endswith(("threading.py", "queue.py")):
            line = linecache.getline(f, lineno).strip()
            return f"{os.path.basename(f)}:{lineno} in {name}: {line}"
        site = site or f"{os.path.basename(f)}:{lineno} in {name}"
    return site or "(its code has returned)"


def stack(ident):
    """[(file, line, function)] of thread ident's stack, innermost first. faulthandler reads it
    in C with the GIL held: walking a running thread's frames from Python (sys._current_frames,
    f_back) can crash CPython 3.11 when that thread pops a frame between two reads."""
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        text = out.read()
    frames, mine = [], False
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            mine = int(re.search(r"0x([0-9a-f]+)", line)[1], 16) == ident
        elif mine and line.startswith('  File "'):
            f, rest = line[8:].rsplit('", line ', 1)
            lineno, name = rest.split(" in ", 1)
            frames.append((f, int(lineno), name))
    return frames


def attach(comm):
    """Give a communicator a flight record (the launchers do, launch.py); a process rank's
    watcher thread also answers for it when another rank finds the world broken."""
    comm.flight = Flight(comm.rank)
    if isinstance(comm, ProcessComm):
        watch(comm.store, comm.flight, comm.world_size)
    return comm


# -----------------------------------------------------------------------------
# the diagnosis: pure functions of every rank's snapshot

def describe(r):
    """'#12 all_gather 2,923 float32, unit 1, forward gather (no grad), step 1 micro 0'."""
    seq, op, kind, dtype, numel, phase, unit, step, micro, grad = r[:T0]
    what = op if kind == op else f"{op} ({kind})"
    where = ", ".join(x for x in (f"unit {unit}" if unit >= 0 else "",
                                   phase + ("" if grad else " (no grad)") if phase else "") if x)
    return (f"#{seq} {what} of {numel:,} {dtype}" + (f", {where}" if where else "")
            + f", step {step} micro {micro}")


def _identity(r):
    return None if r is None else (r[OP], r[KIND], r[DTYPE], r[NUMEL], r[PHASE], r[UNIT], r[GRAD])


def diagnose(snaps, world_size, reason, me, timeout=None):
    """The error to raise, from every rank's snapshot (a rank with none sent nothing): a
    CollectiveMismatch if their records part somewhere, else a CollectiveStall. Rank `me`
    found the problem, for `reason` (after waiting `timeout` seconds, if it timed out)."""
    by_seq = {s["rank"]: {r[SEQ]: r for r in s["records"]} for s in snaps.values()}
    reached = {k: max(recs, default=-1) for k, recs in by_seq.items()}
    seqs = sorted({q for recs in by_seq.values() for q in recs})
    first = next((q for q in seqs
                  if len({_identity(recs[q]) for recs in by_seq.values() if q in recs}) > 1), None)
    # mismatch: the odd one out at the first differing collective (of the ranks there)
    if first is not None:
        groups = {}
        for k in sorted(k for k in by_seq if first in by_seq[k]):
            groups.setdefault(_identity(by_seq[k][first]), []).append(k)
        odd = min(groups.values(),
                  key=lambda g: (len(g), not any(by_seq[k][first][GRAD] == 0 for k in g), g))
        culprit = odd[0]
        head = (f"mismatched collectives: the ranks part at collective #{first}; rank {culprit} "
                "went its own way")
        cause = _mismatch_cause(by_seq, first, odd)
    else:  # every collective agrees: someone is behind (never arrived) or gone
        missing = [k for k in range(world_size) if k not in snaps]
        ahead = max(reached.values(), default=-1)
        behind = [k for k in sorted(reached) if reached[k] < ahead]
        culprit = (missing or behind or [None])[0]
        waited = f" (waited {timeout:g}s)" if timeout else ""
        if culprit in missing:
            head = f"rank {culprit} sent no record: it died or hangs outside Python{waited}"
        elif culprit is not None:
            head = f"rank {culprit} never arrived at collective #{reached[culprit] + 1}{waited}"
        else:  # (messages outside any collective)
            head, culprit = "", me
        cause = ("likely cause: a rank that never arrived: it is stuck or slow outside minizero (a "
                 "data loader, I/O, a breakpoint, a print to a full pipe) or skipped a collective "
                 "the others ran (one step or micro-batch fewer); every rank must run the same "
                 "steps, micro-batches and forwards")
    lines = [f"{head} ({reason})" if head else reason]
    lines += [_where(k, snaps.get(k), by_seq.get(k), first) for k in range(world_size)] + [cause]
    return (CollectiveStall if first is None else CollectiveMismatch)("\n".join(lines), culprit)


def _where(k, snap, recs, first):
    """Rank k's line: its collective (the first differing one, else its current one) and call
    site."""
    if snap is None:
        return f"  rank {k}: no record (gone)"
    at = recs.get(first) or recs.get(snap["current"])
    if at is not None:
        state = f"in {describe(at)}"
    elif recs:
        gap = f"{snap['now'] - snap['idle']:.1f}s ago" if snap["idle"] else "never"
        state = f"in no collective; its last was {describe(recs[max(recs)])}, ended {gap}"
    else:
        state = "in no collective yet"
    return f"  rank {k}: {state}\n          at {snap['site']}"


def _mismatch_cause(by_seq, first, odd):
    mine = by_seq[odd[0]][first]
    other = next(by_seq[k][first] for k in by_seq if k not in odd and first in by_seq[k])
    ranks = "rank " + ", ".join(map(str, odd)) if len(odd) < 3 else f"ranks {odd}"
    if mine[PHASE] == "forward gather" and (not mine[GRAD] and other[GRAD]
                                            or other[PHASE] != "forward gather"):
        return (f"likely cause: {ranks} ran a forward the others did not (at stage 3 every forward "
                "all-gathers each unit, so every rank must run it): evaluation on one rank "
                "(`if rank == 0: model(x)`) or a forward whose backward never came; run it on "
                "every rank (each on its own batch), or evaluate a copy made from "
                "engine.full_state_dict()")
    if mine[PHASE] != other[PHASE] or mine[UNIT] != other[UNIT]:
        return (f"likely cause: the ranks' code took different paths ({ranks}: "
                f"{mine[PHASE] or mine[KIND]} of unit {mine[UNIT]}, the others: "
                f"{other[PHASE] or other[KIND]} of unit {other[UNIT]}): a branch, a skipped step "
                "or micro-batch, or a module only some ranks run (an MoE expert: at stage 3 it "
                "must share a unit with modules every rank runs, units=[...], or use stage 0-2)")
    return ("likely cause: the ranks called different collectives or sizes: every rank must call "
            "the same collectives, on the same sizes, in the same order")


# -----------------------------------------------------------------------------
# processes: the snapshots travel through the process group's store

def exchange_snapshots(store, flight, world_size, incident, wait=1.5):
    """Publish this rank's snapshot under `incident` and collect the others' (those that do
    not answer within `wait` seconds are left out: the diagnosis calls them gone)."""
    store.set(f"minizero/{incident}/{flight.rank}", pickle.dumps(flight.snapshot()))
    keys = {k: f"minizero/{incident}/{k}" for k in range(world_size)}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not store.check(list(keys.values())):
        time.sleep(0.05)
    return {k: pickle.loads(store.get(key)) for k, key in keys.items() if store.check([key])}


def watch(store, flight, world_size, every=0.25):
    """A daemon thread per process rank: once any rank declares the world broken (FAILED),
    this rank publishes its snapshot even if its own code is busy elsewhere (a stalled rank
    answers too) and latches the failure, so its next collective raises instead of posting
    a message that might meet a stale one (gloo would abort the process). It stops at exit,
    before the interpreter ends: a thread caught inside a store call then aborts the process
    ("terminate called without an active exception", seen under torchrun)."""
    stop = threading.Event()

    def loop():
        while flight.failed is None and not stop.wait(every):
            try:
                if store.check([FAILED]):
                    reason = store.get(FAILED).decode()
                    flight.failed = PeerFailed(f"rank {flight.rank}: the world broke: {reason}")
                    flight.failed = diagnose(exchange_snapshots(store, flight, world_size, "fail"),
                                             world_size,
                                             reason, flight.rank)
            except Exception:  # the store went with the world: nothing left to answer
                return
    thread = threading.Thread(target=loop, daemon=True, name=f"minizero-flight{flight.rank}")
    thread.start()
    atexit.register(lambda: (stop.set(), thread.join(timeout=5)))


# -----------------------------------------------------------------------------
# the trace: Engine(trace=DIR) writes one Chrome trace (chrome://tracing, ui.perfetto.dev) per rank

class Tracer:
    """Times each unit's forward and backward (hooks of its own) beside the collectives the
    flight records, and writes them as DIR/rank{r}.json after each of the first `steps` steps.
    Its module hooks run outside torch.compile's graphs, as the engine's.

    On a GPU a hook runs when its work is queued, not when the GPU runs it: there each time is
    an event recorded on the calling thread's stream (the comm thread's for its collectives),
    read back as seconds at the end of the step, after one synchronize (traced steps only)."""

    def __init__(self, path, comm, units, tensors, steps=3):
        self.path = path            # the directory of the trace files
        self.tensors = tensors      # module output -> the tensors in it (minizero.tensors)
        self.flight = comm.flight   # the communicator's record: its spans are the collectives
        self.world_size = comm.world_size  # an all-gather's whole buffer is N times its input
        self.t = 0                  # steps done: the step a span belongs to
        self.steps = steps          # steps traced; later ones cost nothing
        self.compute = []           # (name, start, end, step) of unit forwards and backwards
        self.open = {}              # span name -> start, for spans still running
        self.spent = []             # the collectives of the traced steps, once tracing stops
        self.gpu = bool(units) and units[0].flat.is_cuda  # time the GPU's work, not launches
        self.marks = {}             # GPU: (record's seq, T0 or T1) -> its time (an event, then s)
        # GPU: (host seconds, event) of one moment: an event's time is its distance from it
        self.origin = self._origin() if self.gpu else None
        self.flight.spans, self.flight.tracer = [], self
        os.makedirs(path, exist_ok=True)
        for u in units:
            u.module.register_forward_pre_hook(self._begin(u))
            u.module.register_forward_hook(self._end(u))
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._grad(u))

    def _origin(self):
        """(host seconds, an event) of one moment: the GPU idle, an event runs when recorded."""
        torch.cuda.synchronize()
        event = self.now()
        return time.perf_counter(), event

    def now(self):
        """This moment: the host's clock, or on a GPU an event queued on this thread's stream."""
        if not self.gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, t):
        """A GPU's time from now() as host seconds, once its event has run (floats already are)."""
        if isinstance(t, float):
            return t
        host, event = self.origin
        return host + event.elapsed_time(t) / 1e3

    def mark(self, rec, i):
        """A collective's record starts (i=T0) or ends (T1): on a GPU, when its stream is there."""
        if self.gpu:
            self.marks[rec[SEQ], i] = self.now()

    def _begin(self, u):
        def hook(module, args):
            if self.flight.spans is not None:
                self.open[f"forward unit {u.index}"] = self.now()
        return outside_graphs(hook)

    def _end(self, u):
        def hook(module, args, out):
            t0 = self.open.pop(f"forward unit {u.index}", None)
            if t0 is None:
                return
            self.compute.append((f"forward unit {u.index}"
                                 + ("" if torch.is_grad_enabled() else " (no grad)"),
                                 t0, self.now(), self.t))
            # backward of this unit starts when its outputs' gradient arrives
            for t in self.tensors(out):
                if t.requires_grad:
                    t.register_hook(self._backward_starts(u))
        return outside_graphs(hook)

    def _backward_starts(self, u):
        def hook(grad):
            if f"backward unit {u.index}" not in self.open:
                self.open[f"backward unit {u.index}"] = self.now()
        return hook

    def _grad(self, u):
        def hook(p):
            if f"backward unit {u.index}" in self.open:
                self.open[f"last grad {u.index}"] = self.now()
        return hook

    def step(self, t):
        """After the engine's step t: close the backward spans, write the file, maybe stop."""
        if self.flight.spans is None:
            return
        for name in [k for k in self.open if k.startswith("backward")]:
            i = name.split()[-1]
            end = self.open.pop(f"last grad {i}", None) or self.now()
            self.compute.append((name, self.open.pop(name), end, t - 1))
        if self.gpu:
            # the step's events have all run once the GPU is idle: read them as seconds
            torch.cuda.synchronize()
            self.compute = [(n, self.seconds(a), self.seconds(b), s) for n, a, b, s in self.compute]
            self.marks = {k: self.seconds(v) for k, v in list(self.marks.items())}
        self.t = t
        self.write()
        if t >= self.steps:
            self.flight.spans = None

    def events(self):
        """Chrome trace events: compute on track 0, collectives on track 1 (µs)."""
        r = self.flight.rank
        out = [dict(ph="M", name="process_name", pid=r, args=dict(name=f"rank {r}")),
               dict(ph="M", name="thread_name", pid=r, tid=0, args=dict(name="compute")),
               dict(ph="M", name="thread_name", pid=r, tid=1, args=dict(name="collectives"))]
        for name, t0, t1, step in self.compute:
            out.append(dict(ph="X", name=name, cat="compute", pid=r, tid=0, ts=t0 * 1e6,
                            dur=(t1 - t0) * 1e6,
                            args=dict(step=step)))
        for rec in self.flight.spans or self.spent:
            if rec[T1] is None:
                continue
            # a GPU's times where they were marked, else the host's
            t0, t1 = (self.marks.get((rec[SEQ], i), rec[i]) for i in (T0, T1))
            # whole
            nbytes = (rec[NUMEL] * rec[DTYPE].itemsize
                      * (self.world_size if rec[OP] == "all_gather" else 1))
            name = f"{rec[KIND]}" + (f" unit {rec[UNIT]}" if rec[UNIT] >= 0 else "")
            out.append(dict(ph="X", name=name, cat="collective", pid=r, tid=1, ts=t0 * 1e6,
                            dur=(t1 - t0) * 1e6,
                            args=dict(op=rec[OP], kind=rec[KIND], phase=rec[PHASE], unit=rec[UNIT],
                                      bytes=nbytes,
                                      dtype=str(rec[DTYPE]), seq=rec[SEQ], step=rec[STEP],
                                      micro=rec[MICRO])))
        return out

    def write(self):
        self.spent = self.flight.spans
        with open(os.path.join(self.path, f"rank{self.flight.rank}.json"), "w") as f:
            json.dump(dict(traceEvents=self.events(), displayTimeUnit="ms"), f)

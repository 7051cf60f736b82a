"""
Starting a world of ranks, each running fn(comm, *args): as threads of this process (the
tests' world, each rank with an ops.ThreadComm), or as processes on torch.distributed (gloo
on CPU, nccl on GPU, each rank with an ops.ProcessComm).

    run_threads(fn, world_size, *args)    ranks are threads of this process, on the CPU or
                                          sharing one GPU (device="cuda"); strict_p2p=True:
                                          under NCCL's point-to-point rules (nccl_model.py)
    run_processes(fn, world_size, *args)  ranks are local processes this one spawns
    init_from_env()                       ranks started by torchrun, any number of nodes

No rank outlives run_processes, and when a rank fails both launchers name that rank, not
the peers that gave up on it (DESIGN.md §9).
"""
import contextlib
import ctypes
import io
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ops
from minizero_lib import flight, nccl_model
from minizero_lib.flight import call_site
from ops import PeerFailed


def _check_world_size(world_size):
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 (the number of ranks); got {world_size!r}")


# -----------------------------------------------------------------------------
# ranks as threads of this process (ops.ThreadComm): the tests' world

class ThreadWorld(ops.ThreadWorld):
    """What a world of thread ranks shares: ops.ThreadWorld's message queues, and the meetings
    of native collectives, the failure flag and every rank's flight record (each rank's
    ops.ThreadComm reaches it as comm.world), and how a message travels through them: post,
    take, meet, each message checked against the receiver's record."""

    def __init__(self, world_size, timeout, device, strict=False):
        super().__init__(world_size, device, timeout)
        self.meetings = {}  # ranks -> (a slot per rank, a barrier): where a native collective meets
        self.read_events = {}  # ranks -> per rank, the CUDA event after its read of every slot
        self.lock = threading.Lock()  # (ranks create meetings on first use)
        # set once any rank failed: the others give up instead of waiting
        self.failed = threading.Event()
        # strict_p2p: NCCL's rules, not the queues
        self.p2p = nccl_model.Streams(self) if strict else None
        self.flights = [None] * world_size  # each rank's flight record, read by whoever diagnoses

    def broken(self, rank, reason, stall=False, latch=True):
        """Raise the diagnosis from every rank's record; latch=True: the world is broken, so
        every rank's next collective raises (the others wake up through `failed`)."""
        me = self.flights[rank]
        me.site = call_site(me.owner)  # (its thread may have ended by the time another rank looks)
        seq, deadline = me.seq, time.monotonic() + 0.5
        while time.monotonic() < deadline and any(f is None or f.seq < seq for f in self.flights):
            # the others get half a second to reach this collective, as processes do
            time.sleep(0.01)
        snaps = {f.rank: f.snapshot() for f in self.flights if f is not None}
        error = flight.diagnose(snaps, self.world_size, reason, rank,
                                self.timeout if stall else None)
        if latch:
            for f in self.flights:
                if f is not None and f.failed is None:
                    f.failed = PeerFailed(f"rank {f.rank}: the world broke at another rank (see "
                                          "its error)")
            self.abort_meetings()
        raise error

    def meeting(self, ranks):
        with self.lock:
            if ranks not in self.meetings:
                self.meetings[ranks] = ([None] * len(ranks), threading.Barrier(len(ranks)))
            return self.meetings[ranks]

    def post(self, me, dst, kind, send):
        """me (an ops.ThreadComm) sends `send` to rank dst: a copy, its kind and me's record tag
        go on their queue (CUDA: with an event the receiver's stream waits for). Queues never
        block: the send is done at once."""
        payload = send.detach().clone()
        self.queues[me.rank, dst].put((kind, payload, nccl_model._made(payload), me.flight.tag))

    def take(self, me, src, kind, t):
        """me (an ops.ThreadComm) receives into t the next message from rank src, which must be of
        the collective me is in (a message of another stops before its payload is read)."""
        rank, deadline = me.rank, time.monotonic() + self.timeout
        while True:
            # A message sent is delivered, as on a real transport, though its sender failed since.
            try:
                got_kind, payload, made, tag = self.queues[src, rank].get(timeout=0.05)
                break
            except queue.Empty:
                if self.failed.is_set():
                    raise PeerFailed(f"rank {rank}: a peer failed, giving up")
                if time.monotonic() > deadline:
                    self.broken(rank, f"rank {rank} had no message from rank {src} within "
                                f"{self.timeout}s ({ops._describe(kind, t)})", stall=True)
        if tag != me.flight.tag:
            self.broken(rank, f"rank {rank} got rank {src}'s message of another collective")
        nccl_model._expect(rank, kind, t, src, ops._describe(got_kind, payload))
        # CUDA: read what the sender's stream wrote, and keep the payload's memory till then.
        if made is not None:
            stream = torch.cuda.current_stream(payload.device)
            stream.wait_event(made)
            payload.record_stream(stream)
        t.copy_(payload)

    def meet(self, me, op, x, out, kind, ranks):
        """me's (an ops.ThreadComm's) native collective op of x into out over `ranks` (all by
        default): every rank leaves x in its slot, checks every slot's header, and reads every x
        straight from shared memory, as a native collective would, summed in rank order."""
        rank = me.rank
        ranks = tuple(ranks or range(self.world_size))
        slots, barrier = self.meeting(ranks)
        i = ranks.index(rank)
        slots[i] = (kind, x.detach(), nccl_model._made(x), me.flight.tag)
        self._barrier(rank, barrier)
        # Every rank sees it: the world stays usable.
        if any(s[3] != me.flight.tag for s in slots):
            self.broken(rank, f"rank {rank} read the ranks' native {kind} headers", latch=False)
        for src, (k, y, made, _) in zip(ranks, slots):
            nccl_model._expect(rank, kind, x, src, ops._describe(k, y))
            if made is not None:
                torch.cuda.current_stream(y.device).wait_event(made)
        ys = torch.stack([s[1] for s in slots])
        # CUDA: the stack above is only queued on my stream; an event says when it has run.
        reads = self.reads(ranks)
        reads[i] = nccl_model._made(ys)
        # Every rank has queued its read of every x: now each stream waits for all of them
        # before it writes anything (out, in place x, or x after the return), on the GPU,
        # not the host.
        self._barrier(rank, barrier)
        for read in reads:
            if read is not None:
                torch.cuda.current_stream(ys.device).wait_event(read)
        out.copy_(ys.view(-1) if op == "all_gather" else
                  ys.sum(0).view(len(ranks), -1)[i] if op == "reduce_scatter" else ys.sum(0))
        # Nobody may reuse its slot (nor its read event) until everyone has read it.
        self._barrier(rank, barrier)
        return out

    def reads(self, ranks):
        """The ranks' read events of their meeting (a slot per rank), made on first use."""
        with self.lock:
            return self.read_events.setdefault(ranks, [None] * len(ranks))

    def _barrier(self, rank, barrier):
        try:
            barrier.wait(timeout=self.timeout)
        except threading.BrokenBarrierError:
            if self.failed.is_set():
                raise PeerFailed(f"rank {rank}: a peer failed, giving up")
            self.broken(rank, f"rank {rank} waited {self.timeout}s for the others at a native "
                        f"collective", stall=True)

    def abort(self):
        self.failed.set()
        self.abort_meetings()

    def abort_meetings(self):  # wake every rank waiting in a native collective
        with self.lock:
            for _, barrier in self.meetings.values():
                barrier.abort()


def _thread_device(device):
    """The rank threads' device: the CPU by default, or one GPU that every rank shares."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: this torch sees no CUDA GPU; use device='cpu'")
    return torch.device("cuda",
                        torch.cuda.current_device()) if device == torch.device("cuda") else device


@contextlib.contextmanager
def _rank_on(device):
    """A rank thread's CUDA state, all per thread: the device, a stream of its own, and backward
    run here (autograd's one worker thread per GPU would run every rank's hooks: one rank's
    hook waiting there for a collective would block the peers' hooks it waits for)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)), \
            torch.autograd.set_multithreading_enabled(False):
        yield
        torch.cuda.current_stream(device).synchronize()  # what the rank returns is complete


def run_threads(fn, world_size, *args, device=None, timeout=60.0, strict_p2p=False):
    """Run fn(comm, *args) on world_size threads; return [result of rank 0, 1, ...].
    If a rank raises, the others are woken up and this raises, naming that rank.
    device="cuda": every rank computes on that one GPU, each on its own stream.
    strict_p2p=True: point-to-point operations follow NCCL's rules (nccl_model.py), and
    a deadlock under them raises, naming what each rank is stuck in."""
    _check_world_size(world_size)
    device = _thread_device(device)
    world = ThreadWorld(world_size, timeout, device, strict_p2p)
    results, errors = [None] * world_size, {}
    if device.type == "cuda":
        # the caller's tensors are complete before other streams read them
        torch.cuda.synchronize(device)

    def main(rank):
        try:
            with _rank_on(device):
                comm = flight.attach(ops.ThreadComm(rank, world))
                world.flights[rank] = comm.flight
                results[rank] = fn(comm, *args)
        except BaseException as e:
            errors[rank] = e
            world.abort()
        finally:  # (its thread id may go to another thread now)
            if world.flights[rank] is not None:
                world.flights[rank].owner = None
        if world.p2p is not None:
            world.p2p.finish(rank)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = None
    # once a rank has failed, one stuck outside collectives (stalled) gets 2 s, not forever
    for t in threads:
        while t.is_alive() and (deadline is None or time.monotonic() < deadline):
            t.join(0.05)
            if errors and deadline is None:
                deadline = time.monotonic() + 2.0
    if world.p2p is not None and world.p2p.stuck:
        raise RuntimeError(world.p2p.stuck)
    # report the rank the diagnosis blames, else the one that failed first-hand, not those that
    # gave up
    if errors:
        rank = min(errors,
                   key=lambda r: (not hasattr(errors[r], "culprit"),
                                  isinstance(errors[r], PeerFailed), r))
        if hasattr(errors[rank], "culprit"):
            e = errors[rank]
            raise RuntimeError(f"rank {e.culprit} failed: {type(e).__name__}: {e}") from e
        raise RuntimeError(f"rank {rank} failed: {type(errors[rank]).__name__}: "
                           f"{errors[rank]}") from errors[rank]
    return results


# -----------------------------------------------------------------------------
# ranks as processes (ops.ProcessComm): spawned here, or started by torchrun

def init_from_env(timeout=300.0, check=None, native=True):
    """For ranks started by torchrun: nccl with one GPU per process if there are GPUs,
    else gloo. RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT come from torchrun.
    check (headers before every message) defaults to on for gloo, whose process aborts
    when a message meets a receive of another size; on nccl a mismatch is found by the timeout."""
    if "RANK" not in os.environ:  # (torch would say only "RANK expected, but not set")
        raise RuntimeError("launch.init_from_env() is for processes started by torchrun (RANK is "
                           "not set): run `torchrun --nproc_per_node=N your_script.py`, or start "
                           "the ranks from Python with launch.run_processes(fn, world_size) "
                           "(processes) or launch.run_threads(fn, world_size) (threads)")
    device = None
    if torch.cuda.is_available():
        device = _rank_device(int(os.environ.get("LOCAL_RANK", 0)))
    kw, attempt = {}, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and attempt != "0":
        # torchrun's store outlives its restarts (torch issue 135712): without keys of their own,
        # a restarted group reads the dead one's addresses, and gloo hangs or fails to connect
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False,
                              timeout=timedelta(seconds=timeout))
        kw = dict(store=dist.PrefixStore(f"minizero/attempt-{attempt}", store),
                  rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("nccl" if device else "gloo", timeout=timedelta(seconds=timeout),
                            device_id=device,
                            **kw)
    return flight.attach(ops.ProcessComm(timeout, device is None if check is None else check,
                                         native))


def _rank_device(local_rank):
    """This process's GPU, made current before anything touches CUDA (NCCL's batched point-to-point
    needs it); also given to init_process_group as device_id, which starts NCCL at once."""
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ValueError(f"LOCAL_RANK is {local_rank} but this process sees {count} GPU(s) "
                         "(CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most "
                         f"{count} processes per node (torchrun --nproc_per_node={count}), one GPU "
                         "each")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _die_with_parent(parent):
    """A rank must not outlive its launcher, however the launcher ends (kill -9 included).
    On Linux the kernel kills us the moment it goes (PR_SET_PDEATHSIG); everywhere, a
    thread checks twice a second that it is still our parent, which also covers a launcher
    that died before the prctl call."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


_RUN_DIR = None  # in a rank spawned by run_processes: the launcher's folder for this run


def remove_at_end(path):
    """For files a rank makes that must not outlive its run (disk offload's): in a rank spawned
    by run_processes the path is listed where the launcher looks, and the launcher removes it
    when the run ends, even if the rank was killed. Elsewhere the caller's own cleanup is all."""
    if _RUN_DIR is not None:
        with open(os.path.join(_RUN_DIR, f"files-{os.getpid()}"), "a") as f:
            f.write(path + "\n")


def _remove_listed(folder):
    for name in (n for n in os.listdir(folder) if n.startswith("files-")):
        with open(os.path.join(folder, name)) as f:
            for path in filter(os.path.exists, f.read().splitlines()):
                os.remove(path)


def _process_main(rank, world_size, backend, store_path, timeout, check, parent, fn, args, results):
    global _RUN_DIR
    _RUN_DIR = os.path.dirname(store_path)
    _die_with_parent(parent)
    # a ^C reaches us too: the launcher alone handles it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = _rank_device(rank) if backend == "nccl" else None
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout), device_id=device)
        out = fn(flight.attach(ops.ProcessComm(timeout, check, store=store)), *args)
        results.put(("ok", rank, _dumps(out)))
    except BaseException as e:  # (a diagnosis ends with the rank it blames, for _blame)
        blame = f"\n{e.culprit}" if hasattr(e, "culprit") else ""
        results.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}{blame}"))
    results.close()
    results.join_thread()  # the result is handed over: now leave without gloo's exit-time abort
    os._exit(0)


class _HostPickler(pickle.Pickler):
    """Pickles a rank's result with every tensor on the host: a CUDA tensor would come back
    on that rank's GPU in the launcher (a CUDA context there per rank, and GPU memory held)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.cpu().__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return NotImplemented


def _dumps(out):
    buf = io.BytesIO()
    _HostPickler(buf).dump(out)
    return buf.getvalue()


def _terminated(signum, frame):
    """SIGTERM, how schedulers stop a job: leave run_processes through its `finally`, which
    kills every rank, and exit with the status the signal itself would have given."""
    print(f"{os.path.basename(sys.argv[0])}: stopped by SIGTERM; killing every rank",
          file=sys.stderr)
    raise SystemExit(128 + signum)


def run_processes(fn, world_size, *args, backend="gloo", timeout=60.0, check=None):
    """Spawn world_size local ranks running fn(comm, *args) (fn must be importable);
    return [result of rank 0, 1, ...]. If a rank raises or dies, every rank is killed and
    this raises, naming that rank. No rank outlives this call: SIGTERM, ^C (KeyboardInterrupt)
    or any exception kill them all, and they kill themselves if this process dies. check
    (headers, each read on the host per hop): on for gloo, off for nccl, as init_from_env."""
    _check_world_size(world_size)
    check = backend != "nccl" if check is None else check
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"nccl takes one GPU per rank: world size {world_size} needs that many, "
                         f"this machine has {torch.cuda.device_count()}; use fewer ranks, or "
                         "backend='gloo'")
    ctx = mp.get_context("spawn")  # fork hangs once the parent has used torch's threads
    results = ctx.Queue()
    # the only thread that takes signals
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminated) if main else None
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_process_main, daemon=True,
                             args=(r, world_size, backend, os.path.join(tmp, "store"), timeout,
                                   check, os.getpid(), fn, args,
                                   results)) for r in range(world_size)]
        for p in procs:
            p.start()
        out, failure = {}, None
        try:
            failure = _wait_for_ranks(procs, results, out)
        finally:
            for p in procs:
                if len(out) < world_size:  # a failure, an exception, SIGTERM or ^C: no rank goes on
                    p.kill()  # (a no-op on a rank that has exited)
                p.join(timeout=10)
            _remove_listed(tmp)  # files the ranks left behind (a rank killed, or gone by os._exit)
            if main:
                signal.signal(signal.SIGTERM, before)
    if failure is not None:
        raise RuntimeError(failure)
    return [out[r] for r in range(world_size)]


def _wait_for_ranks(procs, results, out, grace=2.0):
    """Collect each rank's result into out; return None, or the failure to report. An error
    is not final until every rank has reported or exited, or `grace` seconds have passed:
    the rank that died often cannot be seen dead yet when a survivor reports the broken
    connection, and the report must name the rank that died, not the survivor."""
    errors, deadline = {}, None
    while len(out) < len(procs):
        try:
            status, rank, payload = results.get(timeout=0.2)
            if status == "ok":
                out[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs)
                if p.exitcode not in (None, 0) and r not in out and r not in errors]
        if (errors or dead) and deadline is None:
            deadline = time.monotonic() + grace
        # each reported, or died without a word
        settled = len(out) + len(errors) + len(dead) == len(procs)
        if deadline is not None and (settled or time.monotonic() > deadline):
            return _blame(procs, errors, dead)
    return None


def _blame(procs, errors, dead):
    """The first-hand failure: a rank that died (its peers' errors follow from that), else a
    rank's own error, else the rank a flight diagnosis blames (one that went its own way or
    never arrived: not the first rank that died of it), else the lowest rank that gave up
    on a peer (PeerFailed)."""
    if dead:
        code = procs[dead[0]].exitcode
        name = {s.value: s.name for s in signal.Signals}.get(-code, "unnamed")
        return f"rank {dead[0]} " + (f"was killed by signal {-code} ({name})" if code < 0
                                     else f"died with exit code {code}")
    diagnosed = ("CollectiveMismatch:", "CollectiveStall:")
    own = [r for r in sorted(errors) if not errors[r].startswith(("PeerFailed:", *diagnosed))]
    if not own and any(e.startswith(diagnosed) for e in errors.values()):
        message, culprit = next(e for _, e in sorted(errors.items())
                                if e.startswith(diagnosed)).rsplit("\n", 1)
        return f"rank {culprit} failed: {message}"  # (_process_main appends the rank it blames)
    r = own[0] if own else min(errors)
    return f"rank {r} failed: {errors[r]}"

"""
The communication layer of minizero, its ground floor: ring collectives written on a
communicator whose one point-to-point operation is an exchange (send to one rank and receive
from another, as one group). In reading order: the collectives; Comm, what every communicator
has; its transports, ThreadComm (ranks are threads of this process: run_threads) and
ProcessComm (processes on gloo or nccl, started by minizero_lib/launch.py or torchrun); the
details of torch's own collectives. It imports nothing of the project: the flight
record (minizero_lib/flight.py) attaches from above, where the ranks are launched.

    reduce_scatter(x) -> shard      rank r ends with chunk r of the sum over ranks
    all_gather(shard) -> full       every rank ends with every rank's chunk
    all_reduce(x)     -> full       reduce_scatter then all_gather
    broadcast(x, src)               every rank ends with rank src's x

Every ring collective makes each rank send (N-1)/N of the buffer. The ring fixes the
order in which chunk c is summed: it starts at rank c+1 and travels c+2, ..., c (mod N),
each hop rounded to the buffer's dtype. That order is what makes every ZeRO stage
bit-identical to DDP, so the ring is the default; `comm.native = True` swaps in torch's
own collectives (NCCL on GPU), which sum in an order of their own.
"""
import contextlib
import functools
import queue
import threading
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist


# -----------------------------------------------------------------------------
# the collectives, as rings of exchanges (comm: a ThreadComm, a ProcessComm, or a group of
# either: minizero_lib/hybrid.py)

def _chunks(x, n):
    if x.dim() != 1 or x.numel() % n:
        raise ValueError(f"collectives take a 1-D tensor whose length is a multiple of the "
                         f"world size; got shape {tuple(x.shape)} for world size {n} (pad it)")
    return x.view(n, -1)


def _recorded(op):
    """A collective's entry point: one record in comm.flight from its start to its end (if
    started without waiting: its wait); one that raises stays the rank's current one."""
    def wrap(fn):
        @functools.wraps(fn)
        def collective(x, comm, *args, **kw):
            rec = comm.flight.start(op, kw.get("kind", op), x)
            out = fn(x, comm, *args, **kw)
            if comm.flight.current is rec:
                comm.flight.end(rec)
            return out
        return collective
    return wrap


@_recorded("reduce_scatter")
def reduce_scatter(x, comm, kind="reduce_scatter"):
    """Sum x over ranks; rank r returns chunk r. Each rank sends (N-1)/N of x.
    Chunk c is summed in the order rank c+1, c+2, ..., c (mod N), rounded at every hop."""
    n, r = comm.world_size, comm.rank
    chunks = _chunks(x, n)
    if n == 1:
        return chunks[0].clone()
    # Torch's own collective is booked as the ring would send: all of it to the right.
    if comm.native:
        comm.book(kind, (r + 1) % n, (n - 1) * chunks[0].numel() * x.element_size())
        return comm.run_native("reduce_scatter", x, torch.empty_like(chunks[0]), kind)
    right, left = (r + 1) % n, (r - 1) % n
    # Step 0: my own piece of chunk r-1 starts its journey. Then N-1 hops, one chunk (x/N)
    # sent per hop, as one exchange; after them acc is chunk r, summed by every rank.
    acc = chunks[(r - 1) % n].clone()
    incoming = torch.empty_like(acc)
    for k in range(n - 1):
        comm.exchange(acc, right, incoming, left, kind)
        # The partial sum of chunk r-2-k, plus mine.
        acc = incoming + chunks[(r - 2 - k) % n]
    return acc


@_recorded("all_gather")
def all_gather(shard, comm, out=None, kind="all_gather"):
    """Concatenate every rank's shard in rank order. Each rank sends (N-1)/N of the result."""
    n, r = comm.world_size, comm.rank
    if out is None:
        out = torch.empty(n * shard.numel(), dtype=shard.dtype, device=shard.device)
    chunks = _chunks(out, n)
    if n == 1:
        return out.copy_(shard)
    if comm.native:
        comm.book(kind, (r + 1) % n, (n - 1) * shard.numel() * shard.element_size())
        return comm.run_native("all_gather", shard, out, kind)
    chunks[r].copy_(shard)
    right, left = (r + 1) % n, (r - 1) % n
    # Hop k: pass on chunk r-k, receive chunk r-1-k.
    for k in range(n - 1):
        comm.exchange(chunks[(r - k) % n], right, chunks[(r - 1 - k) % n], left, kind)
    return out


@_recorded("all_reduce")
def all_reduce(x, comm, kind=None, out=None):
    """Sum over ranks: reduce-scatter then all-gather, so each chunk is summed in the ring's
    order (out=x: in place). Each rank sends 2(N-1)/N of x, booked as the two halves' kinds (or
    both as `kind`), on the native path too: one all-reduce (gloo's reduce-scatter is one)."""
    n = comm.world_size
    if comm.native and n > 1:
        half = (n - 1) * _chunks(x, n)[0].numel() * x.element_size()
        comm.book(kind or "reduce_scatter", (comm.rank + 1) % n, half)
        comm.book(kind or "all_gather", (comm.rank + 1) % n, half)
        out = torch.empty_like(x) if out is None else out
        return comm.run_native("all_reduce", x, out, "all_reduce")
    shard = reduce_scatter(x, comm, kind or "reduce_scatter")
    return all_gather(shard, comm, out=out, kind=kind or "all_gather")


@_recorded("broadcast")
def broadcast(x, comm, src=0, kind="broadcast"):
    """Copy src's x into every rank's x along the chain src -> src+1 -> ... (in place; a bool
    tensor travels as bytes: gloo moves no bools)."""
    n, r = comm.world_size, comm.rank
    if n == 1:
        return x
    buf = x.view(torch.uint8) if x.dtype == torch.bool else x
    # Receive, then pass it on: two exchanges, as the second sends what the first got.
    if r != src:
        comm.exchange(None, None, buf, (r - 1) % n, kind)
    if (r + 1) % n != src:
        comm.exchange(buf, (r + 1) % n, None, None, kind)
    return x


# -----------------------------------------------------------------------------
# the communicator: what every transport has; a transport says how a message travels

FAILED = "minizero/failed"  # the process group's store key: set once the world is broken
# a message header's dtype codes (ProcessComm)
DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4,
              torch.int64: 5, torch.int32: 6, torch.uint8: 7, torch.bool: 8}


class Pending:
    """An operation under way (an exchange, a job on the engine's communication thread);
    wait() finishes it and returns its result. The one handle type of minizero."""

    def __init__(self, wait):
        self.wait = wait


class NoRecord:
    """What a communicator keeps of its collectives until a flight record is attached (the
    launchers of minizero_lib/launch.py attach minizero_lib/flight.py's): nothing. These are
    the calls the collectives and the engine make on it."""
    failed = None                 # once the world is broken: the error every collective raises
    current = None                # the collective running now
    tag = (0, 0, 0, -1, 1, 0)     # what a message's header says of it
    ctx = ("", -1, 0, 0, True)    # the engine's phase, unit, step, micro-batch, grad mode

    def start(self, op, kind, t):
        return None

    def end(self, rec, done=True):
        pass

    def resume(self, rec):
        pass

    def within(self, ctx, job):
        return job

    def stepped(self, t):
        pass

    def diagnose(self, comm, reason, incident, timeout=None):
        """The error a broken world raises: with no records to compare, the reason alone."""
        return (CollectiveStall if timeout else CollectiveMismatch)(reason, None)


class PeerFailed(RuntimeError):
    """Raised on a rank whose peer failed or went silent: the world cannot go on."""


class CollectiveMismatch(ValueError):
    """The ranks are in different collectives: they would sum garbage or hang."""

    def __init__(self, message, culprit):
        super().__init__(message)
        self.culprit = culprit  # the rank whose collectives went their own way (None: unknown)


class CollectiveStall(PeerFailed):
    """A rank waited past the timeout: some rank never arrived."""

    def __init__(self, message, culprit):
        super().__init__(message)
        self.culprit = culprit  # the rank that never arrived (None: unknown)


class Comm:
    """What every communicator has: its place, the ledgers of the bytes it sent, its record
    of collectives, and exchange, the one point-to-point operation the rings run on. A
    transport says how a message travels (_post) and how torch's own collectives run."""

    def __init__(self, rank, world_size, device, headers=False, native=False):
        self.rank = rank              # this rank's number, 0 .. world_size-1
        self.world_size = world_size  # the number of ranks, in ring order
        self.device = device          # where messages live (NCCL moves only CUDA tensors)
        # Whether each message follows a header of its own, checked before the payload moves
        # (ProcessComm(check=True)); a thread's message carries one for free: threads say False.
        self.headers = headers
        self.native = native  # torch's own collectives instead of the ring
        self.unfinished = None  # inside started(): waits of the native collectives started there
        # the last collectives, read when the world breaks (flight.py attaches one from above)
        self.flight = NoRecord()
        self.sent = Counter()  # collective kind -> payload bytes this rank has sent
        self.sent_to = Counter()  # peer (global rank) -> payload bytes this rank has sent it

    def book(self, kind, dst, nbytes):
        """The ledgers: nbytes sent to rank dst in a collective of this kind."""
        self.sent[kind] += nbytes
        self.sent_to[dst] += nbytes

    def exchange(self, send, dst, recv, src, kind="p2p"):
        """Send `send` to rank dst and receive into `recv` from rank src, issued as one group
        (either may be None), and wait for both: a ring hop is one exchange."""
        self.iexchange(send, dst, recv, src, kind).wait()

    def iexchange(self, send, dst, recv, src, kind="p2p"):
        """Start exchange(...): the Pending's wait() finishes it."""
        if send is not None:
            self.book(kind, dst, send.numel() * send.element_size())
        return self._post(send, dst, recv, src, kind)


def _describe(kind, t):
    """A message's kind, shape and dtype in words, cut at 64 characters."""
    return f"{kind} of {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"[:64]


def _halves(kind, send, dst, recv, src):
    """What an exchange does, in words (for errors): 'send of ... to rank 1 + receive ...'."""
    sends = [f"send of {_describe(kind, send)} to rank {dst}"] if send is not None else []
    recvs = [f"receive of {_describe(kind, recv)} from rank {src}"] if recv is not None else []
    return " + ".join(sends + recvs)


# -----------------------------------------------------------------------------
# transport 1: threads in one process, whose world moves the messages, one queue per (src, dst)
# pair. run_threads and ThreadWorld are all a ring needs; launch.run_threads and its world add
# what the tests need: every message checked on receipt, a failed rank named, NCCL's rules
# (strict_p2p), a GPU's streams, torch's own collectives.

class ThreadWorld:
    """What the rank threads of one process share: a message queue per (src, dst) pair."""
    p2p = None  # NCCL's point-to-point rules, modelled (launch.ThreadWorld(strict=True))

    def __init__(self, world_size, device="cpu", timeout=60.0):
        self.world_size = world_size  # the number of rank threads
        self.device = torch.device(device)  # where every rank computes
        self.timeout = timeout        # seconds a rank waits for a message, then gives up
        self.queues = {(s, d): queue.SimpleQueue()
                       for s in range(world_size) for d in range(world_size)}

    def post(self, me, dst, kind, send):
        """me (a ThreadComm) sends a copy of `send` to rank dst: queues never block."""
        self.queues[me.rank, dst].put(send.detach().clone())

    def take(self, me, src, kind, t):
        """me receives into t the next message from rank src."""
        try:
            t.copy_(self.queues[src, me.rank].get(timeout=self.timeout))
        except queue.Empty:
            raise PeerFailed(f"rank {me.rank} had no message from rank {src} within "
                             f"{self.timeout}s ({_describe(kind, t)})") from None

    def meet(self, me, op, x, out, kind, ranks):
        raise ValueError("torch's own collectives (native) on thread ranks need the world of "
                         "minizero_lib.launch.run_threads")


def run_threads(fn, world_size, *args):
    """Run fn(comm, *args) on world_size thread ranks of this process -> each rank's result,
    in rank order; a rank's error is raised here (the others give up after the timeout)."""
    world = ThreadWorld(world_size)
    results, errors = [None] * world_size, []

    def main(rank):
        try:
            results[rank] = fn(ThreadComm(rank, world), *args)
        except BaseException as e:  # noqa: B902 (handed to the caller)
            errors.append(e)
    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class ThreadComm(Comm):
    def __init__(self, rank, world):
        super().__init__(rank, world.world_size, world.device)
        self.world = world  # what the rank threads share: the queues (launch's: more)

    def _post(self, send, dst, recv, src, kind):
        if self.world.p2p is not None:
            return self.world.p2p.issue(self.rank, kind, send, dst, recv, src)
        if send is not None:
            self.world.post(self, dst, kind, send)
        return Pending(lambda: None if recv is None else self.world.take(self, src, kind, recv))

    def run_native(self, op, x, out, kind, ranks=None):
        """The thread world's native collective over `ranks` (global numbers; all by default):
        the ranks meet in shared memory (launch.ThreadWorld.meet). Started it models torch's
        async_op as strictly as any transport may run it: the ranks meet at the wait (x is read
        then), and until then out holds NaN, so reading it early or writing x shows."""
        if self.unfinished is None:
            return self.world.meet(self, op, x, out, kind, ranks)
        keep = x.detach().clone()
        out.fill_(float("nan"))
        # What x must hold at the wait.
        held = keep if out is not x else out.clone()

        def wait():
            bits = [t.detach().reshape(-1).view(torch.uint8) for t in (x, held)]
            if not torch.equal(*bits):
                raise RuntimeError(f"rank {self.rank}: the input of a native {kind} started "
                                   f"(ops.started) was written before its wait")
            self.world.meet(self, op, keep, out, kind, ranks)
        return _finish(self, wait, out)

    def make_groups(self, rank_lists):  # thread ranks meet in any group on first use (meet)
        pass


# -----------------------------------------------------------------------------
# transport 2: torch.distributed (gloo on CPU, nccl on GPU), its ranks started by launch.py.
# With headers (check=True) a 64-byte header naming its kind, size and dtype precedes each message.

class ProcessComm(Comm):
    def __init__(self, timeout=120.0, check=True, native=False, store=None):
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        super().__init__(dist.get_rank(), dist.get_world_size(), device, check, native)
        self.timeout = timedelta(seconds=timeout)  # how long a transfer may take: then a stall
        self.groups = {}  # ranks -> their torch process group, for native collectives in groups
        # Where ranks leave their records; a thread answers for this rank, however busy.
        self.store = store or dist.distributed_c10d._get_default_store()
        # torch's rule for batch_isend_irecv on NCCL: the first call on the group is one every
        # rank takes part in (DESIGN.md §9).
        if self.device.type == "cuda":
            self._guard("the first collective", lambda: self._wait(dist.all_reduce(
                torch.zeros(1, device=self.device), async_op=True)))

    # The constructor's name for headers (callers may set comm.check = False).
    check = property(lambda self: self.headers, lambda self, on: setattr(self, "headers", on))

    def _header(self, kind, t, device=None):
        """The 8 numbers (64 bytes) a message carries ahead of its payload: the sender's record
        tag (sequence number, kind, phase, unit, grad mode, size), the payload's size and dtype.
        Made on the host; to a GPU from pinned memory, not blocking; read on the host (§9.11)."""
        h = torch.tensor([*self.flight.tag, t.numel(), DTYPE_CODE.get(t.dtype, 0)])
        return h.pin_memory().to(device, non_blocking=True) if str(device)[:4] == "cuda" else h

    def _check(self, kind, t, src, header, latch=True):
        if not torch.equal(header.cpu(), self._header(kind, t)):
            self._broken(f"rank {self.rank} got rank {src}'s header of another collective",
                         latch=latch)

    def _broken(self, reason, stall=False, latch=True):
        """Raise the diagnosis from every rank's record, gathered through the store. latch=True:
        the world is broken, so every rank (its watcher thread) is told, and no rank posts a
        message again (a stale payload meeting a header would abort gloo's process)."""
        if latch:
            here = PeerFailed(f"rank {self.rank}: the world broke here")
            self.flight.failed = self.flight.failed or here
            if not self.store.check([FAILED]):
                self.store.set(FAILED, reason)
        incident = "fail" if latch else f"x{self.flight.tag[0]}"
        raise self.flight.diagnose(self, reason, incident,
                                   self.timeout.total_seconds() if stall else None)

    def _guard(self, what, op):
        """Run op, which starts or finishes a transfer. Once a peer is gone, gloo raises in either
        ('Connection reset by peer' at once, or the timeout): the world is broken. After a
        timeout (or once a rank has diagnosed it) the diagnosis says by whom."""
        try:
            return op()
        except Exception as e:
            reason = (f"rank {self.rank}: {what} failed or timed out after "
                      f"{self.timeout.total_seconds()}s: {e}")
            # A stall, or a diagnosed world.
            if "timed out" in str(e).lower() or self.store.check([FAILED]):
                self._broken(reason.splitlines()[0][:300], stall=True)
            self.flight.failed = PeerFailed(f"rank {self.rank}: the world broke here")
            # A peer is gone: the launcher names it.
            raise PeerFailed(reason) from e

    def _post(self, send, dst, recv, src, kind):
        """One group of batch_isend_irecv. With headers, the headers go first, as a group of their
        own, and the receiver checks its header before it posts the payload's (DESIGN.md §9)."""
        send = None if send is None else send.contiguous()
        what = _halves(kind, send, dst, recv, src)
        if self.headers:
            got = None if recv is None else torch.empty(8, dtype=torch.int64, device=recv.device)
            mine = None if send is None else self._header(kind, send, self.device)
            self._group(what, mine, dst, got, src).wait()
            if got is not None:
                self._check(kind, recv, src, got)
        return self._group(what, send, dst, recv, src)

    def _group(self, what, send, dst, recv, src):
        ops = ([dist.P2POp(dist.isend, send, dst)] if send is not None else []) + \
              ([dist.P2POp(dist.irecv, recv, src)] if recv is not None else [])
        works = self._guard(what, lambda: dist.batch_isend_irecv(ops)) if ops else []
        return Pending(lambda: [self._guard(what, lambda w=w: self._wait(w)) for w in works])

    def _wait(self, work):
        """Finish a transfer. NCCL: the stream waits, not the host (a timeout polls in a sleep loop;
        a stall is the group's timeout and the flight watcher's, §9.11). gloo: the host, timed."""
        return work.wait() if self.device.type == "cuda" else work.wait(self.timeout)

    def run_native(self, op, x, out, kind, ranks=None):
        """torch's own collective (NCCL on GPU) of x into out, over `ranks` (a group made by
        make_groups; all by default, torch's group None); with headers, a small all-gather of
        headers first catches ranks in mismatched collectives."""
        ranks = tuple(ranks or range(self.world_size))
        if len(ranks) < self.world_size and ranks not in self.groups:
            raise ValueError(f"no torch process group for ranks {ranks}: make it with "
                             f"comm.make_groups (hybrid.split does)")
        group = self.groups.get(ranks)
        if self.headers:
            h = self._header(kind, x, self.device)
            hs = torch.empty(len(ranks) * h.numel(), dtype=h.dtype, device=h.device)
            self._guard("header all-gather", lambda: self._wait(_NATIVE["all_gather"](
                hs, h, group=group, async_op=True)))
            # Every rank sees a mismatch: the world stays usable.
            for src, g in zip(ranks, hs.cpu().view(len(ranks), -1)):
                self._check(kind, x, src, g, latch=False)
        if op == "all_reduce":
            y = out if out is x else out.copy_(x)  # (gloo and NCCL sum in place)
            work = self._guard(kind, lambda: dist.all_reduce(y, group=group, async_op=True))
        else:
            x = x.contiguous()
            work = self._guard(kind, lambda: _NATIVE[op](out, x, group=group, async_op=True))
        # The closure keeps x and out alive till the wait (_wait: the stream's on NCCL).
        return _finish(self, lambda: self._guard(kind, lambda: (x, out, self._wait(work))), out)

    def make_groups(self, rank_lists):
        """torch's process groups for native collectives inside groups. dist.new_group is a
        collective of the whole world: every rank makes every group, in the same order."""
        for ranks in rank_lists:
            if 1 < len(ranks) < self.world_size and ranks not in self.groups:
                self.groups[ranks] = dist.new_group(list(ranks))


# -----------------------------------------------------------------------------
# torch's own collectives (comm.native), and how the engine starts them without waiting

# *_single in newer torch, *_tensor in older (same arguments).
_NATIVE = {"reduce_scatter": getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
           "all_gather": getattr(dist, "all_gather_single", dist.all_gather_into_tensor)}


@contextlib.contextmanager
def started(comm):
    """Inside, torch's own collectives (comm.native) are started, not finished (async_op=True):
    the caller goes on while they run, and must neither read their outputs nor write their
    inputs until the Pending this yields is waited (how the engine overlaps them with backward,
    as DDP and FSDP2 do). Ring collectives still finish inside: a hop waits for the one before."""
    waits = comm.unfinished = []

    # In the order they started; a second wait() finds nothing left.
    def wait():
        while waits:
            waits.pop(0)()
    try:
        yield Pending(wait)
    finally:
        comm.unfinished = None


def _finish(comm, wait, out):
    """A native collective has started: finish it now, or, inside started(), at its wait. Its
    record stays open until then (a rank stalled in the wait is in that collective)."""
    if comm.unfinished is None:
        wait()
        return out
    rec = comm.flight.current
    comm.flight.end(rec, done=False)

    def finish():
        comm.flight.resume(rec)
        wait()
        comm.flight.end(rec)
    comm.unfinished.append(finish)
    return out

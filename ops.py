"""
The communication layer of minizero: a communicator whose one point-to-point operation
is an exchange (send to one rank and receive from another, as one group), and the ring
collectives written on it (launch.py starts the ranks).

    reduce_scatter(x) -> shard      rank r ends with chunk r of the sum over ranks
    all_gather(shard) -> full       every rank ends with every rank's chunk
    all_reduce(x)     -> full       reduce_scatter then all_gather
    Group(comm, ranks)              some of the ranks as a world of their own, so the same
                                    rings run inside a node or across nodes (hybrid sharding)

Every ring collective makes each rank send (N-1)/N of the buffer. The ring fixes the
order in which chunk c is summed: it starts at rank c+1 and travels c+2, ..., c (mod N),
each hop rounded to the buffer's dtype. That order is what makes every ZeRO stage
bit-identical to DDP, so the ring is the default; `comm.native = True` swaps in torch's
own collectives (NCCL on GPU), which sum in an order of their own.

Two transports run the same ring code:
    ThreadComm     ranks are threads of this process (tests; launch.py: run_threads), on
                   the CPU or sharing one GPU (device="cuda")
    ProcessComm    ranks are processes on gloo or nccl (launch.py: run_processes, or
                   init_from_env under torchrun)
"""
import contextlib
import functools
import hashlib
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from minizero_lib import flight
from minizero_lib.flight import DTYPE_CODE, FAILED, CollectiveMismatch, CollectiveStall, Flight, PeerFailed  # noqa: F401


def _describe(kind, t):  # at most 64 characters: it travels as the processes' header
    return f"{kind} of {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"[:64]


def _expect(rank, kind, t, src, got):
    """The mismatch check of both transports: rank src's header `got` must describe the
    collective this rank is in (kind, size, dtype), or the world would hang or sum garbage."""
    if got != _describe(kind, t):
        raise ValueError(f"mismatched collectives: rank {rank} is in {_describe(kind, t)} but rank {src} "
                         f"sent {got}; every rank must call the same collectives in the same order")


class Pending:
    """An operation in flight (an exchange, a job on the engine's communication thread);
    wait() finishes it and returns its result. The one handle type of minizero."""

    def __init__(self, wait):
        self.wait = wait


@contextlib.contextmanager
def in_flight(comm):
    """Inside, torch's own collectives (comm.native) are started, not finished (torch's
    async_op=True): the caller goes on while they run, and must neither read their outputs
    nor write their inputs until the Pending this yields is waited. How the engine overlaps
    them with backward from its own thread, as DDP and FSDP2 do. Ring collectives still
    finish inside: each hop waits for the one before."""
    waits = comm.flying = []

    def wait():  # in the order they started; a second wait() finds nothing left
        while waits:
            waits.pop(0)()
    try:
        yield Pending(wait)
    finally:
        comm.flying = None


def _finish(comm, wait, out):
    """A native collective has started: finish it now, or, in flight, at in_flight's wait. Its
    flight record stays open until then (a rank stalled in the wait is in that collective)."""
    if comm.flying is None:
        wait()
        return out
    rec = comm.flight.current
    comm.flight.end(rec, done=False)

    def finish():
        comm.flight.resume(rec)
        wait()
        comm.flight.end(rec)
    comm.flying.append(finish)
    return out


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _halves(kind, send, dst, recv, src):
    """What an exchange does, in words (for errors): 'send of ... to rank 1 + receive ... from rank 2'."""
    return " + ".join(([f"send of {_describe(kind, send)} to rank {dst}"] if send is not None else []) +
                      ([f"receive of {_describe(kind, recv)} from rank {src}"] if recv is not None else []))


# -----------------------------------------------------------------------------
# transport 1: threads in one process (their world: launch.ThreadWorld). Messages travel
# through one queue per (src, dst) pair; a header rides along so mismatched collectives are caught.
# On a GPU each rank thread computes on a CUDA stream of its own, so a message also
# carries an event: the receiver's stream waits for it before it reads the payload.
# With strict_p2p=True they follow NCCL's rules instead (nccl_model.py).

class ThreadComm:
    def __init__(self, rank, world):
        self.rank, self.world_size, self.world = rank, world.world_size, world
        self.sent = Counter()  # collective kind -> payload bytes this rank has sent
        self.sent_to = Counter()  # peer (global rank) -> payload bytes this rank has sent it
        self.native = False  # torch's own collectives instead of the ring
        self.headers = False  # messages carry no checked headers (the queues check their own)
        self.flying = None  # inside in_flight(): the waits of the native collectives started there
        self.device = world.device
        self.flight = world.flights[rank] = Flight(rank)  # the last collectives (flight.py)

    def exchange(self, send, dst, recv, src, kind="p2p"):
        """Send `send` to rank dst and receive into `recv` from rank src, issued as one
        group (either may be None); returns when both are done. The one point-to-point
        operation of minizero: a ring hop is one exchange."""
        self.iexchange(send, dst, recv, src, kind).wait()

    def iexchange(self, send, dst, recv, src, kind="p2p"):
        """Start exchange(...): the Pending's wait() finishes it."""
        if send is not None:
            _book(self, kind, dst, send.numel() * send.element_size())
        if self.world.p2p is not None:
            return self.world.p2p.issue(self.rank, kind, send, dst, recv, src)
        if send is not None:  # queues never block: the send is done at once
            payload = send.detach().clone()
            self.world.queues[self.rank, dst].put((kind, payload, _made(payload), self.flight.tag))
        return Pending(lambda: None if recv is None else self._take(recv, src, kind))

    def _take(self, t, src, kind):
        deadline = time.monotonic() + self.world.timeout
        while True:
            try:  # a message already sent is delivered, as on a real transport, though its sender failed since
                got_kind, payload, made, tag = self.world.queues[src, self.rank].get(timeout=0.05)
                break
            except queue.Empty:
                if self.world.failed.is_set():
                    raise PeerFailed(f"rank {self.rank}: a peer failed, giving up")
                if time.monotonic() > deadline:
                    self.world.broken(self.rank, f"rank {self.rank} had no message from rank {src} within "
                                      f"{self.world.timeout}s ({_describe(kind, t)})", stall=True)
        if tag != self.flight.tag:  # the sender is in another collective: stop before the payload is read
            self.world.broken(self.rank, f"rank {self.rank} got rank {src}'s message of another collective")
        _expect(self.rank, kind, t, src, _describe(got_kind, payload))
        if made is not None:  # CUDA: read what the sender's stream has written, and keep the
            stream = torch.cuda.current_stream(payload.device)  # payload's memory until we have read it
            stream.wait_event(made)
            payload.record_stream(stream)
        t.copy_(payload)

    def run_native(self, op, x, out, kind, ranks=None):
        """The thread world's native collective over `ranks` (global numbers; all by default):
        every rank reads the others' x straight from shared memory, as a native collective
        would, and sums in rank order. Started in flight (in_flight), it models torch's
        async_op, as strictly as any transport may run it: the ranks meet at the wait (x is
        read then), and until then out holds NaN, so reading it early or writing x shows."""
        if self.flying is None:
            return self._meet(op, x, out, kind, ranks)
        keep = x.detach().clone()
        out.fill_(float("nan"))
        held = keep if out is not x else out.clone()  # what x must hold at the wait

        def wait():
            if not torch.equal(_bits(x), _bits(held)):
                raise RuntimeError(f"rank {self.rank}: the input of a native {kind} in flight was written "
                                   f"before its wait")
            self._meet(op, keep, out, kind, ranks)
        return _finish(self, wait, out)

    def _meet(self, op, x, out, kind, ranks):
        ranks = tuple(ranks or range(self.world_size))
        slots, barrier = self.world.meeting(ranks)
        me = ranks.index(self.rank)
        slots[me] = (kind, x.detach(), _made(x), self.flight.tag)
        self._barrier(barrier)
        if any(s[3] != self.flight.tag for s in slots):  # every rank sees it: the world stays usable
            self.world.broken(self.rank, f"rank {self.rank} read the ranks' native {kind} headers", latch=False)
        for src, (k, y, made, _) in zip(ranks, slots):
            _expect(self.rank, kind, x, src, _describe(k, y))
            if made is not None:
                torch.cuda.current_stream(y.device).wait_event(made)
        ys = torch.stack([s[1] for s in slots])
        if out is x:  # in place: every rank has read x before anyone overwrites it
            self._barrier(barrier)
        out.copy_(ys.view(-1) if op == "all_gather" else
                  ys.sum(0).view(len(ranks), -1)[me] if op == "reduce_scatter" else ys.sum(0))
        if out.is_cuda:  # the reads above are done before their owners may overwrite them
            torch.cuda.current_stream(out.device).synchronize()
        self._barrier(barrier)  # nobody may reuse its slot until everyone has read it
        return out

    def make_groups(self, rank_lists):  # thread ranks meet in any group on first use (launch.ThreadWorld.meeting)
        pass

    def _barrier(self, barrier):
        try:
            barrier.wait(timeout=self.world.timeout)
        except threading.BrokenBarrierError:
            if self.world.failed.is_set():
                raise PeerFailed(f"rank {self.rank}: a peer failed, giving up")
            self.world.broken(self.rank, f"rank {self.rank} waited {self.world.timeout}s for the others at a "
                              f"native collective", stall=True)


def comm_thread(comm):
    """One thread that runs a rank's communication jobs in order (the engine's overlap). On
    a GPU it first makes the rank's device current: a new thread starts on device 0, where
    its CUDA calls would make a context for every rank (and NCCL needs the right device)."""
    cuda = comm.device.type == "cuda"
    return ThreadPoolExecutor(1, thread_name_prefix=f"minizero-comm{comm.rank}",
                              initializer=torch.cuda.set_device if cuda else None, initargs=(comm.device,) if cuda else ())


def _made(t):
    """CUDA: an event on this thread's current stream, which is making t. CPU: None (done)."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


# -----------------------------------------------------------------------------
# transport 2: torch.distributed (gloo on CPU, nccl on GPU), its ranks started by launch.py.
# With check=True every message is preceded by a 64-byte header naming its kind, size and dtype.

class ProcessComm:
    def __init__(self, timeout=120.0, check=True, native=False, store=None):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout, self.check, self.native = timedelta(seconds=timeout), check, native
        self.headers = check  # messages carry checked headers
        self.sent = Counter()  # collective kind -> payload bytes this rank has sent
        self.sent_to = Counter()  # peer (global rank) -> payload bytes this rank has sent it
        self.groups = {}  # ranks -> torch's process group of them, for native collectives in a Group
        self.flying = None  # inside in_flight(): the waits of the native collectives started there
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        self.flight = Flight(self.rank)  # the last collectives (flight.py)
        self.store = store or dist.distributed_c10d._get_default_store()  # where ranks leave their records
        flight.watch(self.store, self.flight, self.world_size)  # a thread answers for this rank, however busy
        if self.device.type == "cuda":  # torch's rule for batch_isend_irecv on NCCL: the first call on
            self._guard("the first collective",  # the group is one every rank takes part in (DESIGN.md §9)
                        lambda: dist.all_reduce(torch.zeros(1, device=self.device), async_op=True).wait(self.timeout))

    def _header(self, kind, t):
        """The 8 numbers (64 bytes) a message carries ahead of its payload: the sender's record
        tag (sequence number, kind, phase, unit, grad mode, size), the payload's size and dtype."""
        return torch.tensor([*self.flight.tag, t.numel(), DTYPE_CODE.get(t.dtype, 0)], device=t.device)

    def _check(self, kind, t, src, header, latch=True):
        if not torch.equal(header.cpu(), self._header(kind, t).cpu()):
            self._broken(f"rank {self.rank} got rank {src}'s header of another collective", latch=latch)

    def _broken(self, reason, stall=False, latch=True):
        """Raise the diagnosis from every rank's record, gathered through the store. latch=True:
        the world is broken, so every rank (its watcher thread) is told, and no rank posts a
        message again (a stale payload meeting a header would abort gloo's process)."""
        if latch:
            self.flight.failed = self.flight.failed or PeerFailed(f"rank {self.rank}: the world broke here")
            if not self.store.check([FAILED]):
                self.store.set(FAILED, reason)
        incident = "fail" if latch else f"x{self.flight.tag[0]}"
        snaps = flight.exchange_snapshots(self.store, self.flight, self.world_size, incident)
        raise flight.diagnose(snaps, self.world_size, reason, self.rank,
                              self.timeout.total_seconds() if stall else None)

    def _guard(self, what, op):
        """Run op, which starts or finishes a transfer. Once a peer is gone, gloo raises in
        either ('Connection reset by peer' at once, or the timeout): the world is broken.
        After a timeout (or once a rank has diagnosed it) the diagnosis says by whom."""
        try:
            return op()
        except Exception as e:
            reason = f"rank {self.rank}: {what} failed or timed out after {self.timeout.total_seconds()}s: {e}"
            if "timed out" in str(e).lower() or self.store.check([FAILED]):  # a stall, or a diagnosed world
                self._broken(reason.splitlines()[0][:300], stall=True)
            self.flight.failed = PeerFailed(f"rank {self.rank}: the world broke here")
            raise PeerFailed(reason) from e  # a peer is gone: the launcher names it

    def exchange(self, send, dst, recv, src, kind="p2p"):
        """As ThreadComm.exchange: one group of torch.distributed.batch_isend_irecv."""
        self.iexchange(send, dst, recv, src, kind).wait()

    def iexchange(self, send, dst, recv, src, kind="p2p"):
        """Start exchange(...): the Pending's wait() finishes it. With check=True the
        64-byte headers go first, as a group of their own, and the receiver checks its
        header before it posts the payload's receive (DESIGN.md §9)."""
        if send is not None:
            _book(self, kind, dst, send.numel() * send.element_size())
            send = send.contiguous()
        what = _halves(kind, send, dst, recv, src)
        if self.check:
            got = None if recv is None else torch.empty(8, dtype=torch.int64, device=recv.device)
            self._group(what, None if send is None else self._header(kind, send), dst, got, src).wait()
            if got is not None:
                self._check(kind, recv, src, got)
        return self._group(what, send, dst, recv, src)

    def _group(self, what, send, dst, recv, src):
        ops = ([dist.P2POp(dist.isend, send, dst)] if send is not None else []) + \
              ([dist.P2POp(dist.irecv, recv, src)] if recv is not None else [])
        works = self._guard(what, lambda: dist.batch_isend_irecv(ops)) if ops else []
        return Pending(lambda: [self._guard(what, lambda w=w: w.wait(self.timeout)) for w in works])

    def run_native(self, op, x, out, kind, ranks=None):
        """torch's own collective (NCCL on GPU) of x into out, over `ranks` (a group made by
        make_groups; all by default); with check=True, a small all-gather of headers first
        catches ranks in mismatched collectives."""
        ranks = tuple(ranks or range(self.world_size))
        if len(ranks) < self.world_size and ranks not in self.groups:
            raise ValueError(f"no torch process group for ranks {ranks}: make it with comm.make_groups (ops.split does)")
        group = self.groups.get(ranks)  # None: the whole world
        if self.check:
            h = self._header(kind, x)
            hs = torch.empty(len(ranks) * h.numel(), dtype=h.dtype, device=h.device)
            self._guard("header all-gather",
                        lambda: _NATIVE["all_gather"](hs, h, group=group, async_op=True).wait(self.timeout))
            for src, g in zip(ranks, hs.view(len(ranks), -1)):
                self._check(kind, x, src, g, latch=False)  # every rank sees it: the world stays usable
        if op == "all_reduce":
            y = out if out is x else out.copy_(x)  # (gloo and NCCL sum in place)
            work = self._guard(kind, lambda: dist.all_reduce(y, group=group, async_op=True))
        else:
            x = x.contiguous()
            work = self._guard(kind, lambda: _NATIVE[op](out, x, group=group, async_op=True))
        # in flight on NCCL, wait() only makes the current stream wait (a timeout would block the
        # host: the process group's own timeout stands); gloo's wait, and a finished one, are the host's
        wait = work.wait if out.is_cuda and self.flying is not None else lambda: work.wait(self.timeout)
        return _finish(self, lambda: self._guard(kind, lambda: (x, out, wait())), out)  # (x, out: alive till then)

    def make_groups(self, rank_lists):
        """torch's process groups for native collectives inside Groups. dist.new_group is a
        collective of the whole world: every rank makes every group, in the same order."""
        for ranks in rank_lists:
            if 1 < len(ranks) < self.world_size and ranks not in self.groups:
                self.groups[ranks] = dist.new_group(list(ranks))


# torch's own collectives: *_single in newer torch, *_tensor in older (same arguments)
_NATIVE = {"reduce_scatter": getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
           "all_gather": getattr(dist, "all_gather_single", dist.all_gather_into_tensor)}


# -----------------------------------------------------------------------------
# groups: some of the ranks as a world of their own (hybrid sharding, DESIGN.md §10)

class Group:
    """The ranks `ranks` (global numbers, in ring order) of comm as a world of their own:
    rank and world_size are the group's, peers are translated to comm's numbers, and the
    ledgers are comm's, so every ring collective below runs over a group unchanged."""

    def __init__(self, comm, ranks):
        self.comm = comm                        # the whole world's communicator
        self.ranks = tuple(ranks)               # group rank i is global rank ranks[i]
        self.rank = self.ranks.index(comm.rank)  # this rank's place in the group
        self.world_size = len(self.ranks)
        self.sent, self.sent_to, self.device = comm.sent, comm.sent_to, comm.device

    @property
    def headers(self):  # whether the whole world's messages carry checked headers
        return self.comm.headers

    @property
    def native(self):  # the whole world's choice (Engine(native=...) sets it there)
        return self.comm.native

    @property
    def flight(self):  # the whole world's record (flight.py): every rank runs the same groups' collectives
        return self.comm.flight

    def exchange(self, send, dst, recv, src, kind="p2p"):  # the one point-to-point operation
        return self.comm.exchange(send, self._global(dst), recv, self._global(src), kind)

    def iexchange(self, send, dst, recv, src, kind="p2p"):
        return self.comm.iexchange(send, self._global(dst), recv, self._global(src), kind)

    def _global(self, r):
        return None if r is None else self.ranks[r]

    def run_native(self, op, x, out, kind):
        return self.comm.run_native(op, x, out, kind, self.ranks)


def split(comm, shard_size):
    """Hybrid sharding's two groups of this rank -> (shards, replicas): shards is its group of
    shard_size consecutive ranks (a node, under torchrun), replicas the ranks at its position
    in every such group. shard_size = world size (or None) is plain ZeRO: (comm, a group of one)."""
    n, s = comm.world_size, comm.world_size if shard_size is None else shard_size
    if not isinstance(s, int) or s < 1 or n % s:
        raise ValueError(f"shard_size must divide the world size {n} (units are sharded over groups of "
                         f"shard_size ranks and copied across world_size/shard_size groups); got {s!r}: "
                         f"use one of {[d for d in range(1, n + 1) if n % d == 0]}")
    if s == n:
        return comm, Group(comm, [comm.rank])
    shards = [tuple(range(g, g + s)) for g in range(0, n, s)]
    replicas = [tuple(range(p, n, s)) for p in range(s)]
    comm.make_groups(shards + replicas)  # (torch's groups, for the native path: every rank makes all)
    return Group(comm, shards[comm.rank // s]), Group(comm, replicas[comm.rank % s])


def _book(comm, kind, dst, nbytes):
    """The ledgers: bytes this rank sent, by collective kind and by peer (global rank)."""
    comm.sent[kind] += nbytes
    comm.sent_to[comm.ranks[dst] if isinstance(comm, Group) else dst] += nbytes


# -----------------------------------------------------------------------------
# the collectives, as rings of exchanges

def _chunks(x, n):
    if x.dim() != 1 or x.numel() % n:
        raise ValueError(f"collectives take a 1-D tensor whose length is a multiple of the "
                         f"world size; got shape {tuple(x.shape)} for world size {n} (pad it)")
    return x.view(n, -1)


def _recorded(op):
    """A collective's entry point: one record in comm.flight (flight.py) from its start to its end;
    a collective that raises stays the rank's current one, for the diagnosis."""
    def wrap(fn):
        @functools.wraps(fn)
        def collective(x, comm, *args, **kw):
            rec = comm.flight.start(op, kw.get("kind", op), x)
            out = fn(x, comm, *args, **kw)
            if comm.flight.current is rec:  # (else it is in flight: its wait ends it)
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
    if comm.native:  # booked as the ring would send: all of it to the right
        _book(comm, kind, (r + 1) % n, (n - 1) * chunks[0].numel() * x.element_size())
        return comm.run_native("reduce_scatter", x, torch.empty_like(chunks[0]), kind)
    right, left = (r + 1) % n, (r - 1) % n
    acc = chunks[(r - 1) % n].clone()   # step 0: my own piece of chunk r-1 starts its journey
    incoming = torch.empty_like(acc)
    for k in range(n - 1):              # N-1 hops, one chunk (x/N) sent per hop, as one exchange
        comm.exchange(acc, right, incoming, left, kind)
        acc = incoming + chunks[(r - 2 - k) % n]  # the partial sum of chunk r-2-k, plus mine
    return acc                          # after N-1 hops: chunk r, summed by every rank


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
        _book(comm, kind, (r + 1) % n, (n - 1) * shard.numel() * shard.element_size())
        return comm.run_native("all_gather", shard, out, kind)
    chunks[r].copy_(shard)
    right, left = (r + 1) % n, (r - 1) % n
    for k in range(n - 1):              # hop k: pass on chunk r-k, receive chunk r-1-k
        comm.exchange(chunks[(r - k) % n], right, chunks[(r - 1 - k) % n], left, kind)
    return out


@_recorded("all_reduce")
def all_reduce(x, comm, kind=None, out=None):
    """Sum over ranks: reduce-scatter then all-gather, so each chunk is summed in the
    ring's order (out=x: in place). Each rank sends 2(N-1)/N of x, booked as the two halves'
    kinds (or both as `kind`). The native path is one all-reduce, booked as the ring's two
    halves (gloo's reduce-scatter is itself an all-reduce)."""
    n = comm.world_size
    if comm.native and n > 1:
        half = (n - 1) * _chunks(x, n)[0].numel() * x.element_size()
        _book(comm, kind or "reduce_scatter", (comm.rank + 1) % n, half)
        _book(comm, kind or "all_gather", (comm.rank + 1) % n, half)
        return comm.run_native("all_reduce", x, torch.empty_like(x) if out is None else out, "all_reduce")
    return all_gather(reduce_scatter(x, comm, kind or "reduce_scatter"), comm, out=out, kind=kind or "all_gather")


@_recorded("broadcast")
def broadcast(x, comm, src=0, kind="broadcast"):
    """Copy src's x into every rank's x along the chain src -> src+1 -> ... (in place)."""
    n, r = comm.world_size, comm.rank
    if n == 1:
        return x
    buf = x.view(torch.uint8) if x.dtype == torch.bool else x  # gloo moves no bools
    if r != src:  # receive, then pass it on: two exchanges, as the second sends what the first got
        comm.exchange(None, None, buf, (r - 1) % n, kind)
    if (r + 1) % n != src:
        comm.exchange(buf, (r + 1) % n, None, None, kind)
    return x


def check_same(entries, comm, what, fix, kind="fingerprint"):
    """Collective: every rank must hold the same list of strings. Two small all-gathers
    when they agree (a count and a hash); else every rank raises, naming the first entry
    that differs as rank 0 and the first other rank with it see it. Sizes agree on every
    rank at every step, so this works without message headers (check=False) too."""
    if comm.world_size == 1:
        return
    digest = [int.from_bytes(hashlib.sha256(e.encode()).digest()[:8], "little", signed=True) for e in entries]
    whole = int.from_bytes(hashlib.sha256("\n".join(entries).encode()).digest()[:8], "little", signed=True)
    dev = comm.device  # NCCL moves only CUDA tensors; the comparisons below run on the CPU
    heads = all_gather(torch.tensor([len(entries), whole], device=dev), comm, kind=kind).view(-1, 2).cpu()
    if (heads == heads[0]).all():
        return
    longest = int(heads[:, 0].max())
    mine = torch.zeros(longest, dtype=torch.int64)
    mine[:len(digest)] = torch.tensor(digest, dtype=torch.int64)
    table = all_gather(mine.to(dev), comm, kind=kind).view(comm.world_size, -1).cpu()
    i, k = min((i, k) for k in range(1, comm.world_size) for i in range(longest) if table[k, i] != table[0, i])
    say = (entries[i] if i < len(entries) else "nothing more").encode()[:200].ljust(200)
    said = all_gather(torch.frombuffer(bytearray(say), dtype=torch.uint8).to(dev), comm,
                      kind=kind).view(comm.world_size, -1).cpu()
    theirs = [bytes(said[j].tolist()).decode(errors="replace").strip() for j in (0, k)]
    raise ValueError(f"{what} #{i} is '{theirs[0]}' on rank 0 but '{theirs[1]}' on rank {k}; {fix}")

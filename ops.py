"""
The communication layer of minizero: ring collectives written on a communicator whose one
point-to-point operation is an exchange (send to one rank and receive from another, as one
group). In reading order: the collectives; Comm, what every communicator has; its transports,
ThreadComm (ranks are threads of this process, on the CPU or one shared GPU: the tests) and
ProcessComm (processes on gloo or nccl), started by launch.py; Group and split (hybrid
sharding); the details of torch's own collectives; check_same.

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
import hashlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from minizero_lib import flight
from minizero_lib.flight import (DTYPE_CODE, FAILED, CollectiveMismatch,  # noqa: F401
                                 CollectiveStall, Flight, PeerFailed)


# -----------------------------------------------------------------------------
# the collectives, as rings of exchanges (comm: a ThreadComm, a ProcessComm or a Group)

def _chunks(x, n):
    if x.dim() != 1 or x.numel() % n:
        raise ValueError(f"collectives take a 1-D tensor whose length is a multiple of the "
                         f"world size; got shape {tuple(x.shape)} for world size {n} (pad it)")
    return x.view(n, -1)


def _recorded(op):
    """A collective's entry point: one record in comm.flight (flight.py) from its start to its
    end (in flight: its wait); one that raises stays the rank's current one, for the diagnosis."""
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

class Pending:
    """An operation in flight (an exchange, a job on the engine's communication thread);
    wait() finishes it and returns its result. The one handle type of minizero."""

    def __init__(self, wait):
        self.wait = wait


class Comm:
    """What every communicator has: its place, the ledgers of the bytes it sent, its flight
    record, and exchange, the one point-to-point operation the rings run on. A transport says
    how a message travels (_post) and how torch's own collectives run (run_native)."""

    def __init__(self, rank, world_size, device, headers=False, native=False):
        self.rank = rank              # this rank's number, 0 .. world_size-1
        self.world_size = world_size  # the number of ranks, in ring order
        self.device = device          # where messages live (NCCL moves only CUDA tensors)
        # Whether each message follows a header of its own, checked before the payload moves
        # (ProcessComm(check=True)); a thread's message carries one for free: threads say False.
        self.headers = headers
        self.native = native  # torch's own collectives instead of the ring
        self.flying = None  # inside in_flight(): the waits of the native collectives started there
        self.flight = Flight(rank)  # the last collectives (flight.py), read when the world breaks
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
# transport 1: threads in one process, whose world (launch.ThreadWorld) moves the messages:
# one queue per (src, dst) pair, each message with its kind and record tag, checked on receipt,
# and on a GPU an event the receiver's stream waits for (every rank thread computes on a CUDA
# stream of its own). With strict_p2p=True they follow NCCL's rules instead (nccl_model.py).

class ThreadComm(Comm):
    def __init__(self, rank, world):
        super().__init__(rank, world.world_size, world.device)
        self.world = world  # what the rank threads share: queues, meetings, every flight record
        world.flights[rank] = self.flight

    def _post(self, send, dst, recv, src, kind):
        if self.world.p2p is not None:
            return self.world.p2p.issue(self.rank, kind, send, dst, recv, src)
        if send is not None:
            self.world.post(self, dst, kind, send)
        return Pending(lambda: None if recv is None else self.world.take(self, src, kind, recv))

    def run_native(self, op, x, out, kind, ranks=None):
        """The thread world's native collective over `ranks` (global numbers; all by default):
        the ranks meet in shared memory (launch.ThreadWorld.meet). In flight it models torch's
        async_op as strictly as any transport may run it: the ranks meet at the wait (x is read
        then), and until then out holds NaN, so reading it early or writing x shows."""
        if self.flying is None:
            return self.world.meet(self, op, x, out, kind, ranks)
        keep = x.detach().clone()
        out.fill_(float("nan"))
        # What x must hold at the wait.
        held = keep if out is not x else out.clone()

        def wait():
            bits = [t.detach().reshape(-1).view(torch.uint8) for t in (x, held)]
            if not torch.equal(*bits):
                raise RuntimeError(f"rank {self.rank}: the input of a native {kind} in flight was "
                                   f"written before its wait")
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
        self.groups = {}  # ranks -> their torch process group, for native collectives in a Group
        # Where ranks leave their records; a thread answers for this rank, however busy.
        self.store = store or dist.distributed_c10d._get_default_store()
        flight.watch(self.store, self.flight, self.world_size)
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
        snaps = flight.exchange_snapshots(self.store, self.flight, self.world_size, incident)
        raise flight.diagnose(snaps, self.world_size, reason, self.rank,
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
                             f"comm.make_groups (ops.split does)")
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
        """torch's process groups for native collectives inside Groups. dist.new_group is a
        collective of the whole world: every rank makes every group, in the same order."""
        for ranks in rank_lists:
            if 1 < len(ranks) < self.world_size and ranks not in self.groups:
                self.groups[ranks] = dist.new_group(list(ranks))


# -----------------------------------------------------------------------------
# groups: some of the ranks as a world of their own (hybrid sharding, DESIGN.md §10). A
# reader of plain ZeRO can skip this: without shard_size every collective runs on comm.

class Group:
    """The ranks `ranks` (global numbers, in ring order) of comm as a world of their own: rank
    and world_size are the group's, peers are translated to comm's numbers, and all else
    (ledgers, flight, native, headers, device) is comm's, read live, so the rings run unchanged.
    A view, not a Comm: copies of comm's fields would go stale (bench swaps comm.flight)."""

    def __init__(self, comm, ranks):
        self.comm = comm                         # the whole world's communicator
        self.ranks = tuple(ranks)                # group rank i is global rank ranks[i]
        self.rank = self.ranks.index(comm.rank)  # this rank's place in the group
        self.world_size = len(self.ranks)        # the number of ranks in the group's ring
        self.sent, self.sent_to, self.device = comm.sent, comm.sent_to, comm.device  # comm's

    # comm's choices (Engine(native=...) sets them there), record, and waits in flight.
    native = property(lambda self: self.comm.native)
    headers = property(lambda self: self.comm.headers)
    flight = property(lambda self: self.comm.flight)
    flying = property(lambda g: g.comm.flying, lambda g, waits: setattr(g.comm, "flying", waits))

    def book(self, kind, dst, nbytes):
        self.comm.book(kind, self.ranks[dst], nbytes)

    # The same exchange as every communicator's: wait on iexchange.
    exchange = Comm.exchange

    def iexchange(self, send, dst, recv, src, kind="p2p"):
        dst, src = (None if r is None else self.ranks[r] for r in (dst, src))
        return self.comm.iexchange(send, dst, recv, src, kind)

    def run_native(self, op, x, out, kind):
        return self.comm.run_native(op, x, out, kind, self.ranks)


def split(comm, shard_size):
    """Hybrid sharding's two groups of this rank -> (shards, replicas): shards is its group of
    shard_size consecutive ranks (a node, under torchrun), replicas the ranks at its position
    in every such group. shard_size = world size (or None) is plain ZeRO: (comm, a group of 1)."""
    n, s = comm.world_size, comm.world_size if shard_size is None else shard_size
    if not isinstance(s, int) or s < 1 or n % s:
        raise ValueError(f"shard_size must divide the world size {n} (units are sharded over "
                         f"groups of shard_size ranks and copied across world_size/shard_size "
                         f"groups); got {s!r}: use one of "
                         f"{[d for d in range(1, n + 1) if n % d == 0]}")
    if s == n:
        return comm, Group(comm, [comm.rank])
    shards = [tuple(range(g, g + s)) for g in range(0, n, s)]
    replicas = [tuple(range(p, n, s)) for p in range(s)]
    # torch's groups, for the native path: every rank makes all.
    comm.make_groups(shards + replicas)
    return Group(comm, shards[comm.rank // s]), Group(comm, replicas[comm.rank % s])


# -----------------------------------------------------------------------------
# torch's own collectives (comm.native): started in flight, and the engine's overlap thread

# *_single in newer torch, *_tensor in older (same arguments).
_NATIVE = {"reduce_scatter": getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
           "all_gather": getattr(dist, "all_gather_single", dist.all_gather_into_tensor)}


@contextlib.contextmanager
def in_flight(comm):
    """Inside, torch's own collectives (comm.native) are started, not finished (async_op=True):
    the caller goes on while they run, and must neither read their outputs nor write their
    inputs until the Pending this yields is waited (how the engine overlaps them with backward,
    as DDP and FSDP2 do). Ring collectives still finish inside: a hop waits for the one before."""
    waits = comm.flying = []
    # In the order they started; a second wait() finds nothing left.
    def wait():
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


def comm_thread(comm):
    """One thread that runs a rank's communication jobs in order (the engine's overlap). On
    a GPU it first makes the rank's device current: a new thread starts on device 0, where
    its CUDA calls would make a context for every rank (and NCCL needs the right device)."""
    cuda = comm.device.type == "cuda"
    return ThreadPoolExecutor(1, thread_name_prefix=f"minizero-comm{comm.rank}",
                              initializer=torch.cuda.set_device if cuda else None,
                              initargs=(comm.device,) if cuda else ())


# -----------------------------------------------------------------------------
# a check on top of the collectives: every rank holds the same strings

def check_same(entries, comm, what, fix, kind="fingerprint"):
    """Collective: every rank must hold the same list of strings. Two small all-gathers when
    they agree (a count and a hash); else every rank raises, naming the first entry that differs
    as rank 0 and the first other rank with it see it. Sizes agree on every rank at every step,
    so this works without message headers (check=False) too."""
    if comm.world_size == 1:
        return
    digest = [_hash(e) for e in entries]
    whole = _hash("\n".join(entries))
    # NCCL moves only CUDA tensors; the comparisons below run on the CPU.
    dev = comm.device
    heads = all_gather(torch.tensor([len(entries), whole], device=dev), comm, kind=kind)
    heads = heads.view(-1, 2).cpu()
    if (heads == heads[0]).all():
        return
    longest = int(heads[:, 0].max())
    mine = torch.zeros(longest, dtype=torch.int64)
    mine[:len(digest)] = torch.tensor(digest, dtype=torch.int64)
    table = all_gather(mine.to(dev), comm, kind=kind).view(comm.world_size, -1).cpu()
    i, k = min((i, k) for k in range(1, comm.world_size) for i in range(longest)
               if table[k, i] != table[0, i])
    say = (entries[i] if i < len(entries) else "nothing more").encode()[:200].ljust(200)
    said = all_gather(torch.frombuffer(bytearray(say), dtype=torch.uint8).to(dev), comm,
                      kind=kind).view(comm.world_size, -1).cpu()
    theirs = [bytes(said[j].tolist()).decode(errors="replace").strip() for j in (0, k)]
    raise ValueError(f"{what} #{i} is '{theirs[0]}' on rank 0 but '{theirs[1]}' on rank {k}; {fix}")


def _hash(s):
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "little", signed=True)

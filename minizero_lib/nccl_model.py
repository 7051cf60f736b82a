"""
strict_p2p: a CPU model of NCCL's point-to-point rules, for the thread world
(launch.run_threads(..., strict_p2p=True)), so that a ring which would hang on NCCL fails
here, in a test, naming what each rank waits for.

    one stream    each rank's exchanges run one at a time, in the order the rank issued
                  them (from whichever of its threads): only the one at the head runs
    no buffering  a send completes only when the receive it meets runs, at the head of
                  its peer's stream; neither side goes on before
    one group     an exchange's send and receive run together and it completes when both
                  have met theirs (torch.distributed.batch_isend_irecv)
    one device    every tensor is on the ranks' device (NCCL moves only GPU tensors)

A ring hop that sends, then receives in an operation of its own, waits in a circle under
these rules: every rank's send waits for a receive queued behind its peer's send. NCCL
buffers a little (small hops pass there), the model nothing, so it errs on the safe side.

Two helpers serve every thread-world message, here and in launch.ThreadWorld's queues and
meetings: _made (the CUDA event a message carries) and _expect (the receiver's check).
"""
import threading
import time
from collections import deque

import torch

import ops


def _made(t):
    """CUDA: an event on this thread's current stream, which is making t. CPU: None (done)."""
    if not on_gpu(t):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


def on_gpu(t):
    """Whether t is on a GPU, asked in one place (the CPU tests fake the GPU's streams here)."""
    return t.is_cuda


def _expect(rank, kind, t, src, got):
    """The thread world's mismatch check: rank src's message, described as `got`, must be of the
    collective this rank is in (kind, size, dtype), or the world would hang or sum garbage."""
    if got != ops._describe(kind, t):
        raise ValueError(f"mismatched collectives: rank {rank} is in {ops._describe(kind, t)} but "
                         f"rank {src} sent {got}; every rank must call the same collectives in the "
                         f"same order")


class Deadlock(RuntimeError):
    """Every rank waits on an exchange that no rank can match any more."""


class Streams:
    """Every rank's one stream of exchanges, as NCCL runs them."""

    def __init__(self, world):
        # the launch.ThreadWorld: its timeout, `failed`, meetings
        self.world = world
        # each rank's exchanges, in issue order
        self.queued = [deque() for _ in range(world.world_size)]
        self.finished = [False] * world.world_size  # the rank's thread has returned or raised
        self.stuck = None                       # the deadlock, in words, once found
        self.lock = threading.Condition()       # guards the three above

    def issue(self, rank, kind, send, dst, recv, src):
        """Queue rank's exchange (send to dst, receive into recv from src) on its stream."""
        x = Exchange(rank, kind, send, dst, recv, src)
        for t in (x.send, x.recv):  # (a host tensor, say a shard offloaded to the host)
            if t is not None and t.device != self.world.device:
                raise ValueError(f"rank {x.rank}: {x} has a tensor on {t.device}, but the ranks "
                                 f"work on {self.world.device}; NCCL moves only tensors on the "
                                 "rank's GPU: move it there first")
        with self.lock:
            self.queued[x.rank].append(x)
            self._progress()
        return ops.Pending(lambda: self._wait(x))

    def finish(self, rank):
        """The rank's thread is done: it issues nothing more."""
        with self.lock:
            self.finished[rank] = True
            self._progress()

    def _wait(self, x):
        deadline = time.monotonic() + self.world.timeout
        with self.lock:
            while not x.done():
                if self.stuck:
                    raise Deadlock(self.stuck)
                if self.world.failed.is_set():
                    raise ops.PeerFailed(f"rank {x.rank}: a peer failed, giving up")
                if time.monotonic() > deadline:
                    raise ops.PeerFailed(f"rank {x.rank}: no point-to-point progress within "
                                         f"{self.world.timeout}s: {self._heads()}")
                self.lock.wait(0.05)
        if x.error is not None:
            raise x.error

    def _progress(self):
        """Meet every send at a stream's head with the receive at its peer's head, retire
        the exchanges that are done, until nothing moves. Then, if every rank has finished
        or waits behind an exchange that cannot meet its peer, no rank can ever move: a
        deadlock (a rank's later exchanges queue behind its head, so they cannot help)."""
        moved = True
        while moved:
            moved = False
            for q in self.queued:
                x = q[0] if q else None
                peer = self.queued[x.dst] if x is not None and not x.sent else None
                if peer and not peer[0].got and peer[0].src == x.rank:
                    x.deliver(peer[0])
                    moved = True
            for q in self.queued:
                while q and q[0].done():
                    q.popleft()
                    moved = True
        if self.stuck is None and not self.world.failed.is_set() and any(self.queued) \
                and all(q or done for q, done in zip(self.queued, self.finished)):
            self.stuck = ("point-to-point deadlock under NCCL's rules (strict_p2p=True): "
                          f"{self._heads()}")
            self.world.abort_meetings()
        self.lock.notify_all()

    def _heads(self):
        def state(q, done):
            if not q:
                return "has finished" if done else "is in no point-to-point operation"
            behind = (f", ahead of {q[1]}" + (f" and {len(q) - 2} more" if len(q) > 2 else "")
                      if len(q) > 1 else "")
            return f"is stuck in {q[0]}{behind}"
        return "; ".join(f"rank {r} {state(q, done)}"
                         for r, (q, done) in enumerate(zip(self.queued, self.finished)))


class Exchange:
    """One exchange on its rank's stream: a send half, a receive half, or both."""

    def __init__(self, rank, kind, send, dst, recv, src):
        self.rank, self.kind = rank, kind       # who issued it, and the collective's kind
        # the tensor to send (None: no send half) and to whom
        self.send, self.dst = send, dst
        # the tensor to receive into (None: no receive half), from whom
        self.recv, self.src = recv, src
        self.sent, self.got = send is None, recv is None  # each half done
        # CUDA: the issuer's work
        self.made = [_made(t) for t in (send, recv) if t is not None and t.is_cuda]
        self.error = None                       # a mismatched collective, found when the halves met

    def done(self):
        return self.sent and self.got

    def deliver(self, to):
        """This exchange's send meets the receive of `to`: the payload moves now."""
        self.sent = to.got = True
        try:
            _expect(to.rank, to.kind, to.recv, self.rank, ops._describe(self.kind, self.send))
        except ValueError as e:
            to.error = e
            return
        if not to.recv.is_cuda:
            to.recv.copy_(self.send)
            return
        # after what both issuers' streams did to
        stream = torch.cuda.current_stream(to.recv.device)
        # the two tensors; done before either goes on
        for e in self.made + to.made:
            stream.wait_event(e)
        to.recv.copy_(self.send)
        stream.synchronize()

    def __str__(self):
        return ops._halves(self.kind, self.send, self.dst, self.recv, self.src)

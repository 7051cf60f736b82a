"""
Where a rank's collectives run, in the order the engine asks for them (so they pair up
across ranks): on a communication thread of its own while autograd computes (overlap=True,
the default), started in flight on torch's own collectives and finished at their wait (as
DDP and FSDP2 run them), or inline (overlap=False, or one rank). Which one changes when
bytes move, never how they are summed. A first reading can skip this file: every job is
one of stages.py's functions, run now or a little later.
"""
import torch

from ops import Pending, comm_thread, in_flight


class CommQueue:
    """One rank's communication jobs, each a function that runs collectives."""

    def __init__(self, comm, overlap):
        overlap = overlap and comm.world_size > 1  # one rank sends nothing
        self.comm = comm                            # whose collectives run here
        # one thread runs the jobs in the order submitted, so they pair up across ranks
        self.pool = comm_thread(comm) if overlap else None
        # GPU: the thread's collectives run on a side stream, beside the compute stream
        self.side = torch.cuda.Stream(comm.device) if overlap and comm.device.type == "cuda" \
            else None
        self.reductions = []                        # this micro-batch's reductions not yet waited
        self.last = None                            # the job submitted last: drain() waits for it

    def submit(self, job, record, fly=False):
        """Run job() (its collectives recorded under `record`, flight.py's context) and return
        a Pending. fly=True says nothing reads the job's result before its wait, and it is
        one collective, so on torch's collectives without headers it starts right here and
        finishes at the wait (ops.in_flight); not accumulation's later micro-batches (they add
        to the sum), nor hybrid's, nor with headers, which make each start a round trip."""
        job = self.comm.flight.within(record, job)
        if self.pool is not None and fly and self.comm.native and not self.comm.headers:
            with in_flight(self.comm) as pending:
                job()
            self.last = pending
            return pending
        if self.pool is None:
            out = job()
            return Pending(lambda: out)
        if self.side is not None:
            job = self._on_side_stream(job)
        self.last = Pending(self.pool.submit(job).result)
        return self.last

    def _on_side_stream(self, compute):
        """GPU: the side stream waits for the compute that made the job's inputs."""
        ready = torch.cuda.Event()
        ready.record()

        def job():
            with torch.cuda.stream(self.side):
                self.side.wait_event(ready)
                out = compute()
                self.side.synchronize()
                return out
        return job

    def hold(self, reduction):
        """Keep a submitted gradient reduction until drain(). At most one waits behind the one
        sending: each holds a whole unit's gradient, and a slow link must not pile them up."""
        self.reductions.append(reduction)
        if len(self.reductions) > 2:
            self.reductions.pop(0).wait()

    def drain(self):
        """Wait until every job is done (re-raising a failed collective here): collectives may
        then run inline."""
        jobs = [j for j in (*self.reductions, self.last) if j is not None]
        self.reductions, self.last = [], None
        for job in jobs:
            job.wait()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()

"""
The GPU's rules, modelled on the CPU (no GPU needed), so that code which CI cannot run on
a GPU is still held to what NCCL and CUDA demand: NCCL's point-to-point rules
(strict_p2p, nccl_model.py), torch's collectives started without waiting (async_op: ops.started),
and each rank's own GPU made current everywhere (the device calls recorded).
"""
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import minizero
import ops
from minizero_lib import flight, launch
from test_ops import _expect_failure, _planted, assert_bits_equal

torch.set_num_threads(1)


# -----------------------------------------------------------------------------
# torch's collectives started, and finished at their wait

def _started_early(comm, write):
    """An all-reduce started without waiting, its output read before the wait and (write=True) its
    input written before it; the flight record seen before and after."""
    comm.native = True
    x = torch.full((6,), comm.rank + 1.0)
    with ops.started(comm) as pending:
        y = ops.all_reduce(x, comm)
    rec, early = comm.flight.records[-1], y.clone()
    running = (rec[flight.T1] is None, comm.flight.current)
    if write:
        x.add_(1)
    pending.wait()
    pending.wait()  # (nothing left: a second wait is a no-op, as the engine's drain may make one)
    return early, y, running, rec[flight.T1] is not None, comm.flight.current


def test_started_early_is_modelled_as_strictly_as_a_transport_may_run_it():
    """On threads a native collective started early meets its peers at the wait: until then its
    output holds NaN (a read before the wait shows in the result) and writing its input
    raises, so the engine's overlap on torch's collectives is proven here as NCCL runs it.
    Its flight record stays open, outside the rank's current collective, until the wait."""
    for early, y, running, ended, current in launch.run_threads(_started_early, 3, False):
        assert early.isnan().all() and torch.equal(y, torch.full((6,), 6.0))
        assert running == (True, None) and ended and current is None
    _expect_failure(lambda: launch.run_threads(_started_early, 3, True), "input of a native all_reduce started (ops.started) "
                    "was written before its wait")


def test_a_stall_started_early_names_the_collective_waited_for():
    def fn(comm):
        comm.native = True
        with ops.started(comm) as pending:
            ops.all_gather(torch.ones(2), comm)
        if comm.rank == 1:
            time.sleep(2)  # rank 1 waits late: rank 0, waiting, is in that all-gather
            raise KeyError("rank 1 gives up")
        pending.wait()
    _expect_failure(lambda: launch.run_threads(fn, 2, timeout=1.0), "rank 0: in #0 all_gather of 2 float32")


# -----------------------------------------------------------------------------
# NCCL's point-to-point rules (strict_p2p=True): the ring hop as it was (a send,
# then a receive of its own) waits in a circle there; one exchange per hop does not

def _old_hop(comm):
    n, r = comm.world_size, comm.rank
    acc, incoming = torch.full((4,), float(r)), torch.empty(4)
    req = comm.iexchange(acc, (r + 1) % n, None, None, "reduce_scatter")  # isend to the right,
    comm.exchange(None, None, incoming, (r - 1) % n, "reduce_scatter")    # then recv from the left
    req.wait()
    return incoming


def _new_hop(comm):
    n, r = comm.world_size, comm.rank
    acc, incoming = torch.full((4,), float(r)), torch.empty(4)
    comm.exchange(acc, (r + 1) % n, incoming, (r - 1) % n, "reduce_scatter")
    return incoming


@pytest.mark.parametrize("n", [2, 3, 5])
def test_strict_p2p_catches_the_old_ring_hop(n):
    """At 3+ ranks every rank's send waits on its right neighbour, which is sending too; at 2
    ranks each send is queued ahead of the receive it waits for. The queues of the default
    thread world buffer, so the old hop passes there; NCCL's rules find the deadlock at once
    (long before the timeout) and name each rank's operation. The exchange passes both."""
    left = [torch.full((4,), float((r - 1) % n)) for r in range(n)]
    for got, want in zip(launch.run_threads(_old_hop, n), left):
        assert_bits_equal(got, want)
    err = _expect_failure(lambda: launch.run_threads(_old_hop, n, strict_p2p=True, timeout=60.0),
                          "point-to-point deadlock under NCCL's rules", within=10.0)
    for r in range(n):
        assert f"rank {r} is stuck in send of reduce_scatter of (4,) float32 to rank {(r + 1) % n}" in str(err)
    for strict in (False, True):
        for got, want in zip(launch.run_threads(_new_hop, n, strict_p2p=strict), left):
            assert_bits_equal(got, want)


def test_strict_p2p_sends_only_when_received():
    """No buffering: a send to a rank that never receives is a deadlock (the queues would
    take it), named with the rank that has finished; a receive no rank sends to as well."""
    def fn(comm):
        if comm.rank == 0:
            comm.exchange(torch.ones(2), 1, None, None, "buffers")
    assert launch.run_threads(fn, 2) == [None, None]
    _expect_failure(lambda: launch.run_threads(fn, 2, strict_p2p=True), "rank 0 is stuck in send of buffers of (2,) "
                    "float32 to rank 1; rank 1 has finished", within=10.0)

    def fn(comm):
        comm.exchange(None, None, torch.empty(3), 1 - comm.rank)
    _expect_failure(lambda: launch.run_threads(fn, 2, strict_p2p=True), "rank 0 is stuck in receive of p2p of (3,) "
                    "float32 from rank 1; rank 1 is stuck in receive of p2p of (3,) float32 from rank 0", within=10.0)


def test_strict_p2p_moves_only_tensors_on_the_ranks_device():
    """NCCL moves only tensors on the rank's GPU (a host shard would fail there): thread ranks
    on the meta device stand in for GPU ranks, a CPU tensor for a host one."""
    def fn(comm):
        return ops.all_gather(torch.ones(2, device=comm.device if comm.rank else "cpu"), comm)
    _expect_failure(lambda: launch.run_threads(fn, 2, device="meta", strict_p2p=True), "rank 0 failed: ValueError",
                    "has a tensor on cpu, but the ranks work on meta; NCCL moves only tensors on the rank's GPU")


@pytest.mark.parametrize("case", ["kind", "size"])
def test_mismatched_collectives_under_strict_p2p(case):
    def fn(comm):
        if comm.rank == 0:
            return ops.reduce_scatter(torch.ones(4), comm)
        return ops.all_gather(torch.ones(2), comm) if case == "kind" else ops.reduce_scatter(torch.ones(6), comm)
    err = _expect_failure(lambda: launch.run_threads(fn, 2, strict_p2p=True), "mismatched collectives")
    assert isinstance(err.__cause__, ValueError)


def test_strict_p2p_puts_a_ranks_threads_on_one_stream():
    """A rank's exchanges run in the order the rank issued them, whichever of its threads
    issued them (the engine's communication thread and the main thread share NCCL's one
    stream): rank 0's send from one thread, then its receive from another, is the old hop
    at 2 ranks again, though the receive alone could have met rank 1's send."""
    def fn(comm):
        if comm.rank == 1:
            comm.exchange(torch.ones(2), 0, None, None)
            return comm.exchange(None, None, torch.empty(2), 0)
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(comm.exchange, torch.ones(2), 1, None, None)
            time.sleep(0.1)  # (the send is issued first)
            comm.exchange(None, None, torch.empty(2), 1)
            return sending.result()
    assert launch.run_threads(fn, 2) == [None, None]
    _expect_failure(lambda: launch.run_threads(fn, 2, strict_p2p=True), "rank 0 is stuck in send of p2p of (2,) "
                    "float32 to rank 1", "rank 1 is stuck in send of p2p of (2,) float32 to rank 0", within=10.0)


# -----------------------------------------------------------------------------
# each rank's own GPU, everywhere: the device calls recorded (no GPU needed)

def test_the_communication_thread_makes_the_ranks_gpu_current(monkeypatch):
    """A new thread starts on device 0: the engine's communication thread must make the
    rank's GPU current first (else a context on GPU 0 for every rank, and NCCL on the
    wrong device). torch.cuda.set_device is recorded."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device in (torch.device("cuda", 2), torch.device("cpu")):
        pool = minizero.comm_thread(SimpleNamespace(rank=1, device=device))
        pool.submit(lambda: None).result()
        pool.shutdown()
    assert calls == [torch.device("cuda", 2)]


def test_init_from_env_checks_local_rank_and_starts_nccl_at_once(monkeypatch):
    """torchrun's LOCAL_RANK must name a visible GPU (else a clear error); that GPU is made
    current and given to init_process_group as device_id (NCCL starts at once). Recorded:
    torch.cuda's answers and calls, dist.init_process_group; so is run_processes' check."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["device_id"])))
    monkeypatch.setattr(ops, "ProcessComm", lambda *args: SimpleNamespace(rank=0, name="comm"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    assert launch.init_from_env().name == "comm"
    assert calls == [("set_device", torch.device("cuda", 1)), ("nccl", torch.device("cuda", 1))]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"LOCAL_RANK is 2 but this process sees 2 GPU\(s\).*--nproc_per_node=2"):
        launch.init_from_env()
    with pytest.raises(ValueError, match="nccl takes one GPU per rank: world size 3 needs that many, this machine has 2"):
        launch.run_processes(_planted, 3, backend="nccl")

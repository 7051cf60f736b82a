"""Host reads of device values: each one (.item(), .tolist(), .cpu(), bool(t), float(t), ...)
waits for everything queued on a GPU before it, and so does every blocking copy between the
host and a GPU (torch.tensor(..., device=), .to or copy_ across without non_blocking or into
pageable memory) and every synchronize. The engine makes exactly one per step, the flags of
step() (skip or not, DDP's unused parameters), and none in forward or backward, on the
communication thread included. On the CPU every tensor counts as the device's (a blocking
copy is then only torch.tensor(..., device=); on CUDA, gpu_check.sh, every one is seen)."""
import collections
import contextlib
import os
import threading

import pytest
import torch

import minizero
from minizero import Engine
from minizero_lib import launch
from train_gpt import GPT, GPTConfig

DEVICE = os.environ.get("MINIZERO_DEVICE", "cpu")
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def recorded():
    """Count the host reads of tensors on DEVICE, by phase: what the calling thread is in
    (phase.now, set by the loop), or "comm" on an engine's communication thread."""
    counts, lock, phase = collections.Counter(), threading.Lock(), threading.local()
    real = {name: getattr(torch.Tensor, name) for name in READS + ("to", "copy_")}
    real_tensor, syncs = torch.tensor, [torch.cuda.synchronize, torch.cuda.Stream.synchronize,
                                        torch.cuda.Event.synchronize]
    device = torch.device(DEVICE).type

    def count():
        comm = threading.current_thread().name.startswith("minizero-comm")
        with lock:
            counts["comm" if comm else getattr(phase, "now", "other")] += 1

    def wrap(name):
        def read(t, *args, **kwargs):
            if t.device.type == device:
                count()
            return real[name](t, *args, **kwargs)
        return read

    def blocking(src, dst, non_blocking):
        """A copy the host waits for: across host and GPU, blocking, or to pageable host memory."""
        if src.device.type != dst.device.type:
            if not non_blocking or (dst.device.type == "cpu" and not dst.is_pinned()):
                count()

    def to(t, *args, **kw):
        out = real["to"](t, *args, **kw)
        blocking(t, out, kw.get("non_blocking", False))
        return out

    def copy_(dst, src, non_blocking=False):
        blocking(src, dst, non_blocking)
        return real["copy_"](dst, src, non_blocking)

    def tensor(*args, **kw):
        if kw.get("device") is not None and torch.device(kw["device"]).type == device:
            count()
        return real_tensor(*args, **kw)

    def synced(sync):
        return lambda *args, **kw: (count(), sync(*args, **kw))[1]
    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    torch.Tensor.to, torch.Tensor.copy_, torch.tensor = to, copy_, tensor
    torch.cuda.synchronize = synced(syncs[0])
    torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize = synced(syncs[1]), synced(syncs[2])
    try:
        yield counts, phase
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor = real_tensor
        torch.cuda.synchronize = syncs[0]
        torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize = syncs[1], syncs[2]


def train(comm, stage, kw, steps, phase, keep=None):
    """A small GPT's loop with its phases marked; -> keep(engine) before it closes."""
    torch.set_num_threads(1)
    model = GPT(GPTConfig(2, 2, 16, 8, 256, True), torch.Generator().manual_seed(0)).to(comm.device)
    eng = Engine(model, comm, stage, lr=1e-2, **kw)
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        for _ in range(eng.grad_accum):
            x = torch.randint(0, 256, (2, 9), generator=g).to(comm.device)
            phase.now = "forward"
            _, loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            phase.now = "backward"
            eng.backward(loss)
        phase.now = "step"
        eng.step()
        phase.now = "other"
    out = keep(eng) if keep else None
    eng.close()
    return out


CASES = {"fp32": {}, "bf16, accumulation, clipping": dict(dtype=torch.bfloat16, grad_accum=2, clip=0.5),
         "fp16 loss scale, no overlap": dict(dtype=torch.float16, overlap=False),
         "torch's collectives, in flight": dict(native=True)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_one_host_read_per_step_and_none_in_backward(world_size, case):
    steps = 3
    for stage in (0, 1, 2, 3):
        with recorded() as (counts, phase):
            launch.run_threads(train, world_size, stage, CASES[case], steps, phase, device=DEVICE)
        assert counts["step"] == world_size * steps, (stage, counts)
        assert counts["forward"] + counts["backward"] + counts["comm"] == 0, (stage, counts)


def test_the_recorder_sees_a_read_in_a_reduction(monkeypatch):
    """A planted read on the communication thread (a loss scale check, say) is counted."""
    real = minizero.reduce_grads
    monkeypatch.setattr(minizero, "reduce_grads", lambda local, *a: (local.sum().item(), real(local, *a))[1])
    with recorded() as (counts, phase):
        launch.run_threads(train, 2, 0, {}, 2, phase, device=DEVICE)
    assert counts["comm"] == 2 * 2 * 3, counts  # two ranks, two steps, three units
    assert counts["step"] == 2 * 2, counts


def test_the_recorder_sees_a_blocking_copy_in_the_step(monkeypatch):
    """torch.tensor(..., device=) is a blocking copy to a GPU: the step's flags made that way
    (as they once were) are a second host wait per step."""
    real = minizero.all_gather
    plant = lambda x: x + torch.tensor(0.0, dtype=x.dtype, device=x.device)  # noqa: E731
    monkeypatch.setattr(minizero, "all_gather",
                        lambda x, *a, **k: real(plant(x) if k.get("kind") == "flags" else x, *a, **k))
    with recorded() as (counts, phase):
        launch.run_threads(train, 2, 1, {}, 2, phase, device=DEVICE)
    assert counts["step"] == 2 * 2 * 2, counts  # two ranks, two steps, the flags' read and the planted copy
    assert counts["forward"] + counts["backward"] + counts["comm"] == 0, counts

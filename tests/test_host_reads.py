"""Host reads of device values: each one (.item(), .tolist(), .cpu(), bool(t), float(t), ...)
waits for everything queued on a GPU before it. The engine makes exactly one per step, the
flags of step() (skip or not, DDP's unused parameters), and none in forward or backward, on
the communication thread included. On the CPU every tensor counts as the device's."""
import collections
import contextlib
import os
import threading

import pytest
import torch

from minizero_lib import unit
from minizero_lib import launch
from minizero import Engine
from train_gpt import GPT, GPTConfig

DEVICE = os.environ.get("MINIZERO_DEVICE", "cpu")
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def recorded():
    """Count the host reads of tensors on DEVICE, by phase: what the calling thread is in
    (phase.now, set by the loop), or "comm" on an engine's communication thread."""
    counts, lock, phase = collections.Counter(), threading.Lock(), threading.local()
    real = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        def read(t, *args, **kwargs):
            if t.device.type == torch.device(DEVICE).type:
                comm = threading.current_thread().name.startswith("minizero-comm")
                with lock:
                    counts["comm" if comm else getattr(phase, "now", "other")] += 1
            return real[name](t, *args, **kwargs)
        return read
    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield counts, phase
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)


def train(comm, stage, kw, steps, phase):
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
    eng.close()


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
    real = unit.reduce_grads
    monkeypatch.setattr(unit, "reduce_grads", lambda local, *a: (local.sum().item(), real(local, *a))[1])
    with recorded() as (counts, phase):
        launch.run_threads(train, 2, 0, {}, 2, phase, device=DEVICE)
    assert counts["comm"] == 2 * 2 * 3, counts  # two ranks, two steps, three units
    assert counts["step"] == 2 * 2, counts

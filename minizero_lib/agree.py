"""
The step's one agreement among ranks: one small all-gather of flags (kind "flags", booked
apart from Ψ) that carries three rules torch's DDP and GradScaler keep. A first reading
can skip this file.

- Every rank gathered and reduced the same units, or their collectives paired up wrongly.
- DDP's unused-parameter rule: a parameter that got a gradient on any rank in any
  micro-batch is updated; one that got none anywhere is left as torch.optim leaves it.
- A non-finite gradient, in a rank's own gradient or in the sum, skips the step everywhere.
"""
import torch

from minizero_lib import nccl_model
from ops import all_gather


def agree(units, finite, visits, comm, t):
    """Returns None if all is finite, else the ranks whose own gradient was not (empty: the
    sum overflowed). Sets each unit's `used` to any rank's. The flags are read once: the
    step's one host read of a device value (a GPU's queue drains there)."""
    sums = torch.stack([u.reduced.sum(dtype=torch.float32) for u in units]).isfinite().all()
    own = finite if comm.world_size > 1 else sums  # (one rank: its own gradient is the sum)
    bad = torch.stack([~own, ~sums]).double()  # on the device
    mine = [float(visits)] + [float(x) for u in units for x in u.used]
    # Made on the host and queued to the device, not blocking (a GPU: from pinned memory, §9.11).
    mine = torch.tensor(mine, dtype=torch.float64, pin_memory=nccl_model.on_gpu(finite))
    mine = torch.cat([bad, mine.to(finite.device, non_blocking=True)])
    # per rank: (own gradient bad, sum bad, visits, each parameter's used flag...)
    flags = all_gather(mine, comm, kind="flags").view(comm.world_size, -1).tolist()
    if any(f[2] != flags[0][2] for f in flags):
        for u in units:
            u.drop_grads()
        raise RuntimeError(
            f"step {t + 1}: the ranks gathered or reduced different units, so their "
            f"collectives paired up wrongly and nothing was updated. At stage 3 each rank "
            f"gathers the units its forward runs: a module that only some ranks run (an MoE "
            f"expert, a branch) must share a unit with modules every rank runs (units=[...], "
            f"e.g. a whole MoE layer as one unit), or use stage 0-2")
    used = iter(any(col) for col in zip(*(used for _, _, _, *used in flags)))
    for u in units:
        u.used = [next(used) for _ in u.params]
    finite.fill_(True)
    if any(own_bad or sum_bad for own_bad, sum_bad, *_ in flags):
        return [k for k, (own_bad, *_) in enumerate(flags) if own_bad]
    return None

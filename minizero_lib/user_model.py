"""
What the engine asks of the user's model and options, apart from ZeRO itself (minizero.py
calls these; a first reading can skip them): arguments that cannot work, the same model on
every rank, stage 3's parameters unreadable while released (ShardedParameter), modes that
cannot work (reduce_every, reshard_after_forward), and a model built on the meta device
made real one unit at a time.
"""
import hashlib
from itertools import chain

import torch
import torch.nn as nn

from ops import all_gather


def check_args(model, comm, stage, dtype, grad_accum):
    """Engine(...) arguments that cannot work: a ValueError naming the fix."""
    if not hasattr(comm, "world_size"):
        raise ValueError("Engine needs a communicator, its second argument: under torchrun "
                         "comm = launch.init_from_env() (minizero_lib/launch.py); or start the "
                         "ranks with launch.run_threads(fn, N) or launch.run_processes(fn, N), "
                         "which call fn(comm)")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3; got {stage!r}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16; got "
                         f"{dtype}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1; got {grad_accum}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (requires_grad=True): nothing to "
                         "train")
    devices = {str(t.device) for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    if len(devices) > 1:
        raise ValueError(f"parameters and buffers are on different devices {sorted(devices)}; "
                         f"move the model to one device (model.to(device)) first")


def check_real(model):
    """A model with no init= must be real: a ValueError naming what is on the meta device."""
    meta = [n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(f"{meta[0]} is on the meta device: pass init=fn, fn(name, param) filling "
                         "a parameter once its unit exists (or build the model for real)")


def check_same_model(model, comm):
    """Collective: every rank must have built the same model, the same names, shapes, dtypes,
    trainability and ties of every parameter and buffer (each later collective's size depends
    on it). Otherwise raise on every rank, naming the first difference. First, the model must
    be on the device the communicator moves tensors on."""
    device = next(model.parameters()).device
    # (a GPU model on CPU thread ranks would run all its backwards on one thread)
    if device != comm.device and device.type != "meta":
        raise ValueError(f"the model is on {device}, but this rank's communicator works on "
                         f"{comm.device}; move it there first: model.to(comm.device)")
    entries, first = [], {}
    for n, t in chain(model.named_parameters(remove_duplicate=False),
                      model.named_buffers(remove_duplicate=False)):
        tie = first.setdefault(id(t), n)
        entries.append(f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                       + (" trainable" if t.requires_grad else "")
                       + (f" = {tie}" if tie != n else ""))
    check_same(entries, comm, "the ranks built different models: parameter/buffer",
               "build the same model on every rank before Engine(...)")


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


_T = torch.Tensor  # what may be asked of a released parameter: its metadata, never its values
_METADATA = {getattr(_T, n).__get__ for n in (
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim", "layout",
    "is_meta", "is_cuda", "is_cpu")} | {_T.data.__set__, _T.grad.__set__,
                                         _T.requires_grad.__set__} | {getattr(_T, n) for n in (
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "requires_grad_",
    "register_hook", "register_post_accumulate_grad_hook")}


def mark_sharded(names, params):
    """Stage 3: make each parameter a ShardedParameter, released (its unit is not gathered)."""
    for n, p in zip(names, params):
        p.__class__, p.zero_name, p.zero_released = ShardedParameter, n, True


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter. Between uses its storage is released, and reading it would read
    freed memory (a crash), so any op on it then raises instead (its shape, dtype and numel
    stay readable). PyTorch itself turns UninitializedParameter into a Parameter by assigning
    __class__; the engine does the same, so the user's references stay valid."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (an op's tensors are its arguments, or in a list or tuple of them: torch.cat's)
        for a in chain(args, kwargs.values()) if func not in _METADATA else ():
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, ShardedParameter) and t.zero_released:
                    raise RuntimeError(
                        f"{t.zero_name} is sharded across ranks (ZeRO stage 3) and not gathered "
                        "now: read parameters inside `with engine.gathered():` (every rank enters "
                        "it), or take engine.full_state_dict() (a collective); the engine must "
                        "still be alive")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def check_modes(stage, reduce_every, reshard_after_forward, world_size, shard_size):
    """Engine(reduce_every=, reshard_after_forward=) that cannot work: a ValueError naming the
    fix, before any collective."""
    if reduce_every not in ("micro_batch", "step"):
        raise ValueError(f'reduce_every must be "micro_batch" (reduce every micro-batch) or "step" '
                         f"(sum micro-batches locally, reduce once per step: DDP's no_sync); "
                         f"got {reduce_every!r}")
    G = reshard_after_forward
    if type(G) not in (bool, int):
        raise ValueError(f"reshard_after_forward must be True, False or a number of ranks; "
                         f"got {G!r}")
    if G is not True and stage != 3:
        raise ValueError(f"reshard_after_forward={G!r} is for stage 3, the stage that gathers "
                         f"parameters for forward and backward; at stage {stage} leave it True")
    S = shard_size if isinstance(shard_size, int) and shard_size >= 1 else world_size
    divisors = [d for d in range(2, S) if S % d == 0]
    if type(G) is int and G not in divisors:
        raise ValueError(f"reshard_after_forward={G} must divide the shard group's {S} ranks, "
                         f"1 < G < {S} (FSDP2's rule; the backward gathers among G ranks): use "
                         + (f"one of {divisors}" if divisors else "True or False, as no such G "
                            "exists")
                         + " (True: release after forward; False: keep the unit gathered)")


def meta_owners(model, init):
    """For a model built on the meta device: where each trainable parameter's real one must
    go, id(param) -> [(module, key)] (a tie has two), or None if none is on meta. Only
    trainable parameters are made real (by init); anything else on meta is an error."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]  # built under torch.device("meta")
    if meta and init is None:
        raise ValueError(f"{meta[0]} is on the meta device: pass init=fn, fn(name, param) filling "
                         "a parameter once its unit exists (or build the model for real)")
    frozen = [n for n, t in chain(model.named_parameters(),
                                  model.named_buffers()) if t.is_meta and not t.requires_grad]
    if frozen:
        raise ValueError(f"{frozen[0]} (frozen, or a buffer) is on the meta device; the engine "
                         "makes only trainable parameters real: make it real first "
                         "(module.to_empty, then set it)")
    if not meta:
        return None
    owners = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            owners.setdefault(id(p), []).append((module, key))
    return owners


def materialize(named, owners, device, init):
    """For a model built on the meta device (DeepSpeed's zero.Init, FSDP2's to_empty): one
    unit's [(name, param)] made real on device, set in every module that holds them
    (owners: id(param) -> [(module, key)], so ties follow), and filled by init(name, p).
    Units are made one at a time, so no rank ever holds the whole model."""
    out = []
    for name, p in named:
        q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                         requires_grad=p.requires_grad)
        for module, key in owners[id(p)]:
            module._parameters[key] = q
        init(name, q)
        out.append((name, q))
    return out

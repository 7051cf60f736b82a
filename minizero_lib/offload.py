"""
Disk offload of the optimizer state (ZeRO-Infinity's NVMe offload, on any file system).

Each unit's fp32 master and optimizer state (AdamW's m and v, SGD's or Muon's momentum, ...)
for this rank's shard live in a file of their own, named by process, engine, rank and unit
(`*.offload`, never a checkpoint's name). A file has two slots, one of them current. A step
streams each unit's state in from the current slot (the next unit's read runs on an I/O thread
while this one is updated), and writes the updated state to the other slot. Only when every
rank has written every unit do the slots swap and the parameters move, so a write that fails
(a full disk) leaves the model as it was. Resident memory is a few units' state at a time,
never the whole optimizer.

Files are preallocated at construction (a disk too small fails there, not mid-run) and
read and written with pread/pwrite, not mapped, so the page cache is never counted as
the process's memory. They are removed by Engine.close(), when the engine is collected,
at normal interpreter exit, and by run_processes when its run ends (a rank it spawned
may be killed, and every one leaves by os._exit).
"""
import os
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from minizero import runs, share_params
from minizero_lib.launch import remove_at_end
from minizero_lib.optimizers import gather_whole, host_wait, update, whole_rule
from ops import all_gather

F32 = 4  # bytes per element of master and the state


def check_offload(stage, offload, offload_dir, offload_params):
    """Engine(offload=..., offload_dir=..., offload_params=...) that cannot work: a ValueError
    naming the fix."""
    if offload not in (None, "cpu", "disk"):
        raise ValueError(f"offload must be None, 'cpu' or 'disk'; got {offload!r}")
    if (offload or offload_params) and stage == 0:
        raise ValueError("offload moves this rank's shard of the optimizer state off the device; "
                         "stage 0 (DDP) keeps the whole state on every rank: use stage 1-3 with "
                         "offload")
    if offload_params and stage != 3:
        raise ValueError("offload_params moves stage 3's parameter shard to the host; use stage 3")
    if offload == "disk" and not offload_dir:
        raise ValueError("offload='disk' needs offload_dir=, a directory on the disk the optimizer "
                         "state should live on (AdamW needs 24 bytes per parameter / world size)")


def offload_unit(u, offload, offload_params, disk):
    """Unit u is built (minizero.Unit): its master and optimizer state, made where offload
    keeps them (minizero.Unit.own_state makes them beside the params). offload_params: stage
    3's 16-bit shard in host memory (with fp32 compute and the optimizer on the device, it is
    the master too); offload "cpu": the fp32 master and state in host memory, a copy on a CPU
    run too (the host path runs, as on a GPU); "disk": into the unit's file (DiskState), and
    u.master and u.state None. Pinned later, all at once (pin_region)."""
    if offload_params:
        u.owned = u.shard = u.shard.to("cpu", copy=True)
    own = u.flat.dtype != torch.float32 or offload
    master = u.owned.float() if own else u.owned
    u.master = master.to("cpu", copy=True) if offload else master
    u.state = {k: torch.zeros(n, device=u.master.device) for k, n in u.sizes.items()}
    if offload == "disk":
        disk.add(u.index, {"master": u.master, **u.state})
        u.master = u.state = None


def pin_region(units, offload, offload_params):
    """Pin a rank's host state, every unit's (master and optimizer state offloaded to "cpu",
    stage 3's shard with offload_params), as one region of exactly its bytes, offloaded()'s
    formula: pinning each tensor through torch's pinned cache rounds every block up to a power
    of two (up to twice the formula). The region is registered with CUDA (cudaHostRegister),
    so copies to and from it are queued, not blocking; the tensors become views of it.
    Returns the region (whoever holds it keeps it pinned), or None when nothing is pinned."""
    moved = [t for u in units
             for t in ([u.master, *u.state.values()] if offload == "cpu" else [])
             + ([u.shard] if offload_params else [])]
    # fp32 first, then the 16-bit shards: every view starts at a multiple of its element size
    host = list({id(t): t for t in sorted(moved, key=lambda t: -t.element_size())}.values())
    total = sum(t.numel() * t.element_size() for t in host)
    if not total:
        return None
    region = torch.empty(total, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(region.data_ptr(), total, 0) != cudart.cudaError.success:
        raise RuntimeError(f"could not pin {total:,} bytes of host memory for the offloaded state; "
                           f"use pin_memory=False")
    weakref.finalize(region, cudart.cudaHostUnregister, region.data_ptr())
    views, at = {}, 0
    for t in host:
        n = t.numel() * t.element_size()
        views[id(t)] = region[at:at + n].view(t.dtype).view(t.shape).copy_(t)
        at += n
    for u in units:
        u.master = views.get(id(u.master), u.master)
        u.state = u.state and {k: views.get(id(s), s) for k, s in u.state.items()}
        u.shard = views.get(id(u.shard), u.shard)
    return region


def warn_on_cpu(device, offload, offload_params):
    """On a CPU run, offload to "cpu" frees nothing: say so once (the host path still runs,
    with separate copies and the same arithmetic as on a GPU: so it is tested on CPUs)."""
    if device.type == "cpu" and (offload == "cpu" or offload_params):
        warnings.warn("minizero: offload to 'cpu' on a CPU run keeps a copy in the same memory, so "
                      "it frees nothing (the same bits, a little slower); offload='disk' is the "
                      "one that frees RAM here")


class DiskState:
    """One rank's optimizer state, every unit's, in files under `folder`."""

    def __init__(self, folder, tag):
        self.folder = folder                    # where the files live (the user's offload_dir)
        # process, engine and rank: no two engines share a file
        self.tag = tag
        # unit index -> [file descriptor, path, {key: elements}, slot]
        self.files = {}
        # units whose other slot was written since the last commit
        self.written = set()
        self.io = ThreadPoolExecutor(1, thread_name_prefix="minizero-offload")  # reads and writes
        self.writes = []                        # writes in flight this step
        self.closer = weakref.finalize(self, _remove, self.files, self.io)  # close(), GC or exit
        try:
            os.makedirs(folder, exist_ok=True)
            probe = os.path.join(folder, f".{tag}.probe")
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"offload_dir {folder} cannot be written ({e}); give a directory on a "
                             "disk with room for the optimizer state") from None

    def add(self, i, state):
        """Unit i's file: two slots of its {"master", key...}; slot 0 holds master and the
        (zero) state."""
        sizes = {k: t.numel() for k, t in state.items()}
        n = sum(sizes.values())
        path = os.path.join(self.folder, f"minizero-{self.tag}-unit{i}.offload")
        # (a spawned rank that is killed runs no cleanup: its launcher removes it)
        remove_at_end(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.files[i] = [fd, path, sizes, 0]  # slot 0 holds the state
        try:
            os.posix_fallocate(fd, 0, 2 * n * F32)  # reserved now; reads as zeros
        except OSError as e:
            raise ValueError(f"offload_dir {self.folder} has no room for the optimizer state "
                             f"({2 * n * F32:,} bytes for {path}: {e})") from None
        pwrite(fd, state["master"].detach().float().cpu().contiguous(), 0)

    def read(self, i, count=None):
        """Unit i's {"master", key...} (the first count of them) as views of one new fp32 tensor."""
        fd, path, sizes, slot = self.files[i]
        keys = list(sizes)[:count]
        buf = torch.empty(sum(sizes[k] for k in keys), dtype=torch.float32)
        offset = slot * sum(sizes.values()) * F32
        view = memoryview(buf.numpy()).cast("B")
        while len(view):
            got = os.preadv(fd, [view], offset)
            if got == 0:
                raise OSError(f"{path} ends early: the offload file was truncated")
            view, offset = view[got:], offset + got
        return dict(zip(keys, buf.split([sizes[k] for k in keys])))

    def state(self, i, count=None):
        """Unit i's {"master", key...} (the first count of them): a copy."""
        return self.read(i, count)

    def put(self, pairs):
        """(unit index, {"master", key...}) pairs as the new state, all or nothing."""
        for i, state in pairs:
            self.write(i, state)
        self.finish()
        self.commit()

    def stream(self, indices, count=None):
        """Yield (i, state) for each unit i, read from the current slot; the next unit's
        read runs on the I/O thread while the caller works on this one."""
        ahead = self.io.submit(self.read, indices[0], count) if indices else None
        for k, i in enumerate(indices):
            state = ahead.result()
            ahead = self.io.submit(self.read, indices[k + 1],
                                   count) if k + 1 < len(indices) else None
            yield i, state

    def write(self, i, state):
        """Queue unit i's new {"master", key...} for its other slot."""
        fd, path, sizes, slot = self.files[i]
        self.written.add(i)
        flat = torch.cat([state[k].reshape(-1).float().cpu() for k in sizes])
        self.writes.append(self.io.submit(pwrite, fd, flat,
                                          (1 - slot) * sum(sizes.values()) * F32))

    def finish(self):
        """Wait for the queued writes; an OSError (a full disk) comes out here, and then
        nothing that was written counts."""
        writes, self.writes = self.writes, []
        try:
            for w in writes:
                w.result()
        except OSError:
            self.written.clear()
            raise

    def commit(self):
        """The written slots hold the state now."""
        for i in self.written:
            self.files[i][3] = 1 - self.files[i][3]
        self.written.clear()

    def nbytes(self):
        """Bytes of optimizer state offloaded (the files hold two slots: twice this)."""
        return sum(sum(f[2].values()) * F32 for f in self.files.values())

    def close(self):
        self.closer()


def disk_update(units, disk, group, device, hp, comm, t):
    """Engine.step() for stages 1-3 with the optimizer state on disk. Each unit's master
    and state stream in (the next unit's read runs alongside), are updated on the host
    (optimizers.update) and stream out to the files' other slot. Only once every rank has
    written every unit (one small collective) do the slots swap and the params follow,
    as in zero_update (share_params): a failed write (a full disk) leaves params, moments
    and step counts (step t+1's increments taken back) as they were, and raises."""
    error = ""
    try:
        for i, state in disk.stream(range(len(units))):
            u, whole = units[i], whole_rule(units[i])
            gather = gather_whole(group, device) if whole else None
            update(state["master"], {k: t for k, t in state.items() if k != "master"}, u.reduced,
                   runs(u, hp), hp, whole, gather, device)
            disk.write(i, state)
        disk.finish()
    except OSError as e:
        error = str(e)
    # one flag per rank: did every unit's write land?
    done = all_gather(torch.tensor([0.0 if error else 1.0], device=device), comm, kind="offload")
    if not done.all():
        for u in units:
            u.steps = [s - used for s, used in zip(u.steps, u.used)]
            u.drop_grads()
        failed = [k for k, x in enumerate(done.tolist()) if not x]
        raise RuntimeError(f"step {t + 1} not taken: rank(s) {failed} could not write the "
                           f"offloaded optimizer state to {disk.folder} "
                           f"({error or 'see that rank'}); params, moments and step counts are as "
                           "they were. Free space there and train on")
    disk.commit()
    for i, state in disk.stream(range(len(units)), count=1):
        share(state["master"], group, units[i].flat, units[i].shard)


def share(master, group, flat, shard):
    """minizero.share_params, from an offloaded master: stage 3's host shard (offload_params)
    from a GPU's master is read after an event, as the copy is queued (DESIGN.md §9.11)."""
    share_params(master, group, flat, shard)
    if shard is not None and shard is not master and master.is_cuda and not shard.is_cuda:
        host_wait()


def pwrite(fd, t, offset):
    view = memoryview(t.numpy()).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _remove(files, io):
    io.shutdown(wait=True)
    for fd, path, *_ in files.values():
        os.close(fd)
        if os.path.exists(path):
            os.remove(path)
    files.clear()

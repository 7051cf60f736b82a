"""
Saving a checkpoint (the format: checkpoint.py): every rank writes its shard, then rank 0
the manifest that makes the checkpoint complete; inline, or on a thread while training goes on.

    save(engine, dir, meta)                    collective: returns once the checkpoint is complete
    save(engine, dir, meta, background=True)   collective: returns once this rank's shard is
                                               copied to host memory; a thread writes it
    wait(engine)                               collective: the background save committed, or raise

A background save commits without a collective (training's own run meanwhile, and collectives
must pair up in one order on every rank): each rank writes its shard, then its sha256 in a
file beside it; rank 0's thread writes the manifest once every rank's digest file is there.
The next save (or wait(), or Engine.close()) is where the ranks agree, with two small
collectives, that every shard and the manifest were written; a failure raises there, on
every rank. So the directory must be one that every rank sees (as it is for loading).
"""
import json
import os
import threading
import time

import torch

from minizero_lib import checkpoint
from minizero_lib.checkpoint import _remove, frozen, manifest, my_state, piece
from ops import PeerFailed, all_gather, broadcast


def save(engine, path, meta=None, background=False):
    """Collective. Each rank writes its shard; once every rank's shard is safely on disk,
    rank 0 writes the manifest, which alone makes the checkpoint complete. `meta` (JSON:
    the training step, say) rides in the manifest and comes back from load().
    background=True: returns once this rank's shard is copied to host memory (pinned on a
    GPU); a thread writes it, and rank 0's commits the manifest as soon as every shard is
    written. The next save, wait() or Engine.close() waits for it, and raises if it failed."""
    if engine.micro:
        raise RuntimeError("save_checkpoint() between backward() and step(); save after step()")
    wait(engine)  # one save at a time: the one in flight commits (or fails) first
    comm = engine.comm
    os.makedirs(path, exist_ok=True)
    # the tag from the OS, not from torch's RNG: a save must not change what dropout draws next
    mine = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1], device=engine.device)
    # rank 0's nonce, one int64 to every rank: new files never overwrite a complete checkpoint's
    tag = f"{engine.t:08d}-{int(broadcast(mine, comm, kind='checkpoint')):08x}"
    k = piece(engine, comm.rank)  # which 1/N of the layout this rank saves
    m = manifest(engine, tag, meta) if comm.rank == 0 else None  # (rank 0 writes it)
    w = Write(engine, path, tag, k, snapshot(engine, k), m)
    if not background:
        w.write_shard()
        return agree(engine, w)
    w.thread = threading.Thread(target=w.run, name=f"checkpoint {path}", daemon=True)
    w.thread.start()
    # Engine.close() finishes it, first, unless the next save or wait() does.
    engine.at_close.insert(0, w)


def wait(engine):
    """Collective where a background save is in flight (every rank calls it): wait until it
    is committed; if it failed, raise on every rank, naming it, with its files removed."""
    for w in [f for f in engine.at_close if isinstance(f, Write)]:
        engine.at_close.remove(w)
        w.written.wait()
        agree(engine, w)


class Write:
    """One rank's part of one save: its shard written, and on rank 0 the manifest that commits
    every rank's; inline (save()), or on a thread while training goes on (background)."""

    def __init__(self, engine, path, tag, k, shard, m):
        comm = engine.comm
        self.engine = engine              # whose save this is: close() finishes it (__call__)
        self.path = path                  # the checkpoint's directory
        self.tag = tag                    # the save's name in its files (step and a random nonce)
        self.file = os.path.join(path, f"shard-{tag}-{k}.pt")  # this rank's shard, piece k
        self.rank, self.world_size = comm.rank, comm.world_size
        self.shard = shard                # the host snapshot (snapshot()), dropped once written
        self.manifest = m                 # rank 0: the manifest, but for its shards' digests
        self.digest, self.error = bytes(32), ""  # this rank's shard: its sha256, or why it failed
        self.commit_error = ""            # rank 0: why the manifest could not be written
        self.written = threading.Event()  # this rank's shard is written, or failed
        self.cancel = threading.Event()   # a rank failed: rank 0 stops waiting for its shard
        self.thread = None                # background: the thread that writes

    def write_shard(self, report=False):
        """Write the shard; report=True (background): and its sha256 beside it, for rank 0."""
        try:
            self.digest = checkpoint.write_atomic(self.file, self.shard)
            if report:
                checkpoint.write_atomic(self.file + ".sha256", self.digest.hex().encode())
        except OSError as e:
            self.error = str(e)
        self.shard = None
        self.written.set()

    def run(self):
        """The background thread: the shard, then on rank 0 the manifest, as soon as every
        rank's digest file is there (no collective here: training's own run meanwhile)."""
        time.sleep(0.001)  # first the GIL back to save()'s caller, which returns at once
        self.write_shard(report=True)
        files = [os.path.join(self.path, f"shard-{self.tag}-{j}.pt.sha256")
                 for j in range(self.world_size)]
        delay = 0.001
        while self.rank == 0 and not self.error and not all(map(os.path.exists, files)):
            if self.cancel.wait(delay):  # a peer could not write its shard: agree() says so
                return
            delay = min(2 * delay, 0.05)
        if self.rank == 0 and not self.error:
            digests = []
            for f in files:
                with open(f) as fh:
                    digests.append(fh.read())
            self.commit(digests)

    def commit(self, digests):
        """Rank 0: write the manifest (the checkpoint is complete), then remove the files of
        earlier saves in this directory and any half-written ones."""
        m = dict(self.manifest, shards=[{"file": f"shard-{self.tag}-{j}.pt", "sha256": d}
                                        for j, d in enumerate(digests)])
        try:
            data = json.dumps(m, indent=1).encode()
            checkpoint.write_atomic(os.path.join(self.path, "manifest.json"), data)
        except OSError as e:
            self.commit_error = str(e)
            return
        keep = {s["file"] for s in m["shards"]} | {"manifest.json"}
        for f in os.listdir(self.path):
            if f not in keep and (f.startswith("shard-") or f.endswith(".tmp")):
                _remove(os.path.join(self.path, f))

    def remove(self):
        for f in (self.file, self.file + ".sha256"):
            _remove(f)

    def __call__(self):
        """Engine.close(), with this background save still in flight: wait() for it."""
        wait(self.engine)


def agree(engine, w):
    """Collective: every rank learns whether every shard and the manifest of save `w` were
    written; if not, each removes its files (on a full disk a retry needs the space) and
    raises: the rank that could not write with its error, the others naming it."""
    comm = engine.comm
    when = " (a background save, found at the next save or close)" if w.thread else ""
    # all_gather: 33 int64 per rank (written or not, the shard's 32-byte sha256)
    report = torch.tensor([0 if w.error else 1, *w.digest], dtype=torch.int64, device=engine.device)
    reports = all_gather(report, comm, kind="checkpoint").view(comm.world_size, -1).cpu()
    failed = [k for k in range(comm.world_size) if reports[k, 0] != 1]
    if failed:
        w.cancel.set()
        w.thread and w.thread.join()
        w.remove()
        raise (RuntimeError if w.error else PeerFailed)(
            f"checkpoint not saved: rank(s) {failed} could not write their shard in {w.path} "
            f"({w.error or 'see that rank'}){when}; the checkpoints saved before it are untouched")
    if comm.rank == 0 and w.thread is None:
        by_piece = sorted(range(comm.world_size), key=lambda j: piece(engine, j))  # piece 0, 1..
        w.commit([bytes(reports[j, 1:].tolist()).hex() for j in by_piece])
    elif comm.rank == 0:
        w.thread.join()
    done = torch.tensor([0. if w.commit_error else 1.], device=engine.device)
    if all_gather(done, comm, kind="checkpoint")[0] != 1:  # one float per rank: rank 0's says
        w.remove()
        raise RuntimeError(f"checkpoint not saved: could not write its manifest "
                           f"{os.path.join(w.path, 'manifest.json')} "
                           f"({w.commit_error or 'see rank 0'})"
                           f"{when}; the checkpoints saved before it are untouched")


def snapshot(engine, k):
    """This rank's shard (piece k) as copies in host memory, pinned on a GPU, so that training
    may change the state while they are written: master and optimizer state, this rank's
    torch RNG (dropout's), and in shard 0 the frozen parameters and buffers."""
    units = [{key: _host(t) for key, t in my_state(engine, u, k).items()} for u in engine.units]
    shard = {"units": units, "rank": engine.comm.rank, "rng": rng_state(engine.device)}
    if k == 0:  # frozen parameters and buffers, as full_state_dict gives them
        shard["extra"] = {n: _host(t.float() if t.is_floating_point() else t)
                          for n, t in frozen(engine).items()}
    if engine.device.type == "cuda":
        torch.cuda.current_stream(engine.device).synchronize()  # the pinned copies are complete
    return shard


def _host(t):
    """A copy of t in host memory (a view would save its whole storage, and change in training)"""
    if t.device.type == "cpu":
        return t.detach().clone()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach(), non_blocking=True)


def rng_state(device):
    """torch's RNG state of this rank: the CPU generator's, and its GPU's."""
    cuda = {"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {}
    return {"cpu": torch.get_rng_state(), **cuda}

"""
Checkpoints of a minizero Engine: one shard file per rank and a manifest written last.

    load(engine, dir)          collective: re-cut a checkpoint of any world size and stage
    read_checkpoint(dir)       no process group: the logical (unpadded) fp32 vectors per name
    consolidate(dir)           no process group: one plain state_dict, every name of the model
    checkpoints(root)          the complete checkpoints in root's step-N folders, newest first
    prune(root, keep=2)        remove the older ones and the saves that never completed

Saving (writer.py: every rank writes its shard, inline or on a thread, then rank 0 the
manifest) makes a checkpoint complete only when its manifest says so. Each save writes new
shard files (their names carry the step and a random tag), so a crash at any moment leaves
the previous manifest and the shards it names untouched.

The manifest (JSON) holds: the format name, the tag and step, the fp16 loss scale and skip
counts, the world
size, stage and dtype it was saved at, the model's state_dict names, the optimizer and its
hyperparameters, and per unit its parameters (name, tied aliases, shape, offset in the unit's
flat layout, the update it gets and its state's keys, and its step count: a parameter with
no gradient in a step is not stepped). Shard k holds the k-th of N pieces of every unit's
fp32 master and the optimizer state of that range (optimizers.state_layout; rank k's,
unless hybrid: see piece()) and its rank's torch RNG state (dropout's: restored on a load at
the same world size); shard 0 also holds the frozen parameters and buffers. A shard
is checked against its sha256 in the manifest. The pieces in order are the layout, so a
checkpoint of any world size, shard size, stage and optimizer layout loads at any other.
"""
import contextlib
import hashlib
import io
import json
import math
import os
import shutil

import torch

from minizero import state_layout
from ops import all_gather, broadcast

FORMAT = "minizero-2"  # 2: step counts per parameter; 1 had one for all, read as such
# a parameter of a checkpoint that names no optimizer
ADAMW = {"kind": "adamw", "state": {"m": None, "v": None}}
FIELDS = {  # what load() and read_checkpoint() rely on, per part of the manifest: name -> JSON type
    "manifest": {"format": str, "tag": str, "step": int, "scale": (int, float), "clean_steps": int,
                 "world_size": int, "state_dict": list, "units": list, "shards": list},
    "unit": {"numel": int, "padded": int, "params": list},
    "param": {"name": str, "aliases": list, "shape": list, "offset": int, "steps": int},
    "shard": {"file": str, "sha256": str},
}


def piece(engine, rank):
    """Which of the N pieces of the layout a rank saves: piece p·R + g for the rank at place
    p of shard group g (each shard group's chunk p, cut R ways across its replicas). Not
    hybrid (R = 1): piece r is rank r's."""
    S = engine.group.world_size
    return rank % S * (engine.comm.world_size // S) + rank // S


def my_state(engine, u, k):
    """Piece k (of N) of unit u's master and optimizer state, re-cut from what this rank
    keeps (from disk if offloaded there): the whole unit (DDP) or its chunk (a piece of it,
    or all of it unless hybrid)."""
    st = read_state(engine, u)
    q = u.padded // engine.comm.world_size
    start = k * q - (engine.group.rank * u.shard_size if engine.sharded["optimizer"] else 0)
    pieces, sizes = state_layout(u.offsets, [p.shape for p in u.params], u.rules, u.keys, k * q,
                                 k * q + q)
    state = from_params(pieces, u.keys, sizes,
                        to_params(u.pieces, u.keys, st, [p.numel() for p in u.params]))
    return {"master": st["master"][start:start + q], **state}


def to_params(pieces, keys, state, numels, into=None):
    """A range's optimizer state (state_layout's pieces) as per-parameter values, added to
    `into`: {param index: {key: elementwise, the parameter's numel values; whole, its state}}."""
    into = {} if into is None else into
    for p in pieces:
        for k, (c, d) in p.at.items():
            if keys[p.i][k] is None:
                x = into.setdefault(p.i, {}).setdefault(k, torch.zeros(numels[p.i]))
                x[p.lo + p.a - p.o:p.lo + p.b - p.o] = state[k][c:d]
            else:
                into.setdefault(p.i, {})[k] = state[k][c:d].clone()
    return into


def from_params(pieces, keys, sizes, values):
    """A range's optimizer state {key: fp32} from per-parameter values (to_params)."""
    state = {k: torch.zeros(n) for k, n in sizes.items()}
    for p in pieces:
        for k, (c, d) in p.at.items():
            x = values[p.i][k].reshape(-1)
            state[k][c:d] = x[p.lo + p.a - p.o:p.lo + p.b - p.o] if keys[p.i][k] is None else x
    return state


def manifest(engine, tag, meta):
    """The manifest of a save, but for its shards (writer.Write.commit adds them, digests known)."""
    aliases, state = {}, engine.model.state_dict(keep_vars=True)
    for name, t in state.items():
        aliases.setdefault(id(t), []).append(name)
    scaler = getattr(engine, "scaler", None)  # (fp16's loss scale: features.py)
    scale, clean_steps = (scaler.scale, scaler.clean_steps) if scaler else (1.0, 0)
    return {"format": FORMAT, "tag": tag, "step": engine.t, "scale": scale,
            "clean_steps": clean_steps, "skipped": engine.skipped,
            "skips_in_row": engine.skips_in_row, "world_size": engine.comm.world_size,
            "shard_size": engine.group.world_size, "stage": engine.stage,
            "dtype": str(engine.dtype), "state_dict": list(state),
            "optimizer": engine.optimizer,
            "hparams": {"lr": engine.lr, "weight_decay": engine.weight_decay,
                        "grad_accum": engine.grad_accum,
                        "clip": engine.clip,
                        **{k: v for k, v in engine.options.items() if not callable(v)}},
            "units": [{"numel": u.numel, "padded": u.padded,
                       "params": [{"name": n, "aliases": aliases[id(p)], "shape": list(p.shape),
                                   "offset": o,
                                   "steps": t, "kind": kind, "state": keys}
                                  for n, p, o, t, kind, keys in zip(u.names, u.params, u.offsets,
                                                                    u.steps, u.rules,
                                                                    u.keys)]}
                      for u in engine.units],
            "meta": meta}


def load(engine, path):
    """Load a complete checkpoint saved at any world size and stage: the logical (unpadded)
    vectors are re-cut for this engine's layout. Everything is read and checked before
    anything is changed, so a bad checkpoint leaves the engine as it was. At the world size
    it was saved at, each rank's torch RNG is set to the one it saved. Returns `meta`."""
    m, params, shards = _read(path)
    extra = shards[0]["extra"]
    if m.get("optimizer", "adamw") != engine.optimizer:
        raise ValueError(f"checkpoint {path} was saved with optimizer "
                         f"{m.get('optimizer', 'adamw')!r}, and this engine trains with "
                         f"{engine.optimizer!r}: its state does not carry over; build the engine "
                         f"with optimizer={m.get('optimizer', 'adamw')!r}, or start without the "
                         "checkpoint")
    mine = {n: p for u in engine.units for n, p in zip(u.names, u.params)}
    _check_same(path, {n: list(p.shape) for n, p in mine.items()},
                {n: v["shape"] for n, v in params.items()}, "trainable parameter")
    fixed = frozen(engine)
    _check_same(path, {n: list(t.shape) for n, t in fixed.items()},
                {n: list(t.shape) for n, t in extra.items()}, "frozen parameter or buffer")
    for u in engine.units:
        for n, kind, keys in zip(u.names, u.rules, u.keys):
            if (params[n]["kind"], params[n]["state"]) != (kind, keys):
                raise ValueError(f"checkpoint {path}: {n} was updated by {params[n]['kind']} with "
                                 f"state {sorted(params[n]['state'])} there, and by {kind} with "
                                 f"{sorted(keys)} here; build the engine with the options it was "
                                 "saved with")
    r = engine.group.rank  # (hybrid: every replica takes the same chunk)
    mine = lambda u, x: u.chunk(x, r) if engine.sharded["optimizer"] else x  # noqa: E731
    write_state(engine, ((u, {"master": mine(u, _assemble(u, params, "master")), **from_params(
        u.pieces, u.keys, u.sizes,
        [{k: params[n][k] for k in keys} for n, keys in zip(u.names, u.keys)])})
        for u in engine.units))
    for u in engine.units:  # then what the model reads
        u.steps = [params[n]["steps"] for n in u.names]  # the optimizer's per-parameter step counts
        master = _assemble(u, params, "master")
        if engine.sharded["params"]:
            u.shard.copy_(u.chunk(master, r))
        else:
            u.flat.copy_(master)  # the live parameters, all of them
    for n, t in fixed.items():
        t.data.copy_(extra[n])
    scaler = getattr(engine, "scaler", None)  # (fp16's loss scale: features.py)
    if scaler is not None:
        scaler.scale, scaler.clean_steps = m["scale"], m["clean_steps"]
    engine.t, engine.skipped, engine.skips_in_row = m["step"], m.get("skipped", 0), \
        m.get("skips_in_row", 0)
    rng = [s["rng"] for s in shards if s.get("rank") == engine.comm.rank and "rng" in s]
    if m["world_size"] == engine.comm.world_size and rng:  # (at another, ranks' RNGs do not map)
        torch.set_rng_state(rng[0]["cpu"])
        if engine.device.type == "cuda" and "cuda" in rng[0]:
            torch.cuda.set_rng_state(rng[0]["cuda"], engine.device)
    return m.get("meta")


def read_state(engine, u, master_only=False):
    """This rank's fp32 master and optimizer state of unit u (or the master only), as
    {"master": ..., key: tensor}, by name (from disk if they live there: a copy)."""
    disk = getattr(engine, "disk", None)  # (disk offload: features.py)
    if disk is not None:
        return disk.state(u.index, 1 if master_only else None)
    return {"master": u.master} if master_only else {"master": u.master, **u.state}


def write_state(engine, states):
    """(unit, {"master", key...}) pairs as this rank's optimizer state. On disk they go
    to the other slots and count once all are written: a failed write changes nothing."""
    disk = getattr(engine, "disk", None)
    if disk is not None:
        return disk.put((u.index, state) for u, state in states)
    for u, state in states:
        for k, t in read_state(engine, u).items():
            t.copy_(state[k])


@contextlib.contextmanager
def gathered(engine, modules=None, writable=False):
    """Collective: every rank enters it. Inside, the parameters of the units that hold
    `modules`' parameters (all units by default) are whole and may be read. With
    writable=True, on exit rank 0's values win: they are broadcast and written into every
    rank's fp32 master (and stage 3's shard), so every rank trains on what rank 0 wrote.
    DeepSpeed: GatheredParameters; FSDP: summon_full_params. Outside it, at stage 3,
    reading a parameter raises (minizero.ShardedParameter)."""
    want = None if modules is None else {id(p) for m in modules for p in m.parameters()}
    units = [u for u in engine.units if want is None or any(id(p) in want for p in u.params)]
    if any(u.held is not None for u in units):
        raise RuntimeError("engine.gathered() is already open for these parameters; do not nest "
                           "it")
    engine.queue.drain()
    if engine.sharded["params"]:
        engine.release_all()
        for u in units:  # kind "gathered": each rank sends (N-1)/N·Ψ_u, into a buffer of its own
            u.held = all_gather(u.shard.to(engine.device, non_blocking=True), engine.group,
                                kind="gathered")
            u.point(u.held)
            u.mark(released=False)
    engine.writable = writable
    try:
        yield
    finally:
        engine.writable = False
        for u in units:
            if writable:
                full = u.flat if u.held is None else u.held
                write_master(engine, u, broadcast(full, engine.comm, kind="gathered"))
            # The params keep viewing what was held, so a backward through a loss read in here
            # still finds the values; the next gather points them at flat again.
            if u.held is not None:
                u.mark(released=True)
                u.held = None


def write_master(engine, u, full):
    """Take the unit's whole params `full` as the new weights (engine.gathered(writable=True)):
    this rank's master (on disk too), the stage-3 shard, and flat."""
    mine = u.chunk(full, engine.group.rank) if engine.sharded["optimizer"] else full
    # (from disk: a copy, written back whole: a slot is written whole)
    state = read_state(engine, u)
    state["master"].copy_(mine)
    if getattr(engine, "disk", None) is not None:
        write_state(engine, [(u, state)])
    if u.shard is not None and u.shard is not u.master:
        u.shard.copy_(mine)
    elif u.shard is None and full is not u.flat:
        u.flat.copy_(full)


def frozen(engine):
    """{name: tensor} of the model's state that is not a trainable parameter."""
    trainable = {id(p) for u in engine.units for p in u.params}
    return {n: t for n, t in engine.model.state_dict(keep_vars=True).items()
            if id(t) not in trainable}


# -----------------------------------------------------------------------------
# the files, read without a process group (consolidation uses this too)


def write_atomic(path, obj):
    """Write to a temporary name, fsync, then rename: the file is whole or absent."""
    data = obj if isinstance(obj, bytes) else _serialize(obj)
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except BaseException:
        _remove(path + ".tmp")  # a full disk must not fill up further with each retry
        raise
    return hashlib.sha256(data).digest()


def _remove(path):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _serialize(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def read_manifest(path):
    """The manifest of the checkpoint in directory `path`, checked whole (validate_manifest)."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.exists(mpath):
        newest = checkpoints(path)  # (a training run's folder of them: name the one to read)
        raise FileNotFoundError(f"no complete checkpoint in {path}: {mpath} is missing " + (
            f"(its newest complete checkpoint is {newest[0]})" if newest else
            "(a save that never finished leaves no manifest)"))
    with open(mpath) as f:
        try:
            m = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"checkpoint manifest {mpath} is not JSON (line {e.lineno}: {e.msg}); "
                             "it is damaged: save the checkpoint again") from e
    validate_manifest(m, mpath)
    return m


def validate_manifest(m, mpath):
    """Every field that load() and read_checkpoint() use, present and of its type, the
    format, one shard per rank, parameters inside their unit: else a ValueError naming the
    file and the field, before anything is read from the shards or changed in an engine."""
    def bad(what):
        return ValueError(f"checkpoint manifest {mpath}: {what}; it is damaged or not a minizero "
                          "checkpoint")

    def need(d, part, where):
        if not isinstance(d, dict):
            raise bad(f"{where or 'the manifest'} is {d!r}, not an object")
        for k, t in FIELDS[part].items():
            if not isinstance(d.get(k), t):
                raise bad(f"{where}{k} is "
                          + (f"{d[k]!r}, not {_names(t)}" if k in d else "missing"))
    need(m, "manifest", "")
    if m["format"] == "minizero-1":  # every parameter had taken every step
        for u in m["units"] if isinstance(m["units"], list) else []:
            for p in u.get("params", []) if isinstance(u, dict) else []:
                p.setdefault("steps", m["step"]) if isinstance(p, dict) else None
        m["format"] = FORMAT
    if m["format"] != FORMAT:
        raise bad(f"format is {m['format']!r}, and this minizero reads {FORMAT!r}")
    n = m["world_size"]
    if n < 1 or len(m["shards"]) != n:
        raise bad(f"shards lists {len(m['shards'])} files for world_size {n}, one per rank")
    for k, shard in enumerate(m["shards"]):
        need(shard, "shard", f"shards[{k}].")
    for i, u in enumerate(m["units"]):
        need(u, "unit", f"units[{i}].")
        if u["padded"] % n or not 0 <= u["numel"] <= u["padded"]:
            raise bad(f"units[{i}].padded is {u['padded']}, but it must be a multiple of "
                      f"world_size {n} and at least its numel {u['numel']}")
        for j, p in enumerate(u["params"]):
            need(p, "param", f"units[{i}].params[{j}].")
            shape_ok = all(type(x) is int and x >= 0 for x in p["shape"])
            if not shape_ok or not (0 <= p["offset"]
                                    <= p["offset"] + math.prod(p["shape"]) <= u["numel"]):
                raise bad(f"units[{i}].params[{j}] ({p['name']}) has shape {p['shape']} at offset "
                          f"{p['offset']}, outside its unit of {u['numel']} elements")
            kind, keys = p.get("kind", "adamw"), p.get("state", ADAMW["state"])
            if not isinstance(kind, str) or not isinstance(keys, dict) or \
                    not all(v is None or type(v) is int and v >= 0 for v in keys.values()):
                raise bad(f"units[{i}].params[{j}] ({p['name']}) has update {kind!r} and state "
                          f"{keys!r}; a state is {{key: null (one value per element) or an element "
                          "count}")


def _names(t):
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def read_checkpoint(path):
    """-> (manifest, {name: {"master", and each state key: fp32 tensor (an elementwise one
    shaped as the parameter); "shape", "steps", "kind", "state"}}, {name: tensor} of frozen
    parameters and buffers). Every shard is checked against the manifest's sha256."""
    m, params, shards = _read(path)
    return m, params, shards[0]["extra"]


def _read(path):
    """read_checkpoint, with every shard as loaded (load() takes its rank's RNG from them)."""
    m = read_manifest(path)
    shards = []
    for s in m["shards"]:
        fpath = os.path.join(path, s["file"])
        if not os.path.exists(fpath):
            raise FileNotFoundError(f"checkpoint {path} is missing its shard {fpath}")
        with open(fpath, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != s["sha256"]:
            raise ValueError(f"checkpoint shard {fpath} is truncated or corrupted "
                             f"({len(data)} bytes, sha256 differs from the manifest's)")
        shards.append(torch.load(io.BytesIO(data), weights_only=True))
    params, n = {}, m["world_size"]
    for i, unit in enumerate(m["units"]):
        master = torch.cat([s["units"][i]["master"] for s in shards])
        if len(master) != unit["padded"]:
            raise ValueError(f"checkpoint {path}: its shards hold {len(master)} values of "
                             f"units[{i}], its manifest says {unit['padded']}; the manifest and "
                             "shards are of different saves")
        ps = [dict(ADAMW, **p) for p in unit["params"]]
        layout = ([p["offset"] for p in ps], [p["shape"] for p in ps], [p["kind"] for p in ps],
                  [p["state"] for p in ps])
        values, s = {}, unit["padded"] // n
        for k, shard in enumerate(shards):  # each shard's range, laid out as it was saved
            to_params(state_layout(*layout, k * s, k * s + s)[0], layout[3], shard["units"][i],
                      [math.prod(p["shape"]) for p in ps], values)
        for j, p in enumerate(ps):
            size = math.prod(p["shape"])
            params[p["name"]] = {"master": master[p["offset"]:p["offset"] + size].view(p["shape"]),
                                 **{k: v.view(p["shape"]) if p["state"][k] is None else v
                                    for k, v in values.get(j, {}).items()},
                                 **{k: p[k] for k in ("shape", "steps", "kind", "state")}}
    return m, params, shards


def consolidate(path):
    """A checkpoint as one plain fp32 state_dict: every name of model.state_dict(),
    both names of a tied weight, frozen parameters and buffers."""
    m, params, extra = read_checkpoint(path)
    values = dict(extra)
    for unit in m["units"]:
        for p in unit["params"]:
            for alias in p["aliases"]:
                values[alias] = params[p["name"]]["master"].clone()
    return {n: values[n] for n in m["state_dict"]}


def _assemble(u, params, key):
    """One unit's padded fp32 vector of `key`, in this layout, from per-name values."""
    # on the host, as read: each rank copies its chunk over
    x = torch.zeros(u.padded, dtype=torch.float32)
    for n, p, o in zip(u.names, u.params, u.offsets):
        x[o:o + p.numel()] = params[n][key].reshape(-1)
    return x


def _check_same(path, ours, theirs, what):
    for n in sorted(ours.keys() | theirs.keys()):
        if ours.get(n) != theirs.get(n):
            raise ValueError(f"checkpoint {path} is of another model: {what} {n} has shape "
                             f"{theirs.get(n, 'absent')} there and {ours.get(n, 'absent')} here")


# -----------------------------------------------------------------------------
# a training run's checkpoints: one folder per save, step_dir(root, step)


def step_dir(root, step):
    return os.path.join(root, f"step-{step:08d}")  # (zero-padded: name order is step order)


def checkpoints(root):
    """The complete checkpoints in root's step-N folders, newest first: a folder counts
    once its manifest is whole and every shard it names is there (a save killed half-way
    left none, or not all). A missing root has none."""
    found = []
    for name in sorted(os.listdir(root) if os.path.isdir(root) else [], reverse=True):
        path = os.path.join(root, name)
        if not name.startswith("step-"):
            continue
        try:
            m = read_manifest(path)
        except (OSError, ValueError):
            continue
        if all(os.path.exists(os.path.join(path, s["file"])) for s in m["shards"]):
            found.append(path)
    return found


def prune(root, keep=2):
    """Remove what no restart needs: complete checkpoints but the newest `keep`, and the
    folders of saves older than the newest complete one that never completed. A folder
    newer than that (a save in flight) stays."""
    done = checkpoints(root)
    for name in os.listdir(root) if done else []:
        path = os.path.join(root, name)
        old = path in done[keep:] or path not in done and path < done[0]
        if name.startswith("step-") and old:
            shutil.rmtree(path, ignore_errors=True)

"""
The demo's side of a run that survives being killed (train_gpt.py): one command, started
again after every failure (torchrun --max-restarts), trains on from the newest complete
checkpoint in its --out-dir, to the bit as if it had never stopped.

    check_out_dir(cfg)                 before any rank starts: --out-dir writable, and what it
                                       holds is nothing, or this model's checkpoint to resume
    resume_from(cfg, world_size)       the newest complete checkpoint, or None: start fresh
    step_batches(split, c, step, ...)  a rank's batches of a step, from the seed and the step
    leaf_seeds(c, step, rank)          --reduce-order tree: their dropout seeds, the leaves' 
    save(engine, c, step, log)         a checkpoint in out_dir/step-N, the older ones pruned
    record(c, rank, **fields)          rank 0's line in out_dir/log.jsonl; read_log() reads them

What a restart takes from where: the weights, the optimizer's state (offloaded too), its
step counts, the fp16 loss scale and skip counts from the checkpoint; each rank's torch RNG
(dropout's) from its own shard, at the same world size; the lr from the step (get_lr); the
batches from the seed and the step (step_batches), at any world size.
"""
import json
import os
import tempfile
import time

import torch

from minizero_lib import checkpoint

MODEL = ("n_layer", "n_head", "n_embd", "block_size", "bias")  # the options that make the GPT


def check_out_dir(cfg):
    """A ValueError naming the fix unless --out-dir can be written and holds no checkpoint,
    or (with --resume) one of this model (MODEL's options) and optimizer at a step up to
    --steps. Nothing in it is changed: another run's checkpoint stays whole."""
    out = cfg["out_dir"]
    if not out:
        if cfg["resume"]:
            raise ValueError("--resume needs --out-dir, the checkpoint directory to resume from")
        return
    try:  # now, not at the first save, a save interval of training later
        os.makedirs(out, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise ValueError(f"--out-dir {out} cannot be created or written ({e}); "
                         "give a directory you can write to")
    found = checkpoint.checkpoints(out)
    if not found:
        return  # a fresh start (train() says so)
    m = checkpoint.read_manifest(found[0])
    meta = m.get("meta") or {}
    if not isinstance(meta.get("step"), int):
        raise ValueError(f"--out-dir {out}: the checkpoint {found[0]} has no training step "
                         "(meta.step): it was not saved by train_gpt.py; give another --out-dir")
    theirs = {**meta.get("model", {}), "optimizer": m.get("optimizer", "adamw")}
    ours = {**{k: cfg[k] for k in MODEL}, "optimizer": cfg["optimizer"]}
    differ = [k for k in ours if theirs.get(k) != ours[k]]
    if differ:
        there, here = (", ".join(f"{k}={d.get(k)}" for k in differ) for d in (theirs, ours))
        raise ValueError(f"--out-dir {out} holds a checkpoint of another model or optimizer "
                         f"({there} there, {here} here); give another --out-dir (that one is "
                         "left as it is), or the options it was saved with")
    if not cfg["resume"]:
        raise ValueError(f"--out-dir {out} already holds a checkpoint at step {meta['step']}; "
                         "add --resume to train on from it, or give another --out-dir")
    if meta["step"] > cfg["steps"]:
        raise ValueError(f"--resume: the checkpoint in {out} is at step {meta['step']}, and "
                         f"--steps is {cfg['steps']}; give --steps of at least {meta['step']}")


def resume_from(cfg, world_size):
    """With --resume: the newest complete checkpoint in --out-dir (None: start fresh). Its
    global batch is kept (unless a --config sets train_batch_size): grad_accum_for re-cuts it
    for this world size, so a restart with another number of ranks trains on the same batches."""
    found = checkpoint.checkpoints(cfg["out_dir"]) if cfg["resume"] else []
    meta = (checkpoint.read_manifest(found[0]).get("meta") or {}) if found else {}
    saved, per_step = meta.get("global_batch"), cfg["batch_size"] * world_size
    if cfg["global_batch"] is None and saved is not None:
        if saved % per_step:
            fix = f"a --batch-size that divides {saved // world_size}" if saved % world_size == 0 \
                else "a number of ranks that divides it"
            raise ValueError(f"--resume: the checkpoint {found[0]} trained at a global batch of "
                             f"{saved} sequences, not a multiple of --batch-size "
                             f"{cfg['batch_size']} x {world_size} ranks; give {fix}, or a "
                             "--config whose train_batch_size is one")
        cfg["global_batch"], cfg["grad_accum"] = saved, 1  # (grad_accum: derived from it)
    return found[0] if found else None


def load(engine, path, c, log):
    """The step a run starts at: resume_from's checkpoint loaded (at any world size and stage:
    the engine re-cuts the saved vectors) and its step, or 0 without one."""
    if path:
        step = engine.load_checkpoint(path)["step"]
        log(f"resumed from {path} at step {step}")
        return step
    if c.resume:
        log(f"no complete checkpoint in {c.out_dir}: starting fresh")
    return 0


def step_batches(split, c, step, rank, world_size):
    """This rank's grad_accum micro-batches (x, y) of a step: its rows of the step's global
    batch of random windows of split, drawn from the seed and the step alone, so that a run
    resumed at any step, at any world size (the same global batch), trains on the same."""
    gen = torch.Generator().manual_seed(c.seed * 1_000_003 + step + 1)
    n, T = c.batch_size * c.grad_accum * world_size, c.block_size
    ix = torch.randint(len(split) - T, (n,), generator=gen).view(world_size, c.grad_accum, -1)[rank]
    return [tuple(torch.stack([split[i + o:i + o + T] for i in rows]).long() for o in (0, 1))
            for rows in ix]


def leaf_seeds(c, step, rank):
    """--reduce-order tree: each of this rank's micro-batches' dropout seed, its leaf's (rank r's
    j-th micro-batch of a step is leaf r·A + j), so the same at any world size; the ring: None
    (each rank draws from its own RNG, seeded once)."""
    if c.reduce_order != "tree":
        return None
    return [(c.seed * 1_000_003 + step) * 4099 + rank * c.grad_accum + j
            for j in range(c.grad_accum)]


def save(engine, c, step, log):
    """Collective: save `step` in its own folder of c.out_dir (in the background unless
    --no-background-save), then (rank 0) prune what no restart needs, and log how long this
    rank's training stood still for it."""
    t0 = time.perf_counter()
    meta = dict(step=step, model={k: getattr(c, k) for k in MODEL},
                global_batch=c.batch_size * c.grad_accum * engine.comm.world_size)
    path = checkpoint.step_dir(c.out_dir, step)
    engine.save_checkpoint(path, meta, background=c.background_save)
    if engine.comm.rank == 0:  # the save before this one is committed now: the call waited for it
        checkpoint.prune(c.out_dir)
    stall = time.perf_counter() - t0
    log(f"saved checkpoint {path}: training stood still {1000 * stall:.1f} ms")
    record(c, engine.comm.rank, step=step, stall_s=stall)


def record(cfg, rank, **fields):
    """Rank 0 appends one JSON line to out_dir/log.jsonl: a step trained {"step", "loss"}, an
    eval {"step", "val"}, a save {"step", "stall_s"}. A restart appends the steps it trains
    again. (One small write per line: a kill leaves whole lines.)"""
    if cfg.out_dir and rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(fields) + "\n")


def read_log(out_dir):
    """The records of out_dir/log.jsonl in the order written (a damaged line is skipped)."""
    out = []
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out

"""
Train a small GPT with minizero, in the shape of nanoGPT (model.py + train.py in one file). Data
needs no download: byte-level tokens (vocab 256) of the Python standard library's own sources.

    python train_gpt.py                          # 2 local CPU ranks (gloo), ZeRO stage 3
    python train_gpt.py --world-size 4 --stage 2 --dtype bfloat16 --optimizer muon --data FILE
    torchrun --nproc-per-node 8 train_gpt.py --preset gpt2 --config ds_config.json
    torchrun --max-restarts 9 --nproc-per-node 8 train_gpt.py --out-dir D --resume  # survives kills
"""
import argparse
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import minizero
import ops
from minizero_lib import checkpoint, compiled, launch, resume
from minizero_lib.ds_config import (NANOGPT, banner, check_numbers, check_parallel, dtype_arg, flag_bool,
                                    grad_accum_for, merge, micro_batch_for, optimizer_options, read_ds_config,
                                    read_json, reshard_arg, shard_size)

# -----------------------------------------------------------------------------
# the model: nanoGPT's GPT; dropout off by default (each process's torch RNG draws its masks:
# rank threads, as the tests run, would share one RNG)

@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    vocab_size: int = 256  # bytes
    bias: bool = True
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0  # (0: the identity, and no RNG drawn)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # flash if it can
        return F.dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)), p)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x):
        return F.dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):  # pre-LayerNorm: the residual stream is never normalized in place
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config, generator=None):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),  # one ZeRO unit per block
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one Parameter, two names
        # nanoGPT's init, drawn from an explicit generator: threads of one process share
        # torch's global RNG, and every rank must build the very same model
        for name, p in self.named_parameters():
            self.init_weights(name, p, generator)

    @torch.no_grad()
    def init_weights(self, name, p, generator=None):
        """nanoGPT's init of one parameter; also what Engine(init=...) calls on each
        parameter of a GPT built on the meta device, once its unit exists."""
        if name.endswith("c_proj.weight"):  # residual projections, scaled by depth (GPT-2)
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.config.n_layer), generator=generator)
        elif p.dim() >= 2:
            nn.init.normal_(p, 0.0, 0.02, generator=generator)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        else:  # LayerNorm's weight (already 1 when built for real)
            nn.init.ones_(p)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # parameters() counts the tie once

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # in the parameters' dtype
        x = F.dropout(x, self.config.dropout, self.training)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        # the loss in fp32 whatever the compute dtype: a 16-bit log-softmax loses the small probabilities
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


# -----------------------------------------------------------------------------
# data: bytes in, bytes out

def stdlib_corpus(max_bytes=3_000_000):
    """The standard library's own .py files in sorted path order, concatenated and cut at
    max_bytes. site-packages is left out: it depends on what happens to be installed."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "__pycache__")]
        paths += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    out, n = [], 0
    for p in sorted(paths):
        out.append(Path(root, p).read_bytes())
        n += len(out[-1])
        if n >= max_bytes:
            break
    return b"".join(out)[:max_bytes]


def load_data(path=None):
    """{"train": first 90% of the bytes, "val": the last 10%} as uint8 tensors."""
    raw = stdlib_corpus() if path is None else Path(path).read_bytes()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n = split_at(len(data))
    return {"train": data[:n], "val": data[n:]}


def split_at(n):
    return int(0.9 * n)  # the train split is the first 90% of n bytes


def get_batch(split, batch_size, block_size, generator):
    """batch_size random windows of split (a 1-D uint8 tensor); y is x shifted by one."""
    ix = torch.randint(len(split) - block_size, (batch_size,), generator=generator)
    x = torch.stack([split[i:i + block_size] for i in ix]).long()
    y = torch.stack([split[i + 1:i + 1 + block_size] for i in ix]).long()
    return x, y


# -----------------------------------------------------------------------------
# configuration: defaults < --preset < --config (DeepSpeed JSON) < flags given

DEFAULTS = dict(
    world_size=2, stage=3, dtype=None, n_layer=4, n_head=4, n_embd=128, block_size=64, bias=True,
    batch_size=16, grad_accum=1, steps=400, lr=3e-3, min_lr=3e-4, warmup=30, clip=1.0,
    betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, eval_interval=100, eval_iters=8,
    out_dir=None, resume=False, save_interval=None, background_save=True, dropout=0.0,
    seed=1337, data=None, native=None, preset=None, config=None,
    sample_tokens=200, global_batch=None, offload=None, offload_dir=None, pin_memory=True, shard_size=None,
    trace=None, optimizer="adamw", muon_lr=0.05, momentum=None, reduce_every="micro_batch",
    reshard_after_forward="true", compile=False, quantize_weights=None, quantize_grads=None,
    offload_params=False, loss_scale=2.0 ** 16, scale_window=1000, reduce_dtype=None, reduce_order="ring",
)
OPTIMIZER_DEFAULTS = {  # the demo's choices per optimizer (under --config and flags): SGD with momentum,
    "sgd": dict(lr=0.3, min_lr=0.03, momentum=0.9, weight_decay=0.0),  # Adafactor at torch's lr (a relative step)
    "adafactor": dict(lr=1e-2, min_lr=1e-3),
}
# GPT-2's 124M shape; one reduction per step, as nanoGPT's DDP (no_sync)
PRESETS = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, lr=6e-4, min_lr=6e-5,
                        reduce_every="step")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    # allow_abbrev=False: a typo is an error, never another flag that it happens to begin
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)

    def opt(name, typ=None, help="", **kw):  # default None: we can tell which flags were given
        key = name[2:].replace("-", "_")
        kw.update(type=typ) if typ else None
        # a flag that takes a value, also with underscores, and under nanoGPT's name if it has one
        nano = NANOGPT.get(key, key)
        names = [name] + ([f"--{n}" for n in (key, nano, nano.replace("_", "-"))] if typ else [])
        p.add_argument(*dict.fromkeys(names), dest=key, help=f"{help} (default: {DEFAULTS[key]})".strip(), **kw)
    opt("--world-size", int, "local ranks to spawn when not under torchrun")
    opt("--stage", int, "0 = DDP, 1-3 = ZeRO stages", choices=range(4))
    opt("--shard-size", str, "hybrid sharding: shard over groups of this many ranks, copy across the groups; "
        "'node': torchrun's LOCAL_WORLD_SIZE; None: all ranks")
    opt("--dtype", dtype_arg, "compute dtype: fp32 (float32), bf16 (bfloat16) or fp16 "
        "(float16); None: bfloat16 on GPU, float32 on CPU", metavar="DTYPE")
    for name in ("n-layer", "n-head", "n-embd", "block-size", "batch-size", "grad-accum", "steps",
                 "warmup", "eval-interval", "eval-iters", "seed", "sample-tokens"):
        opt("--" + name, int, metavar="N")
    opt("--quantize-weights", int, "ZeRO++ qwZ: stage 3 all-gathers int8 codes", choices=[8])
    opt("--quantize-grads", int, "ZeRO++ qgZ: gradients sent as int8 or int4 codes", choices=[8, 4])
    for name in ("lr", "min-lr", "clip", "weight-decay"):
        opt("--" + name, float, metavar="X")
    opt("--out-dir", str, "save checkpoints here (step-N folders, the last two kept) and log.jsonl")
    opt("--save-interval", int, "save every this many steps; None: every eval interval")
    opt("--background-save", None, "write checkpoints on a thread while training goes on",
        action=argparse.BooleanOptionalAction)
    opt("--dropout", float, "nanoGPT's dropout")
    opt("--offload", str, "the optimizer's shard in host memory or in files (stages 1-3)", choices=["cpu", "disk"])
    opt("--offload-dir", str, "with --offload disk: the directory of its files")
    opt("--offload-params", None, "stage 3's parameter shard in host memory", action="store_true",
        default=None)
    opt("--resume", None, "continue from the newest complete checkpoint in --out-dir; none there: "
        "start fresh", action="store_true", default=None)
    opt("--data", str, "train on this text file; None: the standard library's sources")
    opt("--native", None, "torch's own collectives instead of the ring; None: on under torchrun on GPUs",
        action=argparse.BooleanOptionalAction)
    opt("--preset", str, "", choices=list(PRESETS))
    opt("--optimizer", str, "Muon on the blocks' Linear weights and AdamW on the rest; SGD with momentum",
        choices=["adamw", "sgd", "adafactor", "muon"])
    opt("--muon-lr", float, "Muon's learning rate, on the same schedule as --lr")
    opt("--momentum", float, "SGD's or Muon's momentum; None: SGD 0.9 here, Muon torch's 0.95")
    opt("--config", str, "a DeepSpeed JSON config")
    opt("--reduce-order", str, "tree: the same bits at any power-of-two world size", choices=["ring", "tree"])
    opt("--reduce-every", str, "step: sum micro-batches locally, reduce once (DDP's no_sync)",
        choices=["micro_batch", "step"])
    opt("--reshard-after-forward", str, "stage 3: true, false (keep for backward), or N: hpZ, "
        "backward gathers among N ranks")
    opt("--compile", flag_bool, "torch.compile each block (--compile=False: not)", nargs="?",
        const=True, metavar="BOOL")
    opt("--trace", str, "write each rank's Chrome trace of the first steps here (ui.perfetto.dev); 4 steps "
        "unless --steps is given")
    given = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    cfg = {**DEFAULTS, **PRESETS.get(given.get("preset"), {}), **({"steps": 4} if given.get("trace") else {})}
    ds, notes = read_ds_config(read_json(given["config"])) if given.get("config") else ({}, None)
    cfg.update(OPTIMIZER_DEFAULTS.get(given.get("optimizer", ds.get("optimizer")), {}))
    return merge(cfg, ds, given, notes)  # (and what DeepSpeed derives from the config)


def check_config(cfg):
    """Everything about the options that can be checked before a rank starts; a ValueError
    that names the fix. The checkpoint and data are read only as far as that needs."""
    check_numbers(cfg)  # each within its range
    N = int(os.environ.get("WORLD_SIZE", cfg["world_size"]))
    micro_batch_for(cfg, N)  # (a config's train_batch_size without its micro-batch)
    resume.check_out_dir(cfg)
    resume.resume_from(cfg, N)  # (its global batch)
    grad_accum_for(SimpleNamespace(**cfg), N)
    if cfg["data"] is not None:
        check_data(cfg["data"], cfg["block_size"])
    check_parallel(cfg, N)  # the mesh, ZeRO++'s quantization and offload, against the stage
    return cfg


def check_data(path, block_size):
    try:
        with open(path, "rb") as f:
            n = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise ValueError(f"--data {path}: {e.strerror}; give a text file (no --data: the standard library's sources)")
    train, val = split_at(n), n - split_at(n)
    if min(train, val) < block_size + 1:
        raise ValueError(f"--data {path} has {n} bytes: its train and val splits (90%, 10%) have {train} and {val}, "
                         f"but --block-size {block_size} needs {block_size + 1} in each; give a file of at least "
                         f"{10 * (block_size + 1)} bytes or a smaller --block-size")


# -----------------------------------------------------------------------------
# training

def get_lr(step, c, lr=None, min_lr=None):
    """Linear warmup, then cosine decay to min_lr at the last step (nanoGPT); of c.lr, or of lr."""
    lr, min_lr = (c.lr, c.min_lr) if lr is None else (lr, min_lr)
    if step < c.warmup:
        return lr * (step + 1) / (c.warmup + 1)
    ratio = (step - c.warmup) / max(1, c.steps - c.warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (lr - min_lr)


def fmt_bytes(n):
    return f"{n / 2**20:.2f} MiB"


def mfu(n_params, c, tok_s, world_size):
    """nanoGPT's model flops utilization: 6 flops per parameter per token, plus attention,
    per GPU, against its dense bf16 peak (H100/H200: 989 TFLOPS; any other GPU: A100's 312)."""
    flops = (6 * n_params + 12 * c.n_layer * c.n_embd * c.block_size) * tok_s / world_size
    peak = 989e12 if any(g in torch.cuda.get_device_name() for g in ("H100", "H200")) else 312e12
    return flops / peak


def train_step(model, engine, batches, device, seeds=None):
    """One step over this rank's micro-batches -> their mean loss. To a GPU the batches go from
    pinned memory, queued; the loss is read once, after the step (each read drains the GPU).
    seeds: each micro-batch's dropout seed (--reduce-order tree: its leaf's, at any world size)."""
    loss_sum = 0.0
    for i, (x, y) in enumerate(batches):
        if seeds:
            torch.manual_seed(seeds[i])
        if device.type == "cuda":
            x, y = (t.pin_memory().to(device, non_blocking=True) for t in (x, y))
        _, loss = model(x, y)
        engine.backward(loss)
        loss_sum += loss.detach().double()
    engine.step()
    return float(loss_sum) / engine.grad_accum


def train(comm, cfg):
    """Train on this rank; every rank runs this. Returns the loss curves and the run's stats."""
    c = SimpleNamespace(**{**DEFAULTS, **(cfg if isinstance(cfg, dict) else vars(cfg))})
    rank, N, device = comm.rank, comm.world_size, comm.device
    torch.manual_seed(c.seed + rank)  # each rank's dropout masks (checkpoints keep this RNG's state)
    path = resume.resume_from(vars(c), N)  # None: a fresh start
    c.grad_accum, c.save_interval = grad_accum_for(c, N), c.save_interval or c.eval_interval
    tokens_per_step = c.batch_size * c.block_size * c.grad_accum * N  # over all ranks
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # to time the GPU's work, not its queue
    dtype = DTYPES[c.dtype or ("bfloat16" if cuda else "float32")]
    log = print if rank == 0 else (lambda *a, **k: None)

    data = load_data(c.data)
    gcfg = GPTConfig(c.n_layer, c.n_head, c.n_embd, c.block_size, 256, c.bias, c.dropout)
    model = GPT(gcfg, torch.Generator().manual_seed(c.seed)).to(device)  # the same on every rank
    n_params = model.num_params()
    engine = minizero.Engine(model, comm, c.stage, optimizer=c.optimizer, lr=c.lr, weight_decay=c.weight_decay,
                             decay=lambda name, p: p.dim() >= 2, dtype=dtype, grad_accum=c.grad_accum,
                             clip=c.clip or None, reduce_dtype=DTYPES.get(c.reduce_dtype),
                             loss_scale=c.loss_scale, scale_window=c.scale_window, offload=c.offload,
                             offload_dir=c.offload_dir, offload_params=c.offload_params,
                             pin_memory=c.pin_memory, shard_size=shard_size(vars(c), N), trace=c.trace,
                             **({} if c.reduce_order == "tree" else dict(reduce_every=c.reduce_every)),
                             reshard_after_forward=reshard_arg(c.reshard_after_forward),
                             quantize_weights=c.quantize_weights, quantize_grads=c.quantize_grads,
                             native=c.native, reduce_order=c.reduce_order, **optimizer_options(c))
    if c.compile:  # each block one graph; the engine's hooks run between them (DESIGN.md §14)
        log("compiling each block (the first step takes ~20 s)...")
        compiled.compile_units(model, [u.module for u in engine.units])
    S = engine.group.world_size
    log(f"{N} ranks, ZeRO stage {c.stage}" + (f" sharded over {S} ranks, {N // S} copies" if S < N else "")
        + f", {c.optimizer}, {str(dtype)[6:]}, {n_params / 1e6:.2f}M parameters, "
        f"{c.batch_size}x{c.grad_accum}x{N} sequences of {c.block_size} per step")
    mem, formula = engine.memory(), engine.formula()
    for k in mem:
        log(f"  model state per rank, {k:9s}: {fmt_bytes(mem[k]):>12} measured, {fmt_bytes(formula[k]):>12} formula")
    for where, n in engine.offloaded().items():
        log(f"  offloaded per rank to {where:5s}: {fmt_bytes(n):>12} measured, "
            f"{fmt_bytes(engine.formula(offloaded=True)[where]):>12} formula (the optimizer's fp32 master and state)")

    start = resume.load(engine, path, c, log)  # the step to go on from (0: a fresh start)
    # every rank evaluates the same fixed val batches, so their val losses agree
    vgen = torch.Generator().manual_seed(c.seed)
    val_batches = [get_batch(data["val"], c.batch_size, c.block_size, vgen) for _ in range(c.eval_iters)]

    @torch.no_grad()
    def evaluate():
        model.eval()  # (no dropout)
        losses = [model(x.to(device), y.to(device))[1].item() for x, y in val_batches]
        model.train()
        return sum(losses) / len(losses)

    train_curve, val_curve, times, comm_step = [], [], [], None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(start, c.steps + 1):
        if step % c.eval_interval == 0 or step == c.steps:
            val_curve.append((step, evaluate()))
            log(f"step {step}: val loss {val_curve[-1][1]:.4f}")
            resume.record(c, rank, step=step, val=val_curve[-1][1])
        if c.out_dir and step > start and (step % c.save_interval == 0 or step == c.steps):
            resume.save(engine, c, step, log)  # (background: a thread writes it)
        if step == c.steps:
            break
        engine.lr = get_lr(step, c)
        if c.optimizer == "muon":  # Muon's lr on the same schedule
            engine.options["muon_lr"] = get_lr(step, c, c.muon_lr, c.min_lr / c.lr * c.muon_lr if c.lr else 0.0)
        sent_before, to_before, skipped = dict(comm.sent), dict(comm.sent_to), engine.skipped
        sync()
        t0 = time.perf_counter()
        batches = resume.step_batches(data["train"], c, step, rank, N)
        loss = train_step(model, engine, batches, device, resume.leaf_seeds(c, step, rank))
        sync()
        times.append(time.perf_counter() - t0)
        train_curve.append((step, loss))
        resume.record(c, rank, step=step, loss=loss)
        # what one step sends, beside DESIGN.md's formula: a step taken (fp16 skips its first ones)
        if comm_step is None and engine.skipped == skipped:
            comm_step = {k: v - sent_before.get(k, 0) for k, v in comm.sent.items() if v != sent_before.get(k, 0)}
            expect = engine.formula(sent=True)
            log("bytes sent per step by rank 0: " + ", ".join(
                f"{k} {v:,} (formula {expect[k]:,})" if k in expect else f"{k} {v:,}" for k, v in sorted(comm_step.items())))
            if S < N:  # hybrid: what stays in the shard group (a node) and what leaves it
                inside = sum(v - to_before.get(k, 0) for k, v in comm.sent_to.items() if k in engine.group.ranks)
                log(f"  of which to its shard group {inside:,}, to other groups "
                    f"{sum(comm.sent_to.values()) - sum(to_before.values()) - inside:,}")
        if step % 10 == 0 or step == c.steps - 1:
            tok_s = tokens_per_step / times[-1]
            util = f", mfu {100 * mfu(n_params, c, tok_s, N):.1f}%" if cuda else ""
            log(f"step {step}: loss {train_curve[-1][1]:.4f}, time {1000 * times[-1]:.1f} ms, tok/s {tok_s:,.0f}{util}")

    timed = times[min(len(times) - 1, 5):] or [float("nan")]  # the first steps are warm-up
    ms = 1000 * sum(timed) / len(timed)
    tok_s = tokens_per_step / ms * 1000
    peak = minizero.peak_memory(device)
    peaks = ops.all_gather(torch.tensor([float(peak)], device=device), comm, kind="stats").tolist()
    log(f"{ms:.1f} ms/step, {tok_s:,.0f} tok/s" + (f", mfu {100 * mfu(n_params, c, tok_s, N):.1f}%" if cuda else "")
        + (f", {engine.skipped} steps skipped for non-finite gradients" if engine.skipped else "")
        if times else f"nothing left to train: the checkpoint is at step {start} of --steps "
        f"{c.steps}; give a larger --steps to train on")
    log(f"peak memory per rank ({'cuda max_memory_allocated' if cuda else 'process max RSS'}): "
        + ", ".join(fmt_bytes(p) for p in peaks) + f"; model state is {fmt_bytes(sum(mem.values()))} of it, "
        "the rest is activations, buffers and (on CPU) torch itself")
    # generation runs on every rank (stage 3 gathers collectively); the same seed draws the same text
    prompt = data["val"][:c.block_size // 2].long()[None].to(device)
    model.eval()
    out = model.generate(prompt, c.sample_tokens, temperature=0.8, top_k=50,
                         generator=torch.Generator(device).manual_seed(c.seed))
    sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    log("-" * 40 + "\n" + sample + "\n" + "-" * 40)
    if c.trace:
        log(f"trace of the first steps: {c.trace}/rank{{0..{N - 1}}}.json (open in ui.perfetto.dev)")
    engine.close()  # the background save committed; (disk offload: its files go now)
    if c.out_dir and rank == 0:
        checkpoint.prune(c.out_dir)
    return dict(train=train_curve, val=val_curve, ms_per_step=ms, tokens_per_s=tok_s, peak_memory=peak, memory=mem,
                formula=formula, comm_per_step=comm_step, n_params=n_params, skipped=engine.skipped, sample=sample)


def train_entry(comm, cfg):
    """One spawned rank: share the cores, then train."""
    if comm.device.type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))  # ranks on this machine
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return train(comm, cfg)


def main(argv=None):
    try:
        cfg = check_config(parse_args(argv))
        N = int(os.environ.get("WORLD_SIZE", cfg["world_size"]))
        gpus = torch.cuda.is_available() and ("RANK" in os.environ or torch.cuda.device_count() >= N)
        if os.environ.get("RANK", "0") == "0":  # first, before any rank builds the model: what was taken
            print("\n".join(banner(cfg, N, gpus)), flush=True)
    except ValueError as e:  # the user's options: one line, as argparse's own errors (tracebacks are for bugs)
        print(f"train_gpt.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        if "RANK" in os.environ:  # started by torchrun
            try:
                comm = launch.init_from_env(native=torch.cuda.is_available() if cfg["native"] is None else cfg["native"])
            except ValueError as e:  # more processes than GPUs: one line, as the options' errors
                print(f"train_gpt.py: error: {e}", file=sys.stderr)
                sys.exit(2)
            train_entry(comm, cfg)
            torch.distributed.destroy_process_group()  # NCCL asks for it: no rank leaves work pending
        else:  # start our own world: one GPU per rank if there are enough, else CPU processes
            launch.run_processes(train_entry, cfg["world_size"], cfg, backend="nccl" if gpus else "gloo")
    except KeyboardInterrupt:  # run_processes has killed every rank on its way out
        print("train_gpt.py: interrupted; every rank was stopped", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()

"""
What the benchmark's modes share: the run's Config, a Variant (one row: minizero at a
stage, or torch's DDP or FSDP2), build() (a variant's GPT with its optimizer, behind
step(x, y) -> loss), the batches every variant sees, and the medians and ratios the
tables print. Every variant starts from the same weights (seed 1337) and trains with
nanoGPT's AdamW, each with its own fp32 optimizer state.
"""
import contextlib
import os
import statistics
import tempfile
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import minizero
import ops
from train_gpt import GPT, GPTConfig

MiB = 2 ** 20
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1  # nanoGPT's AdamW: decay only on matrices
# Disk offload's optimizer state lives in files here (on a disk, not tmpfs, on this machine).
OFFLOAD_DIR = os.path.join(tempfile.gettempdir(), "minizero-bench-offload")


@dataclass(frozen=True)
class Config:
    world_size: int = 2
    n_layer: int = 4        # the timing table's GPT; --quick and --max-model change it
    n_head: int = 4
    n_embd: int = 256
    block: int = 64
    batch: int = 8          # sequences per rank per step
    reps: int = 15          # interleaved repetitions: the table shows their medians
    steps: int = 3          # timed steps per variant per rep
    warmup: int = 2
    budget_mb: int = 768
    variants: tuple = ()


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "ddp", "fsdp2" or "zero"
    stage: int = 0
    native: bool = False
    overlap: bool = True
    offload: str = None  # "disk": the optimizer state in files under OFFLOAD_DIR
    record: bool = True  # False: the flight record switched off, to time what it costs
    compile: bool = False  # each block compiled (torch.compile), before DDP or FSDP2 wrap it
    order: str = "ring"  # "tree": Engine(reduce_order="tree"), the same bits at any world size

    @property
    def zero_stage(self):
        """What the formulas count it as: DDP keeps all (0), FSDP2 shards all (3)."""
        return {"ddp": 0, "fsdp2": 3}.get(self.kind, self.stage)


def gpt_config(cfg, n_layer=None):
    return GPTConfig(n_layer or cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block, 256, True)


def meta_params(cfg, n_layer):
    """The GPT's parameter count, built on the meta device: building it for real here would
    raise this process's peak RSS, which spawned ranks inherit in ru_maxrss (Linux keeps
    the high-water mark across fork and exec), and every later row would measure high."""
    with torch.device("meta"):
        return GPT(gpt_config(cfg, n_layer)).num_params()


def batches(cfg, rank, n, device="cpu"):
    """n fixed batches of random tokens for this rank: every variant sees the same ones."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, 256, (n, cfg.batch, cfg.block + 1), generator=g).to(device)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in x]


# -----------------------------------------------------------------------------
# one variant: a model with its optimizer, behind step(x, y) -> loss


def build(v, comm, gcfg, meta=False):
    """The same GPT (same seed, so the same weights) wrapped the variant's way. meta=True
    (the memory worlds): minizero and FSDP2 build it on the meta device and make each
    unit (FSDP2: each rank's shard) real in turn, as one does for a model too big for a
    rank; DDP has no such path and builds it whole. Returns (step, the engine or None)."""
    meta = meta and v.kind != "ddp"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(gcfg, None if meta else torch.Generator().manual_seed(1337))
    model = model if meta else model.to(comm.device)
    if v.compile and v.kind != "zero":  # (torchtitan's order: compile, then shard)
        for block in model.transformer.h:
            block.compile()
    if v.kind == "zero":
        return build_zero(v, comm, model, meta)
    if v.kind == "ddp":
        model = DDP(model)
    else:  # FSDP2: every block is its own group, the root (embeddings, tied head) the last
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        if meta:  # FSDP2's recipe: shard on meta, then allocate and fill only this rank's shards
            model.to_empty(device=comm.device)
            for name, p in model.named_parameters():
                model.init_weights(name, p.to_local())
    opt = torch.optim.AdamW(decay_groups(model), lr=LR, betas=BETAS, eps=EPS)

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step, None


def build_zero(v, comm, model, meta):
    """minizero's Engine at the variant's stage around model (on the meta device if meta)."""
    # native=None: the engine leaves comm.native alone; we set it per step, since every
    # engine in this world shares one communicator
    engine = minizero.Engine(model, comm, v.stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             decay=lambda name, p: p.dim() >= 2, overlap=v.overlap, native=None,
                             offload=v.offload, offload_dir=OFFLOAD_DIR if v.offload else None,
                             init=model.init_weights if meta else None, reduce_order=v.order)
    if v.compile:  # after Engine(...): the engine's hooks stay outside the graphs either way
        for block in model.transformer.h:
            block.compile()
    # (ops.NoRecord keeps nothing: the difference in ms/step is what the record costs)
    record = comm.flight if v.record else ops.NoRecord()

    def step(x, y):
        comm.native, comm.flight = v.native, record
        _, loss = model(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step, engine


def decay_groups(model):
    """AdamW's groups as minizero's engines get them (decay=...): matrices decay, the rest not."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# -----------------------------------------------------------------------------
# what the tables print: medians over reps, and ratios within a rep


def slowest(res, names, reps, key="times"):
    """Seconds per step of each variant in each rep: the slowest rank's (key="cpu": CPU
    seconds)."""
    return {name: [max(r[name][key][i] for r in res) for i in range(reps)] for name in names}


def medians(times):
    """ms per step of each variant: the median over reps."""
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def paired(times, a, b):
    """a's time over b's: the median over reps of the ratio within each rep."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def ratios(times):
    """The table's three comparisons with torch and with no overlap."""
    return {"stage0-native/ddp": paired(times, "stage0-native", "torch-ddp"),
            "stage3-native/fsdp2": paired(times, "stage3-native", "torch-fsdp2"),
            "stage3 overlap on/off": paired(times, "stage3-native", "stage3-native-noovl")}

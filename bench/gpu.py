"""
--gpu (gpu_check.sh): minizero against a plain torch loop on one GPU (the overhead ratio),
and the native rows of the timing table on CUDA at the world size the GPUs allow. Without
CUDA the same code runs, tiny, on the CPU: it proves it starts.
"""
from dataclasses import replace

import torch

from minizero_lib import launch
from bench.common import Config, Variant, medians, ratios, slowest
from bench.overhead import overhead
from bench.speed import time_world

GPT2 = dict(n_layer=12, n_head=12, n_embd=768, block=1024, batch=8, reps=5, steps=3, warmup=3)
TINY = dict(n_layer=1, n_head=2, n_embd=32, block=16, batch=2, reps=2, steps=1, warmup=1)
ROWS = [Variant("torch-ddp", "ddp"), Variant("torch-fsdp2", "fsdp2"),
        Variant("stage0-native", "zero", 0, True), Variant("stage3-native", "zero", 3, True),
        Variant("stage3-native-noovl", "zero", 3, True, False)]


def gpu_bench(quick):
    """The overhead line, the native rows' ms/step, and the summary line gpu_check.sh greps."""
    torch.set_num_threads(1)  # as every rank of the table: one torch thread
    cuda = torch.cuda.is_available()
    cfg = Config(world_size=1, **(TINY if quick or not cuda else GPT2))
    where = "the CPU (no CUDA: tiny sizes, times mean nothing)"
    if cuda:
        where = torch.cuda.get_device_name()
    print(f"--gpu on {where}:", flush=True)
    over = overhead(cfg, tiny=False)[0][0]
    # the native rows: NCCL puts one rank on each GPU, so one GPU runs world size 1 only
    n = max(1, torch.cuda.device_count()) if cuda else 1
    cfg = replace(cfg, world_size=n, variants=tuple(ROWS), reps=min(cfg.reps, 3),
                  steps=min(cfg.steps, 2), warmup=min(cfg.warmup, 2))
    res = launch.run_processes(time_world, n, cfg, backend="nccl" if cuda else "gloo",
                               check=False, timeout=600)
    row = slowest(res, [v.name for v in ROWS], cfg.reps)
    print(f"  native rows, fp32, world size {n} ({'nccl' if cuda else 'gloo'}): "
          + ", ".join(f"{name} {t:.1f} ms" for name, t in medians(row).items()), flush=True)
    skipped = "none"
    if cuda and n == 1:
        skipped = "world sizes above 1 (one GPU; NCCL takes one GPU per rank)"
    print(f"summary: overhead vs plain torch loop {over:.2f}x; world {n}: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios(row).items()) + f"; skipped: {skipped}")

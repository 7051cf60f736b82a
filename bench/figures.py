"""
--plot DIR: memory.png (stages 0-3 against N: formula lines, Engine.memory() points, thread
worlds) and timeline.png (a stage-3 step traced on gloo ranks), drawn by
minizero_lib/plots.py (matplotlib, an optional extra: pip install -e ".[plot]").
"""
import json
import os
import tempfile

import torch

import minizero
from minizero_lib import flight, launch, plots
from bench.common import Config, Variant, batches, build, gpt_config, meta_params
from train_gpt import GPT


def plot(out_dir, quick):
    """Write memory.png and timeline.png in out_dir; return the exit status (2: no
    matplotlib, after one line on stderr saying how to get it)."""
    plt = plots.pyplot()
    if plt is None:
        return 2
    cfg = Config(n_layer=2, n_embd=64, block=32, batch=4) if quick else Config()
    worlds = range(1, 5 if quick else 9)
    measured = {}
    for n in worlds:
        for stage, nbytes in enumerate(launch.run_threads(state_bytes, n, gpt_config(cfg))[0]):
            measured[stage, n] = nbytes
    os.makedirs(out_dir, exist_ok=True)
    plots.memory_png(plt, os.path.join(out_dir, "memory.png"), meta_params(cfg, cfg.n_layer),
                     torch.bfloat16, measured, list(worlds))
    with tempfile.TemporaryDirectory() as tmp:
        launch.run_processes(traced_world, cfg.world_size, cfg, tmp, check=False, timeout=600)
        traces = []
        for r in range(cfg.world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                traces.append(json.load(f)["traceEvents"])
    plots.timeline_png(plt, os.path.join(out_dir, "timeline.png"), traces, step=2)
    print(f"wrote {out_dir}/memory.png and {out_dir}/timeline.png")
    return 0


def state_bytes(comm, gcfg):
    """Engine.memory() of each stage (bf16 compute, fp32 AdamW) on this thread world."""
    out = []
    for stage in range(4):
        model = GPT(gcfg, torch.Generator().manual_seed(1337))
        engine = minizero.Engine(model, comm, stage, dtype=torch.bfloat16)
        out.append(sum(engine.memory().values()))
        engine.close()
    return out


def traced_world(comm, cfg, trace_dir):
    """Three stage-3 steps of the timing table's GPT with Engine(trace=...): its first three."""
    torch.set_num_threads(1)
    step, engine = build(Variant("stage3-ring", "zero", 3), comm, gpt_config(cfg))
    # (build() makes the engine; this is trace=trace_dir)
    flight.Tracer(trace_dir, comm, engine.units, minizero.tensors)
    for x, y in batches(cfg, comm.rank, 3):
        step(x, y)
    engine.close()

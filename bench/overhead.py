"""
Overhead (--overhead, and a row of the timing table): one rank, a plain torch loop against
minizero's stage-0 engine, alternating reps: nothing is sent, so the difference is the
engine's own work (a tiny GPT: its fixed cost). On a GPU if there is one.
"""
import time
from dataclasses import replace

import torch

import minizero
from minizero_lib import launch
from bench.common import BETAS, EPS, LR, WD, batches, decay_groups, gpt_config, medians, paired
from train_gpt import GPT


def plain_vs_engine(comm, cfg):
    """One rank trains the same GPT two ways, alternating reps: a plain torch loop (AdamW
    unfused, bf16 autocast on GPU, as nanoGPT) and minizero's stage-0 engine (bf16 params,
    fp32 master). Returns {name: [seconds per step, per rep]} ("name cpu": CPU) and the
    last losses."""
    cuda = comm.device.type == "cuda"
    data = batches(cfg, 0, cfg.warmup + cfg.reps * cfg.steps, comm.device)
    plain = GPT(gpt_config(cfg), torch.Generator().manual_seed(1337)).to(comm.device)
    opt = torch.optim.AdamW(decay_groups(plain), lr=LR, betas=BETAS, eps=EPS, fused=False,
                            foreach=cuda)
    ours = GPT(gpt_config(cfg), torch.Generator().manual_seed(1337)).to(comm.device)
    engine = minizero.Engine(ours, comm, 0, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             native=True, decay=lambda name, p: p.dim() >= 2,
                             dtype=torch.bfloat16 if cuda else torch.float32)

    def plain_step(x, y):
        with torch.autocast(comm.device.type, torch.bfloat16, enabled=cuda):
            loss = plain(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def engine_step(x, y):
        loss = ours(x, y)[1]
        engine.backward(loss)
        engine.step()
        return loss.detach()

    steps = {"plain": plain_step, "minizero": engine_step}
    out = {key: [] for name in steps for key in (name, name + " cpu")}
    for step in steps.values():
        for x, y in data[:cfg.warmup]:
            step(x, y)
    # time the GPU's work, not its queue
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for rep in range(cfg.reps):
        batch = data[cfg.warmup + rep * cfg.steps:][:cfg.steps]
        for name in list(steps)[::1 if rep % 2 == 0 else -1]:  # alternate who goes first
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for x, y in batch:
                steps[name](x, y)
            sync()
            out[name].append((time.perf_counter() - t0) / len(batch))
            out[name + " cpu"].append((time.process_time() - c0) / len(batch))
    # the same batch: near-equal losses
    losses = {name: float(steps[name](*data[-1])) for name in steps}
    return out, losses


def overhead(cfg, tiny=True):
    """One rank (on a GPU if there is one): minizero's stage-0 engine over a plain torch loop
    at cfg's GPT (and a tiny one: mostly the fixed cost). Returns [(ratio, ratio of CPU
    times)], printing a line for each GPT."""
    torch.set_num_threads(1)  # as every rank of the table: one torch thread
    cuda, out = torch.cuda.is_available(), {}
    # (ms steps: more reps, for a steady ratio)
    small = replace(cfg, n_layer=1, n_head=2, n_embd=32, block=16, batch=2, steps=10 * cfg.steps,
                    reps=4 * cfg.reps)
    for name, c in {"GPT": cfg, **({"tiny GPT": small} if tiny else {})}.items():
        c = replace(c, world_size=1)
        device = "cuda" if cuda else "cpu"
        times, losses = launch.run_threads(plain_vs_engine, 1, c, device=device)[0]
        ms = medians(times)
        out[name] = (paired(times, "minizero", "plain"), paired(times, "minizero cpu", "plain cpu"))
        print(f"  {name} {c.n_layer}x{c.n_embd}, batch {c.batch}x{c.block}, {c.reps} reps of "
              f"{c.steps} steps: plain torch loop{' (bf16 autocast)' if cuda else ''} "
              f"{ms['plain']:.2f} ms/step, minizero stage 0 at one rank"
              f"{' (bf16)' if cuda else ''} {ms['minizero']:.2f} "
              f"({ms['minizero'] - ms['plain']:+.2f} ms, {out[name][0]:.3f}x; CPU time "
              f"{out[name][1]:.3f}x); last losses {losses['plain']:.4f} and "
              f"{losses['minizero']:.4f}", flush=True)
    return list(out.values())


def overhead_summary(cfg):
    """--overhead: the two lines of overhead(cfg), then its summary line."""
    (big, big_cpu), (tiny, _) = overhead(cfg)
    print(f"summary: overhead/plain loop {big:.2f}x (CPU {big_cpu:.2f}x, tiny GPT {tiny:.2f}x)")

"""
The demo's GPT (train_gpt.py's defaults, stage 3) on 4 thread ranks, 3 steps per mode of
quantization: the bytes one step sends (measured by the ledger, and the formula), and the
largest error of what quantization produced against its bound, over every element:

  weights  what each forward read (qwZ) against the owner's exact shard; the bound per element
           is amax over its block / 254, plus one rounding to the compute dtype
  grads    each rank's reduced gradient shard against the exact (fp64) sum of every rank's
           local gradient; the bound is the sum over the other ranks of amax over their
           block / (2Q) (Q = 127 or 7; a rank's own piece never moves), plus one rounding

With --check, then minizero.check on the same GPT at 4 ranks under quantize_grads=8 and 4:
stages 0-3 against stage 0's bits, and the bytes against the formula.

    PYTHONPATH=$PWD python tests/quant_table.py [--dtype bfloat16] [--check]
"""
import argparse
import copy
import sys

import torch

sys.path.insert(0, ".")
import train_gpt  # noqa: E402
import minizero  # noqa: E402
from minizero_lib import launch, quantize  # noqa: E402
from minizero import Engine  # noqa: E402

N, STEPS = 4, 3
MODES = {"none": {}, "weights 8": dict(quantize_weights=8), "grads 8": dict(quantize_grads=8),
         "grads 4": dict(quantize_grads=4),
         "weights 8 + grads 4": dict(quantize_weights=8, quantize_grads=4)}
KINDS = ("all_gather", "reduce_scatter")


def per_element_bound(x, bits, block):
    """amax over each element's block / (2Q), in fp64 (and fp32's rounding, 2^-20 amax)."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float64)
    padded[:n] = x.double()
    amax = padded.view(-1, block).abs().amax(1)
    return (amax * (1 / (2 * quantize.QMAX[bits]) + 2.0 ** -20)).repeat_interleave(block)[:n]


def rank(comm, model, data, dtype, kw):
    """One rank's run: (bytes of the last step and the formula, forwards seen, reductions seen)."""
    c = train_gpt.DEFAULTS
    model = copy.deepcopy(model)
    e = Engine(model, comm, c["stage"], lr=c["lr"], weight_decay=c["weight_decay"],
               decay=lambda name, p: p.dim() >= 2, dtype=dtype, clip=c["clip"],
               betas=c["betas"], eps=c["eps"], **kw)
    forwards = []  # (gathered flat, this rank's exact shard) before each unit's forward
    for u in e.units:
        u.module.register_forward_pre_hook(
            lambda m, a, u=u: forwards.append((u.flat.clone(), u.shard.clone())))
    gen = torch.Generator().manual_seed(c["seed"] + comm.rank + 1)
    for step in range(STEPS):
        before = dict(comm.sent)
        x, y = train_gpt.get_batch(data["train"], c["batch_size"], c["block_size"], gen)
        e.backward(model(x, y)[1])
        e.step()
    sent = {k: comm.sent[k] - before.get(k, 0) for k in KINDS}
    formula = e.formula(sent=True)
    e.close()
    return sent, {k: formula.get(k, 0) for k in KINDS}, forwards


def worst_ratio(err, allowed):
    return float((err / allowed.clamp_min(1e-30)).max())


def weight_error(runs, bits, block, dtype):
    """Max |gathered - exact| and max of its ratio to the bound, over every forward and rank."""
    worst, ratio = 0.0, 0.0
    for i in range(len(runs[0][2])):
        exact = [run[2][i][1] for run in runs]
        for run in runs:
            flat = run[2][i][0].view(N, -1)
            for r, w in enumerate(exact):
                err = (flat[r].double() - w.double()).abs()
                allowed = per_element_bound(w, bits, block) + \
                    flat[r].double().abs() * torch.finfo(dtype).eps
                worst, ratio = max(worst, float(err.max())), max(ratio, worst_ratio(err, allowed))
    return worst, ratio


def grad_error(reductions, bits, block, dtype):
    """Max |reduced - exact sum| and max of its ratio to the bound, over every unit, step, rank."""
    worst, ratio = 0.0, 0.0
    for k in range(len(reductions[0])):
        buckets = [reductions[r][k][0] for r in range(N)]
        exact = sum(b.double() for b in buckets).view(N, -1)
        for r in range(N):
            got = reductions[r][k][1].double()
            err = (got - exact[r]).abs()
            allowed = exact[r].abs() * torch.finfo(dtype).eps + sum(
                per_element_bound(buckets[s].view(N, -1)[r], bits, block)
                for s in range(N) if s != r)
            worst, ratio = max(worst, float(err.max())), max(ratio, worst_ratio(err, allowed))
    return worst, ratio


def check_stages(make_model, data, dtype):
    """minizero.check on the demo's GPT: every stage's bits against stage 0's, per bits."""
    c = train_gpt.DEFAULTS

    def make_batch(step, rank, micro):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        return train_gpt.get_batch(data["train"], c["batch_size"], c["block_size"], gen)
    for bits in (8, 4):
        report = minizero.check(make_model, make_batch, loss_fn=lambda m, b: m(*b)[1],
                                world_sizes=(N,), steps=2, lr=c["lr"], clip=c["clip"],
                                weight_decay=c["weight_decay"], dtype=dtype, quantize_grads=bits)
        print(f"\nminizero.check(GPT, world_sizes=({N},), steps=2, quantize_grads={bits})")
        print(report)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=list(train_gpt.DTYPES), default="float32")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    dtype = train_gpt.DTYPES[args.dtype]
    torch.set_num_threads(1)
    c = train_gpt.DEFAULTS
    data = train_gpt.load_data()
    config = train_gpt.GPTConfig(c["n_layer"], c["n_head"], c["n_embd"], c["block_size"], 256,
                                 c["bias"])

    def make_model():
        return train_gpt.GPT(config, torch.Generator().manual_seed(c["seed"]))
    model = make_model()
    # every reduction's local bucket and result, per rank (through quantize.reduce_grads)
    seen, exact_reduce = {}, quantize.reduce_grads

    def recording(bucket, reduced, group, quant):
        out = exact_reduce(bucket, reduced, group, quant)
        seen.setdefault(group.rank, []).append((bucket.clone(), out.clone()))
        return out
    quantize.reduce_grads = recording
    print(f"demo GPT ({model.num_params():,} parameters), {N} thread ranks, stage {c['stage']}, "
          f"{str(dtype)[6:]}, block {quantize.BLOCK}, {STEPS} steps; bytes per step per rank "
          f"(rank 0's last step)")
    print(f"{'mode':21s} {'all_gather':>23s} {'reduce_scatter':>23s}   {'weights: max err':>16s} "
          f"{'/bound':>7s}   {'grads: max err':>14s} {'/bound':>7s}")
    for name, kw in MODES.items():
        seen.clear()
        runs = launch.run_threads(rank, N, model, data, dtype, kw)
        sent, formula = runs[0][0], runs[0][1]
        assert all(run[0] == run[1] for run in runs), (name, [run[:2] for run in runs])
        ag, rs = (f"{sent[k]:,} = {formula[k]:,}" for k in KINDS)
        w = weight_error(runs, 8, quantize.BLOCK, dtype) if kw.get("quantize_weights") else None
        bits = kw.get("quantize_grads")
        g = grad_error([seen[r] for r in range(N)], bits, quantize.BLOCK, dtype) if bits else None
        cells = [f"{w[0]:16.3e} {w[1]:7.4f}" if w else f"{'exact':>16s} {'':7s}",
                 f"{g[0]:14.3e} {g[1]:7.4f}" if g else f"{'ring, exact':>14s} {'':7s}"]
        print(f"{name:21s} {ag:>23s} {rs:>23s}   {cells[0]}   {cells[1]}")
    quantize.reduce_grads = exact_reduce
    if args.check:
        check_stages(make_model, data, dtype)


if __name__ == "__main__":
    main()

"""
The torch referee of minizero.check: stage 0 against torch itself, step by step. The
stages are held to stage 0's bits (check.py); this holds stage 0 to what torch computes,
split so that nothing amplifies rounding: torch's gradient at the engine's parameters, and
torch.optim.AdamW driven by the engine's own gradient (see check.py's docstring).
"""
import copy

import torch

import check
from minizero import cast_floats


def hold_to_torch(row, model, ranks, spec, n, tol, device):
    """Stage 0 against torch, step by step, on the ranks' device. Gradient: torch's at the
    engine's parameters before the step, over every rank's micro-batches with the loss
    averaged as the engine averages it. Update: torch.optim.AdamW given the engine's own
    mean gradient."""
    kw, run = spec["engine_kw"], ranks[0]
    dtype = kw.get("dtype", torch.float32)  # torch's gradient in the engine's compute dtype
    grad_model, upd_model = copy.deepcopy(model).to(device, dtype), copy.deepcopy(model).to(device).float()
    grad_model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    upd_model.load_state_dict(run["initial"])
    names = [nm for names, *_ in run["layout"] for nm in names]
    decay = kw.get("decay")
    params = [upd_model.get_parameter(nm) for nm in names]
    groups = [{"params": [p for nm, p in zip(names, params) if decay is None or decay(nm, p)]},
              {"params": [p for nm, p in zip(names, params) if not (decay is None or decay(nm, p))],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=kw.get("lr", 1e-3),
                            betas=kw.get("betas", (0.9, 0.999)), eps=kw.get("eps", 1e-8),
                            weight_decay=kw.get("weight_decay", 0.0))
    worst, lr = [0.0, 0.0], kw.get("lr", 1e-3)
    state = run["initial"]
    for step, h in enumerate(run["hist"]):
        if not h["stepped"]:  # skipped for a non-finite gradient, as torch's GradScaler: no parameter moves
            row.skipped += 1
            for nm in h["state"].keys() - {nm for nm, _ in model.named_buffers()}:
                found = check._diff(None, "referee-skip", h["state"][nm], state[nm], nm, 0, step, None, n, 0)
                row.first = row.first or found
            state = h["state"]  # (the buffers moved: the forward ran)
            continue
        row.refereed += 1
        mean = _engine_grad(ranks, step, n)
        grad_model.load_state_dict(state)
        total, size = _torch_grad(grad_model, names, spec, step, n, run["grad_accum"], h["scale"], device)
        scale = max(float(size[nm].nan_to_num(0, 0, 0).max()) for nm in names if size[nm].numel()) + 1e-30
        for nm, used in zip(names, [x for u in h["used"] for x in u]):
            gap = _gap(mean[nm], total[nm])
            rel = float(gap.max()) / scale if gap.numel() else 0.0
            worst[0] = max(worst[0], rel)
            if rel > tol[0] and row.first is None:
                row.first = _referee_divergence("referee-grads", mean[nm], total[nm], gap, nm, step, n)
            upd_model.get_parameter(nm).grad = mean[nm].clone() if used else None
        if kw.get("clip") is not None:
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], kw["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        for nm, p in zip(names, params):
            ours, theirs = h["state"][nm], p.detach()
            gap = _gap(ours, theirs) / (theirs.abs().nan_to_num(0, 0, 0) + lr)
            err = float(gap.max())
            worst[1] = max(worst[1], err)
            if err > tol[1] and row.first is None:
                row.first = _referee_divergence("referee-update", ours, theirs, gap, nm, step, n)
        state = h["state"]
    row.referee = tuple(worst)


def _gap(ours, theirs):
    """|ours - theirs|, 0 where both hold the same NaN or inf, inf where only one is non-finite."""
    same = (ours == theirs) | (ours.isnan() & theirs.isnan())
    return torch.where(same, 0.0, (ours.float() - theirs.float()).abs().nan_to_num(float("inf")))


def _torch_grad(model, names, spec, step, n, accum, scale, device):
    """torch's mean gradient, computed as the engine computes it: one backward per rank
    and micro-batch, each loss times scale/accum in the compute dtype, summed in fp32,
    then divided by N·scale. Also the sum of |contributions|: the scale of its rounding.
    Buffers as DDP has them: every rank's forward reads rank 0's, as its last forward left them."""
    total = {nm: torch.zeros_like(model.get_parameter(nm), dtype=torch.float32) for nm in names}
    size = {nm: torch.zeros_like(t) for nm, t in total.items()}
    buffers = list(model.buffers()) if spec["engine_kw"].get("broadcast_buffers", True) else []
    for k in range(accum):
        start = [b.clone() for b in buffers]  # rank 0's, broadcast before each rank's forward
        for r in range(n):
            for b, x in zip(buffers, start):
                b.copy_(x)
            model.zero_grad(set_to_none=True)
            batch = check._to(spec["make_batch"](step, r, k), device)
            if spec.get("seeded"):  # (a spec made elsewhere may not say)
                torch.manual_seed(check._seed(step, r, k))
            (spec["loss_fn"](model, batch).float() * (scale / accum)).backward()
            for nm in names:
                g = model.get_parameter(nm).grad
                if g is not None:
                    total[nm] += g.float()
                    size[nm] += g.float().abs()
            after = [b.clone() for b in buffers] if r == 0 else after  # what rank 0's forward left
        for b, x in zip(buffers, after):
            b.copy_(x)
    return ({nm: t / (n * scale) for nm, t in total.items()}, {nm: t / (n * scale) for nm, t in size.items()})


def _cast_inputs(dtype):  # as the engine casts its model's inputs
    return lambda module, args, kwargs: (cast_floats(args, dtype), cast_floats(kwargs, dtype))


def _engine_grad(ranks, step, n):
    """Stage 0's mean gradient of a step, per parameter name: the reduced shards of one
    shard group (ranks 0..S-1) after the last micro-batch, concatenated, times 1/(N · loss scale)."""
    out, h, S = {}, ranks[0]["hist"][step], ranks[0]["shard_size"]
    for ui, (names, offsets, sizes, _) in enumerate(ranks[0]["layout"]):
        full = torch.cat([ranks[r]["hist"][step]["grads"][-1][ui] for r in range(S)]).float() / (n * h["scale"])
        for nm, o, k in zip(names, offsets, sizes):
            out[nm] = full[o:o + k].view(h["state"][nm].shape)
    return out


def _referee_divergence(what, ours, theirs, gap, name, step, n):
    x, y = ours.double().reshape(-1), theirs.double().reshape(-1)
    i = int(gap.reshape(-1).argmax())
    return check.Divergence(what, n, 0, step, None, 0, name, i, float(x[i]), float(y[i]),
                            float(_gap(ours, theirs).max()), check._ulps(ours.float(), theirs.float()))

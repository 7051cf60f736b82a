"""
The referee of minizero.check: it judges the runs that check.py records, step by step.
Every stage is held to stage 0's bits, every rank to rank 0's, memory and bytes to the
formulas (compare); and stage 0 to what torch computes (hold_to_torch, the torch referee),
split so that nothing amplifies rounding: torch's gradient at the engine's parameters, and
torch's optimizer (AdamW, SGD, Adafactor, or Muon + AdamW) driven by the engine's own
gradient (see check.py's docstring).
"""
import copy

import torch

from minizero_lib import check
from minizero_lib.user_model import cast_floats
from minizero_lib.optimizers import OPTIMIZERS, optimizer_options


# -----------------------------------------------------------------------------
# every stage against stage 0, every rank against rank 0, and the formulas


def compare(row, ranks, base, n, stage, buffers, initial):
    """Fill row: this stage against stage 0 (base); every rank's starting values against
    rank 0's model (initial), its parameters after a step against rank 0's, and the buffers
    every forward read against rank 0's (after a step they differ: each rank's forward
    updates its own, and rank 0's win at the next forward, as in DDP); and the formulas."""
    for r, run in enumerate(ranks):
        for name, value in initial.items():
            found = _diff(None, "initial", run["initial"][name].cpu(), value, name, r, 0, None, n, stage)
            row.first = row.first or found
    for step, h0 in enumerate(ranks[0]["hist"]):
        for r, run in enumerate(ranks):
            h, ref = run["hist"][step], base[r]["hist"][step] if base else None
            found = []
            if ref is not None:
                for m, (mine, theirs) in enumerate(zip(h["grads"], ref["grads"])):
                    for ui, (a, b) in enumerate(zip(mine, theirs)):
                        found.append(_diff(row, "grads", a, b, run["layout"][ui], r, step, m, n, stage))
                for name in h["state"]:
                    found.append(_diff(row, "params", h["state"][name], ref["state"][name], name, r, step, None,
                                       n, stage))
                for ui, (a, b) in enumerate(zip(h["live"], ref["live"])):  # the params forward reads
                    found.append(_diff(row, "params", a, *_chunk(b, a, run["layout"][ui]), r, step, None, n, stage))
                for mine, theirs in zip(h["moments"], ref["moments"]):  # the optimizer's state, by key
                    for (name, k), (start, t) in mine.items():
                        found.append(_diff(row, "optimizer", t, theirs[name, k][1][start:start + t.numel()],
                                           f"{name} ({k})", r, step, None, n, stage))
                found.append(_steps(h, ref, run["layout"], "optimizer", r, step, n, stage))
            for name in h["state"].keys() - buffers:
                found.append(_diff(None, "ranks", h["state"][name], h0["state"][name], name, r, step, None, n, stage))
            found.append(_steps(h, h0, run["layout"], "ranks", r, step, n, stage))
            for m, (mine, theirs) in enumerate(zip(h["read"], h0["read"])):  # buffers as each forward read them
                for seen, seen0 in zip(mine, theirs):
                    found += [_diff(None, "ranks", seen[k], seen0[k], f"{k} (as forward read it)", r, step, m, n,
                                    stage) for k in seen]
            if h["memory"] != run["formula"] or h["kept"]:
                row.memory_ok = False
                key = next((k for k in h["memory"] if h["memory"][k] != run["formula"].get(k)), h["kept"])
                found.append(check.Divergence("memory", n, stage, step, None, r, key, 0, h["memory"].get(key, 0),
                                              run["formula"].get(key, 0)))
            expect = _bytes(run, stage, h["stepped"])
            if h["sent"] != expect:
                row.bytes_ok = False
                key = next(k for k in check.KEPT if h["sent"][k] != expect[k])
                found.append(check.Divergence("bytes", n, stage, step, None, r, key, 0, h["sent"][key], expect[key]))
            if row.first is None:
                row.first = next((d for d in found if d is not None), None)


def _chunk(theirs, mine, layout):
    """Stage 0's whole buffer, cut as this stage keeps it (a shard: its chunk), and where to
    name an element of it: (tensor, (names, offsets, sizes, where the chunk starts))."""
    names, offsets, sizes, s = layout
    if mine.numel() < theirs.numel():  # a shard: against its chunk of stage 0's
        return theirs[s:s + mine.numel()], (names, offsets, sizes, s)
    return theirs, (names, offsets, sizes, 0)  # whole buffers: element i is element i


def _steps(h, ref, layout, what, r, step, n, stage):
    """AdamW's per-parameter step counts, against stage 0's or rank 0's."""
    for (names, *_), mine, theirs in zip(layout, h["steps"], ref["steps"]):
        for name, a, b in zip(names, mine, theirs):
            if a != b:
                return check.Divergence(what, n, stage, step, None, r, f"{name} (AdamW step count)", 0, a, b,
                                        abs(a - b))
    return None


def _bytes(run, stage, stepped):
    expect = dict(run["bytes"])
    if not stepped and stage in (1, 2):  # a skipped step gathers no params (stage 0 gathered its grads)
        expect["all_gather"] = 0
    if not stepped:  # ...and nothing for the optimizer
        expect.pop("optimizer", None)
    return {k: expect.get(k, 0) for k in check.KEPT}


def _diff(row, what, a, b, where, rank, step, micro, n, stage):
    """None if a and b are the same bits; else a Divergence at their first difference.
    where is a parameter's name, or a unit's layout (names, offsets, sizes, where a's chunk starts)."""
    if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) \
            and torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)):  # NaN where NaN
        return None
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    bad = ((x != y) & ~(x.isnan() & y.isnan())).nonzero()
    i = int(bad[0]) if len(bad) else 0
    gap = (x - y).abs().nan_to_num(float("inf"))
    if row is not None:
        row.max_diff = max(row.max_diff, float(gap.max()))
    name, index = where, i
    if not isinstance(where, str):  # a reduced shard: find the parameter its element belongs to
        names, offsets, sizes, s = where
        g = s + i
        name, index = next(((nm, g - o) for nm, o, k in zip(names, offsets, sizes) if o <= g < o + k),
                           ("padding", g))
    return check.Divergence(what, n, stage, step, micro, rank, name, index, float(x[i]), float(y[i]),
                            float(gap.max()), _ulps(a, b))


def _ulps(a, b):
    """The largest distance in units of last place between a and b (same dtype)."""
    if not a.is_floating_point() or a.dtype != b.dtype:
        return 0
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    def ordered(t):  # floats' bit patterns, made monotonic in value
        i = t.contiguous().view(ints).long()
        return torch.where(i < 0, -(i & (2 ** (8 * a.element_size() - 1) - 1)), i)
    return int((ordered(a) - ordered(b)).abs().max())


# -----------------------------------------------------------------------------
# stage 0 against torch


def hold_to_torch(row, model, ranks, spec, n, tol, device):
    """Stage 0 against torch, step by step, on the ranks' device. Gradient: torch's at the
    engine's parameters before the step, over every rank's micro-batches with the loss
    averaged as the engine averages it. Update: the torch optimizer(s) given the engine's own
    mean gradient."""
    kw, run = spec["engine_kw"], ranks[0]
    dtype = kw.get("dtype", torch.float32)  # torch's gradient in the engine's compute dtype
    grad_model, upd_model = copy.deepcopy(model).to(device, dtype), copy.deepcopy(model).to(device).float()
    grad_model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    upd_model.load_state_dict(run["initial"])
    names = [nm for names, *_ in run["layout"] for nm in names]
    params = [upd_model.get_parameter(nm) for nm in names]
    opts = torch_optimizers(list(zip(names, params)), run["kinds"], kw)
    worst = [0.0, 0.0]
    state = run["initial"]
    for step, h in enumerate(run["hist"]):
        if not h["stepped"]:  # skipped for a non-finite gradient, as torch's GradScaler: no parameter moves
            row.skipped += 1
            for nm in h["state"].keys() - {nm for nm, _ in model.named_buffers()}:
                found = _diff(None, "referee-skip", h["state"][nm], state[nm], nm, 0, step, None, n, 0)
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
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for nm, p in zip(names, params):
            ours, theirs = h["state"][nm], p.detach()
            lr = kw.get("muon_lr", 1e-3) if run["kinds"][nm] == "muon" else kw.get("lr", 1e-3)
            gap = _gap(ours, theirs) / (theirs.abs().nan_to_num(0, 0, 0) + lr)
            err = float(gap.max())
            worst[1] = max(worst[1], err)
            if err > tol[1] and row.first is None:
                row.first = _referee_divergence("referee-update", ours, theirs, gap, nm, step, n)
        state = h["state"]
    row.referee = tuple(worst)


def torch_optimizers(named, kinds, kw):
    """The torch optimizers the engine's options name (Muon + AdamW: torch's two), with
    weight decay on the params decay(name, p) selects."""
    decay, optimizer = kw.get("decay"), kw.get("optimizer", "adamw")
    o = optimizer_options(optimizer, {k: v for k, v in kw.items() if k in OPTIMIZERS[optimizer]})
    lr, wd = kw.get("lr", 1e-3), kw.get("weight_decay", 0.0)
    make = {"adamw": lambda g: torch.optim.AdamW(g, lr=lr, betas=o["betas"], eps=o["eps"]),
            "sgd": lambda g: torch.optim.SGD(g, lr=lr, momentum=o["momentum"], nesterov=o["nesterov"]),
            "adafactor": lambda g: torch.optim.Adafactor(g, lr=lr, beta2_decay=o["beta2_decay"], eps=o["eps"],
                                                         d=o["d"]),
            "muon": lambda g: torch.optim.Muon(g, lr=o["muon_lr"], momentum=o["momentum"], nesterov=o["nesterov"],
                                               ns_coefficients=o["ns_coefficients"], ns_steps=o["ns_steps"],
                                               adjust_lr_fn=o["adjust_lr_fn"])}
    opts = []
    for kind in sorted(set(kinds.values())):
        mine = [(nm, p) for nm, p in named if kinds[nm] == kind]
        groups = [{"params": [p for nm, p in mine if decay is None or decay(nm, p)], "weight_decay": wd},
                  {"params": [p for nm, p in mine if not (decay is None or decay(nm, p))], "weight_decay": 0.0}]
        opts.append(make[kind]([g for g in groups if g["params"]]))
    return opts


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
                            float(_gap(ours, theirs).max()), _ulps(ours.float(), theirs.float()))

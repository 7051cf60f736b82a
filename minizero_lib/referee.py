"""
The referee of minizero.check: it judges the runs that check.py records, step by step.
Every stage is held to stage 0's bits, every rank to rank 0's, memory and bytes to the
formulas (compare); and stage 0 to what torch computes (hold_to_torch, the torch referee),
split so that nothing amplifies rounding: torch's gradient at the engine's parameters, and
torch's optimizer (AdamW, SGD, Adafactor, or Muon + AdamW) driven by the engine's own
gradient (see check.py's docstring). The runs and findings are report.py's types.
"""
import copy

import torch

from minizero import cast_floats
from minizero_lib.optimizers import OPTIMIZERS, optimizer_options
from minizero_lib.report import SENT_KINDS, Divergence, seed, to_device


# -----------------------------------------------------------------------------
# every stage against stage 0, every rank against rank 0, and the formulas


def compare(row, ranks, base, n, stage, buffer_names, initial):
    """Fill row: this stage's RankRuns (ranks) against stage 0's (base); every rank's starting
    values against rank 0's model (initial), its parameters after a step against rank 0's,
    and the buffers every forward read against rank 0's (after a step they differ: each
    rank's forward updates its own, and rank 0's win at the next forward, as in DDP); and the
    formulas."""
    for r, run in enumerate(ranks):
        for name, value in initial.items():
            found = _diff(None, "initial", run.initial[name].cpu(), value, name, r, 0, None, n,
                          stage)
            row.first = row.first or found
    for step, h0 in enumerate(ranks[0].history):
        for r, run in enumerate(ranks):
            h = run.history[step]
            findings = []
            if base is not None:
                findings += _against_stage_0(row, run, h, base[r].history[step], r, step, n, stage)
            findings += _against_rank_0(run, h, h0, buffer_names, r, step, n, stage)
            findings += _against_formulas(row, run, h, r, step, n, stage)
            if row.first is None:
                row.first = next((d for d in findings if d is not None), None)


def compare_worlds(row, worlds, buffer_names):
    """reduce_order="tree": stage 0's state after each step at world size n (the last of
    worlds) against the first world size's, to the bit: the tree's order is not the world's."""
    base, (n, run) = next(iter(worlds.values())), list(worlds.items())[-1]
    for step, (h, ref) in enumerate(zip(run.history, base.history)):
        for name in (nm for nm in h.state if nm not in buffer_names):
            found = _diff(None, "world sizes", h.state[name], ref.state[name], name, 0, step,
                          None, n, 0)
            if found is not None:
                row.first = row.first or found
                return


def _against_stage_0(row, run, h, ref, r, step, n, stage):
    """Rank r's step h against stage 0's (ref): every micro-batch's reduced gradient shard, the
    parameters and buffers, the 16-bit params forward reads, and the optimizer's state."""
    findings = []
    for m, (mine, theirs) in enumerate(zip(h.grads, ref.grads)):
        for ui, (a, b) in enumerate(zip(mine, theirs)):
            findings.append(_diff(row, "grads", a, b, run.layout[ui], r, step, m, n, stage))
    for name in h.state:
        findings.append(_diff(row, "params", h.state[name], ref.state[name], name, r, step, None,
                              n, stage))
    for ui, (a, b) in enumerate(zip(h.live, ref.live)):
        findings.append(_diff(row, "params", a, *_chunk(b, a, run.layout[ui]), r, step, None, n,
                              stage))
    # The optimizer's state, by key.
    for mine, theirs in zip(h.moments, ref.moments):
        for (name, key), (start, t) in mine.items():
            stage_0s = theirs[name, key][1][start:start + t.numel()]
            findings.append(_diff(row, "optimizer", t, stage_0s, f"{name} ({key})", r, step, None,
                                  n, stage))
    findings.append(_step_counts(h, ref, run.layout, "optimizer", r, step, n, stage))
    return findings


def _against_rank_0(run, h, h0, buffer_names, r, step, n, stage):
    """Rank r's step h against rank 0's (h0): the parameters, the step counts, and the buffers
    as each forward read them."""
    # In the state's order (a set's would hang on the hash seed): the first named is the first.
    findings = [_diff(None, "ranks", h.state[name], h0.state[name], name, r, step, None, n, stage)
                for name in h.state if name not in buffer_names]
    findings.append(_step_counts(h, h0, run.layout, "ranks", r, step, n, stage))
    for m, (mine, theirs) in enumerate(zip(h.read, h0.read)):
        for seen, seen0 in zip(mine, theirs):
            findings += [_diff(None, "ranks", seen[nm], seen0[nm], f"{nm} (as forward read it)", r,
                               step, m, n, stage) for nm in seen]
    return findings


def _against_formulas(row, run, h, r, step, n, stage):
    """Rank r's memory and bytes sent in step h against the formulas."""
    findings = []
    if h.memory != run.memory_formula or h.kept:
        row.memory_ok = False
        category = next((k for k in h.memory if h.memory[k] != run.memory_formula.get(k)), h.kept)
        findings.append(Divergence(what="memory", world_size=n, stage=stage, step=step, micro=None,
                                   rank=r, name=category, index=0,
                                   ours=h.memory.get(category, 0),
                                   theirs=run.memory_formula.get(category, 0)))
    expect = _bytes(run, stage, h.stepped)
    if h.sent != expect:
        row.bytes_ok = False
        kind = next(k for k in SENT_KINDS if h.sent[k] != expect[k])
        findings.append(Divergence(what="bytes", world_size=n, stage=stage, step=step, micro=None,
                                   rank=r, name=kind, index=0, ours=h.sent[kind],
                                   theirs=expect[kind]))
    return findings


def _chunk(theirs, mine, layout):
    """Stage 0's unsharded buffer, cut as this stage keeps it (a shard: its chunk), and where
    to name an element of it: (tensor, its UnitLayout)."""
    if mine.numel() < theirs.numel():
        # A shard: against its chunk of stage 0's.
        return theirs[layout.start:layout.start + mine.numel()], layout
    # Unsharded buffers: element i is element i.
    return theirs, layout._replace(start=0)


def _step_counts(h, ref, layout, what, r, step, n, stage):
    """AdamW's per-parameter step counts, against stage 0's or rank 0's."""
    for unit, mine, theirs in zip(layout, h.step_counts, ref.step_counts):
        for name, a, b in zip(unit.names, mine, theirs):
            if a != b:
                return Divergence(what=what, world_size=n, stage=stage, step=step, micro=None,
                                  rank=r, name=f"{name} (AdamW step count)", index=0, ours=a,
                                  theirs=b, max_abs=abs(a - b))
    return None


def _bytes(run, stage, stepped):
    """The bytes the step must have sent, by the ledger's kinds in SENT_KINDS."""
    expect = dict(run.bytes_formula)
    if not stepped and stage in (1, 2):
        # A skipped step gathers no params (stage 0 gathered its grads).
        expect["all_gather"] = 0
    if not stepped:
        # ...and nothing for the optimizer.
        expect.pop("optimizer", None)
    return {kind: expect.get(kind, 0) for kind in SENT_KINDS}


def _diff(row, what, a, b, where, rank, step, micro, n, stage):
    """None if a and b are the same bits; else a Divergence at their first difference.
    where is a parameter's name, or the UnitLayout of a unit (a's chunk of it)."""
    # NaN where NaN, and the same bits elsewhere.
    if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) \
            and torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0)):
        return None
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    bad = ((x != y) & ~(x.isnan() & y.isnan())).nonzero()
    i = int(bad[0]) if len(bad) else 0
    gap = (x - y).abs().nan_to_num(float("inf"))
    if row is not None:
        row.max_diff = max(row.max_diff, float(gap.max()))
    name, index = where, i
    if not isinstance(where, str):
        # A reduced shard: find the parameter its element belongs to.
        g = where.start + i
        spans = zip(where.names, where.offsets, where.sizes)
        name, index = next(((nm, g - o) for nm, o, size in spans if o <= g < o + size),
                           ("padding", g))
    return Divergence(what=what, world_size=n, stage=stage, step=step, micro=micro, rank=rank,
                      name=name, index=index, ours=float(x[i]), theirs=float(y[i]),
                      max_abs=float(gap.max()), max_ulp=_ulps(a, b))


def _ulps(a, b):
    """The largest distance in units of last place between a and b (same dtype)."""
    if not a.is_floating_point() or a.dtype != b.dtype:
        return 0
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]

    def ordered(t):
        # Floats' bit patterns, made monotonic in value.
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
    # torch's gradient in the engine's compute dtype.
    dtype = kw.get("dtype", torch.float32)
    grad_model = copy.deepcopy(model).to(device, dtype)
    upd_model = copy.deepcopy(model).to(device).float()
    grad_model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    upd_model.load_state_dict(run.initial)
    names = [nm for unit in run.layout for nm in unit.names]
    params = [upd_model.get_parameter(nm) for nm in names]
    opts = torch_optimizers(list(zip(names, params)), run.rules, kw)
    # The worst relative differences seen: (gradient, update).
    worst = [0.0, 0.0]
    state = run.initial
    buffer_names = {nm for nm, _ in model.named_buffers()}
    for step, h in enumerate(run.history):
        if not h.stepped:
            # Skipped for a non-finite gradient, as torch's GradScaler: no parameter moves.
            row.skipped += 1
            # Every parameter, in the state's order.
            for nm in [nm for nm in h.state if nm not in buffer_names]:
                found = _diff(None, "referee-skip", h.state[nm], state[nm], nm, 0, step, None, n, 0)
                row.first = row.first or found
            # (The buffers moved: the forward ran.)
            state = h.state
            continue
        row.refereed += 1
        # (reduce_order="tree": each micro-batch's backward had no 1/grad_accum; the mean's after)
        mean = _engine_grad(ranks, step, n * (run.grad_accum if kw.get("reduce_order") == "tree"
                                              else 1))
        grad_model.load_state_dict(state)
        total, parts = _torch_grad(grad_model, names, spec, step, n, run.grad_accum, h.loss_scale,
                                   device)
        rounding = max(float(parts[nm].nan_to_num(0, 0, 0).max()) for nm in names
                       if parts[nm].numel()) + 1e-30
        for nm, used in zip(names, [x for u in h.used for x in u]):
            gap = _gap(mean[nm], total[nm])
            rel = float(gap.max()) / rounding if gap.numel() else 0.0
            worst[0] = max(worst[0], rel)
            if rel > tol[0] and row.first is None:
                row.first = _referee_divergence("referee-grads", mean[nm], total[nm], gap, nm,
                                                step, n)
            upd_model.get_parameter(nm).grad = mean[nm].clone() if used else None
        if kw.get("clip") is not None:
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], kw["clip"])
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for nm, p in zip(names, params):
            ours, theirs = h.state[nm], p.detach()
            lr = kw.get("muon_lr", 1e-3) if run.rules[nm] == "muon" else kw.get("lr", 1e-3)
            gap = _gap(ours, theirs) / (theirs.abs().nan_to_num(0, 0, 0) + lr)
            err = float(gap.max())
            worst[1] = max(worst[1], err)
            if err > tol[1] and row.first is None:
                row.first = _referee_divergence("referee-update", ours, theirs, gap, nm, step, n)
        state = h.state
    row.referee = tuple(worst)


def torch_optimizers(named, rules, kw):
    """The torch optimizers the engine's options name (Muon + AdamW: torch's two), one per
    update rule in rules (per parameter name), with weight decay on the params decay(name, p)
    selects."""
    decay, optimizer = kw.get("decay"), kw.get("optimizer", "adamw")
    o = optimizer_options(optimizer, {k: v for k, v in kw.items() if k in OPTIMIZERS[optimizer]})
    lr, wd = kw.get("lr", 1e-3), kw.get("weight_decay", 0.0)
    make = {"adamw": lambda g: torch.optim.AdamW(g, lr=lr, betas=o["betas"], eps=o["eps"]),
            "sgd": lambda g: torch.optim.SGD(g, lr=lr, momentum=o["momentum"],
                                             nesterov=o["nesterov"]),
            "adafactor": lambda g: torch.optim.Adafactor(g, lr=lr, beta2_decay=o["beta2_decay"],
                                                         eps=o["eps"], d=o["d"]),
            "muon": lambda g: torch.optim.Muon(g, lr=o["muon_lr"], momentum=o["momentum"],
                                               nesterov=o["nesterov"],
                                               ns_coefficients=o["ns_coefficients"],
                                               ns_steps=o["ns_steps"],
                                               adjust_lr_fn=o["adjust_lr_fn"])}
    opts = []
    for rule in sorted(set(rules.values())):
        mine = [(nm, p) for nm, p in named if rules[nm] == rule]
        decayed = [p for nm, p in mine if decay is None or decay(nm, p)]
        undecayed = [p for nm, p in mine if not (decay is None or decay(nm, p))]
        groups = [{"params": decayed, "weight_decay": wd},
                  {"params": undecayed, "weight_decay": 0.0}]
        opts.append(make[rule]([g for g in groups if g["params"]]))
    return opts


def _gap(ours, theirs):
    """|ours - theirs|, 0 where both hold the same NaN or inf, inf where only one is non-finite."""
    same = (ours == theirs) | (ours.isnan() & theirs.isnan())
    return torch.where(same, 0.0, (ours.float() - theirs.float()).abs().nan_to_num(float("inf")))


def _torch_grad(model, names, spec, step, n, accum, loss_scale, device):
    """torch's mean gradient, computed as the engine computes it: one backward per rank
    and micro-batch, each loss times loss_scale/accum in the compute dtype, summed in fp32,
    then divided by N·loss_scale. Also the sum of |contributions| (|parts|): the scale of its
    rounding. Buffers as DDP has them: every rank's forward reads rank 0's, as its last
    forward left them. reduce_every="step": as DDP under no_sync(), each rank's .grad sums
    its micro-batches in the compute dtype, and only those sums are summed across ranks."""
    total = {nm: torch.zeros_like(model.get_parameter(nm), dtype=torch.float32) for nm in names}
    parts = {nm: torch.zeros_like(t) for nm, t in total.items()}
    no_sync = spec["engine_kw"].get("reduce_every") == "step"
    local = [{} for _ in range(n)]  # no_sync: each rank's accumulated .grad
    buffers = list(model.buffers()) if spec["engine_kw"].get("broadcast_buffers", True) else []
    for micro in range(accum):
        # Rank 0's, broadcast before each rank's forward.
        start = [b.clone() for b in buffers]
        for r in range(n):
            for b, x in zip(buffers, start):
                b.copy_(x)
            model.zero_grad(set_to_none=True)
            batch = to_device(spec["make_batch"](step, r, micro), device)
            # (A spec made elsewhere may not say whether the model draws random numbers.)
            if spec.get("seeded"):
                torch.manual_seed(seed(step, r, micro))
            (spec["loss_fn"](model, batch).float() * (loss_scale / accum)).backward()
            for nm in names:
                g = model.get_parameter(nm).grad
                if g is not None and no_sync:
                    local[r][nm] = local[r][nm] + g if nm in local[r] else g.clone()
                elif g is not None:
                    total[nm] += g.float()
                if g is not None:
                    parts[nm] += g.float().abs()
            # What rank 0's forward left.
            after = [b.clone() for b in buffers] if r == 0 else after
        for b, x in zip(buffers, after):
            b.copy_(x)
    for nm, g in ((nm, g) for grads in local for nm, g in grads.items()):
        total[nm] += g.float()
    return ({nm: t / (n * loss_scale) for nm, t in total.items()},
            {nm: t / (n * loss_scale) for nm, t in parts.items()})


def _cast_inputs(dtype):
    """A forward pre-hook that casts the model's inputs, as the engine casts its model's."""
    return lambda module, args, kwargs: (cast_floats(args, dtype), cast_floats(kwargs, dtype))


def _engine_grad(ranks, step, n):
    """Stage 0's mean gradient of a step, per parameter name: the reduced shards of one
    shard group (ranks 0..S-1) after the last micro-batch, concatenated, times
    1/(n · loss scale) (n: N, or G leaves)."""
    mean, h, S = {}, ranks[0].history[step], ranks[0].shard_size
    for ui, unit in enumerate(ranks[0].layout):
        shards = [ranks[r].history[step].grads[-1][ui] for r in range(S)]
        full = torch.cat(shards).float() / (n * h.loss_scale)
        for nm, o, size in zip(unit.names, unit.offsets, unit.sizes):
            mean[nm] = full[o:o + size].view(h.state[nm].shape)
    return mean


def _referee_divergence(what, ours, theirs, gap, name, step, n):
    """The referee's finding at the element of the largest gap."""
    x, y = ours.double().reshape(-1), theirs.double().reshape(-1)
    i = int(gap.reshape(-1).argmax())
    return Divergence(what=what, world_size=n, stage=0, step=step, micro=None, rank=0, name=name,
                      index=i, ours=float(x[i]), theirs=float(y[i]),
                      max_abs=float(_gap(ours, theirs).max()),
                      max_ulp=_ulps(ours.float(), theirs.float()))

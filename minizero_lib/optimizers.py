"""
Muon and Adafactor, beside minizero.py's elementwise AdamW and SGD: torch.optim's, as pure
functions over explicit tensors; every optimizer's options, checked; and `update`, which runs
minizero.update's elementwise pieces and then the whole-tensor ones on a range of a unit
(stage 0: the whole buffer; stages 1-3: this rank's chunk), offloaded or not.

Muon (Newton-Schulz on each whole matrix) and Adafactor (row and column sums, norms,
an RMS clip over the whole tensor) look at whole tensors, which a flat shard cuts at an
arbitrary element. So each rank all-gathers what they read of its unit (Muon: the momentum
update, in bf16, as Newton-Schulz casts it; Adafactor: the gradient and the params, fp32),
runs on each whole tensor it holds a piece of the very computation stage 0 runs on the very
same tensor, and keeps its own slice: the same bits at every stage (Moonlight's distributed
Muon does the same; the cost is in minizero.comm_bytes_per_step).

A parameter's optimizer state is a dict of named tensors (torch.optim's names: AdamW's m
and v, SGD's and Muon's momentum_buffer, Adafactor's row and col, or variance for a vector),
held per unit and range by key (state_layout), so the engine moves, offloads and saves it
without knowing which optimizer made it.
"""
import math

import torch
import torch.nn as nn

import minizero
from minizero import mean_grad
from ops import all_gather

OPTIMIZERS = {  # name -> its options besides lr and weight_decay: torch.optim's names and defaults
    **minizero.OPTIMIZERS,
    "adafactor": dict(beta2_decay=-0.8, eps=(None, 1e-3), d=1.0),
    "muon": dict(muon_lr=1e-3, momentum=0.95, nesterov=True, ns_steps=5,
                 ns_coefficients=(3.4445, -4.7750, 2.0315),
                 # betas, eps: AdamW's, on the rest
                 adjust_lr_fn=None, muon=None, betas=(0.9, 0.999), eps=1e-8),
}
WHOLE = ("muon", "adafactor")  # the updates that read whole tensors
MUON_EPS = 1e-7  # torch's Muon: the Frobenius norm Newton-Schulz divides by is at least this


def optimizer_options(optimizer, options):
    """The optimizer's options: torch.optim's defaults with `options` over them. An unknown
    optimizer or option raises, listing the choices."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(map(repr, OPTIMIZERS))}; got "
                         f"{optimizer!r}")
    unknown = sorted(set(options) - set(OPTIMIZERS[optimizer]))
    if unknown:
        raise ValueError(f"optimizer {optimizer!r} has no option {unknown[0]!r}; its options are "
                         f"lr, weight_decay, {', '.join(OPTIMIZERS[optimizer])}")
    o = {**OPTIMIZERS[optimizer], **options}
    if optimizer in ("sgd", "muon") and o["nesterov"] and not o["momentum"]:
        raise ValueError(f"{optimizer}: nesterov=True needs a momentum > 0 (torch.optim's rule)")
    if optimizer == "muon" and o["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
        raise ValueError("muon: adjust_lr_fn must be None, 'original' or 'match_rms_adamw'; got "
                         f"{o['adjust_lr_fn']!r}")
    if optimizer == "adafactor" and not (isinstance(o["eps"],
                                                    (tuple, list)) and len(o["eps"]) == 2):
        raise ValueError("adafactor: eps is torch's pair (eps1 or None, eps2), default (None, "
                         f"1e-3); got {o['eps']!r}")
    if optimizer == "adafactor" and (o["d"] < 1 or o["beta2_decay"] > 0):
        raise ValueError(f"adafactor: d must be >= 1 and beta2_decay <= 0; got d={o['d']}, "
                         f"beta2_decay={o['beta2_decay']}")
    return o


def choose_rules(model, optimizer, options):
    """fn(name, param) -> the update it gets: the optimizer's own, except that "muon" gives
    Muon to the params options["muon"](name, p) selects (default, the Muon recipe: every 2-D
    weight of an nn.Linear not tied to an nn.Embedding) and AdamW to the rest."""
    if optimizer != "muon":
        return lambda n, p: optimizer
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    pick = options["muon"] or (lambda n, p: id(p) in linear and id(p) not in embedding
                               and p.dim() == 2)

    def rule(n, p):
        if pick(n, p) and p.dim() != 2:
            raise ValueError(f"muon= selects {n} of shape {tuple(p.shape)}, but Muon updates 2-D "
                             "matrices only; leave it to AdamW (muon=fn returning False for it)")
        return "muon" if pick(n, p) else "adamw"
    return rule


def state_keys(rule, shape, options):
    """One parameter's optimizer state: {key: None (elementwise, one value per element, cut
    like master) or the element count of a whole-tensor state}, torch.optim's names."""
    if rule != "adafactor":  # (Muon's momentum buffer is SGD's)
        return minizero.state_keys(rule, shape, options)
    n = math.prod(shape)  # adafactor: factored second moments of a matrix, whole ones of a vector
    if len(shape) > 1:
        return {"row": n // max(shape[-1], 1), "col": n // max(shape[-2], 1)}
    return {"variance": n}


# the formulas' part: the planner's fp32 state elements per parameter beside the master (AdamW's
# m and v; SGD's momentum, 0 without; Muon's momentum, while the AdamW params beside it keep 2:
# Engine.formula counts its layout; Adafactor's rows and columns, R + C of R·C: 0 here), and the
# bytes per element a whole-tensor update all-gathers (update)
STATE_PER_PARAM = {"adamw": 2, "sgd": 1, "muon": 1, "adafactor": 0}
GATHERED = {"muon": 2, "adafactor": 8}


def whole_rule(u):
    """The unit's whole-tensor update ("muon" or "adafactor"), or None."""
    return next((k for k in u.rules if k in WHOLE), None)


def state_numel(units):
    """fp32 elements of optimizer state the units keep beside the master (their layouts' count)."""
    return sum(n for u in units for n in u.sizes.values())


def whole_numel(units):
    """{"muon" or "adafactor": Ψ of the units whose update reads whole tensors}."""
    out = {}
    for u in units:
        if whole_rule(u):
            out[whole_rule(u)] = out.get(whole_rule(u), 0) + u.padded
    return out


def gather_whole(group, device):
    """What Muon and Adafactor read of whole tensors, all-gathered over the unit (each rank
    sends (N-1)/N·Ψ_u of it, kind "optimizer"), on the device: offloaded or not, the
    whole-tensor part runs where stage 0 runs it."""
    return lambda x: all_gather(x.to(device, non_blocking=True), group, kind="optimizer")


def update(master, state, grad, steps, hp, whole_rule=None, gather=None, device=None):
    """One optimizer step on a range of a unit (the whole buffer, or this rank's chunk):
    minizero.update's elementwise pieces, then the whole-tensor ones. grad is the reduced
    gradient sum there; master and the state tensors (by key) are updated in place.
    whole_rule: the unit's whole-tensor update ("muon", "adafactor" or None); gather(x) -> x's
    whole unit, an all-gather every rank of such a unit calls, whatever its own range holds
    (stage 0 holds the whole unit: None). Muon and Adafactor run on `device` (the model's),
    also when the state is offloaded: where stage 0 runs them."""
    o, gather = hp.options, gather or (lambda x: x)
    # offloaded: the update runs on the host; the gradient (on a GPU) comes over once,
    offloaded = grad.is_cuda and not master.is_cuda
    grad = moved(grad, master.device)
    coef = None if hp.coef is None else moved(hp.coef, master.device)  # the clip coefficient too
    hp = hp._replace(coef=coef)
    minizero.update(master, state, grad, steps, hp)
    g = mean_grad(grad, hp.unscale, coef) if whole_rule else None
    # momentum on my slice, Newton-Schulz on each whole matrix (bf16 in, as torch casts)
    if whole_rule == "muon":
        dev = device or master.device  # (lerp is a fused kernel: the host's may round otherwise)
        x = torch.zeros(len(g), dtype=torch.bfloat16, device=dev)
        mine = [(p, t, wd) for p, t, wd in steps if p.rule == "muon"]
        for p, t, wd in mine:
            c, d = p.at.get("momentum_buffer", (0, 0))
            buf = state["momentum_buffer"][c:d] if d else None
            here = None if buf is None else buf.to(dev, non_blocking=True)
            g_here = g[p.a:p.b].to(dev, non_blocking=True)
            x[p.a:p.b] = muon_momentum(here, g_here, o["momentum"], o["nesterov"])
            if here is not buf:  # offloaded: the buffer back to the host (read after host_wait)
                buf.copy_(here, non_blocking=True)
        full = gather(x)  # stages 1-3: each rank sends (N-1)/N·Ψ_u bf16
        for p, t, wd in mine:
            n, w = math.prod(p.shape), p.lo - p.o  # w: where my range starts inside the parameter
            ortho = newton_schulz(full[p.o:p.o + n].view(p.shape), o["ns_coefficients"],
                                  o["ns_steps"])
            master[p.a:p.b].mul_(1 - o["muon_lr"] * wd)
            master[p.a:p.b].add_(moved(ortho.reshape(-1)[w + p.a:w + p.b], master.device),
                                 alpha=-muon_lr(o["muon_lr"], o["adjust_lr_fn"], p.shape))
    elif whole_rule == "adafactor":  # the whole gradient and params (before this step), fp32
        gs, ps = gather(g), gather(master)  # stages 1-3: each rank sends (N-1)/N·Ψ_u twice, fp32
        # (offloaded: on the device, as stage 0, and the state back to the host)
        for p, t, wd in steps:
            n, w = math.prod(p.shape), p.lo - p.o
            s = {k: state[k][c:d].to(gs.device, non_blocking=True) for k, (c, d) in p.at.items()}
            step, size = adafactor(ps[p.o:p.o + n].view(p.shape), gs[p.o:p.o + n].view(p.shape), s,
                                   t, hp.lr,
                                   o["beta2_decay"], *o["eps"], o["d"])
            for k, (c, d) in p.at.items() if gs.device != master.device else ():
                state[k][c:d].copy_(s[k], non_blocking=True)  # (read after the event below)
            if wd:  # (master's copy to the device is done: adafactor() read its norm on the host)
                master[p.a:p.b].mul_(1 - hp.lr * wd)
            master[p.a:p.b].add_(moved(step.reshape(-1)[w + p.a:w + p.b], master.device),
                                 alpha=-size)
    if whole_rule and offloaded:  # the state copied back to the host is complete before it is read
        host_wait()


def moved(t, device):
    """t on device, for the offloaded update (DESIGN.md §9.11). From a GPU to the host: into
    pinned memory, not blocking, and the host waits on an event for that copy before it reads
    it (a blocking copy would drain the stream unannounced); other moves are not blocking
    (from pinned memory the copy is queued; from pageable memory CUDA stages it at once)."""
    if device.type != "cpu" or not t.is_cuda:
        return t.to(device, non_blocking=True)
    out = pinned_like(t)
    out.copy_(t, non_blocking=True)
    host_wait()
    return out


def pinned_like(t):
    """A staging buffer in pinned host memory (torch's pinned cache: reused step to step)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def host_wait():
    """The host waits for the work queued on this thread's stream so far (an event's)."""
    done = torch.cuda.Event()
    done.record()
    done.synchronize()


def muon_momentum(buf, g, momentum, nesterov):
    """torch's Muon before Newton-Schulz: buf.lerp_(g, 1 - momentum), then Nesterov's
    g.lerp(buf, momentum). Elementwise (lerp rounds once per element, on any slice)."""
    if buf is None:  # momentum 0: the gradient itself
        return g
    buf.lerp_(g, 1 - momentum)
    return g.lerp(buf, momentum) if nesterov else buf


def newton_schulz(G, coefficients, steps, eps=MUON_EPS):
    """torch's Muon orthogonalization of one whole matrix: bf16, the transpose of a tall
    one, first divided by its Frobenius norm, then `steps` quintic iterations."""
    X = G.bfloat16()
    if G.size(0) > G.size(1):
        X = X.T
    X = X.div(X.norm().clamp(min=eps))
    a, b, c = coefficients
    for _ in range(steps):
        A = X @ X.T
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X.T if G.size(0) > G.size(1) else X


def muon_lr(lr, adjust_lr_fn, shape):
    """torch's Muon step size for an A x B matrix: lr·sqrt(max(1, A/B)) ("original", the
    default) or lr·0.2·sqrt(max(A, B)) ("match_rms_adamw")."""
    A, B = shape[:2]
    return lr * (0.2 * math.sqrt(max(A, B)) if adjust_lr_fn == "match_rms_adamw"
                 else math.sqrt(max(1, A / B)))


def adafactor(p, g, state, t, lr, beta2_decay, eps1, eps2, d):
    """torch.optim.Adafactor on one whole tensor (p before this step's decay, g its mean
    gradient): its row and column second moments (or a vector's whole one) in `state`,
    updated in place. -> (the update, its step size: relative step, RMS-clipped by d)."""
    eps1 = torch.finfo(torch.float32).eps if eps1 is None else eps1
    beta = t ** beta2_decay
    alpha = max(eps2, p.norm(2).item() / p.numel() ** 0.5) * min(lr, 1 / t ** 0.5)
    if g.dim() > 1:
        row = state["row"].view(*g.shape[:-1], 1)
        col = state["col"].view(*g.shape[:-2], 1, g.shape[-1])
        row.lerp_(torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)), beta)
        col.lerp_(torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2)), beta)
        var = (row @ col).div_(row.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        variance = state["variance"].view(g.shape)
        variance.lerp_(g * g, beta)
        var = variance.clone()
    step = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
    return step, alpha / max(1.0, step.norm(2).item() / (step.numel() ** 0.5 * d))

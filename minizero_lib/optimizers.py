"""
The optimizers minizero trains with: torch.optim's AdamW, SGD, Adafactor and Muon, as pure
functions over explicit tensors, and the one `update` that runs them on a range of a unit
(stage 0: the whole buffer; stages 1-3: this rank's chunk).

AdamW and SGD are elementwise: a shard's update is the same bits as the whole buffer's,
cut. Muon (Newton-Schulz on each whole matrix) and Adafactor (row and column sums, norms,
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
import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

from minizero_lib import nccl_model

OPTIMIZERS = {  # name -> its options besides lr and weight_decay: torch.optim's names and defaults
    "adamw": dict(betas=(0.9, 0.999), eps=1e-8),
    "sgd": dict(momentum=0.0, nesterov=False),
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
    if rule == "adamw":
        return {"m": None, "v": None}
    if rule in ("sgd", "muon"):
        return {"momentum_buffer": None} if options["momentum"] else {}
    n = math.prod(shape)  # adafactor: factored second moments of a matrix, whole ones of a vector
    if len(shape) > 1:
        return {"row": n // max(shape[-1], 1), "col": n // max(shape[-2], 1)}
    return {"variance": n}


class Piece(NamedTuple):
    """One parameter's part of a range [lo, hi) of its unit."""
    i: int         # the parameter's index in its unit
    rule: str      # the update it gets (choose_rules)
    shape: tuple   # its shape
    o: int         # where the whole parameter starts in the unit
    lo: int        # where the range starts in the unit
    a: int         # its elements inside the range: [a, b), relative to lo
    b: int
    at: dict       # key -> (c, d): its state inside the range's tensor of that key
    decays: tuple = ()  # the [a, b) parts of it whose parameters decay (runs)


def state_layout(offsets, shapes, rules, keys, lo, hi):
    """The parameters inside elements [lo, hi) of a unit (one Piece each), and per key the
    element count of the range's state tensor. An elementwise key every parameter has spans
    the whole range, padding too (AdamW's m and v are master's twins); one only some have
    holds just theirs, back to back (Muon's momentum; the AdamW moments of the rest); a
    whole-tensor key holds the whole state of each parameter in the range (Adafactor's)."""
    full = (set.intersection(*({k for k, w in ks.items() if w is None} for ks in keys))
            if keys else set())
    sizes = {k: (hi - lo if k in full else 0) for ks in keys for k in ks}
    pieces = []
    for i, (o, shape, rule, ks) in enumerate(zip(offsets, shapes, rules, keys)):
        a, b = max(o, lo) - lo, min(o + math.prod(shape), hi) - lo
        if a >= b:
            continue
        at = {}
        for k, count in ks.items():
            if k in full:
                at[k] = (a, b)
            else:
                c = sizes[k]
                at[k] = (c, c + (b - a if count is None else count))
                sizes[k] = at[k][1]
        pieces.append(Piece(i, rule, tuple(shape), o, lo, a, b, at))
    return pieces, sizes


# the formulas' part (stages.py): the planner's fp32 state elements per parameter beside the master
# (AdamW's m and v; SGD's momentum, 0 without; Muon's momentum, while the AdamW params beside it
# keep 2: Engine.formula counts its layout; Adafactor's rows and columns, R + C of R·C: 0 here),
# and the bytes per element a whole-tensor update all-gathers (update)
STATE_PER_PARAM = {"adamw": 2, "sgd": 1, "muon": 1, "adafactor": 0}
GATHERED = {"muon": 2, "adafactor": 8}


def state_numel(units):
    """fp32 elements of optimizer state the units keep beside the master (their layouts' count)."""
    return sum(n for u in units for n in u.sizes.values())


def whole_numel(units):
    """{"muon" or "adafactor": Ψ of the units whose update reads whole tensors}."""
    out = {}
    for u in units:
        if u.whole_rule:
            out[u.whole_rule] = out.get(u.whole_rule, 0) + u.padded
    return out


class Hyper(NamedTuple):
    """One step's hyperparameters, and what turns the reduced gradient sum into the mean
    gradient: 1/(N·loss scale), then the clipping coefficient (or None)."""
    lr: float
    weight_decay: float
    options: dict   # the optimizer's other options (optimizer_options)
    unscale: float
    coef: Optional[torch.Tensor]


def runs(u, hp):
    """The steps of the unit's range this step: (Piece, step count, weight decay) per
    parameter some rank gave a gradient (torch skips a grad=None parameter: no decay, no
    state, no step); a Piece's decays say where the weight decay applies. Elementwise
    neighbours with the same step count are merged into one piece: AdamW's always (its
    decay is a multiply of its own, per parameter), SGD's only with the same weight decay
    (it enters the gradient). Every stage cuts its range the same way, so the same
    elements see the same numbers."""
    out = []
    for p in u.pieces:
        if not u.used[p.i]:
            continue
        t, wd = u.steps[p.i], hp.weight_decay if u.decays[p.i] else 0.0
        p, wd = p._replace(decays=((p.a, p.b),
                                   ) if wd else ()), hp.weight_decay if p.rule == "adamw" else wd
        if out and p.rule not in WHOLE and out[-1][0].rule == p.rule and out[-1][1:] == (t, wd) \
                and out[-1][0].b == p.a \
                and all(out[-1][0].at[k][1] == c for k, (c, _) in p.at.items()):
            q = out[-1][0]
            decays = q.decays[:-1] + ((q.decays[-1][0], p.b),
                                      ) if q.decays and p.decays and q.decays[-1][1] == p.a \
                else q.decays + p.decays  # (neighbours that both decay: one span)
            p = q._replace(b=p.b, at={k: (q.at[k][0], d) for k, (_, d) in p.at.items()},
                           decays=decays)
            out[-1] = (p, t, wd)
        else:
            out.append((p, t, wd))
    return out


BLOCK = 2 ** 16  # CPU: AdamW makes ~15 passes; over 256 KiB blocks they stay in cache (~2x faster)


def update(master, state, grad, steps, hp, whole_rule=None, gather=None, device=None):
    """One optimizer step on a range of a unit (the whole buffer, or this rank's chunk):
    grad is the reduced gradient sum there; master and the state tensors (by key) are
    updated in place. whole_rule: the unit's whole-tensor update ("muon", "adafactor" or None);
    gather(x) -> x's whole unit, an all-gather every rank of such a unit calls, whatever its
    own range holds (stage 0 holds the whole unit: None). Muon and Adafactor run on
    `device` (the model's), also when the state is offloaded: where stage 0 runs them."""
    o, gather = hp.options, gather or (lambda x: x)
    # offloaded: the update runs on the host; the gradient (on a GPU) comes over once,
    offloaded = nccl_model.on_gpu(grad) and not nccl_model.on_gpu(master)
    grad = moved(grad, master.device)
    coef = None if hp.coef is None else moved(hp.coef, master.device)  # the clip coefficient too
    # AdamW's temporaries
    scratch = [torch.empty(BLOCK) for _ in range(3)] if master.is_cpu else [None] * 3
    for p, t, wd in steps:
        s = {k: state[k][c:d] for k, (c, d) in p.at.items()}
        # elementwise, so on the CPU block by block: the same bits, less memory traffic
        if p.rule == "adamw":
            step = BLOCK if master.is_cpu else p.b - p.a  # (a GPU: one launch per op, whole)
            decay = scalars(master.device, 1 - hp.lr * wd)[0]
            for lo in range(p.a, p.b, step):
                hi, i, j = min(p.b, lo + step), lo - p.a, min(p.b, lo + step) - p.a
                # decoupled weight decay first: p·(1 - lr·wd) where it applies
                for a, b in p.decays:
                    if a < hi and lo < b:
                        master[max(a, lo):min(b, hi)].mul_(decay)
                tmp = (scratch if scratch[0] is None or hi - lo == BLOCK
                       else [x[:hi - lo] for x in scratch])
                adamw(master[lo:hi], mean_grad(grad[lo:hi], hp.unscale, coef, tmp[2]), s["m"][i:j],
                      s["v"][i:j], t,
                      hp.lr, *o["betas"], o["eps"], out=tmp[:2])
        elif p.rule == "sgd":
            sgd(master[p.a:p.b], mean_grad(grad[p.a:p.b], hp.unscale, coef),
                s.get("momentum_buffer"), t, hp.lr,
                o["momentum"], o["nesterov"], wd)
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
    if device.type != "cpu" or not nccl_model.on_gpu(t):
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


def mean_grad(grad, unscale, coef, out=None):
    """The mean gradient: the reduced sum (on the update's device) in fp32, times 1/(N·loss
    scale), then times the clipping coefficient (x·1 is x: one rank unclipped reads the sum)."""
    g = grad.to(torch.float32)
    if unscale != 1:
        g = torch.mul(g, unscale, out=out)
    return g if coef is None else torch.mul(g, coef, out=out)


def adamw(p, g, m, v, t, lr, beta1, beta2, eps, out=(None, None)):
    """One AdamW step after its weight decay (decoupled: update multiplies p by 1 - lr·wd
    first), torch.optim.AdamW semantics: bias correction, eps outside the sqrt. Elementwise,
    with only + - * / sqrt (each rounded once, never fused), so a shard gives the same bits
    as the whole buffer, and the same on the host (offload) as on a GPU: every divisor is a
    tensor on p's device (DESIGN.md §2). p, m and v are updated in place (the same
    operations in the same order as m * beta1 + g * (1 - beta1), ...); the temporaries go
    into `out` (two tensors of p's size), or new ones (None)."""
    tmp, tmp2 = out
    b1, c1, b2, c2, bc2, e, step = scalars(p.device, beta1, 1 - beta1, beta2, 1 - beta2,
                                           math.sqrt(1 - beta2 ** t),
                                           eps, lr / (1 - beta1 ** t))
    m.mul_(b1).add_(torch.mul(g, c1, out=tmp))
    v.mul_(b2).add_(torch.mul(g, g, out=tmp).mul_(c2))
    denom = torch.sqrt(v, out=tmp2).div_(bc2).add_(e)
    p.sub_(torch.div(m, denom, out=tmp).mul_(step))
    return p, m, v


def scalars(device, *xs):
    """xs as 0-d fp32 tensors on device, made once. An op with a Python number converts it
    to a tensor each call (µs that add up over the CPU's blocks); a tensor holding the same
    fp32 value rounds the same (the kernels multiply in fp32 either way). On a GPU, once per
    stream: one made on a thread rank's stream is not ready on another's (DESIGN.md §9.11)."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    return _scalars(device, stream, *xs)


@functools.lru_cache(maxsize=64)
def _scalars(device, stream, *xs):
    return tuple(torch.full((), x, dtype=torch.float32, device=device) for x in xs)


scalars.cache_clear = _scalars.cache_clear


def sgd(p, g, buf, t, lr, momentum, nesterov, weight_decay):
    """One SGD step, torch.optim.SGD semantics (dampening 0): weight decay added to the
    gradient; the momentum buffer starts as the first gradient (t is the step count).
    Elementwise: each op rounds per element wherever the slice starts."""
    if weight_decay:
        g = g.add(p, alpha=weight_decay)
    if buf is not None:
        buf.copy_(g) if t == 1 else buf.mul_(momentum).add_(g)
        g = g.add(buf, alpha=momentum) if nesterov else buf
    p.add_(g, alpha=-lr)


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

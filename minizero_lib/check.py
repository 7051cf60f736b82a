"""
minizero.check: the equivalence proof as a tool you run on your own model.

    report = minizero.check(make_model, make_batch, world_sizes=(1, 2, 3, 4), steps=3, lr=1e-3)
    print(report)             # a row per (world size, stage)
    assert report.ok, report.first

    python minizero.py check my_model.py --world-sizes 1,2,4 --dtype bf16 [--device cuda]

It trains your model under DDP (stage 0) and under ZeRO stages 1-3 on each world size
(ranks are threads, or gloo processes; on a GPU, threads sharing it, or one nccl process
per GPU), from the same initial values on the same batches, and checks, step by step
and micro-batch by micro-batch:

  grads    every stage's reduced gradient shard equals stage 0's, to the bit, on every rank
  params   every stage's parameters and buffers equal stage 0's after every step, to the bit:
           the fp32 state, and the 16-bit params forward reads (stage 3: its shard)
  optimizer every stage's AdamW m, v and per-parameter step counts equal stage 0's
  ranks    every rank starts from rank 0's values (ranks 1.. are built from others, as a user
           who seeds each rank differently would: the engine's broadcast must fix that, as
           DDP's does), holds what rank 0 holds after every step, and every forward reads
           rank 0's buffers
  memory   Engine.memory() and .offloaded() equal the formulas fed the padded size computed
           here from the model's own parameters (and no stage keeps more than it says);
           stage 0, the reference, runs without offload
  bytes    the bytes each rank sends equal the formula
  referee  stage 0 against torch itself: torch's gradient at the engine's parameters
           (every rank's micro-batches, loss averaged over ranks), within a tolerance of
           the step's largest sum of |contributions| to one gradient element (rounding
           in backward scales with what flows through it); and torch's optimizer
           (AdamW, SGD, Adafactor, or Muon + AdamW) driven by the engine's own gradient. Split
           this way neither half amplifies rounding
           (Adam turns noise in a near-zero gradient into a whole step), so a float
           tolerance means something; it is reported and can be set. A NaN or inf that
           stage 0 and torch do not share is a finding; a step skipped for non-finite
           gradients must leave stage 0 as it was; the report says how many steps the
           referee saw.

Any difference between stages is a finding: the stages are equal by construction
(DESIGN.md). report.first names where they first part: step, micro-batch, world size,
stage, rank, parameter, element, both values, and the difference in ULPs.
"""
import copy
import os
import pickle
import random
import time
from itertools import chain

import torch

from minizero_lib import launch
# Named judge here: check()'s own `referee` is a flag, whether stage 0 is held to torch.
from minizero_lib import referee as judge
from minizero import Engine, default_units, group_params
from minizero_lib.checkpoint import read_state
from minizero_lib.compiled import compile_units
from minizero_lib.formulas import comm_bytes_per_step, model_state_bytes, offloaded_bytes
from minizero_lib.optimizers import state_numel, whole_numel
from minizero_lib.quantize import BLOCK
from minizero_lib.report import (GRAD_TOL, SENT_KINDS, UPDATE_TOL, Divergence, RankRun, Report,
                                 Row, StepRecord, UnitLayout, run_to_device, seed, to_device)

# cuBLAS's deterministic setting, read when cuBLAS starts.
CUBLAS = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def default_loss(model, batch):
    """Call the model with the batch; the loss is the output if it is a scalar, else
    out.loss, out["loss"], or the first scalar tensor in a tuple or list output."""
    if isinstance(batch, dict):
        out = model(**batch)
    else:
        out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    if torch.is_tensor(out) and out.dim() == 0:
        return out
    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, dict) and torch.is_tensor(out.get("loss")):
        return out["loss"]
    for x in out if isinstance(out, (tuple, list)) else ():
        if torch.is_tensor(x) and x.dim() == 0:
            return x
    raise ValueError(f"found no scalar loss in the model's output ({type(out).__name__}); "
                     f"pass loss_fn=")


def check(make_model, make_batch, *, loss_fn=None, world_sizes=(1, 2, 3, 4), stages=(0, 1, 2, 3),
          steps=3, referee=True, tol=None, processes=False, jitter=False, timeout=120.0,
          device=None, strict_p2p=False, compile=False, progress=None, **engine_kw):
    """Run the model under every stage and world size and compare (see the module's
    docstring). make_model() builds the model, once: every rank and stage starts from
    it. make_batch(step, rank, micro) is that rank's micro-batch: a tuple of positional
    arguments or a dict of keyword arguments. engine_kw goes to Engine (lr, dtype,
    grad_accum, clip, shard_size, reduce_every, quantize_grads, ...; units may be a function
    of the model; reshard_after_forward is stage 3's alone, held to the others' bits).
    processes=True runs gloo processes: then the callables must be importable. device="cuda":
    each rank's model and batches, and the torch referee, on the GPU (processes: nccl, one GPU
    each), with torch's deterministic algorithms, as equal bits need equal local compute.
    strict_p2p=True: thread ranks follow NCCL's point-to-point rules (launch.run_threads).
    compile=True (or a backend's name, "inductor" by default): every rank compiles each of
    its units' modules after Engine(...) (compiled.compile_units, as torchtitan compiles
    each block), so the stages are compared, and stage 0 refereed, as compiled code.
    progress(world_size, stage, row) is called as each run starts (row None) and ends.
    reduce_order="tree" (world sizes powers of two): each world size runs the same G leaves a
    step, G = grad_accum x the largest world size (rank r's micro-batch j is leaf r·A + j, and
    make_batch(step, rank, micro) says what leaf rank·A + micro is at the largest world size),
    and every world size's state after each step is held to the first's, to the bit."""
    if 0 not in stages:
        # Everything is compared with stage 0.
        stages = (0, *stages)
    device = torch.device(device or "cpu")
    _refuse(world_sizes, engine_kw, processes, device, (make_model, make_batch, loss_fn, engine_kw))
    if device.type == "cuda":
        # Before make_model may start cuBLAS.
        os.environ.setdefault(*CUBLAS)
    model = make_model()
    drawn = random_modules(model, make_batch(0, 0, 0), loss_fn or default_loss)
    if drawn and not processes:
        raise ValueError(f"the model draws random numbers in forward ({', '.join(drawn[:3])}"
                         f"{', ...' if len(drawn) > 3 else ''}): thread ranks share torch's random "
                         f"number generator, so their runs cannot be compared; run it on processes "
                         f"(--processes, processes=True: each rank draws from a seed of its own, "
                         f"as the referee does), or without randomness (model.eval() in "
                         f"make_model, or dropout 0)")
    dtype = engine_kw.get("dtype", torch.float32)
    # Quantized gradients (qgZ) are not torch's: stage 0's is reported against it, not held to it
    # (tests/test_quantize.py holds the quantization bound); the update half still is.
    grad_tol = float("inf") if engine_kw.get("quantize_grads") else GRAD_TOL[dtype]
    report = Report(tol=(tol[0] if tol else grad_tol, tol[1] if tol else UPDATE_TOL))
    spec = dict(make_model=make_model, make_batch=make_batch, loss_fn=loss_fn or default_loss,
                steps=steps, jitter=jitter, engine_kw=engine_kw, seeded=bool(drawn),
                compile=compile,
                state={k: v.clone() for k, v in model.state_dict().items()})
    num_threads = torch.get_num_threads()
    # Ranks are threads (or processes on the same cores).
    torch.set_num_threads(1)
    restore = deterministic(device)
    buffer_names = {nm for nm, _ in model.named_buffers()}
    # Rank 0's model's values, as the engine holds them in the compute dtype.
    initial = {k: v.to(dtype).float() if v.is_floating_point() else v
               for k, v in spec["state"].items()}
    worlds = {}  # reduce_order="tree": world size -> stage 0's rank 0 run
    try:
        for n in world_sizes:
            spec_n = per_world(spec, n, world_sizes)
            # Per stage: every rank's RankRun.
            runs = {}
            for s in sorted(stages):
                if progress:
                    progress(n, s, None)
                t0 = time.perf_counter()
                row = Row(n, s)
                try:
                    runs[s] = _run_stage(n, s, spec_n, model, processes, device, timeout,
                                         strict_p2p)
                except RuntimeError as e:
                    # The model (or the engine on it) failed on some rank.
                    row.first = Divergence(what="error", world_size=n, stage=s, step=0, micro=None,
                                           rank=0, name=str(e).split("\n")[0])
                    report.rows.append(row)
                    if progress:
                        progress(n, s, row)
                    continue
                row.seconds = time.perf_counter() - t0
                judge.compare(row, runs[s], runs.get(0) if s else None, n, s, buffer_names,
                              initial)
                if s == 0 and referee:
                    judge.hold_to_torch(row, model, runs[0], spec_n, n, report.tol, device)
                if s == 0 and engine_kw.get("reduce_order") == "tree":
                    worlds[n] = runs[0][0]
                    judge.compare_worlds(row, worlds, buffer_names)
                report.rows.append(row)
                if progress:
                    progress(n, s, row)
    finally:
        torch.set_num_threads(num_threads)
        restore()
    return report


def per_world(spec, n, world_sizes):
    """spec at world size n: reduce_order="tree" runs the largest world size's leaves, A_n =
    G/n of them a rank (engine_kw's grad_accum is the largest world size's)."""
    kw = spec["engine_kw"]
    if kw.get("reduce_order") != "tree":
        return spec
    accum = kw.get("grad_accum", 1)
    mine = accum * max(world_sizes) // n
    return dict(spec, engine_kw=dict(kw, grad_accum=mine),
                make_batch=Leaves(spec["make_batch"], mine, accum))


class Leaves:
    """make_batch at a smaller world size, under reduce_order="tree": rank r's micro-batch j
    is leaf r·A + j, the leaf make_batch(step, rank, micro) names at the largest world size
    (its A there: accum). A class, not a closure: processes unpickle it."""

    def __init__(self, make_batch, mine, accum):
        self.make_batch, self.mine, self.accum = make_batch, mine, accum

    def __call__(self, step, rank, micro):
        leaf = rank * self.mine + micro
        return self.make_batch(step, leaf // self.accum, leaf % self.accum)


def _refuse(world_sizes, engine_kw, processes, device, callables):
    """Raise, naming the fix, for options no run can satisfy."""
    S = engine_kw.get("shard_size")
    if engine_kw.get("reduce_order") == "tree" and any(n & (n - 1) for n in world_sizes):
        raise ValueError(f"reduce_order='tree' compares world sizes that are powers of two; got "
                         f"world_sizes={tuple(world_sizes)}: use e.g. (1, 2, 4)")
    if engine_kw.get("quantize_weights"):
        raise ValueError("quantize_weights quantizes stage 3's gather, and check() compares "
                         "every stage with stage 0, which gathers nothing: drop it "
                         "(quantize_grads works)")
    # Hybrid sharding: every stage, stage 0 included, runs at that S.
    if S is not None and any(n % S for n in world_sizes):
        raise ValueError(f"shard_size={S} must divide every world size, and "
                         f"world_sizes={tuple(world_sizes)}; give multiples of it, like "
                         f"world_sizes={(S, 2 * S)}")
    G = engine_kw.get("reshard_after_forward", True)
    if type(G) is int and any(((S or n) % G or not 1 < G < (S or n)) for n in world_sizes):
        raise ValueError(f"reshard_after_forward={G} must divide every shard group's size, and be "
                         f"smaller (world_sizes={tuple(world_sizes)}, shard_size={S}); give world "
                         f"sizes that are multiples of {2 * G}, like world_sizes={(2 * G,)}")
    if processes and device.type == "cuda" and torch.cuda.device_count() < max(world_sizes):
        raise ValueError(f"processes=True on CUDA runs one nccl process per GPU: world size "
                         f"{max(world_sizes)} needs that many GPUs, this machine has "
                         f"{torch.cuda.device_count()}; use threads")
    if processes:
        try:
            pickle.dumps(callables)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"processes=True sends make_model, make_batch, loss_fn and the engine "
                             f"options to each rank, so they must be importable functions, not "
                             f"lambdas or locals: {e}")


def _run_stage(n, stage, spec, model, processes, device, timeout, strict_p2p):
    """Every rank's RankRun of one stage at world size n, on threads or processes."""
    if not processes:
        return launch.run_threads(rank_run, n, stage, dict(spec, model=model), device=device,
                                  timeout=timeout, strict_p2p=strict_p2p)
    backend = "nccl" if device.type == "cuda" else "gloo"
    runs = launch.run_processes(rank_run, n, stage, spec, timeout=timeout, backend=backend)
    # On nccl each rank's tensors come back on its own GPU: gather them.
    return [run_to_device(run, device) for run in runs]


def random_modules(model, batch, loss_fn):
    """The modules whose own forward moves torch's global random state (dropout, noise), as
    'name: Module(...)', from one forward of a copy without gradients; the state is put back."""
    probe, before, moved = copy.deepcopy(model), {}, []
    names = {m: name or "(the model)" for name, m in probe.named_modules()}

    def pre(m, args):
        before.setdefault(m, torch.random.get_rng_state())

    def post(m, args, out):
        if not torch.equal(before.pop(m), torch.random.get_rng_state()):
            moved.append(m)
    hooks = [h for m in names for h in (m.register_forward_pre_hook(pre),
                                        m.register_forward_hook(post))]
    rng_state = torch.random.get_rng_state()
    try:
        with torch.no_grad():
            loss_fn(probe, batch)
    except Exception:
        # A model that fails: the run itself reports where, on its ranks.
        return []
    finally:
        torch.random.set_rng_state(rng_state)
        for h in hooks:
            h.remove()
    # A parent moves the state only through a child that did: name the child.
    moved = list(dict.fromkeys(moved))
    return [f"{names[m]}: {m if not list(m.children()) else type(m).__name__}" for m in moved
            if not any(c in moved for c in list(m.modules())[1:])]


def deterministic(device):
    """On CUDA, torch's deterministic kernels only: some (index_add, ...) sum with atomics in
    a different order each run, and a kernel with no deterministic version (flash attention's
    backward) raises, naming itself, instead of letting the stages differ for a reason that is
    not the engine's. cuBLAS reads its variable once, when it starts: check() sets it before
    any CUDA work, in the parent before it spawns ranks (they inherit it), and each spawned
    rank switches the kernels on before it builds its model. Returns what puts them back."""
    if device.type != "cuda":
        return lambda: None
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault(*CUBLAS)
    torch.use_deterministic_algorithms(True, warn_only=False)
    return lambda: torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# -----------------------------------------------------------------------------
# one rank's run: what every comparison needs, recorded after every backward and step


def rank_run(comm, stage, spec):
    """One rank's run of one stage: its RankRun."""
    if "model" in spec:
        # Threads: a copy of the one model.
        model = copy.deepcopy(spec["model"]).to(comm.device)
    else:
        # Processes: build it, then take the parent's values.
        deterministic(comm.device)
        model = spec["make_model"]().to(comm.device)
        model.load_state_dict(spec["state"])
    perturb(model, comm.rank)
    kw = dict(spec["engine_kw"])
    if stage == 0:
        # DDP keeps all its state in memory: the reference every offload is held to.
        kw = {k: v for k, v in kw.items() if k not in ("offload", "offload_dir", "offload_params")}
    if stage != 3:
        # Only stage 3 gathers for forward and backward; the others are held to its bits.
        kw.pop("reshard_after_forward", None)
    if callable(kw.get("units")):
        kw["units"] = kw["units"](model)
    # From the model's own sizes, before the engine.
    numel, sizes = _padded(model, comm.world_size, kw), _padded_units(model, comm.world_size, kw)
    engine = Engine(model, comm, stage, **kw)
    if spec.get("compile"):
        backend = spec["compile"] if isinstance(spec["compile"], str) else "inductor"
        compile_units(model, [u.module for u in engine.units], backend=backend)
    memory_formula, bytes_formula = _formulas(numel, comm.world_size, stage, kw, engine.units,
                                              sizes)
    if spec["jitter"]:
        _jitter(engine, random.Random(1000 * stage + comm.rank))
    # The buffers each forward read (after the engine's broadcast: this hook runs after its).
    seen = []

    def record(m, args):
        if torch.is_grad_enabled():
            seen.append({nm: b.detach().clone() for nm, b in m.named_buffers()})
    if kw.get("broadcast_buffers", True):
        model.register_forward_pre_hook(record)
    layout = [UnitLayout(u.names, u.offsets, [p.numel() for p in u.params],
                         u.shard_size * engine.group.rank) for u in engine.units]
    rules = {nm: rule for u in engine.units for nm, rule in zip(u.names, u.rules)}
    run = RankRun(layout=layout, rules=rules, shard_size=engine.group.world_size,
                  grad_accum=engine.grad_accum, initial=engine.full_state_dict(),
                  memory_formula=memory_formula, bytes_formula=bytes_formula)
    for step in range(spec["steps"]):
        run.history.append(_step(engine, model, comm, spec, step, seen))
    engine.close()
    return run


def _step(engine, model, comm, spec, step, seen):
    """One step of the engine, its micro-batches' backwards first: its StepRecord."""
    sent_before, grads, kept, read = dict(comm.sent), [], [], []
    for micro in range(engine.grad_accum):
        batch = to_device(spec["make_batch"](step, comm.rank, micro), comm.device)
        # (A spec made elsewhere may not say whether the model draws random numbers.)
        if spec.get("seeded"):
            torch.manual_seed(seed(step, comm.rank, micro))
        engine.backward(spec["loss_fn"](model, batch))
        # (reduce_every="step": a reduced shard only after the last micro-batch)
        if engine.units[0].reduced is not None:
            grads.append([u.reduced.clone() for u in engine.units])
        kept.append(_kept_too_much(engine))
        read.append(seen[:])
        seen.clear()
    # Measured with the reduced shards alive.
    memory = _memory(engine.memory(), engine.offloaded())
    scaler = getattr(engine, "scaler", None)  # (fp16's loss scale)
    loss_scale = scaler.scale if scaler else 1.0
    counts_before = [list(u.steps) for u in engine.units]
    stepped = engine.step()
    sent = {kind: comm.sent[kind] - sent_before.get(kind, 0) for kind in SENT_KINDS}
    kept.append(_kept_too_much(engine))
    used = [[b > a for a, b in zip(x, u.steps)] for x, u in zip(counts_before, engine.units)]
    # The 16-bit params forward reads.
    live = [(u.flat if u.shard is None else u.shard).clone() for u in engine.units]
    return StepRecord(grads=grads, live=live, loss_scale=loss_scale, stepped=stepped, sent=sent,
                      used=used, kept=next((k for k in kept if k), None), read=read,
                      moments=[_moments(engine, u) for u in engine.units],
                      step_counts=[list(u.steps) for u in engine.units], memory=memory,
                      state=engine.full_state_dict())


def _moments(engine, u):
    """This rank's optimizer state of unit u, per (parameter name, key): (the parameter's first
    element it covers, a copy); a whole-tensor state (Adafactor's rows, columns) whole, from 0.
    Stage 0's covers every parameter from 0, so a shard is held to that slice of it."""
    opt_state, moments = read_state(engine, u), {}
    for p in u.pieces:
        for key, (c, d) in p.at.items():
            start = p.lo + p.a - p.o if u.keys[p.i][key] is None else 0
            moments[u.names[p.i], key] = (start, opt_state[key][c:d].clone())
    return moments


def perturb(model, rank):
    """Ranks 1.. start from other values than rank 0 (a user who seeds each rank
    differently does this): every parameter and buffer plus the rank. DDP broadcasts
    rank 0's at construction, so the engine must, before anything reads them."""
    with torch.no_grad():
        for t in chain(model.parameters(), model.buffers()):
            if rank and not t.is_meta and t.dtype != torch.bool and not t.is_complex():
                t.add_(rank)


def _padded(model, n, kw):
    """Ψ as the layout must pad it, computed from the model's own parameter sizes and the
    units (each unit's Ψ padded to a multiple of N here, not by the engine)."""
    return sum(_padded_units(model, n, kw))


def _padded_units(model, n, kw):
    """Each unit's padded Ψ_u, as _padded adds them up (quantized messages pad per unit)."""
    units = default_units(model) if kw.get("units") is None else kw["units"]
    return [-(-sum(p.numel() for _, p in g) // n) * n for g in group_params(model, units)]


def _formulas(numel, n, stage, kw, units, sizes):
    """What memory (with offload) and bytes must be, for Ψ = numel: (memory, bytes). AdamW's
    state is the formula's own (2Ψ/N); another optimizer's state and the whole tensors it
    gathers are counted from the units' layouts (optimizers.state_numel, whole_numel).
    Quantized gradients: their bytes from each unit's padded size, `sizes`."""
    dtype, offload = kw.get("dtype", torch.float32), kw.get("offload")
    params = kw.get("offload_params", False)
    # Hybrid sharding: a unit is cut S ways, and R = N/S replicas.
    S = kw.get("shard_size") or n
    sharding = numel, S, stage, dtype
    opt_numel = None if kw.get("optimizer", "adamw") == "adamw" else state_numel(units)
    modes = {k: kw[k] for k in ("reduce_every", "reshard_after_forward", "reduce_order")
             if k in kw}
    resident = model_state_bytes(*sharding, offload, params, kw.get("reduce_dtype"), opt_numel,
                                 **modes, grad_accum=kw.get("grad_accum", 1))
    memory = _memory(resident, offloaded_bytes(*sharding, offload, params, opt_numel))
    q = kw.get("quantize_grads")
    return memory, comm_bytes_per_step(sizes if q else numel, *sharding[1:],
                                       kw.get("grad_accum", 1),
                                       kw.get("reduce_dtype"), n // S, whole_numel(units), **modes,
                                       quantize_grads=q, quant_block=kw.get("quant_block", BLOCK))


def _memory(resident, offloaded):
    """Resident bytes by category, and offloaded bytes by where: measured or formula."""
    return {**resident, **{f"offloaded to {k}": v for k, v in offloaded.items()}}


def _kept_too_much(engine):
    """What a stage promises not to keep between its sync points, if it keeps it anyway."""
    # reduce_every="step" keeps the local sum until the step's last micro-batch (u.summing)
    for u in engine.units:
        if engine.sharded["grads"] and ((u.bucket is not None and not u.summing) or
                                        any(p.grad is not None for p in u.params)):
            return f"a full gradient of {u.names[0]}'s unit survived backward"
        if u.index in getattr(engine, "secondary", {}):
            return f"{u.names[0]}'s unit kept its secondary shard past backward"
        if engine.sharded["params"] and u.flat.untyped_storage().nbytes():
            return f"{u.names[0]}'s unit stayed gathered"
        if engine.micro == 0 and (u.reduced is not None or u.reduced_full is not None):
            return f"{u.names[0]}'s reduced gradient survived the step"
    return None


def _jitter(engine, rng):
    """Random delays before every communication job, as FSDP2's parity tests inject:
    they change when bytes move, which must never change what they sum to."""
    submit = engine._submit

    def delayed(job, *where):
        pause = rng.uniform(0, 0.002)
        return submit(lambda: (time.sleep(pause), job())[1], *where)
    engine._submit = delayed

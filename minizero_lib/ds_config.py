"""
The demo's options as DeepSpeed, nanoGPT and torch users write them: a DeepSpeed JSON config
(`train_gpt.py --config ds_config.json`), nanoGPT's flag names, dtype names, the checks made
before any rank starts, and the banner the demo prints first, saying what it took.

Each key of a DeepSpeed config, by its dotted path, is one of:
  honoured  (HONOURED) sets a demo option, its value checked: the ZeRO stage, bf16 / fp16 and
            the loss scale, offload, clipping, the batch, the optimizer, the lr schedule;
  "auto"    (Hugging Face's Trainer writes it) on any key: the demo's own value;
  ignored   (IGNORED) DeepSpeed's performance knobs and logs, meaningless here (bucket sizes,
            overlap_comm, prefetch, steps_per_print, ...): accepted, listed on one line;
  refused   (REFUSED) asks for what minizero does not do (pipeline or tensor parallelism,
            Lamb, a static loss scale, ...): a ValueError naming the key;
  unknown   anything else. DeepSpeed ignores keys it does not know, so minizero does too and
            lists them on one warning line; but a key one typo from an honoured one
            (`zero_optimisation`, `stgae`: difflib's ratio >= NEAR) is refused, naming the key
            it probably meant: ignoring it would silently train another way.
"""
import argparse
import difflib
import json
import os
from types import SimpleNamespace

from minizero_lib.user_model import check_modes

# offload_optimizer.device -> Engine(offload=...)
OFFLOAD = {"none": None, "cpu": "cpu", "nvme": "disk"}
# optimizer.type, lower-cased -> Engine(optimizer=...)
OPTIMIZER = {"adamw": "adamw", "adam": "adamw", **{k: k for k in ("sgd", "adafactor", "muon")}}
# scheduler.type: DeepSpeed's warmup schedules, which the demo's warmup and cosine can follow
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# --dtype's names, torch's and their short forms
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
               "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
# communication_data_type (DeepSpeed's names; older versions spelled bf16 "bfp16")
COMM_DTYPES = {**DTYPE_NAMES, "bfp16": "bfloat16"}
# an unknown key this close to an honoured one (difflib's ratio) is taken for its typo
NEAR = 0.8

_num = lambda v: type(v) in (int, float) and v >= 0  # noqa: E731 (bool is no number here)
_int = lambda v: type(v) is int and v >= 1  # noqa: E731
_int0 = lambda v: type(v) is int and v >= 0  # noqa: E731
_bool = (lambda v: type(v) is bool, "true or false")
_pos = (_int, "an integer >= 1")
_nonneg = (_num, "a number >= 0")
_in = lambda *xs: (lambda v: v in xs, " or ".join(map(repr, xs)))  # noqa: E731
HONOURED = {  # dotted path -> (our option, check, what it must be)
    "zero_optimization.stage": ("stage", lambda v: type(v) is int and 0 <= v <= 3, "0, 1, 2 or 3"),
    "bf16.enabled": ("bf16", *_bool),
    "bfloat16.enabled": ("bf16", *_bool),  # (DeepSpeed's older spelling)
    "fp16.enabled": ("fp16", *_bool),
    "fp16.initial_scale_power": ("scale_power", lambda v: _int0(v) and v <= 64, "an integer 0-64"),
    "fp16.loss_scale_window": ("scale_window", *_pos),
    "communication_data_type": ("reduce_dtype", lambda v: str(v).lower() in COMM_DTYPES,
                                "'fp32', 'fp16' or 'bf16'"),
    "gradient_accumulation_steps": ("grad_accum", *_pos),
    "train_batch_size": ("global_batch", *_pos),
    "train_micro_batch_size_per_gpu": ("batch_size", *_pos),
    "gradient_clipping": ("clip", _num, "a number >= 0 (0: no clipping)"),
    "optimizer.type": ("optimizer", lambda v: True, ""),  # (REFUSED names those minizero lacks)
    "optimizer.params.lr": ("lr", *_nonneg),
    "optimizer.params.betas": ("betas", lambda v: type(v) in (list, tuple) and len(v) == 2
                               and all(map(_num, v)), "a pair of numbers"),
    "optimizer.params.eps": ("eps", *_nonneg),
    "optimizer.params.weight_decay": ("weight_decay", *_nonneg),
    "optimizer.params.momentum": ("momentum", *_nonneg),
    "scheduler.type": ("scheduler", lambda v: v in SCHEDULERS, " or ".join(SCHEDULERS)),
    "scheduler.params.warmup_num_steps": ("warmup", _int0, "an integer >= 0"),
    "scheduler.params.total_num_steps": ("steps", *_pos),
    "scheduler.params.warmup_max_lr": ("lr", *_nonneg),
    "scheduler.params.warmup_min_lr": ("warmup_min_lr", *_nonneg),
    "scheduler.params.cos_min_ratio": ("min_lr_ratio", *_nonneg),
    "scheduler.params.warmup_min_ratio": ("warmup_min_ratio", *_nonneg),
    "scheduler.params.warmup_type": ("warmup_type", *_in("log", "linear")),
    "zero_optimization.offload_optimizer.device": ("offload", *_in("none", "cpu", "nvme")),
    "zero_optimization.offload_optimizer.nvme_path": ("offload_dir", lambda v: isinstance(v, str)
                                                      and v, "a directory"),
    "zero_optimization.offload_optimizer.pin_memory": ("pin_memory", *_bool),
    "zero_optimization.offload_param.device": ("offload_params", *_in("none", "cpu")),
    # DeepSpeed's older spellings of the two offloads and their pinning
    "zero_optimization.cpu_offload": ("offload", *_bool),
    "zero_optimization.cpu_offload_param": ("offload_params", *_bool),
    "zero_optimization.cpu_offload_use_pin_memory": ("pin_memory", *_bool),
    # MiCS shards over groups of this many ranks: hybrid sharding, Engine(shard_size=...)
    "zero_optimization.mics_shard_size": ("shard_size", lambda v: _int(v) or v == -1, ">= 1 or -1"),
    # ZeRO++ hpZ: the secondary partition's size (1: none), Engine(reshard_after_forward=G)
    "zero_optimization.zero_hpz_partition_size": ("reshard_after_forward", *_pos),
    # ZeRO++: qwZ's int8 parameter all-gather, qgZ's int4 gradient all-to-all (quantize.py)
    "zero_optimization.zero_quantized_weights": ("quantize_weights", *_bool),
    "zero_optimization.zero_quantized_gradients": ("quantize_grads", *_bool),
}
QUANTIZED = {"quantize_weights": 8, "quantize_grads": 4}  # DeepSpeed's true -> the bits ZeRO++ uses

# No meaning here: how DeepSpeed buckets, overlaps, prefetches, logs and profiles. A path
# ending in "." is a whole section.
IGNORED = set("""
steps_per_print wall_clock_breakdown memory_breakdown dump_state zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer prescale_gradients gradient_predivide_factor dataloader_drop_last
disable_allgather graph_harvesting seq_parallel_communication_data_type vocabulary_size
use_data_before_expert_parallelism tensorboard. wandb. csv_monitor. comet. comms_logger.
flops_profiler. monitor_config. aio. checkpoint. timers. nebula. autotuning. data_types. compile.
activation_checkpointing. amp. bf16. bfloat16. elasticity. curriculum_learning. data_efficiency.
progressive_layer_drop. eigenvalue. quantize_training. hybrid_engine. tensor_parallel.
fp16.hysteresis fp16.consecutive_hysteresis fp16.min_loss_scale fp16.auto_cast
optimizer.params.torch_adam optimizer.params.foreach optimizer.params.fused
scheduler.params.last_batch_iteration
""".split()) | {"zero_optimization." + k for k in """
contiguous_gradients reduce_scatter reduce_bucket_size use_multi_rank_bucket_allreduce
allgather_partitions allgather_bucket_size allgather_size overlap_comm load_from_fp32_weights
elastic_checkpoint sub_group_size ignore_unused_parameters legacy_stage1 round_robin_gradients
mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint
override_module_apply log_trace_cache_warnings enable_sanity_checks
save_muon_momentum_buffer_in_memory stage3_gather_fp16_weights_on_model_save offload_optimizer.
offload_param. leaf_module. zeropp_loco_param.
""".split()} | {f"zero_optimization.{s}{k}" for s in ("", "stage3_") for k in """
prefetch_bucket_size param_persistence_threshold model_persistence_threshold max_live_parameters
max_reuse_distance gather_16bit_weights_on_model_save module_granularity_threshold
use_all_reduce_for_fetch_params allgather_sequential partition_stream_chunk_size
""".split()}

_true = lambda v: v is True  # noqa: E731
_any = lambda v: True  # noqa: E731
_not = lambda ok: lambda v: v != ok  # noqa: E731
LACKS = "is not in minizero (data parallelism, ZeRO): drop it"
REFUSED = {  # dotted path (or section, ending ".") -> (does the value ask for it, the fix)
    "optimizer.type": (lambda v: str(v).lower() not in OPTIMIZER,
                       "minizero has no such optimizer: use AdamW (Adam), SGD, Adafactor or Muon"),
    "optimizer.params.": (_any, "the demo's optimizers take lr, betas, eps, weight_decay and "
                                "momentum: drop it"),
    "optimizer.params.amsgrad": (_true, "minizero's AdamW has no AMSGrad: set it false"),
    "optimizer.params.adam_w_mode": (_not(True), "minizero's AdamW decays decoupled: set it true"),
    "optimizer.params.bias_correction": (_not(True), "minizero's AdamW corrects its bias: set it "
                                                     "true"),
    "scheduler.type": (lambda v: v not in SCHEDULERS, f"use {', '.join(SCHEDULERS)} or none"),
    "scheduler.params.": (_any, "not a parameter of the warmup schedules: drop it"),
    "fp16.loss_scale": (_not(0), "a static scale, and minizero's is dynamic: give 0 (and "
                                 "initial_scale_power for where it starts)"),
    "fp16.fp16_master_weights_and_grads": (_true, "minizero keeps an fp32 master: set it false"),
    "zero_optimization.offload_param.device": (lambda v: v == "nvme", "parameters offload to host "
                                               "memory only: use \"cpu\""),
    "zero_optimization.offload_optimizer.ratio": (_not(1), "the optimizer's shard is offloaded "
                                                           "whole: drop it"),
    "zero_optimization.zero_quantized_nontrainable_weights": (_true, "frozen weights stay "
                                                              "unquantized: set it false"),
    "activation_checkpointing.cpu_checkpointing": (_true, "activations stay on the device: set it "
                                                          "false"),
    "sparse_gradients": (_true, "gradients are dense here: set it false"),
    "amp.enabled": (_true, "apex AMP is not in minizero: use bf16 or fp16"),
    **{k: (_not(1), f"tensor or sequence parallelism {LACKS}") for k in
       ("tensor_parallel.autotp_size", "tensor_parallel.tp.tp_size", "sequence_parallel_size")},
    **{k + ".": (_any, f"{k} {LACKS}") for k in ("pipeline", "sparse_attention",
                                                 "compression_training", "weight_quantization",
                                                 "zero_optimization.zenflow")},
    **{k + ".enabled": (_true, f"{k} is not in minizero: set it false") for k in (
        "curriculum_learning", "data_efficiency", "progressive_layer_drop", "eigenvalue",
        "quantize_training", "hybrid_engine", "elasticity")},
}


def parse_ds_config(ds):
    """A DeepSpeed config (a dict) -> the demo options it sets (read_ds_config's first half)."""
    return read_ds_config(ds)[0]


def read_ds_config(ds):
    """A DeepSpeed config (a dict) -> (the options it sets, notes: {"ignored", "auto",
    "unknown": [dotted paths], "schedule": [what the demo's schedule cannot follow]}). A
    refused key, a near miss of an honoured one or an impossible value is a ValueError naming
    the key's dotted path."""
    notes = {"ignored": [], "auto": [], "unknown": [], "schedule": []}
    out = {}
    for path, v in flatten(ds):
        if v == "auto":
            notes["auto"].append(path)
            continue
        refuse(path, v)
        if path in HONOURED:
            name, ok, want = HONOURED[path]
            if not ok(v):
                raise ValueError(f"ds config: {path!r} must be {want}, got {v!r}")
            out[name] = tuple(v) if name == "betas" else v
        elif path in REFUSED:
            continue  # not refused: its value is what minizero does anyway (loss_scale 0, ...)
        elif path in IGNORED or section(path, IGNORED):  # (a section of none we read: its name)
            held = section(path, IGNORED)
            name = held + "*" if held and not any(k.startswith(held) for k in HONOURED) else path
            notes["ignored"] += [] if name in notes["ignored"] else [name]
        else:
            notes["unknown"].append(path)
    return to_options(out, notes), notes


# the sections the tables name: "zero_optimization", "zero_optimization.offload_param", ...
SECTIONS = {p[:i] for p in [*HONOURED, *IGNORED, *REFUSED] for i in range(len(p)) if p[i] == "."}


def flatten(ds, prefix=""):
    """(dotted path, value) of every leaf of a config; a section given a plain value (bf16:
    true) is an error naming it, and a null one is absent."""
    for k, v in ds.items():
        if isinstance(v, dict):
            yield from flatten(v, f"{prefix}{k}.")
        elif prefix + k in SECTIONS and v is not None:
            raise ValueError(f"ds config: {prefix + k!r} must be an object {{...}} of its keys, "
                             f"got {v!r}")
        elif prefix + k not in SECTIONS:
            yield prefix + k, v


def section(path, table):
    """The longest section ("a.b.") in table that holds path, or None."""
    held = [p for p in table if p.endswith(".") and path.startswith(p)]
    return max(held, key=len, default=None)


def refuse(path, v):
    """Raise, naming the key, when path asks for what minizero does not do, or is one typo
    from an honoured key (the module's docstring: unknown keys)."""
    rule = REFUSED.get(path)
    if rule and rule[0](v):
        raise ValueError(f"ds config: {path!r} is {v!r}: {rule[1]}")
    known = path in HONOURED or path in IGNORED or path in REFUSED
    if not known and (guess := near_miss(path)):
        raise ValueError(f"ds config: unknown key {path!r}: did you mean {guess!r}? (a key "
                         "minizero reads; DeepSpeed would skip the typo silently)")
    held = None if known else section(path, REFUSED)
    if held and len(section(path, IGNORED) or "") < len(held):
        raise ValueError(f"ds config: {path!r}: {REFUSED[held][1]}")


def near_miss(path):
    """The honoured key that path is one typo away from, or None: at the first of its names
    that no honoured key has at that place, the closest such name, if close enough."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        there = {k.split(".")[i] for k in HONOURED
                 if k.split(".")[:i] == parts[:i] and k.count(".") >= i}
        if part in there:
            continue
        close = difflib.get_close_matches(part, there, n=1, cutoff=NEAR)
        return ".".join(parts[:i] + close + parts[i + 1:]) if close else None


def to_options(out, notes):
    """The honoured values as the demo's options, in its own terms."""
    bf16, fp16 = out.pop("bf16", None), out.pop("fp16", None)
    if bf16 and fp16:
        raise ValueError("ds config: 'bf16.enabled' and 'fp16.enabled' are both true; pick one")
    if (bf16, fp16) != (None, None):  # both present and false: DeepSpeed trains in fp32
        out["dtype"] = "bfloat16" if bf16 else "float16" if fp16 else "float32"
    if "scale_power" in out:
        out["loss_scale"] = 2.0 ** out.pop("scale_power")
    if "reduce_dtype" in out:
        out["reduce_dtype"] = COMM_DTYPES[str(out["reduce_dtype"]).lower()]
    if "clip" in out:
        out["clip"] = out["clip"] or None  # DeepSpeed's 0 means no clipping
    if "offload" in out:  # DeepSpeed's NVMe offload is minizero's disk offload (cpu_offload: bool)
        out["offload"] = OFFLOAD[{True: "cpu", False: "none"}.get(out["offload"], out["offload"])]
    if "offload_params" in out:
        out["offload_params"] = out["offload_params"] in (True, "cpu")
    if out.get("shard_size") == -1:  # MiCS's default: shard over every rank
        out["shard_size"] = None
    if out.get("reshard_after_forward") == 1:  # DeepSpeed's 1: no secondary partition
        out["reshard_after_forward"] = "true"
    for name, bits in QUANTIZED.items():
        if name in out:
            out[name] = bits if out[name] else None
    if "optimizer" in out:  # (Adam is trained as AdamW: decoupled decay, as the demo always had it)
        out["optimizer"] = OPTIMIZER[str(out["optimizer"]).lower()]
    schedule(out, notes)
    return out


def schedule(out, notes):
    """A DeepSpeed scheduler as the demo's schedule (train_gpt.get_lr: linear warmup, then
    cosine to min_lr at the last step); notes["schedule"] says what it cannot follow."""
    kind, auto, shape = out.pop("scheduler", None), notes["auto"], out.pop("warmup_type", "log")
    start = out.pop("warmup_min_lr", 0) + out.pop("warmup_min_ratio", 0)
    if kind is None:
        return
    if kind == "WarmupLR":  # constant after the warmup: cosine from lr to lr
        out["min_lr_ratio"] = 1.0
    if kind == "WarmupDecayLR":
        notes["schedule"].append("its linear decay runs as the demo's cosine")
    if kind == "WarmupDecayLR" and "scheduler.params.warmup_min_lr" not in auto:
        out["min_lr"] = start  # (it decays to warmup_min_lr)
    if kind == "WarmupCosineLR" and "scheduler.params.cos_min_ratio" not in auto:
        out.setdefault("min_lr_ratio", 1e-4)  # DeepSpeed's default cos_min_ratio
    if shape == "log":
        notes["schedule"].append("its log warmup (warmup_type's default) runs as linear")
    if start:
        notes["schedule"].append(f"the warmup starts near 0, not at {start:g}")


def merge(cfg, ds, given, notes=None):
    """The demo's options: its defaults cfg < the config's ds < the flags given; then what
    DeepSpeed derives: min_lr as a ratio of lr, a micro-batch left to train_batch_size."""
    out = {**cfg, **ds, **given, **({"ds_notes": notes} if notes else {})}
    ratio = out.pop("min_lr_ratio", None)
    if ratio is None and "lr" in ds and "min_lr" not in ds:  # the demo's min_lr / lr, at ds's lr
        ratio = cfg["min_lr"] / cfg["lr"]
    if ratio is not None and "min_lr" not in given:
        out["min_lr"] = ratio * out["lr"]
    if "global_batch" in ds and "batch_size" not in ds and "batch_size" not in given:
        out["batch_size"] = None  # micro_batch_for: train_batch_size / (grad_accum x ranks)
    return out


def micro_batch_for(cfg, world_size):
    """DeepSpeed's rule for a config with train_batch_size and no micro-batch size: the
    micro-batch is train_batch_size / (grad_accum x ranks). Fills cfg["batch_size"]."""
    if cfg["batch_size"] is not None:
        return
    per = cfg["grad_accum"] * world_size
    if cfg["global_batch"] % per:
        raise ValueError(f"train_batch_size {cfg['global_batch']} is not divisible by "
                         f"grad_accum {cfg['grad_accum']} x world size {world_size}; give "
                         "train_micro_batch_size_per_gpu, or change the batch or the ranks")
    cfg["batch_size"] = cfg["global_batch"] // per


def read_json(path):
    """--config's file as a dict; a missing file or bad JSON is a ValueError naming it."""
    try:
        with open(path) as f:
            ds = json.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}; give the path of a DeepSpeed JSON config")
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path} is not valid JSON: line {e.lineno}, column {e.colno}: "
                         f"{e.msg}")
    if not isinstance(ds, dict):
        raise ValueError(f"--config {path} holds a JSON {type(ds).__name__}; a DeepSpeed config is "
                         "an object {...}")
    return ds


# -----------------------------------------------------------------------------
# the banner: what the demo took from its flags and config, before any rank starts


def banner(cfg, world_size, cuda):
    """The demo's first lines: stage, dtype, offload, the batch (micro x accumulation x ranks,
    DeepSpeed's rule), the optimizer's schedule; then the config's notes, one line each."""
    c = SimpleNamespace(**cfg)
    dtype = c.dtype or ("bfloat16" if cuda else "float32")
    # fp16's scale is dynamic: halved on an overflow, doubled after a window of clean steps
    said = dtype + (f" (loss scale from {c.loss_scale:g}, x2 after {c.scale_window} clean steps)"
                    if dtype == "float16" else "")
    said += "" if c.reduce_dtype in (None, dtype) else f" (gradients reduced in {c.reduce_dtype})"
    ga = grad_accum_for(c, world_size)
    lines = [f"train_gpt.py: ZeRO stage {c.stage}{' (DDP)' if c.stage == 0 else ''}, {said}, "
             f"{offloaded(c)}, batch {c.batch_size} x {ga} x {world_size} ranks (micro x "
             f"accumulation x ranks) = {c.batch_size * ga * world_size} sequences of "
             f"{c.block_size}",
             f"  {c.optimizer}, lr {c.lr:g}: warmup {c.warmup} steps, then "
             + ("constant" if c.min_lr == c.lr else f"cosine to {c.min_lr:g}")
             + f", {c.steps} steps, clip {c.clip or 'off'}"]
    notes = cfg.get("ds_notes") or {}
    for key, says in (("schedule", "its scheduler: "), ("ignored", "ignored, no meaning here: "),
                      ("auto", '"auto", the demo\'s value: '),
                      ("unknown", "unknown keys, ignored as DeepSpeed ignores them: ")):
        if notes.get(key):
            lines.append(f"  ds config {c.config}: {says}{', '.join(notes[key])}")
    return lines + ["  starting the ranks; each builds the model (a large one takes a while)..."]


def offloaded(c):
    """What lives off the device, and where, in words."""
    where = {"cpu": "host memory" + (" (pinned)" if c.pin_memory else ""),
             "disk": f"files in {c.offload_dir}"}
    parts = ([f"optimizer state offloaded to {where[c.offload]}"] if c.offload else []) \
        + (["parameters offloaded to host memory"] if c.offload_params else [])
    return ", ".join(parts) or "no offload"


# -----------------------------------------------------------------------------
# flags' values, the numbers and the mesh


# nanoGPT's train.py names of what the demo shares with it (--max_iters=100 is --steps 100)
NANOGPT = dict(steps="max_iters", lr="learning_rate", grad_accum="gradient_accumulation_steps",
               clip="grad_clip", warmup="warmup_iters")


def optimizer_options(c):
    """Engine options of --optimizer: AdamW's betas and eps (also Muon's AdamW), Muon's muon_lr,
    the momentum."""
    adamw = dict(betas=tuple(c.betas), eps=c.eps)
    momentum = {} if c.momentum is None else dict(momentum=c.momentum)
    return {"adamw": adamw, "muon": dict(adamw, muon_lr=c.muon_lr, **momentum), "sgd": momentum,
            "adafactor": {}}[c.optimizer]


def flag_bool(text):
    """A flag's true or false, as nanoGPT writes them (--compile=False)."""
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1", "yes")


def dtype_arg(text):
    """--dtype's value, torch's name or its short one (bf16), -> torch's name."""
    if str(text).lower() not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"invalid dtype {text!r}: give one of "
                                         f"{', '.join(DTYPE_NAMES)}")
    return DTYPE_NAMES[str(text).lower()]


# the least each of the demo's numeric options may be
AT_LEAST = dict(world_size=1, n_layer=1, n_head=1, n_embd=1, block_size=1, batch_size=1,
                grad_accum=1, eval_interval=1, eval_iters=1, steps=0, warmup=0, sample_tokens=0,
                lr=0, min_lr=0, clip=0, muon_lr=0, momentum=0, save_interval=1, dropout=0,
                weight_decay=0)


def check_numbers(cfg):
    """The demo's numeric options within their ranges: a ValueError naming the flag."""
    for k, low in AT_LEAST.items():
        if cfg[k] is not None and not cfg[k] >= low:  # (nan is not >= anything)
            raise ValueError(f"--{k.replace('_', '-')} must be at least {low}; got {cfg[k]}")
    if cfg["n_embd"] % cfg["n_head"]:
        raise ValueError(f"--n-embd {cfg['n_embd']} must be a multiple of --n-head {cfg['n_head']}")
    if not cfg["dropout"] < 1:
        raise ValueError(f"--dropout must be below 1; got {cfg['dropout']}")


def check_parallel(cfg, world_size):
    """The mesh (--shard-size, the modes), ZeRO++'s quantization and offload, against the stage
    and the world size, before any rank starts: a ValueError naming the fix."""
    check_modes(cfg["stage"], cfg["reduce_every"], reshard_arg(cfg["reshard_after_forward"]),
                world_size, shard_size(cfg, world_size))
    check_quantized(cfg)
    if cfg["offload"] and cfg["stage"] == 0:
        raise ValueError("--offload moves the optimizer's shard off the device; stage 0 (DDP) "
                         "keeps the whole state on every rank: use --stage 1, 2 or 3")
    if cfg["offload_params"] and cfg["stage"] != 3:
        raise ValueError("--offload-params (offload_param.device cpu) moves stage 3's parameter "
                         f"shard to host memory; stage {cfg['stage']} keeps whole parameters: use "
                         "--stage 3")
    if cfg["offload"] == "disk" and not cfg["offload_dir"]:
        raise ValueError("--offload disk needs --offload-dir (DeepSpeed: offload_optimizer."
                         "nvme_path), a directory on the disk the optimizer state should live on")


def check_quantized(cfg):
    """--quantize-weights and --quantize-grads (or their DeepSpeed keys): a ValueError naming the
    fix."""
    if cfg.get("quantize_weights") not in (None, 8):
        raise ValueError("--quantize-weights must be 8 (int8 codes); got "
                         f"{cfg['quantize_weights']}")
    if cfg.get("quantize_grads") not in (None, 8, 4):
        raise ValueError("--quantize-grads must be 8 or 4 (int8 or int4 codes); got "
                         f"{cfg['quantize_grads']}")
    if cfg.get("quantize_weights") and cfg["stage"] != 3:
        raise ValueError("--quantize-weights (zero_quantized_weights) quantizes stage 3's "
                         f"parameter all-gather, and stage {cfg['stage']} gathers none: use "
                         "--stage 3, or drop it")


def grad_accum_for(c, world_size):
    """DeepSpeed's rule: train_batch_size = micro batch x grad_accum x world size."""
    if c.global_batch is None:
        return c.grad_accum
    if c.global_batch % (c.batch_size * world_size):
        raise ValueError(f"train_batch_size {c.global_batch} is not divisible by the micro batch "
                         f"{c.batch_size} x world size {world_size}; change the batch or the "
                         "number of ranks")
    ga = c.global_batch // (c.batch_size * world_size)
    if c.grad_accum not in (1, ga):
        raise ValueError(f"train_batch_size {c.global_batch} = {c.batch_size} x grad_accum x "
                         f"{world_size} needs grad_accum {ga}, but gradient_accumulation_steps is "
                         f"{c.grad_accum}")
    return ga


def shard_size(cfg, world_size):
    """--shard-size as a number of ranks (None: all of them), checked against the world size."""
    s = cfg["shard_size"]
    if s is None:
        return None
    s = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if s == "node" else s
    if not str(s).isdigit() or int(s) < 1 or world_size % int(s):
        raise ValueError(f"--shard-size {s} must be 'node' or a number of ranks that divides the "
                         f"world size {world_size}, like "
                         f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    return int(s)


def reshard_arg(value):
    """--reshard-after-forward true|false|N (or zero_hpz_partition_size N) -> True, False or N."""
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    if not text.isdigit():
        raise ValueError(f"--reshard-after-forward must be true, false or a number of ranks (hpZ); "
                         f"got {value!r}")
    return int(text)

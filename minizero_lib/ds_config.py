"""
DeepSpeed's JSON config (`train_gpt.py --config ds_config.json`), read as the demo's
options: the keys minizero has, each checked, and DeepSpeed's batch rule. Any other key
is an error that names it, never silently ignored. Then the demo's mesh options (--shard-size,
--reduce-every, --reshard-after-forward), checked against the world size.
"""
import json
import os

from minizero_lib.user_model import check_modes

# offload_optimizer.device -> Engine(offload=...)
OFFLOAD = {"none": None, "cpu": "cpu", "nvme": "disk"}
# optimizer.type, lower-cased -> Engine(optimizer=...)
OPTIMIZER = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd", "adafactor": "adafactor",
             "muon": "muon"}
_num = lambda v: type(v) in (int, float) and v >= 0  # noqa: E731 (bool is no number here)
_int = lambda v: type(v) is int and v >= 1  # noqa: E731
DS_KEYS = {  # the DeepSpeed keys minizero has: dotted path -> (our option, check, what it must be)
    "zero_optimization.stage": ("stage", lambda v: type(v) is int and 0 <= v <= 3, "0, 1, 2 or 3"),
    "bf16.enabled": ("bf16", lambda v: type(v) is bool, "true or false"),
    "fp16.enabled": ("fp16", lambda v: type(v) is bool, "true or false"),
    "gradient_accumulation_steps": ("grad_accum", _int, "an integer >= 1"),
    "train_batch_size": ("global_batch", _int, "an integer >= 1"),
    "train_micro_batch_size_per_gpu": ("batch_size", _int, "an integer >= 1"),
    "gradient_clipping": ("clip", _num, "a number >= 0 (0: no clipping)"),
    "optimizer.type": ("optimizer", lambda v: str(v).lower() in OPTIMIZER,
                       "AdamW, Adam, SGD, Adafactor or Muon"),
    "optimizer.params.lr": ("lr", _num, "a number >= 0"),
    "optimizer.params.betas": ("betas",
                               lambda v: type(v) in (list, tuple) and len(v) == 2
                               and all(map(_num, v)),
                               "a pair of numbers"),
    "optimizer.params.eps": ("eps", _num, "a number >= 0"),
    "optimizer.params.weight_decay": ("weight_decay", _num, "a number >= 0"),
    "optimizer.params.momentum": ("momentum", _num, "a number >= 0"),
    "zero_optimization.offload_optimizer.device": ("offload",
                                                   lambda v: isinstance(v, str) and v in OFFLOAD,
                                                   "'none', 'cpu' or 'nvme'"),
    "zero_optimization.offload_optimizer.nvme_path": ("offload_dir",
                                                      lambda v: isinstance(v, str) and v,
                                                      "a directory"),
    "zero_optimization.offload_optimizer.pin_memory": ("pin_memory", lambda v: type(v) is bool,
                                                       "true or false"),
    # ZeRO++ hpZ: the secondary partition's size (1: none), Engine(reshard_after_forward=G)
    "zero_optimization.zero_hpz_partition_size": ("reshard_after_forward", _int, "an integer >= 1"),
    # ZeRO++: qwZ's int8 parameter all-gather, qgZ's int4 gradient all-to-all (quantize.py)
    "zero_optimization.zero_quantized_weights": ("quantize_weights", lambda v: type(v) is bool,
                                                 "true or false"),
    "zero_optimization.zero_quantized_gradients": ("quantize_grads", lambda v: type(v) is bool,
                                                   "true or false"),
}
QUANTIZED = {"quantize_weights": 8, "quantize_grads": 4}  # DeepSpeed's true -> the bits ZeRO++ uses


def parse_ds_config(ds):
    """A DeepSpeed config (a dict) -> the options it sets. Any key minizero does not have,
    or an impossible value, is a ValueError naming the key's dotted path."""
    flat = {}

    def walk(d, prefix):
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.__setitem__(prefix + k, v)
    walk(ds, "")
    out = {}
    for path, v in flat.items():
        if path not in DS_KEYS:
            raise ValueError(f"ds config: unknown key {path!r}; minizero reads only "
                             f"{sorted(DS_KEYS)}")
        name, ok, want = DS_KEYS[path]
        if not ok(v):
            raise ValueError(f"ds config: {path!r} must be {want}, got {v!r}")
        out[name] = tuple(v) if name == "betas" else v
    if out.get("bf16") and out.get("fp16"):
        raise ValueError("ds config: 'bf16.enabled' and 'fp16.enabled' are both true; pick one")
    if "bf16" in out or "fp16" in out:  # both present and false: DeepSpeed trains in fp32
        out["dtype"] = ("bfloat16" if out.get("bf16") else "float16" if out.get("fp16")
                        else "float32")
    if "clip" in out:
        out["clip"] = out["clip"] or None  # DeepSpeed's 0 means no clipping
    if "offload" in out:  # DeepSpeed's NVMe offload is minizero's disk offload
        out["offload"] = OFFLOAD[out["offload"]]
    if out.get("reshard_after_forward") == 1:  # DeepSpeed's 1: no secondary partition
        out["reshard_after_forward"] = "true"
    for name, bits in QUANTIZED.items():
        if name in out:
            out[name] = bits if out[name] else None
    if "optimizer" in out:  # (Adam is trained as AdamW: decoupled decay, as the demo always had it)
        out["optimizer"] = OPTIMIZER[str(out["optimizer"]).lower()]
    return {k: v for k, v in out.items() if k not in ("bf16", "fp16")}


def read_json(path):
    """--config's file as a dict; a missing file or bad JSON is a ValueError naming the file and
    line."""
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


def check_mesh(cfg, world_size):
    """--shard-size, --reduce-every and --reshard-after-forward, before any rank starts."""
    check_modes(cfg["stage"], cfg["reduce_every"], reshard_arg(cfg["reshard_after_forward"]),
                world_size, shard_size(cfg, world_size))

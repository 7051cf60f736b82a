"""Tests for train_gpt.py: the DeepSpeed config mapping, the model, the data, and (with
minizero) a short training run whose loss curve is the same bits at stage 0 and stage 3."""
import json
import os
import math

import pytest
import torch

from minizero_lib import ds_config
from minizero_lib import launch
import train_gpt as tg


# ---- parse_ds_config / parse_args

def test_ds_config_maps_to_overrides():
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": False},
          "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                    "weight_decay": 0.1}}}
    assert ds_config.parse_ds_config(ds) == dict(stage=2, dtype="bfloat16", grad_accum=4, batch_size=8, clip=0.5,
                                          optimizer="adamw", lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert ds_config.parse_ds_config({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}) == \
        dict(optimizer="sgd", momentum=0.9)
    assert ds_config.parse_ds_config({}) == {}
    assert ds_config.parse_ds_config({"fp16": {"enabled": True}}) == {"dtype": "float16"}
    assert ds_config.parse_ds_config({"bf16": {"enabled": False}}) == {"dtype": "float32"}
    assert ds_config.parse_ds_config({"gradient_clipping": 0}) == {"clip": None}  # DeepSpeed: 0 = off


@pytest.mark.parametrize("ds, key", [
    ({"zero_optimisation": {"stage": 2, "overlap_comm": True}}, "zero_optimisation.stage"),  # a typo of a key it reads
    ({"zero_optimization": {"stgae": 3}}, "zero_optimization.stgae"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale"),  # a static scale
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}}}, "optimizer.params.amsgrad"),
])
def test_ds_config_refused_key_is_named(ds, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        ds_config.parse_ds_config(ds)


@pytest.mark.parametrize("ds, key", [
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage"),
    ({"optimizer": {"type": "LAMB"}}, "optimizer.type"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"bf16": True}, "bf16"),
])
def test_ds_config_impossible_values_raise(ds, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        ds_config.parse_ds_config(ds)


def test_parse_args_precedence(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 3}))
    cfg = tg.parse_args(["--config", str(path), "--batch-size", "5", "--preset", "gpt2"])
    assert (cfg["stage"], cfg["batch_size"]) == (1, 5)  # a flag given beats the config file
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["block_size"]) == (12, 12, 768, 1024)
    cfg = tg.parse_args(["--config", str(path), "--stage", "3"])  # even a flag equal to its default
    assert cfg["stage"] == 3
    assert tg.parse_args([]) == tg.DEFAULTS


# ---- the model

CFG = tg.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def make(seed=0, cfg=CFG):
    return tg.GPT(cfg, torch.Generator().manual_seed(seed))


def test_tied_weight_is_one_parameter():
    m = make()
    assert m.lm_head.weight is m.transformer.wte.weight
    names = dict(m.named_parameters(remove_duplicate=False))
    assert names["lm_head.weight"] is names["transformer.wte.weight"]
    assert m.num_params() == sum(p.numel() for n, p in m.named_parameters())  # counted once
    assert "lm_head.weight" in m.state_dict() and "transformer.wte.weight" in m.state_dict()


def test_init_is_deterministic_and_nanogpt_shaped():
    a, b, c = make(1), make(1), make(2)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if p.dim() >= 2:
            assert not torch.equal(p, r), n
    big = make(0, tg.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64))
    assert abs(big.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 2e-3
    assert abs(big.transformer.h[0].mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(8)) < 1e-3
    assert big.transformer.h[0].attn.c_attn.bias.abs().sum() == 0
    assert isinstance(big.transformer.h, torch.nn.ModuleList)


def test_forward_shapes_and_initial_loss():
    m = make()
    idx = torch.randint(256, (3, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = m(idx)
    assert logits.shape == (3, 16, 256) and loss is None
    targets = torch.randint(256, (3, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = m(idx, targets)  # (not idx itself: tied embeddings lean towards repeating a byte)
    assert loss.shape == () and abs(loss.item() - math.log(256)) < 0.1  # ~uniform at init
    logits, _ = m(idx[:, :5])
    assert logits.shape == (3, 5, 256)
    with pytest.raises(AssertionError, match="block_size"):
        m(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_and_backward_in_16_bit(dtype):
    m = make().to(dtype)
    idx, targets = torch.randint(256, (2, 2, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = m(idx, targets)
    assert logits.dtype == dtype and loss.dtype == torch.float32
    assert abs(loss.item() - math.log(256)) < 0.2
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in m.parameters())


def test_causal():  # the logits at position t do not depend on tokens after t
    m = make()
    a = torch.randint(256, (1, 16), generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    assert torch.allclose(m(a)[0][:, :10], m(b)[0][:, :10], atol=1e-6)


def test_generate():
    m = make()
    prompt = torch.zeros(2, 3, dtype=torch.long)
    out = m.generate(prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 23) and torch.equal(out[:, :3], prompt)
    again = m.generate(prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)  # same seed, same text: what lets every rank generate together


# ---- data

def test_corpus_is_deterministic_bytes():
    a, b = tg.stdlib_corpus(), tg.stdlib_corpus()
    assert a == b and len(a) == 3_000_000
    assert b"def " in a and b"import " in a


def test_load_data_split(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 40)
    d = tg.load_data(str(path))
    assert d["train"].dtype == torch.uint8 and len(d["train"]) == 9216 and len(d["val"]) == 1024
    assert bytes(torch.cat([d["train"], d["val"]]).tolist()) == path.read_bytes()


def test_get_batch_is_deterministic_and_shifted():
    split = torch.arange(1000) % 251
    split = split.to(torch.uint8)
    x, y = tg.get_batch(split, 4, 8, torch.Generator().manual_seed(0))
    x2, y2 = tg.get_batch(split, 4, 8, torch.Generator().manual_seed(0))
    x3, _ = tg.get_batch(split, 4, 8, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.long
    assert torch.equal(x, x2) and torch.equal(y, y2) and not torch.equal(x, x3)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[:, -1], (x[:, -1] + 1) % 251)


def test_lr_schedule():
    c = type("C", (), dict(lr=1.0, min_lr=0.1, warmup=10, steps=110))
    lrs = [tg.get_lr(s, c) for s in range(111)]
    assert lrs[0] < lrs[9] < 1.0 and abs(lrs[10] - 1.0) < 1e-12 and abs(lrs[110] - 0.1) < 1e-12
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


# ---- training with minizero (fails until minizero.py exists)

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=12, warmup=2, lr=3e-3,
            min_lr=3e-4, eval_interval=6, eval_iters=2, sample_tokens=8)


def test_train_loss_falls_and_stages_agree_bitwise():
    import minizero  # noqa: F401  (imported here so the tests above run without it)
    runs = {stage: launch.run_threads(tg.train, 2, {**TINY, "stage": stage}) for stage in (0, 3)}
    for stage, (r0, r1) in runs.items():
        assert r0["val"][-1][1] < r0["val"][0][1] - 0.3, (stage, r0["val"])
        assert r0["val"] == r1["val"]  # every rank evaluates the same batches with the same weights
        assert r0["train"] != r1["train"]  # ...but trains on batches of its own
        assert r0["sample"] == r1["sample"]
        assert r0["memory"] == r0["formula"]
    assert runs[0][0]["train"] == runs[3][0]["train"] and runs[0][0]["val"] == runs[3][0]["val"]
    assert runs[0][1]["train"] == runs[3][1]["train"]
    assert runs[0][0]["sample"] == runs[3][0]["sample"]
    n, psi = 2, runs[0][0]["n_params"]
    for stage, ratio in ((0, 2), (3, 3)):  # DESIGN.md: 2Ψ for DDP, 3Ψ for stage 3 (within padding)
        sent = sum(v for k, v in runs[stage][0]["comm_per_step"].items() if k in ("reduce_scatter", "all_gather"))
        assert abs(sent / (4 * psi * (n - 1) / n) - ratio) < 0.01, (stage, sent)


def test_save_at_two_ranks_stage3_resume_at_three_ranks_stage1(tmp_path):
    """--out-dir saves at every eval; --resume continues at another world size and stage, at the
    same global batch (grad_accum 3 x 2 ranks, then 2 x 3): the first val loss after resuming
    is the last one before, to the bit, and training goes on."""
    first = launch.run_threads(tg.train, 2, {**TINY, "stage": 3, "steps": 6, "grad_accum": 3,
                                             "out_dir": str(tmp_path)})[0]
    cfg = {**TINY, "stage": 1, "steps": 12, "out_dir": str(tmp_path), "resume": True}
    second = launch.run_threads(tg.train, 3, cfg)[0]
    assert second["train"][0][0] == 6 and second["val"][0] == first["val"][-1]
    assert second["val"][-1][1] < second["val"][0][1]


def test_ds_offload_keys():
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/scratch",
                                                                   "pin_memory": False}}}
    assert ds_config.parse_ds_config(ds) == dict(stage=3, offload="disk", offload_dir="/scratch", pin_memory=False)
    assert ds_config.parse_ds_config({"zero_optimization": {"offload_optimizer": {"device": "none"}}}) == {"offload": None}
    with pytest.raises(ValueError, match="'zero_optimization.offload_optimizer.device' must be"):
        ds_config.parse_ds_config({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})
    for argv, says in [(["--offload", "disk", "--stage", "0"], "stage 0"), (["--offload", "disk"], "--offload-dir")]:
        with pytest.raises(ValueError, match=says):
            tg.check_config(tg.parse_args(argv))


def test_train_with_disk_offload_is_the_same_run(tmp_path):
    """--offload disk: the same loss curve and sample, to the bit, at stage 3; the memory
    lines move the optimizer to disk; no file stays behind."""
    cfg = {**TINY, "stage": 3, "steps": 4, "eval_interval": 2}
    plain = launch.run_threads(tg.train, 2, cfg)[0]
    off = launch.run_threads(tg.train, 2, {**cfg, "offload": "disk", "offload_dir": str(tmp_path)})[0]
    assert (off["train"], off["val"], off["sample"]) == (plain["train"], plain["val"], plain["sample"])
    assert off["memory"]["optimizer"] == 0 < plain["memory"]["optimizer"] and os.listdir(tmp_path) == []


def test_train_batch_size_must_divide_by_world_size():
    from types import SimpleNamespace as C
    assert ds_config.grad_accum_for(C(global_batch=48, batch_size=4, grad_accum=1), 3) == 4
    with pytest.raises(ValueError, match="train_batch_size 50 is not divisible by the micro batch 4 x world size 3"):
        ds_config.grad_accum_for(C(global_batch=50, batch_size=4, grad_accum=1), 3)
    with pytest.raises(ValueError, match="needs grad_accum 4, but gradient_accumulation_steps is 2"):
        ds_config.grad_accum_for(C(global_batch=48, batch_size=4, grad_accum=2), 3)
    assert ds_config.parse_ds_config({"train_batch_size": 48}) == {"global_batch": 48}

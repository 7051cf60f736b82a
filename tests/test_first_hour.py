"""A DeepSpeed, nanoGPT or torch user's first hour: real DeepSpeed configs (tests/ds_configs/,
sources in its SOURCES.md) run as their authors wrote them or are refused in one line; nanoGPT's
flag names and short dtype names work; long work says what it does; the reports are honest."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import train_gpt as tg
from minizero_lib import checkpoint, cli, compiled, ds_config, launch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(HERE, "tests", "ds_configs")
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, steps=4, warmup=2, lr=3e-3,
            min_lr=3e-4, eval_interval=6, eval_iters=2, sample_tokens=8)
ADAMW_FP16 = dict(optimizer="adamw", scale_window=1000, loss_scale=65536.0, dtype="float16")
BATCH = "(micro x accumulation x ranks)"


def cfg_of(ds, *flags, tmp_path=None):
    """The demo's options, checked, for a config given as a dict or a file in tests/ds_configs."""
    path = os.path.join(CONFIGS, ds) if isinstance(ds, str) else tmp_path / "ds.json"
    if not isinstance(ds, str):
        path.write_text(json.dumps(ds))
    return tg.check_config(tg.parse_args(["--config", str(path), *flags]))


# ---- real configs: the options each sets, and the demo's first line


REAL = {
    "hf_transformers_zero2.json": (
        dict(stage=2, offload="cpu", pin_memory=True, optimizer="adamw", scale_window=1000, loss_scale=65536.0,
             min_lr_ratio=1.0),
        f"train_gpt.py: ZeRO stage 2, float32, optimizer state offloaded to host memory (pinned), batch 16 x 1 x 2 "
        f"ranks {BATCH} = 32 sequences of 64"),
    "hf_transformers_zero3.json": (
        dict(ADAMW_FP16, stage=3, offload="cpu", pin_memory=True, offload_params=True, lr=3e-5, betas=(0.8, 0.999),
             eps=1e-8, weight_decay=3e-7, warmup=500, min_lr_ratio=1.0),
        "train_gpt.py: ZeRO stage 3, float16 (loss scale from 65536, x2 after 1000 clean steps), optimizer state "
        f"offloaded to host memory (pinned), parameters offloaded to host memory, batch 16 x 1 x 2 ranks {BATCH} = "
        "32 sequences of 64"),
    "hf_accelerate_zero3_offload.json": (
        dict(ADAMW_FP16, stage=3, offload="cpu", pin_memory=True, offload_params=True, grad_accum=1),
        "train_gpt.py: ZeRO stage 3, float16 (loss scale from 65536, x2 after 1000 clean steps), optimizer state "
        f"offloaded to host memory (pinned), parameters offloaded to host memory, batch 16 x 1 x 2 ranks {BATCH} = "
        "32 sequences of 64"),
    "megatron_ds_zero1_gbs256_mbs8.json": (
        dict(global_batch=256, batch_size=8, stage=1, clip=1.0, scale_window=500, dtype="float16", loss_scale=2048.0),
        "train_gpt.py: ZeRO stage 1, float16 (loss scale from 2048, x2 after 500 clean steps), no offload, batch "
        f"8 x 16 x 2 ranks {BATCH} = 256 sequences of 64"),
    "megatron_ds_zero2_bf16.json": (
        dict(global_batch=96, grad_accum=1, optimizer="adamw", lr=1.5e-4, weight_decay=0.01, stage=2,
             reduce_dtype="bfloat16", clip=1.0, scale_window=1000, dtype="bfloat16"),
        f"train_gpt.py: ZeRO stage 2, bfloat16, no offload, batch 48 x 1 x 2 ranks {BATCH} = 96 sequences of 64"),
    "dse_megatron_zero2.json": (
        dict(global_batch=16, grad_accum=1, stage=2, optimizer="adamw", lr=1.5e-4, clip=1.0, scale_window=1000,
             dtype="float16"),
        "train_gpt.py: ZeRO stage 2, float16 (loss scale from 65536, x2 after 1000 clean steps), no offload, batch "
        f"8 x 1 x 2 ranks {BATCH} = 16 sequences of 64"),
}
REFUSED = {
    "dse_bing_bert_lamb.json": "ds config: 'optimizer.type' is 'Lamb': minizero has no such optimizer: use AdamW "
                               "(Adam), SGD, Adafactor or Muon",
    "dse_cifar.json": "ds config: 'fp16.fp16_master_weights_and_grads' is True: minizero keeps an fp32 master: set it "
                      "false",
    "dse_zero_infinity.json": "ds config: 'zero_optimization.offload_param.device' is 'nvme': parameters offload to "
                              "host memory only: use \"cpu\"",
}


def test_every_config_file_is_tested():
    assert sorted(f for f in os.listdir(CONFIGS) if f.endswith(".json")) == sorted([*REAL, *REFUSED])


@pytest.mark.parametrize("name", sorted(REAL))
def test_a_real_config_sets_its_options_and_the_first_line_says_them(name):
    options, first = REAL[name]
    assert ds_config.parse_ds_config(ds_config.read_json(os.path.join(CONFIGS, name))) == options
    lines = ds_config.banner(cfg_of(name), 2, cuda=False)
    assert lines[0] == first
    assert lines[-1].startswith("  starting the ranks; each builds the model")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_real_config_asking_for_what_minizero_lacks_is_one_line(name, capsys, monkeypatch):
    monkeypatch.setattr(launch, "run_processes", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as e:
        tg.main(["--config", os.path.join(CONFIGS, name)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "" and err == f"train_gpt.py: error: {REFUSED[name]}\n"


def test_auto_takes_the_demos_value_and_knobs_are_listed_once():
    cfg = cfg_of("hf_transformers_zero2.json")
    assert (cfg["dtype"], cfg["lr"], cfg["batch_size"], cfg["warmup"]) == (None, 3e-3, 16, 30)  # the demo's own
    assert cfg["min_lr"] == cfg["lr"]  # WarmupLR: constant after the warmup
    lines = ds_config.banner(cfg, 2, cuda=False)
    assert "  adamw, lr 0.003: warmup 30 steps, then constant, 400 steps, clip 1.0" in lines
    assert ds_config.banner(cfg, 8, cuda=True)[0].startswith("train_gpt.py: ZeRO stage 2, bfloat16,")  # GPU: bf16
    ignored = [line for line in lines if "ignored, no meaning here" in line]
    assert len(ignored) == 1 and ignored[0].count("zero_optimization.overlap_comm") == 1
    auto = [line for line in lines if '"auto"' in line]
    assert len(auto) == 1 and "fp16.enabled, bf16.enabled, optimizer.params.lr" in auto[0]


def test_unknown_keys_are_listed_and_a_near_miss_is_refused(tmp_path):
    cfg = cfg_of({"zero_optimization": {"stage": 1, "stage3_param_persitance_threshold": 1e5}, "my_own_key": 1},
                 tmp_path=tmp_path)
    assert cfg["stage"] == 1
    assert ("  ds config " + str(tmp_path / "ds.json") + ": unknown keys, ignored as DeepSpeed ignores them: "
            "zero_optimization.stage3_param_persitance_threshold, my_own_key") in ds_config.banner(cfg, 2, False)
    for ds, typo, meant in [({"zero_optimisation": {"stage": 3}}, "zero_optimisation.stage", "zero_optimization.stage"),
                            ({"fp16": {"enabeld": True}}, "fp16.enabeld", "fp16.enabled"),
                            ({"optimizer": {"type": "AdamW", "params": {"weight_decya": 0.1}}},
                             "optimizer.params.weight_decya", "optimizer.params.weight_decay"),
                            ({"train_micro_batch_size_per_gpuu": 4}, "train_micro_batch_size_per_gpuu",
                             "train_micro_batch_size_per_gpu")]:
        with pytest.raises(ValueError, match=re.escape(f"unknown key '{typo}': did you mean '{meant}'?")):
            ds_config.parse_ds_config(ds)


@pytest.mark.parametrize("ds, says", [
    ({"pipeline": {"stages": 4}}, "'pipeline.stages': pipeline is not in minizero"),
    ({"tensor_parallel": {"autotp_size": 2}}, "'tensor_parallel.autotp_size' is 2: tensor or sequence parallelism"),
    ({"sequence_parallel_size": 4}, "'sequence_parallel_size' is 4"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}}, "'activation_checkpointing.cpu_checkpointing' is True"),
    ({"sparse_attention": {"mode": "fixed"}}, "'sparse_attention.mode': sparse_attention is not in minizero"),
    ({"optimizer": {"type": "OneBitAdam"}}, "'optimizer.type' is 'OneBitAdam'"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, "'optimizer.params.nesterov'"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0}}}, "'scheduler.type' is 'OneCycle'"),
    ({"fp16": {"enabled": True, "loss_scale": 1024}}, "'fp16.loss_scale' is 1024: a static scale"),
    ({"curriculum_learning": {"enabled": True}}, "'curriculum_learning.enabled' is True"),
    ({"communication_data_type": "fp8"}, "'communication_data_type' must be 'fp32', 'fp16' or 'bf16'"),
])
def test_what_minizero_does_not_do_is_refused_naming_the_key(ds, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        ds_config.parse_ds_config(ds)


def test_the_same_keys_asking_for_what_minizero_does_are_accepted():
    assert ds_config.parse_ds_config({
        "tensor_parallel": {"autotp_size": 1}, "activation_checkpointing": {"cpu_checkpointing": False},
        "curriculum_learning": {"enabled": False}, "fp16": {"loss_scale": 0},
        "optimizer": {"params": {"amsgrad": False, "bias_correction": True}}}) == {}


def test_honoured_keys_reach_the_demos_options(tmp_path):
    ds = {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 200, "hysteresis": 2,
                   "min_loss_scale": 1},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "mics_shard_size": 2},
          "communication_data_type": "fp32", "train_batch_size": 64, "gradient_accumulation_steps": 2}
    cfg = cfg_of(ds, "--world-size", "2", tmp_path=tmp_path)
    assert (cfg["loss_scale"], cfg["scale_window"], cfg["offload_params"], cfg["shard_size"]) == (4096, 200, True, 2)
    assert (cfg["reduce_dtype"], cfg["batch_size"], cfg["grad_accum"]) == ("float32", 16, 2)  # 64 = 16 x 2 x 2
    assert ds_config.banner(cfg, 2, False)[0].startswith(
        "train_gpt.py: ZeRO stage 3, float16 (loss scale from 4096, x2 after 200 clean steps) (gradients reduced in "
        f"float32), parameters offloaded to host memory, batch 16 x 2 x 2 ranks {BATCH} = 64")
    with pytest.raises(ValueError, match="--offload-params .* use --stage 3"):
        cfg_of({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, tmp_path=tmp_path)


@pytest.mark.parametrize("sched, lr, expect", [
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"}},
     None, dict(lr=1e-3, min_lr=1e-3, warmup=10, steps=400)),
    ({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "warmup_min_lr": 1e-5, "total_num_steps": 100}},
     None, dict(lr=1e-3, min_lr=1e-5, warmup=30, steps=100)),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5, "cos_min_ratio": 0.1}},
     2e-3, dict(lr=2e-3, min_lr=2e-4, warmup=5, steps=50)),
])
def test_a_warmup_scheduler_is_the_demos_warmup_and_decay(tmp_path, sched, lr, expect):
    ds = {"scheduler": sched, **({"optimizer": {"type": "AdamW", "params": {"lr": lr}}} if lr else {})}
    cfg = cfg_of(ds, tmp_path=tmp_path)
    assert {k: cfg[k] for k in expect} == pytest.approx(expect)
    assert ("linear decay runs as the demo's cosine" in "\n".join(ds_config.banner(cfg, 2, False))) == \
        (sched["type"] == "WarmupDecayLR")


def test_a_config_lr_without_a_schedule_keeps_the_demos_ratio_to_min_lr():
    cfg = cfg_of("dse_megatron_zero2.json")
    assert cfg["min_lr"] == pytest.approx(cfg["lr"] / 10)  # the demo's 3e-4 / 3e-3, not above the lr


# ---- nanoGPT's names, dtypes, and no abbreviations


def test_nanogpt_flag_names_in_both_forms():
    cfg = tg.parse_args(["--max_iters=7", "--learning_rate", "0.01", "--gradient_accumulation_steps=2",
                         "--grad_clip=0.5", "--warmup_iters", "3", "--n_layer=2", "--n_head", "2", "--n_embd=64",
                         "--block_size=32", "--batch_size=4", "--eval_interval=5", "--eval_iters", "2",
                         "--weight_decay=0.05", "--min_lr=1e-4", "--dropout=0.1", "--compile=False"])
    assert {k: cfg[k] for k in ("steps", "lr", "grad_accum", "clip", "warmup", "n_layer", "n_head", "n_embd",
                                "block_size", "batch_size", "eval_interval", "eval_iters", "weight_decay",
                                "min_lr", "dropout", "compile")} == dict(
        steps=7, lr=0.01, grad_accum=2, clip=0.5, warmup=3, n_layer=2, n_head=2, n_embd=64, block_size=32,
        batch_size=4, eval_interval=5, eval_iters=2, weight_decay=0.05, min_lr=1e-4, dropout=0.1, compile=False)
    dashes = tg.parse_args(["--max-iters", "7", "--learning-rate=0.01", "--gradient-accumulation-steps", "2"])
    assert (dashes["steps"], dashes["lr"], dashes["grad_accum"]) == (7, 0.01, 2)
    assert tg.parse_args(["--compile"])["compile"] is True and tg.parse_args(["--compile=True"])["compile"] is True


@pytest.mark.parametrize("short, long", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_dtype_names_short_and_long_everywhere(short, long, capsys):
    assert tg.parse_args(["--dtype", short])["dtype"] == tg.parse_args(["--dtype", long])["dtype"] == long
    planned = []
    for name in (short, long):
        cli.main(["--params", "1e9", "--world-size", "8", "--dtype", name])
        planned.append(capsys.readouterr().out)
    assert planned[0] == planned[1] and f"{long} compute" in planned[0]
    assert ds_config.dtype_arg(short.upper()) == long


@pytest.mark.parametrize("main, argv", [
    (tg.parse_args, ["--ste", "3"]),  # not --steps
    (tg.parse_args, ["--dtype", "fp8"]),
    (cli.main, ["--param", "1e9", "--world-size", "8"]),  # not --params
    (cli.check_main, ["example_check.py", "--world-size", "2"]),  # not --world-sizes
])
def test_a_typo_is_an_error_not_another_flag(main, argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


# ---- help and entry points


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["consolidate", "--help"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage:")
    if argv == ["--help"]:  # the planner's help lists the other commands
        assert "python minizero.py check FILE.py" in out and "python minizero.py consolidate" in out


def test_the_planner_says_which_stages_do_not_fit(capsys):
    cli.main(["--params", "7.5e9", "--world-size", "64", "--memory", "80GB"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "does not fit in 80 GB per rank (model state alone): stage 0 (120.00 GB)"
    cli.main(["--params", "1e9", "--world-size", "8", "--memory", "1TB"])
    assert capsys.readouterr().out.splitlines()[-1] == "every stage fits in 1e+03 GB per rank (model state alone)"


def test_init_from_env_without_torchrun_names_the_ways_to_start(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun.*launch.run_processes.*launch.run_threads"):
        launch.init_from_env()


def test_consolidate_takes_the_newest_checkpoint_of_an_out_dir(tmp_path, capsys):
    small = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, batch_size=2, eval_iters=1, sample_tokens=1)
    launch.run_threads(tg.train, 1, {**small, "steps": 2, "eval_interval": 1, "out_dir": str(tmp_path / "run")})
    capsys.readouterr()
    newest = checkpoint.checkpoints(str(tmp_path / "run"))[0]
    for argv in (["--out-dir", str(tmp_path / "run"), str(tmp_path / "a.pt")], [str(tmp_path / "run"),
                                                                               str(tmp_path / "b.pt")]):
        cli.main(["consolidate", *argv])
        out = capsys.readouterr().out.splitlines()
        assert out[0] == f"consolidating {newest} (training step 2): reading every shard..."
        assert out[1].startswith("wrote ")
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- progress and honest reports


def test_check_says_what_runs_and_what_finished(tmp_path, capsys):
    path = tmp_path / "tiny_model.py"
    path.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def make_model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        def make_batch(step, rank, micro):
            return (torch.randn(5, 4, generator=torch.Generator().manual_seed(step * 10 + rank)),)
        def loss_fn(model, batch):
            return model(*batch).pow(2).mean()
    """))
    assert cli.check_main([str(path), "--world-sizes", "1", "--stages", "0,2", "--steps", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "check: 2 runs; now world size 1, stage 0..."
    assert out[1].startswith("check: world size 1, stage 0: held to torch, ")
    assert out[1].endswith(" s (1 of 2); now world size 1, stage 2...")
    assert out[2].startswith("check: world size 1, stage 2: agrees, ") and out[2].endswith(" s (2 of 2)")
    assert out[-2] == "all stages agree"  # the verdict, as before, then the seconds


def test_the_demo_prints_what_it_took_before_any_rank_starts(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(launch, "run_processes", lambda *a, **k: started.append(capsys.readouterr().out))
    tg.main(["--stage", "1", "--dtype", "bf16", "--world-size", "3", "--grad-accum", "2"])
    lines = started[0].splitlines()
    assert lines[0] == (f"train_gpt.py: ZeRO stage 1, bfloat16, no offload, batch 16 x 2 x 3 ranks {BATCH} = 96 "
                        "sequences of 64")
    assert lines[-1].startswith("  starting the ranks")


def test_compile_says_so_before_it_compiles(monkeypatch, capsys):
    monkeypatch.setattr(compiled, "compile_units", lambda *a, **k: print("COMPILED"))
    launch.run_threads(tg.train, 1, {**TINY, "steps": 0, "compile": True})
    out = capsys.readouterr().out
    assert "compiling each block (the first step takes ~20 s)...\nCOMPILED" in out


def test_fp16_bytes_are_those_of_a_step_taken():
    """A loss scale too large for fp16 skips the first steps, which send no all_gather at stage 1;
    the bytes line is of the first step taken (the README's table: reduce-scatter + all-gather)."""
    r = launch.run_threads(tg.train, 2, {**TINY, "stage": 1, "dtype": "float16", "loss_scale": 2.0 ** 18})[0]
    assert 1 <= r["skipped"] < TINY["steps"]
    assert r["comm_per_step"]["all_gather"] == r["comm_per_step"]["reduce_scatter"] > 0


def test_a_resumed_run_with_nothing_left_says_so(tmp_path, capsys):
    small = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, batch_size=2, eval_iters=1, sample_tokens=1,
                 eval_interval=2, out_dir=str(tmp_path))
    launch.run_threads(tg.train, 1, {**small, "steps": 2})
    capsys.readouterr()
    launch.run_threads(tg.train, 1, {**small, "steps": 2, "resume": True})
    out = capsys.readouterr().out
    assert "nothing left to train: the checkpoint is at step 2 of --steps 2" in out and "nan" not in out


def test_a_real_config_runs_end_to_end():
    """The demo itself (2 gloo processes) on Hugging Face's ZeRO-3 config: fp16 with its loss
    scale, the optimizer and the parameters offloaded, its WarmupLR; the first line is the banner."""
    run = subprocess.run([sys.executable, "train_gpt.py", "--config", os.path.join(CONFIGS, "hf_transformers_zero3.json"),
                          "--steps", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
                          "--batch-size", "4", "--eval-iters", "1", "--sample-tokens", "4"],
                         cwd=HERE, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == ("train_gpt.py: ZeRO stage 3, float16 (loss scale from 65536, x2 after 1000 clean steps), "
                        "optimizer state offloaded to host memory (pinned), parameters offloaded to host memory, "
                        f"batch 4 x 1 x 2 ranks {BATCH} = 8 sequences of 16")
    assert any(line.startswith("  offloaded per rank to cpu") for line in lines)
    assert any(line.startswith("bytes sent per step by rank 0: all_gather") for line in lines)

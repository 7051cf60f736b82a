"""
Faults and bad input: no rank outlives its launcher, the rank that died is the one named,
and every user error of the three command lines is one line naming the fix, found before
any rank starts; and an install that ships every module. (Checkpoint faults are in
test_checkpoint.py.)
"""
import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from minizero_lib import cli, planner
import minizero
from minizero_lib import launch
import ops
import train_gpt as tg

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TINY = ["--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8", "--batch-size", "2",
        "--eval-iters", "1", "--sample-tokens", "1"]


# -----------------------------------------------------------------------------
# process lifecycle: a real launcher, signalled (Linux: ranks are found in /proc)


def ranks_of(pid):
    """The rank processes that `pid` spawned (not multiprocessing's resource tracker)."""
    kids = "".join(open(f"/proc/{pid}/task/{t}/children").read() for t in os.listdir(f"/proc/{pid}/task"))
    return [int(k) for k in kids.split() if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]


def alive(pid):  # a zombie is dead: nobody may have reaped it yet
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks in /proc")
@pytest.mark.parametrize("sig, status, last_line", [
    (signal.SIGTERM, 143, "train_gpt.py: stopped by SIGTERM; killing every rank"),
    (signal.SIGINT, 130, "train_gpt.py: interrupted; every rank was stopped"),
    (signal.SIGKILL, -9, None),  # the launcher cannot act: the ranks must notice themselves
])
def test_no_rank_outlives_its_launcher(tmp_path, sig, status, last_line):
    (tmp_path / "data.txt").write_bytes(bytes(range(256)) * 8)
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    launcher = subprocess.Popen([sys.executable, "train_gpt.py", "--steps", "1000000", "--eval-interval", "1000000",
                                 "--data", str(tmp_path / "data.txt"), *TINY], cwd=HERE, stdout=out, stderr=err,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    ranks = []
    try:
        deadline = time.monotonic() + 60
        while "step 0: val loss" not in (tmp_path / "out").read_text():  # every rank is training
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.1)
        ranks = ranks_of(launcher.pid)
        assert len(ranks) == 2
        launcher.send_signal(sig)
        gone = time.monotonic() + 5
        while any(map(alive, ranks)) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not any(map(alive, ranks)), f"ranks {[r for r in ranks if alive(r)]} outlived the launcher by 5 s"
        assert launcher.wait(timeout=10) == status
        stderr = (tmp_path / "err").read_text()
        if last_line:
            assert stderr.strip().splitlines()[-1] == last_line and "Traceback" not in stderr, stderr
    finally:
        for pid in [launcher.pid] + [r for r in ranks if alive(r)]:  # leave no stray on a failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


# -----------------------------------------------------------------------------
# the right rank blamed (run_processes needs these at the top level)


def _killed_while_peer_sends(comm):
    ops.all_reduce(torch.ones(2), comm)
    if comm.rank == 0:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(500):  # raw gloo, as a user's fn may call it: 'Connection reset by peer' at once
        dist.isend(torch.ones(1), 0)
        time.sleep(0.01)


def _raises_while_peer_sends(comm):
    ops.all_reduce(torch.ones(2), comm)
    if comm.rank == 1:
        raise KeyError("planted on rank 1")
    time.sleep(1.0)  # rank 1 has raised and left: the next send finds the connection closed
    for _ in range(200):
        comm.exchange(torch.ones(1), 1, None, None)
        time.sleep(0.01)


def test_the_rank_killed_is_named_not_the_survivor():
    with pytest.raises(RuntimeError) as info:
        launch.run_processes(_killed_while_peer_sends, 2)
    assert str(info.value) == "rank 0 was killed by signal 9 (SIGKILL)"


def test_a_closed_connection_is_second_hand():
    """gloo raises at the send itself once the peer is gone: that is a PeerFailed too, so the
    rank that raised first-hand is named."""
    with pytest.raises(RuntimeError, match=r"^rank 1 failed: KeyError: 'planted on rank 1'"):
        launch.run_processes(_raises_while_peer_sends, 2)


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one(world_size):
    for run in (launch.run_threads, launch.run_processes):
        with pytest.raises(ValueError, match=f"world_size must be at least 1 .*; got {world_size}"):
            run(lambda comm: None, world_size)


# -----------------------------------------------------------------------------
# train_gpt.py: the user's options, checked before any rank starts


def one_line_error(capsys, main, argv, prog):
    """main(argv) exits 2 with one line on stderr, argparse's way, and prints nothing else."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == "" and err.count("\n") == 1, (info.value.code, out, err)
    assert err.startswith(f"{prog}: error: ")
    return err


@pytest.fixture
def files(tmp_path, monkeypatch):
    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch, "run_processes", no_ranks)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"x" * 300)  # val split: 30 bytes < block_size + 1
    (tmp_path / "bad.json").write_text('{\n  "zero_optimization": {"stage": 2,}\n}\n')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "unknown.json").write_text('{"zero_optimization": {"stgae": 2, "overlap_comm": true}}')
    (tmp_path / "a_file").write_text("")
    return tmp_path


@pytest.mark.parametrize("argv, says", [
    ("--world-size 0", "--world-size must be at least 1; got 0"),
    ("--world-size -1", "--world-size must be at least 1; got -1"),
    ("--steps -1", "--steps must be at least 0"),
    ("--eval-interval 0", "--eval-interval must be at least 1"),
    ("--batch-size 0", "--batch-size must be at least 1"),
    ("--n-layer 0", "--n-layer must be at least 1"),
    ("--block-size -3", "--block-size must be at least 1"),
    ("--grad-accum 0", "--grad-accum must be at least 1"),
    ("--eval-iters 0", "--eval-iters must be at least 1"),
    ("--lr nan", "--lr must be at least 0; got nan"),
    ("--n-head 3", "--n-embd 128 must be a multiple of --n-head 3"),
    ("--data {d}/missing.txt", "--data {d}/missing.txt: No such file or directory"),
    ("--data {d}", "Is a directory"),
    ("--data {d}/empty.txt", "has 0 bytes"),
    ("--data {d}/short.txt", "have 270 and 30, but --block-size 64 needs 65 in each; give a file of at least 650"),
    ("--config {d}/missing.json", "--config {d}/missing.json: No such file or directory"),
    ("--config {d}/bad.json", "--config {d}/bad.json is not valid JSON: line 2"),
    ("--config {d}/list.json", "holds a JSON list; a DeepSpeed config is an object"),
    ("--config {d}/unknown.json", "unknown key 'zero_optimization.stgae': did you mean 'zero_optimization.stage'?"),
    ("--out-dir {d}/a_file/ckpt", "--out-dir {d}/a_file/ckpt cannot be created or written"),
    ("--resume", "--resume needs --out-dir"),
])
def test_train_gpt_user_errors_are_one_line(capsys, files, argv, says):
    err = one_line_error(capsys, tg.main, argv.format(d=files).split(), "train_gpt.py")
    assert says.format(d=files) in err


def test_resume_past_the_last_step(tmp_path, capsys, files):
    """A checkpoint at the last step resumes (a restart after the end: nothing to train); past it, one line."""
    small = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, batch_size=2, eval_iters=1, sample_tokens=1)
    launch.run_threads(tg.train, 1, {**small, "steps": 2, "eval_interval": 2, "out_dir": str(tmp_path)})
    capsys.readouterr()
    argv = ["--resume", "--out-dir", str(tmp_path), "--world-size", "1", *TINY[:10]]
    err = one_line_error(capsys, tg.main, [*argv, "--steps", "1"], "train_gpt.py")
    assert "is at step 2, and --steps is 1; give --steps of at least 2" in err
    for steps in (2, 3):
        assert tg.check_config(tg.parse_args([*argv, "--steps", str(steps)]))["steps"] == steps


def test_train_gpt_command_line_error_has_no_traceback():
    run = subprocess.run([sys.executable, "train_gpt.py", "--eval-interval", "0"], cwd=HERE,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == "train_gpt.py: error: --eval-interval must be at least 1; got 0\n"


# -----------------------------------------------------------------------------
# the planner and consolidate: python minizero.py ...


@pytest.mark.parametrize("argv, says", [
    ("--params 0 --world-size 8", "finite number >= 1, like --params 7.5e9; got 0.0"),
    ("--params -5 --world-size 8", "got -5.0"),
    ("--params nan --world-size 8", "got nan"),
    ("--params inf --world-size 8", "got inf"),
    ("--params 1e9 --world-size 0", "the world size must be at least 1 rank; got 0"),
    ("--params 1e9 --world-size -2", "got -2"),
    ("--params 1e9 --world-size 8 --memory 0GB", "positive size, like --memory 80GB; got 0 B"),
    ("--params 1e9 --world-size 8 --memory -80", "got -8e+10 B"),
    ("--params 1e9 --world-size 8 --memory 80XB", "--memory '80XB' is not a size"),
    ("--params 1e9 --world-size 8 --memory 80GG", "the unit must be one of B, KB, MB, GB, TB"),
])
def test_planner_bad_input_is_one_line(capsys, argv, says):
    assert says in one_line_error(capsys, cli.main, argv.split(), "minizero.py")


def test_planner_memory_units(capsys):
    for text, n in [("80GB", 80e9), ("80GiB", 80 * 2**30), ("1TB", 1e12), ("512MB", 512e6),
                    ("1.5TiB", 1.5 * 2**40), ("80", 80e9), ("80gb", 80e9), ("2048 KiB", 2**21)]:
        assert planner.parse_bytes(text) == n, text
    cli.main(["--params", "7.5e9", "--world-size", "64", "--memory", "80GiB"])
    assert capsys.readouterr().out.splitlines()[2].endswith(f"{80 * 2**30 / 16:.3g} parameters")


@pytest.mark.parametrize("params, world_size", [(1e15, 1), (1e15, 3), (7.5e9, 64), (1, 1)])
def test_planner_columns_never_run_together(params, world_size):
    lines = planner.plan(params, world_size, torch.float32, memory=1e12)
    assert lines[1].split()[:6] == ["stage", "params", "grads", "optimizer", "total/rank", "sent/step"]
    numel = -(-int(params) // world_size) * world_size
    for stage, line in enumerate(lines[2:]):
        cells = line.split()
        b = minizero.model_state_bytes(numel, world_size, stage, torch.float32)
        assert cells[0] == str(stage) and cells[7] == "parameters"
        assert [float(c) for c in cells[1:5]] == [round(x / 1e9, 2) for x in (b["params"], b["grads"], b["optimizer"], sum(b.values()))]


def test_consolidate_bad_paths_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    for argv, says in [(["ckpt", "missing/model.pt"], f"the directory {tmp_path / 'missing'} does not exist"),
                       (["ckpt", "ckpt"], f"OUT ckpt is a directory; give a file name, like {os.path.join('ckpt', 'model.pt')}"),
                       (["ckpt", "model.pt"], "no complete checkpoint in ckpt"),
                       (["ckpt"], "usage: python minizero.py consolidate CHECKPOINT_DIR OUT.pt")]:
        assert says in one_line_error(capsys, cli.main, ["consolidate", *argv], "minizero.py")
    assert not (tmp_path / "model.pt").exists()


def test_train_gpt_with_more_processes_than_gpus_is_one_line(monkeypatch, capsys):
    """torchrun --nproc_per_node above the GPUs this node shows: LOCAL_RANK names none (torch.cuda mocked)."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as e:
        tg.main(["--steps", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("train_gpt.py: error: LOCAL_RANK is 3 but this process sees 2 GPU(s)")


def test_gpu_check_cpu_mode_hides_the_gpus(tmp_path):
    """`bash gpu_check.sh --cpu` must run on the CPU where a GPU is present too: every python
    it starts sees no GPU (CUDA_VISIBLE_DEVICES=""). A stub python records what each saw."""
    seen = tmp_path / "seen"
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "[${{CUDA_VISIBLE_DEVICES-unset}}]" >> {seen}\n')
    stub.chmod(0o755)
    out = subprocess.run(["bash", os.path.join(HERE, "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHON": str(stub), "GPU_CHECK_LOGS": str(tmp_path / "logs"),
                                          "CUDA_VISIBLE_DEVICES": "0"})
    assert "gpu_check (cpu," in out.stdout
    calls = seen.read_text().split()
    assert len(calls) >= 5 and set(calls) == {"[]"}, calls  # torch's version, equivalence, 2 trainings, bench


def test_pip_install_ships_every_module_the_library_imports():
    """`pip install .` (not -e) ships only pyproject's py-modules and its one package: a
    module they import that is missing there installs a minizero whose Engine fails to import."""
    with open(os.path.join(HERE, "pyproject.toml")) as f:
        text = f.read()
    listed = set(re.findall(r'"(\w+)"', re.search(r"py-modules = \[(.*?)\]", text).group(1)))
    package = re.search(r'packages = \["(\w+)"\]', text).group(1)
    local = {f[:-3] for f in os.listdir(HERE) if f.endswith(".py")} | {package}
    files = [name + ".py" for name in listed] + [os.path.join(package, f)
                                                  for f in os.listdir(os.path.join(HERE, package)) if f.endswith(".py")]
    for name in files:
        with open(os.path.join(HERE, name)) as f:
            tree = ast.parse(f.read())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
                   {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert imported & local <= listed | {package}, f"{name} imports {sorted(imported & local - listed)}"


@pytest.mark.parametrize("optimizer, k, gathered", [("adamw", 12, 0), ("sgd", 8, 0), ("muon", 8, 2), ("adafactor", 4, 8)])
def test_planner_optimizers(capsys, optimizer, k, gathered):
    """Bytes per parameter beside params and grads in 16-bit: the fp32 master and the state
    (AdamW 12, SGD with momentum and Muon 8, Adafactor's factored moments counted 0: 4);
    Muon and Adafactor all-gather what they read of whole tensors at stages 1-3."""
    cli.main(["--params", "1e9", "--world-size", "10", "--optimizer", optimizer])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [float(r[3]) for r in rows] == [k, k / 10, k / 10, k / 10]  # GB of optimizer per rank, 1e9 params
    sent = [float(r[5]) for r in rows]
    assert [round(b - a, 2) for a, b in zip(sent[:1] * 4, sent)][1:] == [round(x, 2) for x in (
        0.9 * gathered, 0.9 * gathered, 0.9 * gathered + 1.8)]  # stage 3 also gathers params twice

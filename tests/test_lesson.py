"""
The lesson stands on its own: ops.py imports nothing of the project, minizero.py only ops (at
module level), `import minizero` loads no module of minizero_lib, and a run that asks for no
feature loads none of the features; DDP and ZeRO 1-3 run on ops' own thread ranks
(ops.run_threads) and agree to the bit.
"""
import ast
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import minizero
import ops

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = {"ops", "minizero", "minizero_lib", "train_gpt", "bench"}
FEATURES = ["quantize", "offload", "writer", "compiled", "resume", "cli", "check", "referee",
            "report", "plots", "ds_config", "checkpoint", "features", "hybrid", "optimizers",
            "scaler", "formulas"]


def module_imports(path):
    """The top-level names a file imports at module level (not inside functions)."""
    names = set()
    for node in ast.parse(open(os.path.join(HERE, path)).read()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_ops_is_the_ground_floor_and_minizero_stands_on_it_alone():
    assert module_imports("ops.py") & PROJECT == set()
    assert module_imports("minizero.py") & PROJECT == {"ops"}


def loaded(code):
    """The minizero_lib modules a fresh interpreter has loaded after running code."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(sorted(m for m in "
                          "sys.modules if m.startswith('minizero_lib.')))"],
                         cwd=HERE, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_import_minizero_loads_no_supporting_module():
    assert loaded("import minizero, ops") == []


def test_a_plain_run_loads_no_feature():
    """Stage 3, bf16, accumulation, clipping on ops' thread ranks: only the engine's checks
    (user_model.py) load; a feature keyword loads features.py."""
    run = ("import torch, minizero, ops\n"
           "def body(comm, kw):\n"
           "    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))\n"
           "    e = minizero.Engine(m, comm, 3, dtype=torch.bfloat16, grad_accum=2, clip=1.0, **kw)\n"
           "    for _ in range(2):\n"
           "        e.backward(m(torch.ones(2, 4)).float().sum())\n"
           "    e.step()\n"
           "ops.run_threads(body, 2, {})")
    plain = loaded(run)
    assert plain == ["minizero_lib.user_model"]
    assert [m for m in FEATURES if f"minizero_lib.{m}" in plain] == []
    assert "minizero_lib.features" in loaded(run.replace("{})", "dict(reduce_every='step'))"))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 11)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.cross_entropy(self.head(h).float().flatten(0, 1), x.flatten())


def train(comm, stage, dtype):
    g = torch.Generator().manual_seed(0)  # (threads share torch's global RNG: not that one)
    model = Net()
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g)
    engine = minizero.Engine(model, comm, stage, lr=0.05, weight_decay=0.1, dtype=dtype,
                             grad_accum=2, clip=0.5)
    for step in range(3):
        for micro in range(2):
            x = torch.randint(0, 11, (2, 5), generator=g.manual_seed(step * 10 + micro + comm.rank))
            engine.backward(model(x))
        engine.step()
    return engine.full_state_dict()


def test_the_lesson_runs_on_ops_thread_ranks_and_every_stage_is_ddps_bits():
    for dtype in (torch.float32, torch.bfloat16):
        ddp = ops.run_threads(train, 3, 0, dtype)
        assert all(torch.equal(ddp[0][k], r[k]) for r in ddp for k in ddp[0])  # every rank alike
        for stage in (1, 2, 3):
            zero = ops.run_threads(train, 3, stage, dtype)
            assert all(torch.equal(ddp[0][k], zero[1][k]) for k in ddp[0]), (dtype, stage)

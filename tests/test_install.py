"""What `pip install` puts on the path: minizero and ops, and one package of the project's
own name, so a user's own files (a DETR-style engine.py, a checkpoint.py) never shadow it."""
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
USERS_FILES = ["engine", "check", "checkpoint", "cli", "optimizers", "launch", "stages", "plots", "flight",
               "offload", "referee", "report"]


def test_a_users_own_files_do_not_shadow_the_library(tmp_path):
    """From a folder with its own engine.py, checkpoint.py, ...: import minizero, train a step
    at stage 3 on two thread ranks, save and read a checkpoint."""
    for name in USERS_FILES:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    script = textwrap.dedent("""
        import torch
        import minizero
        from minizero_lib import launch

        def body(comm, path):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            engine = minizero.Engine(model, comm, 3, lr=0.1)
            engine.backward(model(torch.ones(2, 4)).sum())
            engine.step()
            engine.save_checkpoint(path)
            return sorted(engine.full_state_dict())

        names = launch.run_threads(body, 2, "ckpt")[0]
        print(names, sorted(minizero.read_checkpoint("ckpt")[1]))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    assert "['0.bias', '0.weight', '2.bias', '2.weight']" in out.stdout

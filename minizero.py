"""
minizero: data-parallel training with the Zero Redundancy Optimizer, DDP (stage 0) and
ZeRO stages 1, 2 and 3, on PyTorch. This file is the library's face, above its layers:

    stages.py   what ZeRO computes: the layout, the stages as functions, the formulas
    engine.py   Engine: wires those functions to autograd's hooks
    check.py    check: every stage against stage 0's bits and against torch, on your model
    cli.py      the command line below

    engine = minizero.Engine(model, comm, stage=3, lr=3e-4)       # README.md: the whole loop
    report = minizero.check(make_model, make_batch)               # the proof, on your model

    python minizero.py --params 7.5e9 --world-size 64 [--memory 80GB] [--offload disk]
    python minizero.py consolidate CHECKPOINT_DIR OUT.pt
    python minizero.py check FILE.py [--world-sizes 1,2,3,4] [--dtype bf16] ...
"""
import sys

from minizero_lib.check import check  # noqa: F401
from minizero_lib.checkpoint import consolidate, read_checkpoint  # noqa: F401
from minizero_lib.engine import Engine  # noqa: F401
# noqa: F401
from minizero_lib.formulas import (comm_bytes_per_step, model_state_bytes, offloaded_bytes,
                                   peak_memory)

if __name__ == "__main__":  # the planner, consolidate and check
    from minizero_lib.cli import main
    main(sys.argv[1:])

"""Hypothesis profiles: 'ci' (set when CI=true) keeps the whole suite to a few minutes
on 2 cores; 'dev' is the default; 'thorough' draws many more cases; 'quick' is
gpu_check.sh's, a few cases inside its time limit. MINIZERO_STRICT_P2P=1 runs every thread
world under NCCL's point-to-point rules (launch.run_threads(strict_p2p=True)), as gpu_check.sh does.
Tests marked `mutations` (the whole mutation list, test_mutations.py) run only when asked
for: pytest -m mutations."""
import os

import pytest
from hypothesis import HealthCheck, settings

common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=200, derandomize=True, **common)
settings.register_profile("dev", max_examples=100, **common)
settings.register_profile("thorough", max_examples=1000, **common)
settings.register_profile("quick", max_examples=20, derandomize=True, **common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

if os.environ.get("MINIZERO_STRICT_P2P") == "1":
    from minizero_lib import launch

    _run_threads = launch.run_threads
    launch.run_threads = lambda fn, world_size, *args, **kw: _run_threads(fn, world_size, *args,
                                                                          **{**kw, "strict_p2p": True})


def pytest_collection_modifyitems(config, items):
    if "mutations" not in (config.option.markexpr or ""):
        skip = pytest.mark.skip(reason="the whole mutation list: pytest -m mutations, or python test_mutations.py")
        for item in items:
            if "mutations" in item.keywords:
                item.add_marker(skip)

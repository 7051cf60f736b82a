"""
The suite must be able to fail: each mutant below is a one-line bug planted in the source
(the line replaced in the function's own text, compiled and swapped in, in this process)
and the test named beside it must fail with it, in seconds. Bugs every stage shares are
the ones stage-against-stage bits cannot see, so most of these are that kind.

    python -m pytest -q test_mutations.py           # the quick subset (the default run, CI)
    python -m pytest -q test_mutations.py -m mutations   # every mutant
    python test_mutations.py                        # every mutant, as a table: killed by, seconds

A mutant whose line is no longer in the source fails too (the source moved: update it).
"""
import importlib
import inspect
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import Phase, settings

# every module of the project, imported before any mutant is planted: one imported while a
# mutant is in would keep the mutant for good
import minizero  # noqa: F401
from minizero_lib import check, checkpoint, cli, features, optimizers, writer  # noqa: F401

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
settings.register_profile("mutations", parent=settings.get_profile("ci"), database=None,
                          phases=[Phase.explicit, Phase.generate])  # the first failure is enough: no shrinking
PROPERTY = "test_equivalence.py::test_stages_are_bit_identical_to_ddp_and_ddp_is_torch"


class Mutant(NamedTuple):
    name: str     # what the bug is
    target: str   # "module:function" or "module:Class.method" whose source changes
    old: str      # a piece of one line of it, found exactly once
    new: str      # what replaces it
    killer: str   # the test that must fail: "file.py::test_name" or "file.py::test_name[param=value]"
    quick: bool = False  # in the default run


MUTANTS = [
    # the list: each passed the whole suite before it was mended
    Mutant("decay mask ignored (biases and norms decayed)", "minizero:runs",
           "hp.weight_decay if u.decays[p.i] else 0.0", "hp.weight_decay",
           "test_check.py::test_a_decay_mask_is_held_to_torchs_param_groups", quick=True),
    Mutant("no initial broadcast of the unit (ranks keep their own values)", "minizero:Unit",
           "broadcast(self.flat, comm)", "(self.flat, comm)",
           "test_check.py::test_a_correct_engine_passes", quick=True),
    Mutant("AdamW without eps (NaN where a gradient is 0)", "minizero:adamw",
           "math.sqrt(1 - beta2 ** t), eps,", "math.sqrt(1 - beta2 ** t), 0.0,", "test_check.py::test_a_correct_engine_passes", quick=True),
    Mutant("skips in a row never reset", "minizero:Engine.step",
           "self.t, self.skips_in_row = self.t + 1, 0", "self.t = self.t + 1", "test_models.py::test_skips_not_in_a_row_never_reach_the_limit",
           quick=True),
    Mutant("no buffer broadcast before forward", "minizero:Engine._before_forward",
           "if self.buffers and torch.is_grad_enabled():", "if False:",
           "test_check.py::test_batchnorm_agrees_with_the_buffer_broadcast", quick=True),
    Mutant("a whole extra row of padding per unit", "minizero:layout",
           "padded = -(-sum(sizes) // multiple) * multiple",
           "padded = (-(-sum(sizes) // multiple) + 1) * multiple",
           "test_check.py::test_a_correct_engine_passes", quick=True),
    Mutant("offload='cpu': stage 3's fp32 shard not refreshed from the host master", "minizero:share_params",
           "elif shard is not master:", "elif shard.dtype != torch.float32:",
           "test_offload.py::test_cpu_offload_runs_its_host_path_on_a_cpu_run[dtype=fp32]", quick=True),
    Mutant("offload='cpu': the host master left out of offloaded()", "minizero_lib.formulas:offloaded_held",
           "[u.master, *(u.state or {}).values()] if", "[*(u.state or {}).values()] if",
           "test_offload.py::test_cpu_offload_runs_its_host_path_on_a_cpu_run[dtype=fp32]"),
    # more of AdamW, clipping and the mean
    Mutant("no bias correction of m", "minizero:adamw",
           "lr / (1 - beta1 ** t)", "lr", "test_check.py::test_a_correct_engine_passes", quick=True),
    Mutant("clip by the squared norm", "minizero:coef_of",
           "(norm_sq.sqrt() + 1e-6)", "(norm_sq + 1e-6)",
           "test_check.py::test_a_correct_engine_passes"),
    Mutant("clip norm summed over rank 0 only", "minizero:clip_coef",
           "total = total + x", "total = total", "test_check.py::test_a_correct_engine_passes"),
    Mutant("no mean over ranks", "minizero:Engine._unscale",
           "return 1.0 / (self.comm.world_size * 1.0)", "return 1.0", PROPERTY),
    # DDP's unused-parameter rule and per-parameter step counts
    Mutant("unused parameters decayed and moved (torch skips grad=None)", "minizero:runs",
           "if not u.used[p.i]:", "if False:",
           "test_models.py::test_parameters_skipped_on_some_steps_and_ranks", quick=True),
    Mutant("an unused parameter's step counted", "minizero:Engine.step",
           "u.steps = [t + used for", "u.steps = [t + 1 for",
           "test_models.py::test_parameters_skipped_on_some_steps_and_ranks"),
    Mutant("used = rank 0's flags only (not any rank's)", "minizero:Engine._agree",
           "used = iter(any(col) for col in zip(*(used for _, _, _, *used in flags)))",
           "used = iter(bool(x) for x in flags[0][3:])",
           "test_models.py::test_parameters_skipped_on_some_steps_and_ranks"),
    # skipping, loss scale
    Mutant("a non-finite step taken anyway", "minizero:Engine.step",
           "return self._skip(bad)", "self._skip(bad)",
           "test_precision.py::test_fp16_overflow_on_one_rank_skips_the_step_everywhere[stage=0]"),
    Mutant("fp16 loss scale not halved on overflow", "minizero_lib.scaler:LossScaler.skipped_step",
           "self.scale, self.clean_steps = self.scale / 2, 0", "self.clean_steps = 0",
           "test_precision.py::test_fp16_overflow_on_one_rank_skips_the_step_everywhere[stage=1]"),
    # frozen params and buffers at construction; stage 3's gathers and releases; stage 2's buckets
    Mutant("frozen params and buffers not broadcast at construction", "minizero:Engine.__init__",
           "broadcast(t.data, comm)  # frozen", "(t.data, comm)  # frozen",
           "test_equivalence.py::test_native_collectives_keep_the_stages_equal[overlap=False]"),
    Mutant("stage 3 prefetches the unit after next", "minizero:Engine._gather",
           "i = order.index(u) + 1", "i = order.index(u) + 2",
           "test_models.py::test_stage3_prefetches_the_next_unit_of_the_first_pass", quick=True),
    Mutant("stage 3 prefetches in the forward's order during backward too", "minizero:Engine._gather",
           "order = self.bwd_order if self.in_backward else self.fwd_order", "order = self.fwd_order",
           "test_models.py::test_stage3_prefetches_the_next_unit_of_the_first_pass"),
    Mutant("stage 3 keeps a unit gathered after forward", "minizero:Engine._after_forward",
           "\n    self._release(", "\n    0 and self._release(", "test_check.py::test_a_correct_engine_passes"),
    Mutant("stage 2 keeps the full gradient after its reduce-scatter", "minizero:Unit.handed_off",
           "self.bucket = None", "pass",
           "test_check.py::test_a_correct_engine_passes"),
    Mutant("the check's formulas fed the engine's own padded size", "minizero_lib.check:_padded",
           "return sum(", "return 1 + sum(", "test_check.py::test_a_correct_engine_passes"),
    # the property, on its own
    Mutant("reduced in the compute dtype despite reduce_dtype", "minizero:Engine._reduction",
           "local, earlier = bucket.to(self.reduce_dtype),", "local, earlier = bucket,", PROPERTY),
]


# -----------------------------------------------------------------------------
# planting a mutant: the function's source with one line changed, compiled, swapped in


def plant(m):
    """Swap m's mutated function (or class) in for the original, wherever a module of this
    project holds it by name; returns what puts the originals back."""
    modname, qual = m.target.split(":")
    module = importlib.import_module(modname)
    *path, name = qual.split(".")
    owner = module
    for p in path:
        owner = getattr(owner, p)
    original = inspect.unwrap(getattr(owner, name))
    source = textwrap.dedent(inspect.getsource(original))
    if source.count(m.old) != 1:
        raise LookupError(f"{m.target}: {m.old!r} is in its source {source.count(m.old)} times, not once; "
                          f"the source moved: update the mutant")
    namespace = dict(vars(module))  # its globals: the mutant reads the module's names
    exec(compile(source.replace(m.old, m.new), module.__file__, "exec"), namespace)
    mutant = namespace[name]
    holders = [(owner, name)] + [(mod, k) for mod in list(sys.modules.values())
                                 if os.path.abspath(getattr(mod, "__file__", None) or "/").startswith(HERE + os.sep)
                                 for k, v in list(vars(mod).items()) if v is original and mod is not owner]
    undo = [(h, k, getattr(h, k)) for h, k in holders]
    for h, k in holders:
        setattr(h, k, mutant)
    return lambda: [setattr(h, k, v) for h, k, v in reversed(undo)]


def run_test(spec):
    """Call the test "file.py::name[param=value]" in this process (fixtures: monkeypatch,
    tmp_path); returns None if it passed, else its error, one line."""
    file, test = spec.split("::")
    name, _, params = test.partition("[")
    fn = getattr(importlib.import_module(file[:-3]), name)
    kw = dict(p.split("=") for p in params.rstrip("]").split(",") if p)
    kw = {k: int(v) if v.isdigit() else {"False": False, "True": True}.get(v, v) for k, v in kw.items()}
    wanted = inspect.signature(fn).parameters
    with pytest.MonkeyPatch.context() as monkeypatch:
        if "monkeypatch" in wanted:
            kw["monkeypatch"] = monkeypatch
        if "tmp_path" in wanted:
            kw["tmp_path"] = Path(tempfile.mkdtemp(prefix="minizero-mutant-"))
        try:
            fn(**kw)
        except BaseException as e:  # noqa: B902 (pytest.fail and hypothesis raise BaseExceptions too)
            if isinstance(e, KeyboardInterrupt):
                raise
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:100]
    return None


def kill(m):
    """Plant m, run its killer; returns (its failure or None if it survived, seconds)."""
    profile = settings._current_profile
    settings.load_profile("mutations")
    t0 = time.perf_counter()
    undo = plant(m)
    try:
        return run_test(m.killer), time.perf_counter() - t0
    finally:
        undo()
        settings.load_profile(profile)


@pytest.mark.parametrize("m", [m for m in MUTANTS if m.quick], ids=lambda m: m.name)
def test_the_suite_kills_the_quick_mutants(m):
    failure, seconds = kill(m)
    print(f"{m.name}: killed by {m.killer} in {seconds:.1f} s ({failure})")
    assert failure is not None, f"{m.name} survived {m.killer}"


@pytest.mark.mutations
@pytest.mark.parametrize("m", [m for m in MUTANTS if not m.quick], ids=lambda m: m.name)
def test_the_suite_kills_every_mutant(m):
    failure, seconds = kill(m)
    assert failure is not None, f"{m.name} survived {m.killer}"


if __name__ == "__main__":
    import conftest  # noqa: F401  (the hypothesis profiles)
    import torch
    torch.set_num_threads(1)
    rows, total = [], time.perf_counter()
    for m in MUTANTS:
        failure, seconds = kill(m)
        rows.append((m.name, m.killer if failure else "SURVIVED " + m.killer, seconds))
        print(f"{seconds:7.1f} s  {'killed' if failure else 'SURVIVED'}  {m.name}  <- {m.killer}: {failure}",
              flush=True)
    print(f"\n| mutation | killed by | seconds |\n| --- | --- | --- |")
    for name, by, seconds in rows:
        print(f"| {name} | `{by}` | {seconds:.1f} |")
    print(f"\n{sum(r[1].startswith('SURVIVED') for r in rows)} of {len(rows)} survived; "
          f"{time.perf_counter() - total:.0f} s in all")
    sys.exit(1 if any(r[1].startswith("SURVIVED") for r in rows) else 0)

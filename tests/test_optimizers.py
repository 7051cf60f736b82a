"""
The optimizers beyond AdamW (SGD, Muon, Adafactor) on the models users write: adapters,
activation checkpointing, experts some ranks skip, Muon's default split, and the errors that
name the fix. The models and the check are test_models.py's.
"""
import pytest
import torch
import torch.nn as nn

import minizero
from minizero_lib import launch
from test_models import D, V, build, check, experts_route


@pytest.mark.parametrize("optimizer", [dict(optimizer="sgd", momentum=0.9, nesterov=True),
                                       dict(optimizer="muon", muon_lr=0.02), dict(optimizer="adafactor")])
def test_every_optimizer_with_lora_checkpointing_and_skipped_experts(optimizer):
    """A frozen base with adapters (Muon on lora_a and lora_b, which muon= selects),
    activation checkpointing, and experts that some ranks skip (no gradient: no step, no
    state, as torch skips a grad=None parameter): every stage the same bits, torch's optimizer at stage 0."""
    extra = dict(muon=lambda n, p: n.startswith("lora")) if optimizer["optimizer"] == "muon" else {}
    assert check(dict(lora=True, ckpt="plain"), **optimizer, **extra).ok
    report = check(dict(experts=3), dict(route=experts_route), grad_accum=2, units=lambda m: [m, *m.blocks],
                   **optimizer)  # (as in test_parameters_skipped_on_some_steps_and_ranks)
    assert report.ok, report


def test_muon_takes_the_linear_weights_and_adamw_the_rest():
    """The default split: every 2-D nn.Linear weight not tied to an nn.Embedding."""
    model = build()
    model.head.weight = model.emb.weight = nn.Parameter(torch.randn(V, D))  # tied: AdamW
    kinds = launch.run_threads(lambda comm: {n: k for u in minizero.Engine(model, comm, 1, optimizer="muon").units
                                             for n, k in zip(u.names, u.rules)}, 1)[0]
    assert {n for n, k in kinds.items() if k == "muon"} == {f"blocks.{i}.fc.weight" for i in range(3)}


@pytest.mark.parametrize("kw, says", [
    (dict(optimizer="lamb"), "optimizer must be one of 'adamw', 'sgd', 'adafactor', 'muon'; got 'lamb'"),
    (dict(optimizer="sgd", betas=(0.9, 0.99)), "optimizer 'sgd' has no option 'betas'; its options are lr, "
                                                 "weight_decay, momentum, nesterov"),
    (dict(optimizer="sgd", nesterov=True), "nesterov=True needs a momentum > 0"),
    (dict(optimizer="muon", muon=lambda n, p: "norm" in n), "muon= selects blocks.0.norm.weight of shape .8,., "
                                                           "but Muon updates 2-D matrices only"),
    (dict(optimizer="muon", adjust_lr_fn="rms"), "adjust_lr_fn must be None, 'original' or 'match_rms_adamw'"),
    (dict(optimizer="adafactor", eps=1e-8), "eps is torch's pair .eps1 or None, eps2."),
])
def test_optimizer_errors_name_the_fix(kw, says):
    with pytest.raises(RuntimeError, match=says):
        launch.run_threads(lambda comm: minizero.Engine(build(), comm, 1, **kw), 1)

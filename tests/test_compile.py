"""
torch.compile under the engine (DESIGN.md §14): each compiled block is the graph torch makes
of it without the engine, at every stage (the same graphs, captured calls and no graph
break), nothing recompiles after the first step whatever the engine changes between steps,
and the compiled stages give the same bits. Counting uses the aot_eager backend (dynamo and
autograd's graphs, no code generation: cheap); one case compiles with inductor.
"""
import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import checkpoint

import minizero
from minizero_lib import launch
from minizero_lib.compiled import compile_units, graph_counts
import train_gpt as tg

torch.set_num_threads(1)
CFG = tg.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
STEPS = 3


class CheckpointedBlock(tg.Block):
    """The demo's block with torch's activation checkpointing inside: a user's model."""

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def make_gpt(checkpointed=False):
    model = tg.GPT(CFG, torch.Generator().manual_seed(0))
    if checkpointed:
        for i, b in enumerate(model.transformer.h):
            c = CheckpointedBlock(CFG)
            c.load_state_dict(b.state_dict())
            model.transformer.h[i] = c
    return model


def batch(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randint(0, 256, (2, CFG.block_size + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def train(comm, stage, backend, how="after", checkpointed=False, grad_accum=2, kw=None):
    """STEPS steps of the 2-block GPT with its blocks compiled (how: "after" Engine with
    block.compile(), "before" it as torch.compile(block)), or with torch's own AdamW when
    stage is None. Between steps: an eval forward, lr changes, gathered(). Returns the
    losses, the final fp32 state, and the graph counts after the first step and at the end;
    a recompilation after the first step raises."""
    model = make_gpt(checkpointed)
    blocks = model.transformer.h
    if how == "before":
        for i, b in enumerate(blocks):
            blocks[i] = torch.compile(b, backend=backend)
    engine = None if stage is None else minizero.Engine(model, comm, stage, lr=1e-2,
                                                        grad_accum=grad_accum, **(kw or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if engine is None else None
    if how == "after":
        compile_units(model, [u.module for u in engine.units] if engine else blocks,
                      backend=backend)
    losses, first = [], None
    x, y = batch(99, 0)
    with torch.no_grad():
        losses.append(model(x, y)[1].item())  # an eval forward: the no-grad graphs
    for step in range(STEPS):
        for micro in range(grad_accum):
            loss = model(*batch(step, micro))[1]
            losses.append(loss.item())
            if engine is None:
                (loss / grad_accum).backward()
            else:
                engine.backward(loss)
        if engine is None:
            opt.step()
            opt.zero_grad()
            losses.append(model(x, y)[1].item())
        else:
            engine.step()
            engine.lr *= 0.5
            with engine.gathered():
                losses.append(model(x, y)[1].item())
        if step == 0:
            first = graph_counts()
            torch._dynamo.config.error_on_recompile = True  # (reset by the caller)
    state = engine.full_state_dict() if engine else None
    if engine:
        engine.close()
    return losses, state, first, graph_counts()


def counted(stage, backend="aot_eager", how="after", checkpointed=False, **kw):
    """One rank's run from a clean dynamo; the counters are cumulative, so they are taken
    apart from those before it."""
    torch._dynamo.reset()
    before = graph_counts()
    try:
        losses, state, first, end = launch.run_threads(train, 1, stage, backend, how,
                                                            checkpointed, 2, kw)[0]
    finally:
        torch._dynamo.config.error_on_recompile = False
    minus = lambda c: c and {k: c[k] - before[k] for k in c}  # noqa: E731
    return losses, state, minus(first), minus(end)


@pytest.fixture(scope="module")
def torch_counts():
    """The graphs the same model makes compiled without the engine, one per checkpointing."""
    return {ck: counted(None, checkpointed=ck)[3] for ck in (False, True)}


@pytest.mark.parametrize("stage, how, kw", [
    (0, "after", {}), (2, "after", dict(offload="disk")),
    (3, "after", {}), (3, "before", dict(trace=True)), (3, "after", dict(checkpointed=True))])
def test_compiled_blocks_are_the_graphs_torch_makes(stage, how, kw, torch_counts, tmp_path):
    for key in ("trace", "offload"):  # (the flight's Tracer hooks every unit too)
        if key in kw:
            kw["trace" if key == "trace" else "offload_dir"] = str(tmp_path)
    _, _, first, end = counted(stage, how=how, **kw)
    expect = torch_counts[kw.get("checkpointed", False)]
    assert expect["breaks"] == 0 and expect["graphs"] >= 2  # (train and eval)
    assert end == first == expect  # (a recompile after the first step raised)


def test_compiled_stages_give_the_same_bits_on_inductor():
    """Stages 0 and 3, blocks compiled by inductor: the same losses and final state, to the
    bit; and no graph break."""
    losses0, state0, _, end0 = counted(0, backend="inductor")
    losses3, state3, _, end3 = counted(3, backend="inductor")
    assert end0["breaks"] == end3["breaks"] == 0
    assert losses0 == losses3
    assert state0.keys() == state3.keys()
    for k in state0:
        assert torch.equal(state0[k], state3[k]), k


def test_check_compiles_every_ranks_units():
    """check(compile=...) compiles the units (graphs appear) and the stages still agree."""
    torch._dynamo.reset()
    before = graph_counts()["graphs"]
    report = minizero.check(lambda: make_gpt(), lambda step, rank, micro: batch(step, micro),
                            world_sizes=(1, 2), stages=(0, 3), steps=2, compile="aot_eager")
    assert report.ok, report.first
    assert graph_counts()["graphs"] > before

"""
torch.compile under the engine: the user compiles each block (block.compile() or
torch.compile(block), before or after Engine(...)), and the engine's work stays outside
the graphs, as FSDP2 keeps its hooks out (torch._dynamo.disable on its pre- and
post-forward hooks). Dynamo then captures each block's forward whole, the backward
follows from it, and the collectives run eagerly between the graphs (DESIGN.md §14).

    for block in model.transformer.h:   # as torchtitan compiles each block
        block.compile()

A first reading can skip this file: it is what makes the engine invisible to dynamo.
"""
import torch


def outside_graphs(fn):
    """fn, run eagerly even where dynamo traces its caller (a compiled module's _call_impl
    calls its hooks). Traced, a hook would cut the block's graph at every clock read and
    collective (graph breaks), and guard on the engine's state (the gather order, the unit,
    the step), so the graphs would recompile as that state changes; skipped, dynamo sees
    only the block's own ops, and graphs guard on what they would guard on without the
    engine. recursive=True: nothing fn calls is traced either. Only module hooks need it:
    autograd's hooks (a parameter's post-accumulate-grad hook, an output's gradient hook)
    run in autograd's engine, outside any graph, and there the wrap would only cost its
    microsecond or two, once per parameter per backward."""
    return torch._dynamo.disable(fn, recursive=True)


def compile_units(model, modules, **options):
    """Compile each unit's module in place (module.compile(**options)), as torchtitan
    compiles each block: the engine's units ([u.module for u in engine.units]) less the
    root, which holds the others; the root itself when it is the only unit."""
    blocks = [m for m in modules if m is not model] or [model]
    for m in blocks:
        m.compile(**options)
    return blocks


def graph_counts():
    """Dynamo's counters so far: graphs compiled, the calls captured in them, and graph
    breaks (torch._dynamo.utils.counters; torch._dynamo.reset() does not clear them)."""
    from torch._dynamo.utils import counters
    return dict(graphs=counters["stats"]["unique_graphs"],
                calls=counters["stats"]["calls_captured"],
                breaks=sum(counters["graph_break"].values()))

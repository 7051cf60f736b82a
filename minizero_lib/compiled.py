"""
torch.compile under the engine: the user compiles each block (block.compile() or
torch.compile(block), before or after Engine(...)), and the engine's work stays outside
the graphs, as FSDP2 keeps its hooks out (minizero.outside_graphs: torch._dynamo.disable on
its module hooks). Dynamo then captures each block's forward whole, the backward follows
from it, and the collectives run eagerly between the graphs (DESIGN.md §14).

    for block in model.transformer.h:   # as torchtitan compiles each block
        block.compile()

Here: compile_units (check(compile=True), the demo's --compile) and dynamo's counters.
"""


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

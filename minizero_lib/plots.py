"""
The two pictures of `python -m bench --plot DIR` (matplotlib, an optional extra:
pip install -e ".[plot]"):

    memory.png    model-state bytes per rank for stages 0-3 against the world size: the
                  formulas as lines (DESIGN.md section 3), Engine.memory() as points
    timeline.png  one stage-3 step per rank, from Engine(trace=...)'s Chrome traces:
                  each unit's forward and backward above, the collectives below
"""
import sys

from minizero_lib.formulas import model_state_bytes

MiB = 2 ** 20
STAGE_COLORS = ("#444444", "#1f77b4", "#2ca02c", "#d62728")
FORMULAS = ("stage 0 (DDP): 16Ψ", "stage 1: 4Ψ + 12Ψ/N", "stage 2: 2Ψ + 14Ψ/N",
            "stage 3: 16Ψ/N")
SPAN_COLORS = {"forward": "#9ecae1", "backward": "#fdae6b", "all_gather": "#31a354",
               "reduce_scatter": "#de2d26"}


def pyplot():
    """matplotlib's pyplot drawing to files, or None after one line on stderr saying how to get
    it."""
    try:
        import matplotlib
    except ImportError:
        print('python -m bench --plot needs matplotlib, an optional extra: pip install -e '
              '".[plot]" (or pip install matplotlib)', file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def memory_png(plt, path, numel, dtype, measured, worlds):
    """measured: {(stage, world size): bytes per rank}; lines: the formula at Ψ = numel."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for stage in range(4):
        ys = [sum(model_state_bytes(numel, n, stage, dtype).values()) / MiB for n in worlds]
        ax.plot(worlds, ys, color=STAGE_COLORS[stage], label=FORMULAS[stage])
        pts = sorted((n, b / MiB) for (s, n), b in measured.items() if s == stage)
        ax.plot([n for n, _ in pts], [b for _, b in pts], "o", color=STAGE_COLORS[stage],
                markersize=6,
                label="measured: Engine.memory()" if stage == 3 else None)
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("model state per rank (MiB)")
    ax.set_title(f"Model state per rank: Ψ = {numel / 1e6:.2f}M parameters, {str(dtype)[6:]} "
                 "compute + fp32 AdamW",
                 fontsize=10)
    ax.set_xticks(worlds)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def timeline_png(plt, path, traces, step):
    """traces: each rank's Chrome trace events; draws that step (its spans' args.step)."""
    spans = [[e for e in ev if e.get("ph") == "X" and e["args"].get("step") == step]
             for ev in traces]
    t0 = min(e["ts"] for ev in spans for e in ev)
    t1 = max(e["ts"] + e["dur"] for ev in spans for e in ev)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 1.1 * len(traces)), dpi=110)
    rows, labels = [], []
    for r, ev in enumerate(spans):
        compute, comm = 2 * (len(spans) - 1 - r) + 1, 2 * (len(spans) - 1 - r)
        rows += [compute, comm]
        labels += [f"rank {r} compute", f"rank {r} collectives"]
        # enclosing spans (the root unit) first, under the rest
        for e in sorted(ev, key=lambda e: -e["dur"]):
            kind = e["name"].split()[0]
            y = compute if e["cat"] == "compute" else comm
            root = e["cat"] == "compute" and e["name"].endswith(" 0")
            color = SPAN_COLORS.get(kind, "#969696")
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)],
                           (y - 0.4, 0.8 if not root else 0.25),
                           facecolors=color, edgecolors="white", linewidth=0.5,
                           alpha=0.6 if root else 1.0)
            if e["dur"] > (t1 - t0) * 0.045:
                unit = e["name"].split()[-1] if "unit" in e["name"] else ""
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, y + (-0.27 if root else 0),
                        f"u{unit}" if unit else
                        e["name"], ha="center", va="center", fontsize=6)
    ax.set_yticks(rows)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("ms since the step began")
    ax.set_xlim(0, (t1 - t0) / 1e3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SPAN_COLORS.values()] + \
        [plt.Rectangle((0, 0), 1, 1, color="#969696")]
    ax.legend(handles,
              ["forward (unit)", "backward (unit)", "all-gather", "reduce-scatter",
               "other collective"],
              fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.set_title(f"One stage-3 step (step {step}) per rank. u0 is the root unit (embeddings, head; "
                 "thin bar), u1... the blocks.\nEach all-gather runs ahead of the forward or "
                 "backward that needs it (prefetch); each reduce-scatter runs behind backward.",
                 fontsize=8, pad=24)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

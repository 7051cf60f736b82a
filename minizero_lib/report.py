"""
What minizero.check records and reports. check.py runs every stage and records each rank's
run (RankRun, a StepRecord per step); referee.py judges the runs and fills a Row per world
size and stage, where a finding is a Divergence; Report holds the rows and prints the table.
Both modules import this one, and check.py imports referee.py: never the other way.
"""
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple, Optional

import torch

from minizero import map_tensors

# The ledger's kinds (comm.sent's keys) that the bytes formula speaks of.
SENT_KINDS = ("reduce_scatter", "all_gather", "all_reduce", "optimizer", "hpz_gather")
# The referee's gradient tolerance, by compute dtype: a fraction of the largest sum of |parts|.
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# The referee's update tolerance, a fraction of |param| + lr: it runs in fp32 on the engine's
# own gradient, so only the optimizer's own rounding is left.
UPDATE_TOL = 1e-5


def seed(step, rank, micro):
    """A model that draws random numbers draws them from this seed, in every stage and in the
    referee."""
    return 1_000_003 * step + 1009 * rank + micro


def to_device(batch, device):
    """batch with every tensor moved to device, also inside tuples, namedtuples, lists and dicts."""
    return map_tensors(batch, lambda t: t.to(device))


def run_to_device(run, device):
    """A rank's run with every tensor moved to device (on nccl each rank's come back on its own
    GPU): every field of the run and of each of its steps."""
    def on_device(record):
        return replace(record, **{f.name: to_device(getattr(record, f.name), device)
                                  for f in fields(record)})
    return replace(on_device(run), history=[on_device(h) for h in run.history])


# -----------------------------------------------------------------------------
# one rank's run of one stage: what every comparison needs


class UnitLayout(NamedTuple):
    """Where a unit's parameters lie in its flat buffer, and where a rank's chunk of it starts."""
    # The parameters' names, in the flat buffer's order.
    names: list
    # Where each parameter starts in the flat buffer.
    offsets: list
    # Each parameter's number of elements.
    sizes: list
    # Where this rank's chunk (its shard) starts in the flat buffer; 0 for the unsharded buffer.
    start: int


@dataclass
class StepRecord:
    """What one rank holds during and after one step, recorded for the comparisons."""
    # Per micro-batch, per unit: the reduced gradient shard after that micro-batch's backward.
    grads: list
    # Per unit: the 16-bit params forward reads after the step (stage 3: this rank's shard).
    live: list
    # The loss scale the step's backwards ran with.
    loss_scale: float
    # Whether the step ran: False when it was skipped for non-finite gradients.
    stepped: bool
    # The bytes this rank sent during the step, by the ledger's kinds in SENT_KINDS.
    sent: dict
    # Per unit, per parameter: whether the step moved its step count (it got an update).
    used: list
    # What the stage kept past a sync point that promises to free it; None when nothing was.
    kept: Optional[str]
    # Per micro-batch: the buffers each forward read, as {name: tensor}.
    read: list
    # Per unit: the optimizer's state, {(parameter name, key): (the first element it covers,
    # a copy)}.
    moments: list
    # Per unit, per parameter: the optimizer's step count after the step.
    step_counts: list
    # The bytes resident and offloaded, by category, measured with the reduced shards alive.
    memory: dict
    # Every parameter and buffer after the step, by name (Engine.full_state_dict).
    state: dict


@dataclass
class RankRun:
    """One rank's run of one stage: its layout, what the formulas say, and a record per step."""
    # Per unit: its UnitLayout, with this rank's chunk.
    layout: list
    # Per parameter name: the update rule it gets ("adamw", "sgd", "adafactor", "muon").
    rules: dict
    # S: how many ranks a unit is sharded over (the world size, without hybrid sharding).
    shard_size: int
    # How many micro-batches make a step.
    grad_accum: int
    # Every parameter and buffer right after the engine's construction (and its broadcast).
    initial: dict
    # The bytes resident and offloaded, by category, as the formulas say they must be.
    memory_formula: dict
    # The bytes one step must send, by the ledger's kinds, as the formula says.
    bytes_formula: dict
    # A StepRecord per step, in order.
    history: list = field(default_factory=list)


# -----------------------------------------------------------------------------
# the findings and the table


# What each Divergence.what is held to, where it is not torch.
AGAINST = {"grads": "stage 0", "params": "stage 0", "optimizer": "stage 0", "ranks": "rank 0",
           "initial": "rank 0's model", "memory": "the formula", "bytes": "the formula",
           "referee-skip": "the step before", "world sizes": "the first world size (the tree's)"}


@dataclass
class Divergence:
    """Where two runs first part."""
    # What differs: grads | params | optimizer | initial | ranks | memory | bytes |
    # referee-grads | referee-update | referee-skip | error | world sizes (the tree's order).
    what: str
    world_size: int
    stage: int
    step: int
    # The micro-batch, for grads and the buffers a forward read; None for the others.
    micro: Optional[int]
    rank: int
    # The parameter (or buffer, "padding", a memory or ledger category; for an error, the error).
    name: str
    # The first differing element, inside that parameter.
    index: int = 0
    ours: float = 0
    # Stage 0's, rank 0's, torch's or the formula's value.
    theirs: float = 0
    # The largest |difference| over the whole tensor.
    max_abs: float = 0
    max_ulp: int = 0

    def __str__(self):
        if self.what == "error":
            return f"world size {self.world_size}, stage {self.stage}: {self.name}"
        micro = f", micro-batch {self.micro}" if self.micro is not None else ""
        return (f"{self.what} differ at step {self.step}{micro}, world size {self.world_size}, "
                f"stage {self.stage}, rank {self.rank}: {self.name}[{self.index}] is {self.ours!r} "
                f"here, {self.theirs!r} in {AGAINST.get(self.what, 'torch')} "
                f"(max abs diff {self.max_abs:.3g}, {self.max_ulp} ULP)")


@dataclass
class Row:
    """One world size and stage: the table's row."""
    world_size: int
    stage: int
    # The largest |difference| from stage 0, grads and params (0: the same bits).
    max_diff: float = 0.0
    # Stage 0 only: the referee's worst (gradient diff / sum of |parts|, update diff / (|p| + lr)).
    referee: Optional[tuple] = None
    # Stage 0 only: the steps the referee held to torch (those that ran).
    refereed: int = 0
    # Stage 0 only: the steps skipped for non-finite gradients (each checked unchanged).
    skipped: int = 0
    memory_ok: bool = True
    bytes_ok: bool = True
    seconds: float = 0.0
    first: Optional[Divergence] = None


@dataclass
class Report:
    """Every row of a check, and the referee's tolerances."""
    rows: list = field(default_factory=list)
    # The referee's tolerances: (gradient, update).
    tol: tuple = (None, UPDATE_TOL)

    @property
    def ok(self):
        return all(r.first is None for r in self.rows)

    @property
    def refereed(self):
        """Steps the torch referee checked, over every world size (0: it saw no step run)."""
        return sum(r.refereed for r in self.rows if r.stage == 0)

    @property
    def first(self):
        """The first divergence of every row: stage against stage first (the sharper finding),
        then by step, micro-batch, world size, stage and rank."""
        firsts = [r.first for r in self.rows if r.first is not None]
        return min(firsts, key=lambda d: (d.what.startswith("referee"), d.step, d.micro or 0,
                                          d.world_size, d.stage, d.rank), default=None)

    def __str__(self):
        lines = [f"{'world':>5} {'stage':>5}  {'vs stage 0':>11}  {'referee grad':>12} "
                 f"{'update':>9}  {'memory':>7} {'bytes':>7} {'seconds':>8}"]
        lines += [_line(r) for r in self.rows]
        lines.append(f"referee tolerance: gradient {self.tol[0]:.0e} of the largest sum of "
                     f"|contributions|, update {self.tol[1]:.0e} of |param| + lr")
        judged = [r for r in self.rows if r.stage == 0 and r.referee is not None]
        if judged:
            lines.append("referee saw " + ", ".join(
                f"{r.refereed} of {r.refereed + r.skipped} steps at world size {r.world_size}"
                + (f" ({r.skipped} skipped: non-finite gradients)" if r.skipped else "")
                for r in judged))
        lines.append("all stages agree" if self.ok else f"first divergence: {self.first}")
        return "\n".join(lines)


def _line(r):
    """The table's line for row r."""
    if r.referee:
        judged = f"{r.referee[0]:>12.2e} {r.referee[1]:>9.2e}"
    else:
        judged = f"{'':>12} {'':>9}"
    # A row whose first finding is not in grads, params or optimizer still has the same bits.
    bits_differ = r.first is not None and r.first.what in ("grads", "params", "optimizer")
    same = "same bits" if r.max_diff == 0 and not bits_differ else f"{r.max_diff:.2e}"
    return (f"{r.world_size:>5} {r.stage:>5}  {same:>11}  {judged}  {_mark(r.memory_ok):>7} "
            f"{_mark(r.bytes_ok):>7} {r.seconds:>8.2f}")


def _mark(good):
    return "ok" if good else "DIFFERS"

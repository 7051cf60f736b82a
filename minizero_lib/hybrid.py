"""
Hybrid sharding (FSDP2's HSDP, MiCS): Engine(shard_size=S) cuts each unit over groups of S
consecutive ranks (a node, under torchrun) and keeps a copy in each of the R = N/S groups;
the reduced gradient shard is all-reduced across the copies once per step. And ZeRO++'s
hpZ (Engine(reshard_after_forward=G), stage 3): after a unit's forward each rank keeps its
Ψ_u/G of the gathered unit, and the backward gathers from those among G ranks of a node.

    Group(comm, ranks)        some of the ranks as a world of their own: the rings run on it
    split(comm, S)            this rank's two groups: (its S consecutive ranks, its replicas)
    all_reduce_replicas       the reduced shard, summed across the R copies
    keep_secondary            hpZ, after forward: this rank's Ψ_u/G of the gathered unit
    gather_secondary          hpZ, before backward: the all-gather among the G ranks

Stages 0-3 at one S are still bit-identical (DESIGN.md §10).
"""
from ops import Comm, all_reduce, all_gather
from minizero import chunk


class Group:
    """The ranks `ranks` (global numbers, in ring order) of comm as a world of their own: rank
    and world_size are the group's, peers are translated to comm's numbers, and all else
    (ledgers, record, native, headers, device) is comm's, read live, so the rings run unchanged.
    A view, not a Comm: copies of comm's fields would go stale (bench swaps comm.flight)."""

    def __init__(self, comm, ranks):
        self.comm = comm                         # the whole world's communicator
        self.ranks = tuple(ranks)                # group rank i is global rank ranks[i]
        self.rank = self.ranks.index(comm.rank)  # this rank's place in the group
        self.world_size = len(self.ranks)        # the number of ranks in the group's ring
        self.sent, self.sent_to, self.device = comm.sent, comm.sent_to, comm.device  # comm's

    # comm's choices (Engine(native=...) sets them there), record, and started collectives.
    native = property(lambda self: self.comm.native)
    headers = property(lambda self: self.comm.headers)
    flight = property(lambda self: self.comm.flight)
    unfinished = property(lambda g: g.comm.unfinished,
                          lambda g, waits: setattr(g.comm, "unfinished", waits))

    def book(self, kind, dst, nbytes):
        self.comm.book(kind, self.ranks[dst], nbytes)

    # The same exchange as every communicator's: wait on iexchange.
    exchange = Comm.exchange

    def iexchange(self, send, dst, recv, src, kind="p2p"):
        dst, src = (None if r is None else self.ranks[r] for r in (dst, src))
        return self.comm.iexchange(send, dst, recv, src, kind)

    def run_native(self, op, x, out, kind):
        return self.comm.run_native(op, x, out, kind, self.ranks)


def split(comm, shard_size):
    """Hybrid sharding's two groups of this rank -> (shards, replicas): shards is its group of
    shard_size consecutive ranks (a node, under torchrun), replicas the ranks at its position
    in every such group. shard_size = world size (or None) is plain ZeRO: (comm, a group of 1)."""
    n, s = comm.world_size, comm.world_size if shard_size is None else shard_size
    if not isinstance(s, int) or s < 1 or n % s:
        raise ValueError(f"shard_size must divide the world size {n} (units are sharded over "
                         f"groups of shard_size ranks and copied across world_size/shard_size "
                         f"groups); got {s!r}: use one of "
                         f"{[d for d in range(1, n + 1) if n % d == 0]}")
    if s == n:
        return comm, Group(comm, [comm.rank])
    shards = [tuple(range(g, g + s)) for g in range(0, n, s)]
    replicas = [tuple(range(p, n, s)) for p in range(s)]
    # torch's groups, for the native path: every rank makes all.
    comm.make_groups(shards + replicas)
    return Group(comm, shards[comm.rank // s]), Group(comm, replicas[comm.rank % s])


def all_reduce_replicas(reduced, replicas):
    """Hybrid, after a step's last micro-batch: all-reduce the reduced shard across the R
    copies of the unit (2(R-1)/R·Ψ_u/S each, the only gradient bytes that leave a shard
    group, once per step)."""
    return all_reduce(reduced, replicas, kind="all_reduce")


def hpz_group(comm, reshard_after_forward):
    """reshard_after_forward=G (ZeRO++ hpZ): this rank's G consecutive ranks (inside its
    shard group, as G divides S: a node), among which a unit's backward gathers; else None."""
    G = reshard_after_forward
    return split(comm, G)[0] if type(G) is int else None


def keep_secondary(flat, group):
    """Stage 3 with reshard_after_forward=G, after a unit's forward: keep this rank's chunk of
    the gathered unit at G-way granularity, the secondary shard (Ψ_u/G, in the compute
    dtype). A local copy: nothing is sent."""
    return chunk(flat, flat.numel() // group.world_size, group.rank).clone()


def gather_secondary(secondary, flat, group):
    """Stage 3 with reshard_after_forward=G, before a unit's backward: all-gather the
    secondary shards among the G consecutive ranks of `group` (a node) into flat (each rank
    sends (G-1)/G·Ψ_u, kind "hpz_gather"): the backward's gather never leaves the group.
    The same bits as gather_params: both copy the one set of 16-bit values."""
    return all_gather(secondary, group, out=flat, kind="hpz_gather")

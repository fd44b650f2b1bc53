"""Which averaging collective a strategy gets on this job's topology: flat, two-level, 16-bit.

Data parallel (gradients, ``fp16_allreduce``) and local SGD (parameter changes,
``localsgd_configs.sync_dtype``) both average float tensors over all ranks and both honour
``use_hierarchical_allreduce`` and ``nccl_comm_num``; they differ only in what is compressed. So
the choice lives here, once, and each unit passes its own codec. Not a unit: units may import it.

Example:
    >>> coll, notes = averaging_collective(strategy, groups, role, codec=None)
    >>> coll.start_tensor(flat, 0).wait()           # flat averaged over the ranks, in place
"""

from __future__ import annotations

from fleetlike.collectives import (
    CompressedAllReduce,
    FlatAllReduce,
    HalfCodec,
    HierarchicalAllReduce,
    hierarchical_pairs,
)
from fleetlike.comm import CommGroups, Communicator
from fleetlike.config import DistributedStrategy
from fleetlike.roles import Role

__all__ = ["AveragingCollective", "averaging_collective", "comm_label", "two_level_possible"]

AveragingCollective = FlatAllReduce | HierarchicalAllReduce | CompressedAllReduce
Note = tuple[str, bool, str]


def _two_level(s: DistributedStrategy, groups: CommGroups, role: Role, want_hier: bool) -> tuple[bool, int | None, str]:
    """``(possible, block, why_not)``: can the ranks form equal inner groups of > 1 and < world?

    ``hierarchical_allreduce_inter_nranks`` has Paddle's meaning: the ranks of one inner group;
    0 or 1 (Paddle 2.x's default; its transpiler reads ``<= 1`` as "selected automatically")
    mean the ranks of one node, so a Paddle config carries over unchanged. A value > 1 groups
    consecutive ranks and must divide the world size (Fleet's check), else ValueError."""
    world = groups.world
    inter_nranks = int(s.hierarchical_allreduce_inter_nranks) if want_hier else 0
    if inter_nranks > 1:  # 0 and 1 (Paddle's default) both mean: the ranks of one node
        if world.size % inter_nranks:
            raise ValueError(
                f"strategy.hierarchical_allreduce_inter_nranks={inter_nranks} does not divide the "
                f"world size {world.size}; use a divisor of it, or 0 (or 1, as in Paddle) for "
                "the ranks of one node"
            )
        if inter_nranks == world.size:
            return False, None, f"inter_nranks={inter_nranks} is the whole world: one group, nothing to split"
        return True, inter_nranks, ""
    if role.node_num == 1:
        return False, None, "one node: no allreduce crosses nodes, the flat allreduce is used"
    if not role.uniform_nodes():
        return False, None, ("nodes have unequal numbers of ranks; falling back to the flat allreduce "
                             "(set hierarchical_allreduce_inter_nranks to group consecutive ranks)")
    if role.local_size == 1:
        return False, None, "one rank per node: the two-level allreduce equals the flat one"
    return True, None, ""


def two_level_possible(s: DistributedStrategy, groups: CommGroups, role: Role) -> tuple[bool, str]:
    """Whether ``use_hierarchical_allreduce`` would form two levels on this job, and why not (the
    online tuner tries the two-level mode only where it can)."""
    ok, _, why = _two_level(s, groups, role, True)
    return ok, why


def averaging_collective(
    s: DistributedStrategy,
    groups: CommGroups,
    role: Role,
    *,
    codec: HalfCodec | None,
    mixed: bool = False,
    codec_option: str = "fp16_allreduce",
    rings: list[Communicator] | None = None,
) -> tuple[AveragingCollective, list[Note]]:
    """The collective averaging float buffers for strategy ``s``, and what to record in
    ``applied_strategy()``.

    ``codec`` compresses every hop (``mixed=False``) or only the hop across nodes
    (``mixed=True``, which needs the two-level form); ``codec_option`` names the option that
    asked for it in the notes. ``rings`` replaces ``groups.rings(nccl_comm_num)`` for the flat
    form: communicators of the caller's own, for traffic that stays in flight while the main
    thread issues other collectives (ring 0 is the world communicator itself). Cases where the two levels cannot help or cannot be formed fall
    back to the flat allreduce and are recorded as not applied with the reason: one node; one
    rank per node; nodes of unequal sizes (per-node grouping needs equal nodes: set
    inter_nranks > 1 to group consecutive ranks instead)."""
    rings = rings if rings is not None else groups.rings(s.nccl_comm_num)
    notes: list[Note] = []
    world = groups.world
    want_hier = bool(s.use_hierarchical_allreduce)
    hier_ok, block, why_not = _two_level(s, groups, role, want_hier) if (want_hier or mixed) else (False, None, "")
    n = len(rings)
    coll: AveragingCollective
    if hier_ok:
        pairs = hierarchical_pairs(groups, n, block)
        algo = str(s.hierarchical_allreduce_configs["algorithm"]) if want_hier else "reduce_scatter"
        label = "node" if block is None else "block"
        coll = HierarchicalAllReduce(pairs, world, algorithm=algo, inter_codec=codec if mixed else None,
                                     node_label=label)
        if want_hier:
            notes.append(("use_hierarchical_allreduce", True,
                          f"{algo}: {pairs[0][0].size} ranks/{label} x {pairs[0][1].size} {label}s, "
                          f"{n} intra/inter pair(s)"))
    else:
        coll = FlatAllReduce(rings)
        if want_hier:
            notes.append(("use_hierarchical_allreduce", False, why_not))
    if codec is not None:
        if mixed:
            if hier_ok:
                notes.append((codec_option, True,
                              f"mixed: {codec.name} across nodes only, full precision inside nodes"))
            else:
                notes.append((codec_option, False, f"mixed mode compresses only across nodes, but {why_not}"))
        else:
            coll = CompressedAllReduce(coll, codec)
            notes.append((codec_option, True, f"all hops in {codec.name}, pre-divided by {world.size}"
                          + (f", grad_scale {codec.grad_scale:g}" if codec.grad_scale != 1 else "")))
    return coll, notes


def comm_label(coll: AveragingCollective, slot: int) -> str:
    """The communicator(s) that ``coll.start_tensor(t, slot)`` uses, for program listings."""
    inner = coll.inner if isinstance(coll, CompressedAllReduce) else coll
    if isinstance(inner, HierarchicalAllReduce):
        intra, inter = inner.pair_for(slot)
        return f"{intra.name}+{inter.name}"
    return str(inner.rings[slot % len(inner.rings)].name)

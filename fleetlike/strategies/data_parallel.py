"""Data parallel: bucketed gradient averaging that overlaps backward.

`gradient_collective` turns the strategy (``use_hierarchical_allreduce``, ``fp16_allreduce``,
``nccl_comm_num``, ``hierarchical_allreduce_inter_nranks``) and the job's topology into one
`BucketCollective` of `fleetlike.collectives`; `DataParallelUnit` builds the `GradReducer`
around it and hooks it into the step (armed before backward, waited for at synchronize), in
both styles.

Example:
    >>> collective, notes = gradient_collective(strategy, groups, role)
    >>> unit = DataParallelUnit(ctx, amp_skips_non_finite=False)   # c_allreduce_avg ... c_wait_allreduce
"""

from __future__ import annotations


from fleetlike.collectives import (
    BucketCollective,
    CompressedAllReduce,
    FlatAllReduce,
    HalfCodec,
    HierarchicalAllReduce,
    hierarchical_pairs,
    make_reducer,
)
from fleetlike.comm import CommGroups
from fleetlike.config import DistributedStrategy
from fleetlike.program import Op, StepState
from fleetlike.roles import Role
from fleetlike.strategies.step import Hook, StepContext, Unit

__all__ = ["DataParallelUnit", "gradient_collective"]


def gradient_collective(
    s: DistributedStrategy, groups: CommGroups, role: Role
) -> tuple[BucketCollective, list[tuple[str, bool, str]]]:
    """The `BucketCollective` for strategy ``s`` and what to record in ``applied_strategy()``.

    ``hierarchical_allreduce_inter_nranks`` has Paddle's meaning: the ranks of one inner group;
    0 or 1 (Paddle 2.x's default; its transpiler reads ``<= 1`` as "selected automatically")
    mean the ranks of one node, so a Paddle config carries over unchanged. A value > 1 groups
    consecutive ranks and must divide the world size (Fleet's check), else ValueError. Cases
    where the two levels cannot help or cannot be formed fall back to the flat allreduce and
    are recorded as not applied with the reason: one node; one rank per node; nodes of unequal
    sizes (per-node grouping needs equal nodes: set inter_nranks > 1 to group consecutive
    ranks instead).
    """
    rings = groups.rings(s.nccl_comm_num)
    notes: list[tuple[str, bool, str]] = []
    world = groups.world
    block: int | None = None
    hier_ok = False
    want_hier = bool(s.use_hierarchical_allreduce)
    fp16 = bool(s.fp16_allreduce)
    cfg = s.fp16_allreduce_configs if fp16 else None
    mixed = fp16 and str(cfg["mode"]) == "mixed"
    why_not = ""
    if want_hier or mixed:
        inter_nranks = int(s.hierarchical_allreduce_inter_nranks) if want_hier else 0
        if inter_nranks > 1:  # 0 and 1 (Paddle's default) both mean: the ranks of one node
            if world.size % inter_nranks:
                raise ValueError(
                    f"strategy.hierarchical_allreduce_inter_nranks={inter_nranks} does not divide the "
                    f"world size {world.size}; use a divisor of it, or 0 (or 1, as in Paddle) for "
                    "the ranks of one node"
                )
            if inter_nranks == world.size:
                why_not = f"inter_nranks={inter_nranks} is the whole world: one group, nothing to split"
            else:
                hier_ok, block = True, inter_nranks
        elif role.node_num == 1:
            why_not = "one node: no allreduce crosses nodes, the flat allreduce is used"
        elif not role.uniform_nodes():
            why_not = ("nodes have unequal numbers of ranks; falling back to the flat allreduce "
                       "(set hierarchical_allreduce_inter_nranks to group consecutive ranks)")
        elif role.local_size == 1:
            why_not = "one rank per node: the two-level allreduce equals the flat one"
        else:
            hier_ok = True
    codec = HalfCodec(str(cfg["dtype"]), float(cfg["grad_scale"])) if fp16 else None
    n = len(rings)
    if hier_ok:
        pairs = hierarchical_pairs(groups, n, block)
        algo = str(s.hierarchical_allreduce_configs["algorithm"]) if want_hier else "reduce_scatter"
        label = "node" if block is None else "block"
        coll: FlatAllReduce | HierarchicalAllReduce | CompressedAllReduce = HierarchicalAllReduce(pairs, world, algorithm=algo, inter_codec=codec if mixed else None,
                                         node_label=label)
        if want_hier:
            notes.append(("use_hierarchical_allreduce", True,
                          f"{algo}: {pairs[0][0].size} ranks/{label} x {pairs[0][1].size} {label}s, "
                          f"{n} intra/inter pair(s)"))
    else:
        coll = FlatAllReduce(rings)
        if want_hier:
            notes.append(("use_hierarchical_allreduce", False, why_not))
    if fp16:
        assert codec is not None
        if mixed:
            if hier_ok:
                notes.append(("fp16_allreduce", True,
                              f"mixed: {codec.name} across nodes only, full precision inside nodes"))
            else:
                notes.append(("fp16_allreduce", False, f"mixed mode compresses only across nodes, but {why_not}"))
        else:
            coll = CompressedAllReduce(coll, codec)
            notes.append(("fp16_allreduce", True, f"all hops in {codec.name}, pre-divided by {world.size}"
                          + (f", grad_scale {codec.grad_scale:g}" if codec.grad_scale != 1 else "")))
    return coll, notes


class DataParallelUnit(Unit):
    """Bucketed, overlapped gradient averaging (see `GradReducer`): both styles arm the same
    reducer before backward and wait for it before the update."""

    name = "data_parallel"

    def __init__(self, ctx: StepContext, *, amp_skips_non_finite: bool) -> None:
        s = ctx.strategy
        collective, notes = gradient_collective(s, ctx.groups, ctx.role)
        nan_check = bool(s.check_nan_inf) and not amp_skips_non_finite
        self.ctx = ctx
        self.reducer = make_reducer(ctx.model, collective, cap_bytes=s.bucket_cap_bytes(),
                                    find_unused=s.find_unused_parameters, check_nan_inf=nan_check)
        ctx.reducer = self.reducer
        self._step: StepState | None = None  # the step whose counters are below (held, not its id:
        # an id is reused once the object is freed, which once made two steps look like one)
        self._issued = (0, 0)
        cap = s.bucket_cap_bytes()
        rings = ctx.groups.rings(s.nccl_comm_num)
        ctx.record("data_parallel", True, (
            f"{len(self.reducer.buckets)} buckets "
            + (f"of <= {s.fuse_grad_size_in_MB} MB" if cap else "(one per gradient: fuse_all_reduce_ops=False)")
            + f" over {len(rings)} communicator(s)"
        ))
        for name, applied, why in notes:
            ctx.record(name, applied, why)
        if s.check_nan_inf:
            ctx.record("check_nan_inf", nan_check, "gradients checked before each bucket's allreduce" if nan_check
                       else "AMP's dynamic loss scaling already skips non-finite steps on every rank")

    def hooks(self) -> list[Hook]:
        return [
            Hook("before_backward", "arm", self._arm, {"overlap": "bucket allreduce starts as grads fill"},
                 listed=False),
            Hook("synchronize", "c_wait_allreduce", self._wait,
                 {"buckets": len(self.reducer.buckets), "world": self.ctx.groups.world.size}),
        ]

    def _arm(self, st: StepState) -> None:
        reducer = self.reducer
        if self._step is not st:  # count this step's traffic from its first arming
            self._step, self._issued = st, (reducer.collectives_issued, reducer.bytes_issued)
        if st.accumulate or not st.communicate or reducer.armed:
            return
        reducer.prepare(st.roots)

    def _wait(self, st: StepState) -> None:
        reducer = self.reducer
        reducer.finalize()
        if self._step is not st:  # nothing was armed this step
            self._step, self._issued = st, (reducer.collectives_issued, reducer.bytes_issued)
        # buckets launch during backward, so count from the arming, not from this wait
        st.info["collectives"] = reducer.collectives_issued - self._issued[0]
        st.info["bytes_communicated"] = reducer.bytes_issued - self._issued[1]

    def described_ops(self) -> list[Op]:
        return [
            Op(d.pop("op", "c_allreduce_avg"), None, {**d.pop("bucket").describe(), **d}, parent="backward")
            for d in self.reducer.describe()
        ]

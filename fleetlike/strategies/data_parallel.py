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

from collections.abc import Callable

from fleetlike.collectives import BucketCollective, DownsampledAllReduce, HalfCodec, make_reducer
from fleetlike.comm import CommGroups, Communicator
from fleetlike.config import DistributedStrategy
from fleetlike.program import Op, StepState
from fleetlike.roles import Role
from fleetlike.strategies.reduce_clip import ReduceClip
from fleetlike.strategies.step import Hook, StepContext, Unit
from fleetlike.strategies.topology import averaging_collective

__all__ = ["DataParallelUnit", "gradient_collective"]


def gradient_collective(
    s: DistributedStrategy, groups: CommGroups, role: Role, *, rings: list[Communicator] | None = None
) -> tuple[BucketCollective, list[tuple[str, bool, str]]]:
    """The `BucketCollective` for the gradients under strategy ``s`` (``fp16_allreduce`` chooses
    the codec; the topology part is `averaging_collective`'s; ``gossip`` wraps the result in
    `DownsampledAllReduce`) and what to record in ``applied_strategy()``. ``rings``: the flat
    form's communicators of the caller's own."""
    fp16 = bool(s.fp16_allreduce)
    cfg = s.fp16_allreduce_configs if fp16 else None
    codec = HalfCodec(str(cfg["dtype"]), float(cfg["grad_scale"])) if cfg is not None else None
    mixed = cfg is not None and str(cfg["mode"]) == "mixed"
    coll, notes = averaging_collective(s, groups, role, codec=codec, mixed=mixed, rings=rings)
    if not s.gossip:
        return coll, notes
    n = int(s.gossip_configs["downsample_n_elements"])
    notes.append(("gossip", True, f"1/{n} of each bucket per step (rotating offset), the rest kept "
                  "as an error-feedback residual"))
    return DownsampledAllReduce(coll, n), notes


class DataParallelUnit(Unit):
    """Bucketed, overlapped gradient averaging (see `GradReducer`): both styles arm the same
    reducer before backward and wait for it before the update."""

    name = "data_parallel"

    def __init__(self, ctx: StepContext, *, amp_skips_non_finite: bool,
                 multiplier: Callable[[], float] = lambda: 1.0) -> None:
        s = ctx.strategy
        collective, notes = gradient_collective(s, ctx.groups, ctx.role)
        #: gradients_reduce_method and clip_after_allreduce (`fleetlike.strategies.reduce_clip`);
        #: ``multiplier``: what the local gradient is a multiple of at the end of backward
        self.reduce_clip = ReduceClip(s, world_size=ctx.groups.world.size, multiplier=multiplier)
        collective = self.reduce_clip.collective(collective)
        nan_check = bool(s.check_nan_inf) and not amp_skips_non_finite
        self.ctx = ctx
        cap = s.bucket_cap_bytes(ctx.model.parameters())
        hold = self._clip_local if self.reduce_clip.clips_before else None
        self.reducer = make_reducer(ctx.model, collective, cap_bytes=cap,
                                    find_unused=s.find_unused_parameters, check_nan_inf=nan_check, hold=hold)
        ctx.reducer = self.reducer
        self._step: StepState | None = None  # the step whose counters are below (held, not its id:
        # an id is reused once the object is freed, which once made two steps look like one)
        self._issued = (0, 0)
        rings = ctx.groups.rings(s.nccl_comm_num)
        most = int(s.fuse_grad_max_buckets)
        ctx.record("data_parallel", True, (
            f"{len(self.reducer.buckets)} buckets "
            + (f"of <= {cap / (1 << 20):g} MB" + (f" (at most {most}: fuse_grad_max_buckets)" if most else "")
               if cap else "(one per gradient: fuse_all_reduce_ops=False)")
            + f" over {len(rings)} communicator(s)"
        ))
        for name, applied, why in notes:
            ctx.record(name, applied, why)
        rc = self.reduce_clip
        if rc.method != "mean":
            ctx.record("sharding_configs.gradients_reduce_method", True, rc.describe_method())
        if rc.clip_norm > 0 or rc.clip_after:
            ctx.record("sharding_configs.clip_after_allreduce", True, rc.describe_clip())
        if s.check_nan_inf:
            ctx.record("check_nan_inf", nan_check, "gradients checked before each bucket's allreduce" if nan_check
                       else "AMP's dynamic loss scaling already skips non-finite steps on every rank")

    def hooks(self) -> list[Hook]:
        overlap = ("none: the clip before the allreduce needs the whole local gradient" if self.reducer.hold
                   else "bucket allreduce starts as grads fill")
        hooks = [
            Hook("before_backward", "arm", self._arm, {"overlap": overlap}, listed=False),
            Hook("synchronize", "c_wait_allreduce", self._wait,
                 {"buckets": len(self.reducer.buckets), "world": self.ctx.groups.world.size}),
        ]
        if self.reduce_clip.clips_before:  # the reducer's hold, when c_wait_allreduce starts the buckets
            hooks[1].attrs["clip_by_local_norm"] = self.reduce_clip.clip_norm
        if self.reduce_clip.method == "sum":
            hooks[1].attrs["reduce"] = "sum"
        if self.reduce_clip.clips_after:
            hooks.append(Hook("before_update", "clip_by_global_norm", self._clip_reduced,
                              {"clip_norm": self.reduce_clip.clip_norm, "over": "the reduced gradient"}))
        return hooks

    def _clip_local(self) -> None:
        self.reduce_clip.clip_local([b.buffer for b in self.reducer.buckets])

    def _clip_reduced(self, st: StepState) -> None:
        self.reduce_clip.clip_reduced(st, [b.buffer for b in self.reducer.buckets])

    def _arm(self, st: StepState) -> None:
        reducer = self.reducer
        if self._step is not st:  # count this step's traffic from its first arming
            self._step, self._issued = st, (reducer.collectives_issued, reducer.bytes_issued)
        if st.accumulate or not st.communicate or (reducer.armed and not reducer.stopped):
            return  # armed by an earlier forward of this step (unless its backward stopped midway)
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

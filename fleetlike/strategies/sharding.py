"""Optimizer-state and gradient sharding (ZeRO stages 1 and 2; Paddle's ``sharding``).

Each parameter has one owner rank (`fleetlike.collectives.sharded.plan_shards`: whole
parameters, balanced by bytes inside every gradient bucket; a bucket whose balanced segments'
padding, which every rank would hold, would exceed `PAD_LIMIT` of its gradients is split into one
bucket per owner). A step then runs:

1. backward: each bucket is **reduce-scattered** as soon as its gradients are ready (the same
   overlapped `GradReducer` hooks as data parallel), leaving each rank only its own parameters'
   averaged (or summed) gradients;
2. before the update: optional clipping by the **global** norm (squares summed over the owned
   shards, one scalar allreduce), then the gradients of the parameters this rank does not own
   are set to None;
3. the update is the user's own optimizer object: every ``torch.optim`` optimizer skips a
   parameter whose ``.grad`` is None, so it steps (and creates state for) the owned partition
   only, with its param groups, per-group hyper-parameters and any LR scheduler untouched;
4. the owners' parameters are **all-gathered** in place in the gradient buckets
   (`ParamGather`; at most ``segment_broadcast_MB`` in flight), which are zeroed after: under
   sharding the gradients read zero after ``step()``, as after ``zero_grad()``. With
   ``overlap_update`` (the default) the update and the gather are interleaved: the partition
   is stepped chunk by chunk (one optimizer call per chunk, the other chunks' gradients hidden
   as None) and each chunk is broadcast as soon as it is updated, while the next one steps.
   That needs an optimizer whose update is per parameter (torch.optim's own classes, exactly)
   and no step hooks (they would fire once per chunk); otherwise the update runs whole, then
   the gather, and ``fleet.applied_strategy()`` says why.

**Stage 2** (``sharding_configs.stage = 2``, EPL's ``zero.level = "v1"``) is this engine with
transient gradient buckets (`fleetlike.collectives.transient`): each bucket exists from its first
gradient to the end of its reduce-scatter, then this rank keeps its own segment (its parameters'
``.grad``) and the other parameters' ``.grad`` are None. Same buckets, owners, collectives and
update as stage 1, so the same result bit for bit, with 4/N bytes of gradient per parameter in
place of 4; the buckets are gone before the update, so the gather's zeroing clears the kept
shards only.

Using the user's optimizer rather than a copy over the shard is why nothing else changes: its
``state_dict()`` simply holds the owned parameters' state (a shard, in the ordinary format), and
a consolidated checkpoint is the union of the shards (`fleetlike.fleet.checkpoint`).

``clip_after_allreduce`` False (EPL's default) clips each rank's own gradient by its own norm
before communication instead (of the true gradient: AMP's loss scale and gradient merge's k are
divided out, `fleetlike.strategies.reduce_clip`); the reduce-scatter then waits for the end of
backward.

Example:
    >>> s = DistributedStrategy(sharding=True, sharding_configs={"sharding_degree": 0})
    >>> unit = ShardingUnit(ctx, *gradient_collective(s, groups, role), amp_skips_non_finite=False)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as _optim_base

from fleetlike.config.choices import REDUCE_METHOD
from fleetlike.collectives import (
    IN_FLIGHT,
    BucketCollective,
    GradReducer,
    ParamGather,
    ShardedBucket,
    ShardReduceScatter,
    TransientBucket,
    TransientReducer,
    make_reducer,
    plan_shards,
    transient_buckets,
)
from fleetlike.collectives.sharded import PAD_LIMIT
from fleetlike.program import Op, StepState
from fleetlike.strategies.reduce_clip import ReduceClip
from fleetlike.strategies.step import Hook, StepContext, Unit

__all__ = ["ShardingUnit", "check_degree", "check_num_apply_group", "whole_update_reason"]

#: optimizers that cannot step a partition: they need every parameter in one closure
_WHOLE_MODEL_OPTIMIZERS = ("LBFGS",)

#: torch.optim classes (exactly these, not subclasses) whose state and update are per parameter,
#: so stepping a partition in several calls, each seeing some gradients, updates every parameter
#: exactly as one call does: what the interleaved update (``overlap_update``) needs
_PER_PARAMETER = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD",
    "Adafactor", "SparseAdam") if hasattr(torch.optim, n))


def whole_update_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` must be stepped in one call (None when it can be stepped chunk by
    chunk): a class not known to update per parameter, or step hooks, which would run per chunk."""
    if type(optimizer) not in _PER_PARAMETER:
        return (f"{type(optimizer).__name__} is not one of torch.optim's per-parameter optimizers, so its "
                "update may depend on all parameters at once; it runs whole, then the gather")
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None), getattr(optimizer, "_optimizer_step_post_hooks", None),
             getattr(_optim_base, "_global_optimizer_pre_hooks", None), getattr(_optim_base, "_global_optimizer_post_hooks", None))
    if any(hooks):
        return "the optimizer has step hooks, which would run once per chunk; it runs whole, then the gather"
    return None


def check_num_apply_group(n: int, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters; raise when ``n`` groups cannot be made of them."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if n > len(params):
        raise ValueError(
            f"strategy.num_apply_group={n} (EPL: optimizer.num_apply_group), but the optimizer holds "
            f"{len(params)} parameter(s): each group needs at least one; set it to at most {len(params)}"
        )
    if n > 1:
        why = whole_update_reason(optimizer)
        if why is not None:
            raise ValueError(f"strategy.num_apply_group={n} cannot split this update: "
                             + why.split("; it runs whole")[0] + "; set num_apply_group to 1")
    return params


def _mb(x: float) -> str:
    kb = x / 1024
    return f"{kb:.1f}KiB" if kb < 1024 else f"{kb / 1024:.2f}MiB"



def check_degree(cfg: Any, world_size: int, what: str) -> None:
    """Every stage shards over the whole world: ``sharding_configs.sharding_degree`` must be 0
    (the world size) or the world size; ``what`` names what is sharded, for the message."""
    degree = int(cfg["sharding_degree"])
    if degree not in (0, world_size):
        raise ValueError(
            f"strategy.sharding_configs.sharding_degree={degree}, but this job has {world_size} ranks; "
            f"fleetlike shards {what} over every rank: set it to {world_size}, or 0 for whatever the world "
            "size is")

class ShardingUnit(Unit):
    """ZeRO stages 1 and 2 in both styles (see the module docstring)."""

    name = "sharding"
    needs_optimizer = True

    def __init__(self, ctx: StepContext, allreduce: BucketCollective, notes: list[tuple[str, bool, str]], *,
                 amp_skips_non_finite: bool, multiplier: Callable[[], float] = lambda: 1.0,
                 apply_groups: int = 1, stage: int = 1) -> None:
        s = ctx.strategy
        cfg = s.sharding_configs
        world = ctx.groups.world
        check_degree(cfg, world.size, "the optimizer state (Paddle checks sharding_degree x dp_degree == world "
                                      "size, and there is no dp_degree here)" if stage == 1 else
                     "the gradients and optimizer state")
        if stage not in (1, 2):
            raise ValueError(f"ShardingUnit runs stages 1 and 2, not {stage} (stage 3 is ShardedParamsUnit's)")
        #: 2: the gradient buckets are transient, each rank keeps its own shard of them
        self.stage = stage
        self.ctx = ctx
        self.rank = world.rank
        self.clip_norm = float(cfg["clip_norm"])
        self.clip_after = bool(cfg["clip_after_allreduce"])
        #: the clip before communication, on true gradients (AMP's scale and merge's k divided out)
        self.local_clip = ReduceClip(s, world_size=world.size, multiplier=multiplier)
        op = REDUCE_METHOD.op(cfg["gradients_reduce_method"])
        self.collective = ShardReduceScatter.from_allreduce(allreduce, op)
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        buckets = plan_shards(params, s.bucket_cap_bytes(params), world.size, self.collective.positions(),
                              make=transient_buckets(world.rank) if stage == 2 else ShardedBucket)
        nan_check = bool(s.check_nan_inf) and not amp_skips_non_finite
        hold = self._clip_local if self.clip_norm > 0 and not self.clip_after else None
        if stage == 2:
            self.reducer: GradReducer = TransientReducer(
                [p for p in ctx.model.parameters()], self.collective, buckets=buckets,  # type: ignore[arg-type]
                find_unused=s.find_unused_parameters, check_nan_inf=nan_check,
                names={id(p): n for n, p in ctx.model.named_parameters()})
        else:
            self.reducer = make_reducer(ctx.model, self.collective, cap_bytes=s.bucket_cap_bytes(params),
                                        find_unused=s.find_unused_parameters, check_nan_inf=nan_check,
                                        buckets=buckets, hold=hold)
        ctx.reducer = self.reducer
        self.buckets = buckets
        self.owner = {id(p): r for b in buckets for p, r in zip(b.params, b.owners)}
        self.mine = [p for b in buckets for p, r in zip(b.params, b.owners) if r == self.rank]
        self.others = [p for b in buckets for p, r in zip(b.params, b.owners) if r != self.rank]
        rings = self.collective.rings
        self.apply_groups = apply_groups
        chunk = None
        if apply_groups > 1:  # EPL's num_apply_group: the partition stepped in that many chunks
            if not bool(cfg["overlap_update"]):
                raise ValueError(
                    f"strategy.num_apply_group={apply_groups} at sharding stage 1 steps the partition chunk by "
                    "chunk, which sharding_configs.overlap_update=False turns off; set overlap_update True "
                    "or num_apply_group 1")
            shares = [0] * world.size
            for b in buckets:
                for p, r in zip(b.params, b.owners):
                    shares[r] += p.numel() * p.element_size()
            chunk = max(1, -(-max(shares) // apply_groups))
        self.gather = ParamGather(buckets, self.rank, rings, int(float(cfg["segment_broadcast_MB"]) * (1 << 20)),
                                  chunk_bytes=chunk)
        self._step: StepState | None = None
        self._issued = (0, 0)
        self._masked = False
        self._gathered = False
        self._started = (0, 0)
        self.overlap = bool(cfg["overlap_update"])
        #: why the last update ran whole (None: interleaved with the gather)
        self.whole_reason: str | None = None if self.overlap else "sharding_configs.overlap_update is False"
        loads = [0] * world.size
        for b in buckets:
            for p, r in zip(b.params, b.owners):
                loads[r] += p.numel() * p.element_size()
        padding = sum(b.padding * b.buffer.element_size() for b in buckets)
        kept = sum(b.kept_bytes for b in buckets if isinstance(b, TransientBucket))
        ctx.record("sharding", True, (
            (f"stage 2 on the bucket engine: each gradient bucket allocated when its first gradient lands, "
             f"reduced, this rank's shard kept ({_mb(kept)} of gradients of {_mb(sum(loads))}), the rest freed, "
             f"at most {IN_FLIGHT} in flight; " if stage == 2 else "")
            + f"{world.size} shards: this rank owns {len(self.mine)} of {len(params)} parameters "
            f"({_mb(loads[self.rank])} of {_mb(sum(loads))}; per rank {', '.join(_mb(x) for x in loads)}); "
            f"{len(buckets)} reduce-scatter buckets ({_mb(padding)} padding; "
            f"{sum(1 for b in buckets if b.why)} of them one owner's, split from buckets whose padding would exceed {PAD_LIMIT:.0%} of their gradients"
            + (f"; allreduced on {world.backend}, whose reduce_scatter is slower" if self.collective.via_allreduce else "")
            + "), all-gathered in place, "
            f"<= {cfg['segment_broadcast_MB']} MB in flight"
            + (f", interleaved with the update in chunks of {_mb(self.gather.chunk_bytes)}" if self.overlap else "")
            + f"; gradients {cfg['gradients_reduce_method']}"
            + (f", clipped to global norm {self.clip_norm:g} "
               + ("after the reduce-scatter" if self.clip_after else "per rank before communication")
               if self.clip_norm > 0 else "")
        ))
        ctx.record("data_parallel", False, "replaced by sharding (each rank steps its own shard's reduced gradients)")
        for name, applied, why in notes:
            if name == "use_hierarchical_allreduce" and applied:
                why = "two-level reduce-scatter (intra, then inter): " + why.split(": ", 1)[-1]
            ctx.record(name, applied, why)
        if s.check_nan_inf:
            ctx.record("check_nan_inf", nan_check, "gradients checked before each bucket's reduce-scatter" if nan_check
                       else "AMP's dynamic loss scaling already skips non-finite steps on every rank")

    # ------------------------------------------------------------------ binding

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        if type(optimizer).__name__ in _WHOLE_MODEL_OPTIMIZERS:
            raise ValueError(
                f"strategy.sharding cannot drive {type(optimizer).__name__}: it re-evaluates the whole model "
                "in a closure and keeps one state for all parameters, so it cannot step one rank's "
                "partition; use another optimizer or turn sharding off"
            )
        self.drop_foreign_state(optimizer)
        if self.apply_groups > 1:
            check_num_apply_group(self.apply_groups, optimizer)
            self.ctx.record("num_apply_group", True, f"this rank's partition updated in chunks of "
                            f"{_mb(self.gather.chunk_bytes)} (about 1/{self.apply_groups} of the largest partition)")
        if self.overlap:
            why = whole_update_reason(optimizer)
            if why is not None:
                self.ctx.record("sharding_configs.overlap_update", False, why)

    def drop_foreign_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget the state of parameters another rank owns (after loading a full state)."""
        for p in [p for p in optimizer.state if self.owner.get(id(p), self.rank) != self.rank]:
            del optimizer.state[p]

    def owns(self, p: torch.Tensor) -> bool:
        return self.owner.get(id(p), self.rank) == self.rank

    # ------------------------------------------------------------------ hooks

    def hooks(self) -> list[Hook]:
        hooks = [
            Hook("before_backward", "arm", self._arm, {"overlap": "bucket reduce-scatter starts as grads fill"}
                 if self.reducer.hold is None else {"overlap": "none: local clipping needs the whole gradient"},
                 listed=False),
            Hook("synchronize", "c_wait_reduce_scatter", self._wait,
                 {"buckets": len(self.buckets), "world": self.ctx.groups.world.size}),
        ]
        if self.clip_norm > 0 and self.clip_after:
            hooks.append(Hook("before_update", "clip_by_global_norm", self._clip_global,
                              {"clip_norm": self.clip_norm, "over": "all shards (one scalar allreduce)"}))
        hooks += [
            Hook("before_update", "sharding_select_partition", self._select,
                 {"owned_params": len(self.mine), "of": len(self.mine) + len(self.others)}),
            Hook("after_update", "c_allgather_params", self._gather,
                 {"gathers": len(self.buckets), "in_flight_MB": self.ctx.strategy.sharding_configs["segment_broadcast_MB"],
                  "interleaved": lambda: ("no: " + self.whole_reason) if self.whole_reason else
                  f"each {_mb(self.gather.chunk_bytes)} chunk broadcast as optimizer_update steps it"}),
        ]
        return hooks

    def _arm(self, st: StepState) -> None:
        reducer = self.reducer
        if self._step is not st:
            self._step, self._issued = st, (reducer.collectives_issued, reducer.bytes_issued)
        if st.accumulate or not st.communicate or (reducer.armed and not reducer.stopped):
            return  # armed by an earlier forward of this step (unless its backward stopped midway)
        reducer.prepare(st.roots)

    def _wait(self, st: StepState) -> None:
        reducer = self.reducer
        reducer.finalize()
        if self._step is not st:
            self._step, self._issued = st, (reducer.collectives_issued, reducer.bytes_issued)
        st.info["collectives"] = reducer.collectives_issued - self._issued[0]
        st.info["bytes_communicated"] = reducer.bytes_issued - self._issued[1]

    def _owned_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.mine if p.grad is not None]

    def _clip_global(self, st: StepState) -> None:
        if st.accumulate or st.skip_update:
            return
        grads = self._owned_grads()
        world = self.ctx.groups.world
        sq = torch.zeros(1, dtype=torch.float64, device=world.device)
        for g in grads:
            sq += g.detach().double().pow(2).sum().to(sq.device)
        world.all_reduce(sq, "sum", agreed=True)
        norm = math.sqrt(float(sq.item()))
        st.info["grad_norm"] = norm
        _scale(grads, self.clip_norm, norm)

    def _clip_local(self) -> None:
        self.local_clip.clip_local([b.buffer for b in self.buckets])  # this rank's own gradient, padding is 0

    def _select(self, st: StepState) -> None:
        if st.accumulate or st.skip_update:
            return
        for p in self.others:  # the user's optimizer skips these: it steps this rank's partition
            p.grad = None
        self._masked = True

    def run_update(self, st: StepState, step: Callable[[], Any]) -> Any:
        """The update of this rank's partition: interleaved with the gather, chunk by chunk,
        where the optimizer allows (module docstring), else ``step()`` whole (gathered after)."""
        opt = self.ctx.optimizer
        if self.overlap:
            self.whole_reason = "no optimizer bound" if opt is None else whole_update_reason(opt)
        if not self._masked or self.whole_reason is not None or opt is None:
            return step()
        grads = {id(p): p.grad for p in self.mine}
        # parameters the optimizer holds beyond the model's (every rank keeps and steps those):
        # stepped in a call of their own, which also keeps one call on a rank owning nothing
        extra = [p for g in opt.param_groups for p in g["params"] if id(p) not in self.owner and p.grad is not None]
        result: list[Any] = []
        for p in self.mine:
            p.grad = None
        try:
            if extra or not self.mine:
                result.append(step())
            held = [(p, p.grad) for p in extra]
            for p, _ in held:
                p.grad = None

            def step_chunk(params: list[torch.nn.Parameter]) -> None:
                for p in params:
                    p.grad = grads[id(p)]
                try:
                    result.append(step())
                finally:
                    for p in params:
                        p.grad = None

            self._started = self.gather.collectives_issued, self.gather.bytes_issued
            try:
                self.gather.run(step_chunk)  # the buckets are zeroed after: the gradients read zero now
            finally:
                for p, g in held:
                    p.grad = g
        finally:
            for p in self.mine:
                p.grad = grads[id(p)]
        self._gathered = True
        return result[-1] if result else None

    def _gather(self, st: StepState) -> None:
        if not self._masked:
            return
        self._masked = False
        started = self.gather.collectives_issued, self.gather.bytes_issued
        if self._gathered:  # run_update gathered while it stepped
            self._gathered = False
            started = self._started
        else:
            self.gather.run()  # the bucket buffers are zeroed after: the gradients read zero now
        for b in self.buckets:
            b.attach()  # the gradient views are back
        self.reducer.mark_zeroed()  # so the zero_grad that usually follows skips its memset
        st.info["gathers"] = self.gather.collectives_issued - started[0]
        st.info["bytes_gathered"] = self.gather.bytes_issued - started[1]

    # ------------------------------------------------------------------ listing

    def described_ops(self) -> list[Op]:
        ops = [
            Op(d.pop("op"), None, {**d.pop("bucket").describe(), **d}, parent="backward")
            for d in self.reducer.describe()
        ]
        ops += [Op(d.pop("op"), None, d, parent="c_allgather_params") for d in self.gather.describe()]
        return ops

    def layout(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The partition in a checkpoint manifest: the owner of each optimizer parameter index."""
        owners = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                owners.append(self.owner.get(id(p), -1))  # -1: not the model's, kept by every rank
        return {"world_size": self.ctx.groups.world.size, "owners": owners}


def _scale(grads: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_``'s rule: multiply by ``min(1, max_norm / (norm + 1e-6))``."""
    coef = min(1.0, max_norm / (norm + 1e-6))
    for g in grads:
        g.mul_(coef)

"""The strategy engine: one chain of units per model, driven by both faces of fleetlike.

`build_engine` turns a `DistributedStrategy` into units in one fixed order (docs/ARCHITECTURE.md,
"One step, two faces")::

    sync_batch_norm, recompute   model rewrites, done when the engine is built
    slow_rank_check              times this rank's own work
    gradient_merge               k micro-steps, then one communication and one update
    data_parallel | sharding | localsgd
                                 gradient buckets during backward (allreduced | reduce-scattered,
                                 partition stepped, parameters all-gathered) | parameter averaging;
                                 stage 2 on the same buckets, transient (`fleetlike.collectives.transient`);
                                 stage 3 runs on FSDP2 (`fleetlike.strategies.zero`)
    num_apply_group              the update in groups (data parallel; sharding groups itself)
    amp                          autocast, loss scaling, agreed finite check

Each phase of a step runs the units' hooks for that phase in this order. The program style
(`fleetlike.strategies.programs`) lays the hooks out as ops of ``fleet.main_program``; the eager
style calls the `Engine` methods below from the wrapped model and optimizer. Both reach the same
hook functions, so the two styles give the same parameters step for step.

Example (eager style, what the wrappers in `fleetlike.fleet` do):
    >>> engine = build_engine(ctx)
    >>> with engine.forward(training=True) as record:   # the wrapped model's forward
    ...     out = model(x); record(out)
    >>> loss_fn(out, y).backward()                        # buckets allreduce as grads fill
    >>> engine.update(optimizer.step)                      # synchronize, update, hooks
    >>> engine.zero_grad()
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fleetlike.config import rules
from fleetlike.program import StepState
from fleetlike.strategies.amp import AmpUnit
from fleetlike.strategies.apply_groups import ApplyGroupUnit
from fleetlike.strategies.autotune import AutoTuneUnit
from fleetlike.strategies.data_parallel import DataParallelUnit, gradient_collective
from fleetlike.strategies.gradient_merge import GradientMergeUnit
from fleetlike.strategies.health import SlowRankUnit
from fleetlike.strategies.localsgd import LocalSGDUnit
from fleetlike.strategies.recompute import RecomputeUnit
from fleetlike.strategies.sharding import ShardingUnit
from fleetlike.strategies.step import EXPLICIT_SCALING, PHASES, AppliedEntry, Hook, Phase, StepContext, Unit
from fleetlike.strategies.sync_bn import SyncBatchNormUnit
from fleetlike.strategies.sharded_init import ShardedInitError, is_lazy
from fleetlike.strategies.zero import ShardedParamsUnit, _offload_policy, check_same_model, note_offload, stage2_on_fsdp2
from fleetlike.tune import requested

__all__ = ["Engine", "build_engine"]


def build_engine(ctx: StepContext) -> Engine:
    """The units for ``ctx.strategy`` in their fixed order (model rewrites happen here)."""
    s = ctx.strategy
    rules.check(s)
    units: list[Unit | None] = [
        SyncBatchNormUnit.create(ctx) if s.sync_batch_norm else None,
        RecomputeUnit.create(ctx) if s.recompute else None,
    ]
    amp = AmpUnit(ctx) if s.amp else None
    merge = GradientMergeUnit.create(ctx) if s.gradient_merge else None
    comm: Unit
    if s.localsgd or s.adaptive_localsgd:
        comm = LocalSGDUnit(ctx, adaptive=bool(s.adaptive_localsgd))
        ctx.record("data_parallel", False, "replaced by local SGD (parameters averaged, not gradients)")
        if s.check_nan_inf:
            ctx.record("check_nan_inf", False, "local SGD communicates parameters, not gradients")
    elif not (s.sharding and int(s.sharding_configs["stage"]) >= 2) and is_lazy(ctx.model):
        raise ShardedInitError(
            "the model was built as shards (fleet.sharded_init() or the meta device), which only sharding "
            f"stages 2 and 3 can train (strategy.sharding={bool(s.sharding)}, "
            f"sharding_configs.stage={s.sharding_configs['stage']}); set strategy.sharding = True with "
            "sharding_configs.stage 2 or 3, or build the model whole")
    elif s.sharding and (int(s.sharding_configs["stage"]) == 3 or (
            int(s.sharding_configs["stage"]) == 2 and (on_fsdp2 := stage2_on_fsdp2(ctx)) is not None)):
        if int(s.sharding_configs["stage"]) == 2:
            wire = [k for k in ("fp16_allreduce", "use_hierarchical_allreduce") if getattr(s, k)]
            if wire:
                raise ValueError(f"strategy.{wire[0]}=True with sharding stage 2 here: stage 2 runs on FSDP2 because "
                                 f"{on_fsdp2}, and FSDP2 reduce-scatters on one flat process group in the gradients' "
                                 f"dtype; turn {wire[0]} off, or build the model whole without offload")
        comm = ShardedParamsUnit(ctx, amp=amp is not None and amp.scaler.dynamic)
        if int(s.sharding_configs["stage"]) == 2:
            ctx.record("sharding_configs.stage", True, f"stage 2 on FSDP2, not the bucket engine: {on_fsdp2}")
    elif s.sharding:
        stage = int(s.sharding_configs["stage"])
        if stage == 2:  # every rank must build the same model (its gradients are cut by owner)
            check_same_model(ctx.groups.world, ctx.model)
        collective, notes = gradient_collective(s, ctx.groups, ctx.role)
        comm = ShardingUnit(ctx, collective, notes, amp_skips_non_finite=amp is not None and amp.scaler.dynamic,
                            multiplier=_local_multiplier(amp, merge), apply_groups=int(s.num_apply_group), stage=stage)
        if stage == 2:
            note_offload(ctx, _offload_policy(s.sharding_configs, ctx.device)[1])
    else:
        comm = DataParallelUnit(ctx, amp_skips_non_finite=amp is not None and amp.scaler.dynamic,
                                multiplier=_local_multiplier(amp, merge))
    groups = ApplyGroupUnit(ctx, int(s.num_apply_group)) if s.num_apply_group > 1 and not s.sharding else None
    health = SlowRankUnit(ctx) if s.slow_rank_check else None
    tuned = requested(s)
    tune = AutoTuneUnit(_with_strategy(ctx, tuned), comm) if tuned is not None else None
    units += [health, merge, comm, groups, amp, tune]
    return Engine(ctx, [u for u in units if u is not None])


def _local_multiplier(amp: AmpUnit | None, merge: GradientMergeUnit | None) -> Callable[[], float]:
    """What a rank's gradient at the end of a communicating backward is a multiple of its true
    value: AMP's float16 loss scale (when AMP acts this step) times gradient merge's k (when it
    averages the k micro-steps after the allreduce); for the clip before the allreduce."""
    def multiplier() -> float:
        m = 1.0
        if amp is not None and amp.scaling and amp.enabled:
            m *= float(amp.scaler.scale)
        if merge is not None and merge.avg:
            m *= merge.k_steps
        return m
    return multiplier


def _with_strategy(ctx: StepContext, s: Any) -> StepContext:
    """``ctx`` seeing ``s`` (the strategy with ``auto_tune`` turned on by the environment); the
    applied list stays shared."""
    if s is ctx.strategy:
        return ctx
    return dataclasses.replace(ctx, strategy=s, applied=ctx.applied)


class Engine:
    """Runs one model's units through the steps of an eager-style loop (see module docstring).

    The program style uses `hooks`, `forward_context`, `scaled` and `clear` only: its ops carry
    the step's order themselves."""

    def __init__(self, ctx: StepContext, units: list[Unit]) -> None:
        self.ctx = ctx
        self.units = units
        self._hooks: dict[Phase, list[Hook]] = {p: [h for u in units for h in u.hooks() if h.phase == p] for p in PHASES}
        # the hot path of an eager step touches only the units that act there
        self._contexts = [u for u in units if type(u).forward_context is not Unit.forward_context]
        self._watchers = [u for u in units if type(u).outputs is not Unit.outputs]
        #: names of the units that act at the optimizer step (checked at each step's begin)
        self.needs_optimizer = [u.name for u in units if u.needs_optimizer]
        runners = [u for u in units if type(u).run_update is not Unit.run_update]
        if len(runners) > 1:
            raise ValueError(f"units {[u.name for u in runners]} each run the update; only one may")
        #: the unit that runs the optimizer update (`Unit.run_update`), in both styles
        self.updater = runners[0] if runners else Unit()
        #: its strategy name (None when the update is the plain ``optimizer.step()``)
        self.update_runner: str | None = runners[0].name if runners else None
        self.state: StepState | None = None  # the step in progress (eager style)
        self.last: StepState | None = None  # the step the last update ended
        self._synchronized = False
        self._keep_grads = False  # the last update was a gradient-merge micro-step
        self.no_sync_depth = 0

    # ------------------------------------------------------------------ shared by both styles

    @property
    def applied(self) -> list[AppliedEntry]:
        return self.ctx.applied

    def hooks(self, phase: Phase) -> list[Hook]:
        return self._hooks[phase]

    def unit(self, name: str) -> Unit | None:
        return next((u for u in self.units if u.name == name), None)


    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if not self._contexts:
            yield
            return
        with contextlib.ExitStack() as stack:
            for u in self._contexts:
                stack.enter_context(u.forward_context())
            yield

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        for u in self.units:
            loss = u.scale_loss(loss)
        return loss

    def clear(self, st: StepState | None = None) -> None:
        """Zero the gradients, unless a gradient-merge window is still accumulating."""
        if (st.accumulate if st is not None else self._keep_grads):
            return
        if self.ctx.reducer is not None:
            self.ctx.reducer.zero_grad()
        else:
            for p in self.ctx.model.parameters():
                p.grad = None

    def state_dict(self) -> dict[str, Any]:
        states = {u.name: u.state_dict() for u in self.units}
        return {name: st for name, st in states.items() if st is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {u.name: u for u in self.units if u.state_dict() is not None}
        if set(state) != set(mine):
            raise ValueError(
                f"the saved strategy state has units {sorted(state)}, this job's strategy keeps "
                f"{sorted(mine)}; load it into a job with the strategy it was saved with"
            )
        for name, value in state.items():
            mine[name].load_state_dict(value)
        # resumed inside a gradient-merge window: the loaded partial sums must survive the eager
        # loop's zero_grad() before its next micro-step, as they would have without the restart
        merge = self.unit("gradient_merge")
        self._keep_grads = bool(getattr(merge, "micro_step", 0))

    # ------------------------------------------------------------------ eager style

    def _run(self, phase: Phase, st: StepState) -> None:
        for hook in self._hooks[phase]:
            hook.fn(st)

    def begin(self) -> StepState:
        """Start a step if none is in progress (the first training forward, or the update)."""
        if self.state is None:
            if self.needs_optimizer and self.ctx.optimizer is None:
                self.ctx.need_optimizer(f"strategy.{self.needs_optimizer[0]}")
            self.state = StepState(feed=None)
            self._synchronized = False
            self._run("begin", self.state)
        return self.state

    @contextlib.contextmanager
    def forward(self, training: bool, inputs: Any = ()) -> Iterator[Callable[[Any], None]]:
        """Around the wrapped model's forward; the caller passes the outputs to the yielded
        function. A training forward (autograd enabled) starts the step,
        arms the gradient collectives for the coming backward, and lets the units see the outputs."""
        st = self.begin() if training else None
        if st is not None:
            st.communicate = self.no_sync_depth == 0

        def record(outputs: Any) -> None:
            if st is None:
                return
            tensors = [t for t in _tensors(outputs) if t.requires_grad]
            st.roots = tensors
            self._run("before_backward", st)
            if self._watchers:
                entering = [t for t in _tensors(inputs) if t.requires_grad]
                for u in self._watchers:
                    u.outputs(st, tensors, entering)

        with self.forward_context():
            yield record

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scaled by the units (``optimizer.backward(loss)``)."""
        st = self.begin()
        st.loss = loss
        st.communicate = self.no_sync_depth == 0
        if not st.roots:  # the forward did not go through the wrapped model
            st.roots = [loss]
            self._run("before_backward", st)
        with EXPLICIT_SCALING.active():
            self.scaled(loss).backward()

    def synchronize(self) -> StepState:
        """Wait for the gradient collectives and run the units' checks (once per step)."""
        st = self.begin()
        if not self._synchronized:
            self._synchronized = True
            self._run("synchronize", st)
        return st

    def update(self, step: Callable[[], Any], loss: torch.Tensor | float | None = None) -> Any:
        """Synchronize, run the update unless a unit skips it, run the after-update hooks; ends
        the step. ``loss`` is the step's loss for units that need it (adaptive local SGD)."""
        st = self.synchronize()
        if loss is not None:
            st.loss = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._run("before_update", st)
        result = None if (st.skip_update or st.accumulate) else self.updater.run_update(st, step)
        self._run("after_update", st)
        self._keep_grads = st.accumulate
        self.state, self.last = None, st
        return result


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) model output: tensors, sequences, mappings, dataclass-likes."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)

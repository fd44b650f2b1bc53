"""The online tuner in Fleet's face (program and eager style): a unit that switches data
parallel's buckets and collective between steps.

`AutoTuneUnit` owns an `OnlineTuner` (`fleetlike.tune`); at the end of every step that updated
(``after_update``, after the other units, never inside a gradient-merge window) it tells the
tuner, which may switch the setting: the reducer's buckets are laid out anew
(`GradReducer.rebucket`, the current gradients copied) and its collective replaced by the
one `gradient_collective` builds for the candidate, so the hooks, ``.grad`` views and every
other unit carry on. Collectives are built once per (mode, communicators, wire) and the unused
ones shut down when tuning ends. Its ``fleet.applied_strategy()`` line says what is being tried,
then what was chosen and why.

Example:
    >>> s = DistributedStrategy(auto_tune=True, auto_tune_configs={"steps_per_trial": 8})
    >>> model = fleet.distributed_model(model, strategy=s)     # the first steps try settings
    >>> [e for e in fleet.applied_strategy() if e.name == "auto_tune"]
"""

from __future__ import annotations

from typing import Any

from fleetlike.collectives import BucketCollective
from fleetlike.program import StepState
from fleetlike.strategies.data_parallel import DataParallelUnit, gradient_collective
from fleetlike.strategies.step import AppliedEntry, Hook, StepContext, Unit
from fleetlike.strategies.topology import two_level_possible
from fleetlike.tune import OnlineTuner, Setting, log_path

__all__ = ["AutoTuneUnit", "shutdown_collective"]


def shutdown_collective(coll: Any) -> None:
    """Stop the helper threads a collective owns (two-level and 16-bit forms have some)."""
    seen = set()
    while coll is not None and id(coll) not in seen:
        seen.add(id(coll))
        workers = getattr(coll, "workers", None)
        if workers is not None and hasattr(workers, "shutdown"):
            workers.shutdown()
        coll = getattr(coll, "inner", None)


class AutoTuneUnit(Unit):
    """``strategy.auto_tune`` over data parallel's reducer (see the module docstring)."""

    name = "auto_tune"

    def __init__(self, ctx: StepContext, dp: Unit) -> None:
        s = ctx.strategy
        if not isinstance(dp, DataParallelUnit):
            raise ValueError(
                f"strategy.auto_tune tunes data parallel's gradient buckets, but this strategy communicates "
                f"with {dp.name} ({type(dp).__name__}). Fix: turn auto_tune off, or the other strategy")
        if s.gossip:
            raise ValueError("strategy.auto_tune and strategy.gossip: gossip keeps a residual per bucket, which a "
                             "change of buckets would drop. Fix: turn one of them off")
        self.ctx = ctx
        self.reducer = dp.reducer
        self._colls: dict[tuple[Any, int, str], BucketCollective] = {
            self._key(Setting.of(s)): self.reducer.collective}
        ok, self.why_flat = two_level_possible(s, ctx.groups, ctx.role)
        self.tuner = OnlineTuner(ctx.groups.world, s, param_bytes=[p.numel() * p.element_size() for p in self.reducer.params],
                                 two_level_ok=ok, apply=self._apply, log_path=log_path())
        self.entry = AppliedEntry("auto_tune", True, self.tuner.summary())
        ctx.applied.append(self.entry)

    @staticmethod
    def _key(setting: Setting) -> tuple[Any, int, str]:
        return (setting.mode, setting.comm_num, setting.wire)

    def hooks(self) -> list[Hook]:
        return [Hook("after_update", "auto_tune", self._tick, {"trials": lambda: len(self.tuner.trials)})]

    def _tick(self, st: StepState) -> None:
        if st.accumulate or self.tuner.done:
            return
        self.tuner.step_done()
        self.entry.detail = self.tuner.summary()
        if self.tuner.done:
            keep = self._colls.get(self._key(self.tuner.current))
            for coll in self._colls.values():
                if coll is not keep:
                    shutdown_collective(coll)
            self._colls = {self._key(self.tuner.current): self.reducer.collective}

    def _apply(self, setting: Setting) -> None:
        s = setting.applied_to(self.ctx.strategy)
        key = self._key(setting)
        coll = self._colls.get(key)
        if coll is None:
            coll, _ = gradient_collective(s, self.ctx.groups, self.ctx.role)
            self._colls[key] = coll
        self.reducer.rebucket(s.bucket_cap_bytes(), coll)

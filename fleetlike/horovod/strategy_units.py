"""The strategy switches ``hvd.DistributedOptimizer`` applies beside bucket averaging: local
accumulation (``gradient_merge``), the slow-rank check and gossip compression.

AIACC's ``PERSEUS_ACCUMULATE_N_STEPS``, ``PERSEUS_PERF_CHECK_N_STEPS`` and
``PERSEUS_DOWNSAMPLE_N_ELEMENTS`` (and their ``FLEETLIKE_*`` names, `fleetlike.config.knobs`)
act in its Horovod mode as in its DDP mode, with the core's units the DDP face uses:

- ``gradient_merge_configs.k_steps = k`` is Horovod's ``backward_passes_per_step=k``: the k-th
  backward communicates, the k-1 before accumulate locally, ``step()`` closes the window, and the
  gradients are the *sum* of the k passes averaged over ranks (Horovod's and DDP ``no_sync``'s
  semantics; ``gradient_merge_configs.avg`` is Fleet's face's). A script's own
  ``backward_passes_per_step`` that differs from k is refused (which one is meant is a guess);
- ``slow_rank_check`` times each step's own work (the end of the previous ``step()`` to the
  start of this one's ``synchronize()``, less the time spent waiting for the reductions) into
  the core's `SlowRankWindow`, gathered every ``every_n_steps`` steps;
- ``gossip`` is `fleetlike.collectives.DownsampledAllReduce` around the buckets' collective
  (`fleetlike.strategies.data_parallel.gradient_collective` builds it from the strategy).

Example:
    >>> s = DistributedStrategy(gradient_merge=True, gradient_merge_configs={"k_steps": 4})
    >>> passes_per_step(s, 1)
    4
"""

from __future__ import annotations

import time
from typing import Any

from fleetlike.comm import Communicator
from fleetlike.config import DistributedStrategy
from fleetlike.roles import Role
from fleetlike.strategies.health import SlowRankReport, SlowRankWindow

__all__ = ["StepTimer", "passes_per_step"]

_SOURCES = "strategy.gradient_merge_configs.k_steps (FLEETLIKE_ACCUMULATE_N_STEPS / PERSEUS_ACCUMULATE_N_STEPS)"


def passes_per_step(strategy: DistributedStrategy, given: int) -> int:
    """Backward passes per reduction: ``given`` (Horovod's ``backward_passes_per_step``) or the
    strategy's ``gradient_merge`` k; ValueError when both are set and differ."""
    if not strategy.gradient_merge:
        return given
    k = int(strategy.gradient_merge_configs["k_steps"])
    if given != 1 and given != k:
        raise ValueError(
            f"hvd.DistributedOptimizer(backward_passes_per_step={given}) and {_SOURCES}={k} both set the "
            f"backward passes per reduction and disagree. Fix: keep one of them (pass "
            f"backward_passes_per_step={k}, or unset the variable / turn gradient_merge off)")
    return k


class StepTimer:
    """The slow-rank check of ``hvd.DistributedOptimizer``: `sync_begins` with the reducer's wait
    total when ``synchronize()`` starts, `step_done` after the update (on every active rank, in
    the same order: it gathers over ``comm`` every ``every_n_steps`` steps)."""

    def __init__(self, strategy: DistributedStrategy, role: Role, comm: Communicator) -> None:
        cfg = strategy.slow_rank_check_configs
        self.window = SlowRankWindow(int(cfg["every_n_steps"]), float(cfg["factor"]), role)
        self.comm = comm
        self._t0 = time.perf_counter()
        self._waited0 = 0.0
        self._busy = 0.0
        #: the last window's report (None before the first window closes)
        self.report: SlowRankReport | None = None

    def describe(self) -> str:
        return self.window.describe()

    def sync_begins(self, waited: float) -> None:
        """``synchronize()`` starts: this step's own work ends (``waited``: the reducer's total
        seconds spent waiting for reductions, which are not own work)."""
        self._busy += max(0.0, time.perf_counter() - self._t0 - (waited - self._waited0))

    def step_done(self, waited: float) -> dict[str, Any] | None:
        """After the update: count the step; every ``every_n_steps`` gather and return the info."""
        due = self.window.add(self._busy)
        self._busy = 0.0
        if due:
            self.report = self.window.gather(self.comm)
        self._t0, self._waited0 = time.perf_counter(), waited
        return self.report.info() if due and self.report is not None else None

"""Slow-rank report (AIACC's performance check): who makes everyone else wait.

Each step times this rank's *own work*: from the start of the step to the moment it starts
waiting for the gradient collectives (time spent waiting inside backward, where data parallel's
buckets finish, is not counted). Whole-step times are useless here, since in synchronous
training every rank waits for the slowest one and all steps take equally long. Every
``every_n_steps`` steps the ranks all-gather their mean over the window; ranks slower than the
median by more than ``factor`` are logged by rank and host (on rank 0, through the ``fleetlike``
logger) and put in the step's stats as ``slow_ranks``. One tiny collective per window; two clock
reads per step.

Time spent waiting on the input pipeline happens between steps, outside that window, yet a rank
whose data comes late makes everyone wait just as a slow backward does. `DATA_WAIT` is where a
data loader (``fleetlike.io``, a layer above this one) records each step's wait; the report adds
it to the rank's own work and gathers it beside (``st.info["data_wait"]``, seconds per step), so
a slow input pipeline is named as such.

Example:
    >>> s.slow_rank_check = True; s.slow_rank_check_configs = {"every_n_steps": 100, "factor": 1.5}
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import torch

from fleetlike.program import StepState
from fleetlike.roles import parse_endpoint
from fleetlike.strategies.step import Hook, StepContext, Unit

__all__ = ["DATA_WAIT", "DataWait", "SlowRankUnit", "slow_ranks"]

log = logging.getLogger("fleetlike")


class DataWait:
    """Seconds this process waited on its data, summed until `take`n. The loader records from
    the training thread, the report takes on the same or another one: a lock guards the sum.

    Example:
        >>> DATA_WAIT.record(0.02); DATA_WAIT.take()
        0.02
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0

    def record(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def take(self) -> float:
        """The sum since the last take; starts a new sum."""
        with self._lock:
            seconds, self._seconds = self._seconds, 0.0
        return seconds


#: The process's data-wait sum (see the module docstring).
DATA_WAIT = DataWait()


def slow_ranks(times: list[float], factor: float) -> list[int]:
    """Ranks whose time exceeds ``factor`` x the median time."""
    median = statistics.median(times)
    return [r for r, t in enumerate(times) if t > factor * median]


class SlowRankUnit(Unit):
    """Times each step's own work; gathers and reports every ``every_n_steps`` steps."""

    name = "slow_rank_check"

    def __init__(self, ctx: StepContext) -> None:
        cfg = ctx.strategy.slow_rank_check_configs
        self.ctx = ctx
        self.every, self.factor = int(cfg["every_n_steps"]), float(cfg["factor"])
        self.hosts = [parse_endpoint(e)[0] for e in ctx.role.endpoints]
        self.t0 = 0.0
        self.waited0 = 0.0
        self.busy = 0.0
        self.runs = 0
        DATA_WAIT.take()  # waits before this unit existed belong to no window
        ctx.record(self.name, True, f"step times gathered every {self.every} steps; slow = > {self.factor}x median")

    def hooks(self) -> list[Hook]:
        return [
            Hook("begin", "step_timer_start", self._start),
            Hook("synchronize", "step_timer_stop", self._stop, {"measures": "compute before communication"}),
            Hook("after_update", "slow_rank_check", self._check,
                 {"every_n_steps": self.every, "factor": self.factor, "comm": self.ctx.groups.world.name}),
        ]

    def _waited(self) -> float:
        return self.ctx.reducer.wait_seconds if self.ctx.reducer is not None else 0.0

    def _start(self, st: StepState) -> None:
        self.t0, self.waited0 = time.perf_counter(), self._waited()

    def _stop(self, st: StepState) -> None:
        self.busy += time.perf_counter() - self.t0 - (self._waited() - self.waited0)

    def _check(self, st: StepState) -> None:
        self.runs += 1
        if self.runs < self.every:
            return
        data = DATA_WAIT.take() / self.runs
        mean = self.busy / self.runs + data
        self.busy, self.runs = 0.0, 0
        world = self.ctx.groups.world
        both = world.all_gather_flat(torch.tensor([mean, data], dtype=torch.float64)).tolist()
        times, waits = [float(t) for t in both[0::2]], [float(w) for w in both[1::2]]
        slow = [(r, self.hosts[r], times[r]) for r in slow_ranks(times, self.factor)]
        st.info["step_times"] = times
        st.info["data_wait"] = waits
        st.info["slow_ranks"] = slow
        if slow and self.ctx.role.rank == 0:
            median = statistics.median(times)
            for r, host, t in slow:
                cause = " (its input pipeline: waited on data %.4fs)" % waits[r] if waits[r] > t / 2 else ""
                log.warning("slow rank %d on %s: %.4fs of own work per step, %.2fx the median %.4fs%s",
                            r, host, t, t / median, median, cause)

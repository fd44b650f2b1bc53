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

`SlowRankWindow` is the report itself (the window, the gather, the judgement, the log line and
its record `SlowRankReport`); `SlowRankUnit` feeds it each step's own work in both styles, the DDP
face's comm hook (`fleetlike.ddp`) feeds it each backward pass's, so every face reports alike.

Example:
    >>> s.slow_rank_check = True; s.slow_rank_check_configs = {"every_n_steps": 100, "factor": 1.5}
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from fleetlike.comm import Communicator
from fleetlike.program import StepState
from fleetlike.roles import Role, parse_endpoint
from fleetlike.strategies.step import Hook, StepContext, Unit

__all__ = ["DATA_WAIT", "DataWait", "SlowRankReport", "SlowRankUnit", "SlowRankWindow", "slow_ranks"]

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


@dataclass(frozen=True)
class SlowRankReport:
    """One window's verdict, the same on every rank.

    ``step_times``: each rank's own work per step (seconds, its data wait included);
    ``data_wait``: each rank's data wait per step; ``slow_ranks``: ``(rank, host, seconds)`` of
    the ranks slower than ``factor`` x the median."""

    step_times: list[float]
    data_wait: list[float]
    slow_ranks: list[tuple[int, str, float]]

    def info(self) -> dict[str, list]:
        """The step-stats keys every face offers (``st.info``, ``step_info``)."""
        return {"step_times": self.step_times, "data_wait": self.data_wait, "slow_ranks": self.slow_ranks}


class SlowRankWindow:
    """The slow-rank report of one face: `add` each step's own work; every ``every`` steps the
    window is due and `gather` (collective: every rank, in the same order) all-gathers the means
    over ``comm``, logs the slow ranks on rank 0 and returns the `SlowRankReport`.

    Args:
        every, factor: ``slow_rank_check_configs``'s ``every_n_steps`` and ``factor``.
        role: this process's `Role` (its rank, and the hosts the report names).
    """

    def __init__(self, every: int, factor: float, role: Role) -> None:
        self.every, self.factor = int(every), float(factor)
        self.rank = role.rank
        self.hosts = [parse_endpoint(e)[0] for e in role.endpoints]
        self.busy = 0.0
        self.runs = 0
        #: the last window's report (None before the first)
        self.last: SlowRankReport | None = None
        DATA_WAIT.take()  # waits before this window existed belong to no window

    def describe(self) -> str:
        return f"step times gathered every {self.every} steps; slow = > {self.factor}x median"

    def add(self, seconds: float) -> bool:
        """One step's own work done; True when the window is full (call `gather`)."""
        self.busy += seconds
        self.runs += 1
        return self.runs >= self.every

    def gather(self, comm: Communicator) -> SlowRankReport:
        """All-gather the window's means over ``comm`` (collective), start a new window, log the
        slow ranks on rank 0 (the ``fleetlike`` logger) and return the report."""
        runs = max(self.runs, 1)
        data = DATA_WAIT.take() / runs
        mean = self.busy / runs + data
        self.busy, self.runs = 0.0, 0
        both = comm.all_gather_flat(torch.tensor([mean, data], dtype=torch.float64, device=comm.device)).tolist()
        times, waits = [float(t) for t in both[0::2]], [float(w) for w in both[1::2]]
        slow = [(r, self.hosts[r], times[r]) for r in slow_ranks(times, self.factor)]
        if slow and self.rank == 0:
            median = statistics.median(times)
            for r, host, t in slow:
                cause = " (its input pipeline: waited on data %.4fs)" % waits[r] if waits[r] > t / 2 else ""
                log.warning("slow rank %d on %s: %.4fs of own work per step, %.2fx the median %.4fs%s",
                            r, host, t, t / median, median, cause)
        self.last = SlowRankReport(times, waits, slow)
        return self.last


class SlowRankUnit(Unit):
    """Times each step's own work into a `SlowRankWindow`, gathered every ``every_n_steps`` steps."""

    name = "slow_rank_check"

    def __init__(self, ctx: StepContext) -> None:
        cfg = ctx.strategy.slow_rank_check_configs
        self.ctx = ctx
        self.window = SlowRankWindow(int(cfg["every_n_steps"]), float(cfg["factor"]), ctx.role)
        self.every, self.factor = self.window.every, self.window.factor
        self.t0 = 0.0
        self.waited0 = 0.0
        self.busy = 0.0  # this step's own work so far
        ctx.record(self.name, True, self.window.describe())

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
        due = self.window.add(self.busy)
        self.busy = 0.0
        if due:
            st.info.update(self.window.gather(self.ctx.groups.world).info())

"""Slow-rank report (AIACC's performance check): who makes everyone else wait.

Each run of ``main_program`` times this rank's *own work*: from the start of the step to the
moment it starts waiting for the gradient collectives. Whole-step times are useless here, since
in synchronous training every rank waits for the slowest one and all steps take equally long.
Every ``every_n_steps`` runs the ranks all-gather their mean over the window; ranks slower than
the median by more than ``factor`` are logged by rank and host (on rank 0, through the
``fleetlike`` logger) and put in the step's stats as ``slow_ranks``. One tiny collective per
window; two clock reads per step.

Example:
    >>> s.slow_rank_check = True; s.slow_rank_check_configs = {"every_n_steps": 100, "factor": 1.5}
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING

import torch

from fleetlike.program import Op, Program, StepState
from fleetlike.roles import parse_endpoint

if TYPE_CHECKING:
    from fleetlike.strategies.compose import Build

__all__ = ["slow_ranks", "slow_rank_pass"]

log = logging.getLogger("fleetlike")


def slow_ranks(times: list[float], factor: float) -> list[int]:
    """Ranks whose time exceeds ``factor`` x the median time."""
    median = statistics.median(times)
    return [r for r, t in enumerate(times) if t > factor * median]


def slow_rank_pass(program: Program, build: Build) -> Program:
    cfg = build.strategy.slow_rank_check_configs
    every, factor = int(cfg["every_n_steps"]), float(cfg["factor"])
    world = build.groups.world
    hosts = [parse_endpoint(e)[0] for e in build.role.endpoints]
    window = {"t0": 0.0, "busy": 0.0, "runs": 0}
    main = program.clone()

    def start(st: StepState) -> None:
        window["t0"] = time.perf_counter()

    def stop(st: StepState) -> None:
        window["busy"] += time.perf_counter() - window["t0"]

    def check(st: StepState) -> None:
        window["runs"] += 1
        if window["runs"] < every:
            return
        mean = window["busy"] / window["runs"]
        window["busy"], window["runs"] = 0.0, 0
        times = [float(t) for t in world.all_gather_flat(torch.tensor([mean], dtype=torch.float64)).tolist()]
        slow = [(r, hosts[r], times[r]) for r in slow_ranks(times, factor)]
        st.info["step_times"] = times
        st.info["slow_ranks"] = slow
        if slow and build.role.rank == 0:
            median = statistics.median(times)
            for r, host, t in slow:
                log.warning("slow rank %d on %s: %.4fs of own work per step, %.2fx the median %.4fs",
                            r, host, t, t / median, median)

    main.ops.insert(0, Op("step_timer_start", start))
    waits = "c_wait_allreduce" if main.has("c_wait_allreduce") else "optimizer_update"
    main.insert_before(waits, Op("step_timer_stop", stop, {"measures": "compute before communication"}))
    main.ops.append(Op("slow_rank_check", check, {"every_n_steps": every, "factor": factor, "comm": world.name}))
    build.record("slow_rank_check", True, f"step times gathered every {every} steps; slow = > {factor}x median")
    return main

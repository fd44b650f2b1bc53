"""The online tuner: tries communication settings during a job's first steps and keeps the fastest.

Every rank calls `OnlineTuner.step_done` once at the end of each training step. A trial runs one
`Setting` for ``warmup_steps`` unmeasured steps, then ``steps_per_trial`` measured ones. At its
end the ranks all-reduce the step times with MAX, so each measured step counts as long as its
slowest rank made it (a data-parallel step cannot finish before every rank's gradients arrive),
and score the trial by the median of those times (one slow step from a neighbour's process does
not decide). Every rank then holds the same numbers and runs the same search; rank 0's choice is
broadcast and a rank that decided otherwise raises instead of going on with another setting.
So the switch happens at the same step everywhere.

The search is coordinate descent from the starting setting (the strategy as configured: the
planner's recommendation when the job was started from ``python -m fleetlike.plan``'s
strategy file): each free knob in turn (allreduce mode, bucket size, communicators, wire
dtype) tries its values with the others at the best so far; a candidate replaces the best
only when faster by ``min_gain`` beyond the noise. Each comparison is a race
(`fleetlike.tune.race`): a confidence interval on the candidate's gain from the per-step spread
of both trials settles a clear loss at once; otherwise the best is timed again, and while the
gain stays within the noise both are re-run in alternating trials, up to ``race_blocks`` each,
after which the medians decide. So settings far apart cost one trial each and only close
contenders pay for more steps. A short joint phase follows: the top-2 bucket sizes x the
top-2 communicator counts not yet measured (small buckets may pay only with two communicators
overlapping them, while neither alone beats the incumbent by ``min_gain``), kept by the same
rule; more communicators than buckets are skipped. Then the best setting is applied for the
rest of the job and the trial log is written (Horovod's ``HOROVOD_AUTOTUNE_LOG`` columns first:
``hierarchical_allreduce,hierarchical_allgather,cycle_time_ms,tensor_fusion_threshold,score``,
score in gradient bytes per microsecond as Horovod's; then fleetlike's own, ``phase`` saying
``one_knob`` or ``joint``, ``vs_best`` and ``verdict`` how a candidate's race ended, its
``measured_steps`` over all its trials in that race; the last row is the best, as Horovod writes it).

Example:
    >>> tuner = OnlineTuner(world, strategy, param_bytes=sizes, two_level_ok=False, apply=switch)
    >>> for batch in loader:
    ...     train_step(batch); tuner.step_done()
    >>> tuner.summary()
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from fleetlike.comm import Communicator
from fleetlike.config import DistributedStrategy
from fleetlike.tune.race import Contender, Move, Race
from fleetlike.tune.space import AllreduceMode, Knob, Setting, fixed_reasons, knob_values, same_buckets

__all__ = ["LOG_COLUMNS", "OnlineTuner", "Trial", "decode", "encode"]

#: the trial log's columns: Horovod's autotune log, then fleetlike's
LOG_COLUMNS = ("hierarchical_allreduce", "hierarchical_allgather", "cycle_time_ms", "tensor_fusion_threshold",
               "score", "nccl_comm_num", "wire_dtype", "steps_per_s", "median_step_s", "measured_steps", "best", "phase",
               "vs_best", "verdict")
#: the order in which knobs are searched: where two levels can form, the mode moves a slow link's
#: traffic most (1.5-1.6x at 100 Mbit in bench/autotune.py), so the bucket sizes are tried under it
_ORDER = (Knob.ALLREDUCE_MODE, Knob.BUCKET_MB, Knob.COMM_NUM, Knob.WIRE_DTYPE)
_MODES = list(AllreduceMode)
_WIRES = ["native", "float16", "bfloat16"]


@dataclasses.dataclass
class Trial:
    """One measured candidate: its setting and the slowest rank's step times."""

    setting: Setting
    step_times: list[float]
    first_step: int  # the job's step index (0-based) of its first step
    phase: str = "one_knob"  # or "joint": measured in the joint bucket size x communicators phase
    #: as a challenger: its gain over the best with the interval's half width ("+3.1% +- 2.0%"), and
    #: how its race ended (faster / not_faster, "by budget" where the step budget decided)
    vs_best: str = ""
    verdict: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.median_s


class OnlineTuner:
    """See the module docstring. ``apply(setting)`` switches the job's communication (called on
    every rank at the same step, between steps); ``param_bytes`` are the gradient sizes in
    parameter order (to skip bucket sizes that give the same buckets); ``fixed`` names knobs a
    face fixed explicitly (Horovod's variables), or maps each to why."""

    def __init__(self, world: Communicator, strategy: DistributedStrategy, *, param_bytes: Sequence[int],
                 two_level_ok: bool, apply: Callable[[Setting], None], fixed: Iterable[str] | Mapping[str, str] = (),
                 log_path: str | os.PathLike[str] | None = None, cycle_time_ms: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter,
                 bucket_count: Callable[[Setting], int] | None = None) -> None:
        cfg = strategy.auto_tune_configs
        self.world = world
        self.warmup = int(cfg["warmup_steps"])
        self.per_trial = int(cfg["steps_per_trial"])
        self.min_gain = float(cfg["min_gain"])
        self.seconds_per_trial = float(cfg["seconds_per_trial"])
        self.race_blocks = int(cfg["race_blocks"])
        self.race_gain = float(cfg["race_gain"])
        self.confidence = float(cfg["confidence"])
        #: a bound on the steps of one trial, whatever the speed of the first
        self.max_steps_per_trial = max(self.per_trial, 200)
        #: the race under way: the challenger's trial, the incumbent's trial of this race (None
        #: until it is timed again), and which of the two the current block measures
        self._race: Race | None = None
        self._race_c: Trial | None = None
        self._race_b: Trial | None = None
        self._racing = Contender.CHALLENGER
        #: races that needed more than the challenger's trial and the incumbent's re-timing
        self.extended_races = 0
        self._warmed = False
        self.param_bytes = list(param_bytes)
        self.grad_bytes = sum(self.param_bytes)
        #: each knob left alone, and why (the user set it, the face fixes it, ...)
        self.fixed_why = fixed_reasons(strategy, fixed)
        self.fixed = set(self.fixed_why)
        self.values = knob_values(strategy, param_bytes=self.param_bytes, two_level_ok=two_level_ok,
                                  fixed=self.fixed)
        self.start = Setting.of(strategy)
        self.current = self.start
        self.best: Trial | None = None
        self.trials: list[Trial] = []
        self.log_path = Path(log_path) if log_path else None
        self.cycle_time_ms = float(cycle_time_ms)
        self._apply = apply
        #: how many buckets a setting gives (default: from ``param_bytes``; the DDP face counts DDP's own)
        self.bucket_count = bucket_count or (lambda st: len(same_buckets(self.param_bytes, st.bucket_mb)))
        #: the step clock (a test may skew one rank's to check that the ranks still agree)
        self.clock = clock
        self._knobs = [k for k in _ORDER if k in self.values]
        self._pending: list[Setting] = []
        #: the joint phase (bucket size x communicators, after the one-knob passes) has begun
        self._joint_done = False
        self._measured: dict[Setting, Trial] = {}
        self._times: list[float] = []
        self._since_switch = 0
        self._last: float | None = None
        self._began: float | None = None
        #: steps taken while tuning (the first trial's first step to the decision), and their seconds
        self.tuning_steps = 0
        self.tuning_seconds = 0.0
        self.steps = 0
        self.done = not self._knobs
        #: why tuning ended before its search did (the world re-formed), else None
        self.stopped: str | None = None
        self._paused = False

    # ------------------------------------------------------------------ the per-step call

    def step_done(self) -> None:
        """The end of a training step on this rank (collective once per trial: every rank calls it
        at every step)."""
        now = self.clock()
        self.steps += 1
        if self.done:
            return
        if self._last is None:  # the job's first step: its time includes everything before it
            self._last = self._began = now
            self.tuning_steps = 1
            return
        if self._paused:  # the steps since the pause were not ticked: this one starts a new interval
            self._paused = False
            self._last = now
            self.tuning_steps += 1
            return
        dt, self._last = now - self._last, now
        self.tuning_steps += 1
        self._since_switch += 1
        if self._since_switch > self.warmup:
            self._times.append(dt)
        if len(self._times) < self.per_trial:
            return
        self._end_trial()
        self._last = self.clock()  # the switch itself is counted in tuning_seconds, not in a trial
        assert self._began is not None
        self.tuning_seconds = self._last - self._began

    def pause(self) -> None:
        """Steps ran without `step_done` (``hvd.join``: a joined rank stops stepping and the
        others stop ticking): the next `step_done` only restarts the clock, so no measured step
        spans the gap. Called on every rank at the same point (the join's end)."""
        if not self.done and self._last is not None:
            self._paused = True

    def stop(self, setting: Setting, why: str) -> None:
        """End tuning now with ``setting`` (which the caller has applied on every rank, agreed),
        e.g. when the world re-formed under it: no more trials, no more collectives."""
        self.done = True
        self.current = setting
        self.stopped = why
        self._joint_done = True
        self._pending, self._knobs, self._times = [], [], []
        self._race = self._race_c = self._race_b = None
        self._write_log()

    # ------------------------------------------------------------------ one trial ends

    def _end_trial(self) -> None:
        times = torch.tensor(self._times, dtype=torch.float64, device=self.world.device)
        self.world.all_reduce(times, "max")  # each step as long as its slowest rank made it
        trial = Trial(self.current, times.tolist(), self.steps - len(self._times) - self.warmup,
                      "joint" if self._joint_done else "one_knob")
        if not self._warmed:
            # the job's first steps run slower than its later ones (caches, allocator, the other
            # ranks still starting: up to 25% in bench/autotune.py), so, as Horovod's warm-up
            # samples, the first trial only sets the trial length and the start is timed again.
            # Later trials last at least seconds_per_trial at this speed (a few steps of a few
            # milliseconds are at the mercy of every other process on the machine); agreed: the
            # median is the max-reduced one, so every rank computes the same count
            self._warmed = True
            self.per_trial = max(self.per_trial, math.ceil(self.seconds_per_trial / max(trial.median_s, 1e-9)))
            self.per_trial = min(self.per_trial, self.max_steps_per_trial)
            self._times = []
            self._since_switch = 0
            return
        move = self._judge(trial)
        if move in (Move.RUN_CHALLENGER, Move.RUN_INCUMBENT):
            assert self._race_c is not None and self.best is not None
            self._racing = Contender.CHALLENGER if move is Move.RUN_CHALLENGER else Contender.INCUMBENT
            nxt = self._agree(self._race_c.setting if move is Move.RUN_CHALLENGER else self.best.setting)
            if nxt != self.current:
                self._apply(nxt)
                self.current = nxt
            self._times = []
            self._since_switch = 0
            return
        nxt = self._next()
        nxt = self._agree(nxt)
        if nxt is None:
            self.done = True
            assert self.best is not None
            if self.best.setting != self.current:
                self._apply(self.best.setting)
                self.current = self.best.setting
            self._write_log()
            return
        self._apply(nxt)
        self.current = nxt
        self._times = []
        self._since_switch = 0

    def _judge(self, block: Trial) -> Move | None:
        """Score one block of measured steps: the start's first trial, a new challenger (a race
        begins), or one more block of a race under way (`fleetlike.tune.race`). None or SWITCH /
        KEEP: the comparison is over and the search moves on; RUN_*: measure that contender again."""
        race = self._race
        if race is None:
            self.trials.append(block)
            self._measured[block.setting] = block
            if self.best is None:
                self.best = block
                return None
            self._race_c = block
            race = self._race = Race(block.step_times, self.best.step_times, max_blocks=self.race_blocks,
                                     min_gain=self.min_gain, race_gain=self.race_gain, confidence=self.confidence)
            self._racing = Contender.CHALLENGER
        else:
            assert self._race_c is not None
            race.add(self._racing, block.step_times)
            if self._racing is Contender.CHALLENGER:
                self._race_c.step_times.extend(block.step_times)
            elif self._race_b is None:  # the incumbent timed again, right after its challenger
                self._race_b = block
                self.trials.append(block)
            else:
                self._race_b.step_times.extend(block.step_times)
        move = race.next()
        if move in (Move.RUN_CHALLENGER, Move.RUN_INCUMBENT):
            return move
        assert self._race_c is not None and race.last is not None
        if race.challenger_blocks + race.incumbent_blocks > 2:
            self.extended_races += 1
        self._race_c.vs_best = race.last.text()
        self._race_c.verdict = ("faster" if move is Move.SWITCH else "not_faster") + (" by budget" if race.by_budget else "")
        if move is Move.SWITCH:
            self.best = self._race_c
        elif self._race_b is not None:  # the incumbent's freshest times stand for it from now on
            self.best = self._race_b
        self._race = self._race_c = self._race_b = None
        return move

    def _next(self) -> Setting | None:
        """The next candidate to measure (None: the search is over), the same on every rank."""
        assert self.best is not None
        while True:
            while self._pending:
                cand = self._pending.pop(0)
                if cand not in self._measured and not self._redundant(cand):
                    return cand
            if not self._knobs:
                if self._joint_done:
                    return None
                self._joint_done = True
                self._pending = self._joint_candidates()
                continue
            knob = self._knobs.pop(0)
            base = self.best.setting
            self._pending = [base.replace(knob, v) for v in self.values[knob]]

    def _joint_candidates(self) -> list[Setting]:
        """The joint phase: the top-2 bucket sizes x the top-2 communicator counts (each value
        ranked by the fastest trial that ran it), the other knobs at the best. One knob at a time
        misses a pair whose halves each gain less than ``min_gain`` (small buckets only pay with
        two communicators to overlap them); computed from the max-reduced times, so the same on
        every rank. Only where both knobs are free."""
        assert self.best is not None
        if Knob.BUCKET_MB not in self.values or Knob.COMM_NUM not in self.values:
            return []
        base = self.best.setting
        comms = self._top(Knob.COMM_NUM, lambda st: st.comm_num)
        # a bucket size with fewer buckets than communicators pairs with nothing new: the next one does
        most = max(c for c in comms if isinstance(c, int))
        buckets = self._top(Knob.BUCKET_MB, lambda st: st.bucket_mb,
                            lambda b: self.bucket_count(base.replace(Knob.BUCKET_MB, b)) >= most)
        return [base.replace(Knob.BUCKET_MB, b).replace(Knob.COMM_NUM, c) for b in buckets for c in comms]

    def _top(self, knob: Knob, value: Callable[[Setting], object], keep: Callable[[object], bool] = lambda v: True,
             n: int = 2) -> list[object]:
        """The ``n`` values of ``knob`` that ``keep`` accepts with the fastest trials (ties: the
        search's order); a value never measured (two communicators were redundant at the
        incumbent's buckets) ranks last."""
        speed: dict[object, float] = {}
        for t in self.trials:
            v = value(t.setting)
            speed[v] = max(speed.get(v, 0.0), t.steps_per_s)
        return sorted([v for v in self.values[knob] if keep(v)], key=lambda v: -speed.get(v, 0.0))[:n]

    def _redundant(self, cand: Setting) -> bool:
        """More communicators than buckets change nothing: not worth a trial."""
        return cand.comm_num > 1 and self.bucket_count(cand) < cand.comm_num

    def _agree(self, mine: Setting | None) -> Setting | None:
        """Rank 0's decision, broadcast; a rank that decided otherwise raises (never diverges)."""
        code = torch.tensor(encode(mine), dtype=torch.float64)
        root = code.to(self.world.device)
        self.world.broadcast(root, 0)
        root = root.cpu()
        if not torch.equal(root, code):
            raise RuntimeError(
                f"auto_tune: rank {self.world.rank} chose {mine.label() if mine else 'to stop'} but rank 0 "
                f"chose {_decode(root.tolist())}; the ranks measured the same max-reduced step times, so "
                "this is a bug: report it with the trial log")
        return mine

    # ------------------------------------------------------------------ reports

    def summary(self) -> str:
        """What was chosen and why, for ``fleet.applied_strategy()``."""
        if not self.values:
            return (f"nothing to tune: every knob is fixed or has one possible value on this job; fixed knobs: "
                    f"{self.fixed_text()}")
        if self.stopped is not None:
            return (f"stopped with {self.current.label()}: {self.stopped}; {len(self.trials)} trials in "
                    f"{self.tuning_steps} steps; fixed knobs: {self.fixed_text()}")
        if not self.done:
            return (f"tuning: trial {len(self.trials) + 1}, now {self.current.label()}"
                    + (f"; best so far {self.best.setting.label()} at {self.best.steps_per_s:.2f} steps/s"
                       if self.best else "") + f"; fixed knobs: {self.fixed_text()}")
        assert self.best is not None
        first = self.trials[0]
        gain = self.best.steps_per_s / first.steps_per_s
        return (f"chose {self.best.setting.label()}: {self.best.steps_per_s:.2f} steps/s (median of the slowest "
                f"rank's step times), {gain:.2f}x the start ({first.setting.label()}, "
                f"{first.steps_per_s:.2f} steps/s); {len(self.trials)} trials in {self.tuning_steps} steps "
                f"({self.tuning_seconds:.2f} s); {self.extended_races} comparisons re-run where the lead was within "
                f"the noise; fixed knobs: {self.fixed_text()}")

    def fixed_text(self) -> str:
        """The knobs left alone and why, for the applied list."""
        return "; ".join(f"{k.value} ({why})" for k, why in sorted(self.fixed_why.items(), key=lambda kv: kv[0].value)) \
            or "none"

    def rows(self) -> list[dict[str, object]]:
        """The trial log's rows (the best last, again, as Horovod's log ends)."""
        out = [self._row(t, False) for t in self.trials]
        if self.done and self.best is not None and self.stopped is None:  # a stopped search chose nothing
            out.append(self._row(self.best, True))
        return out

    def _row(self, t: Trial, best: bool) -> dict[str, object]:
        s = t.setting
        score = self.grad_bytes / t.median_s / 1e6  # Horovod's score: bytes per microsecond
        return {"hierarchical_allreduce": int(s.mode is AllreduceMode.TWO_LEVEL), "hierarchical_allgather": 0,
                "cycle_time_ms": self.cycle_time_ms, "tensor_fusion_threshold": s.bucket_mb, "score": round(score, 6),
                "nccl_comm_num": s.comm_num, "wire_dtype": s.wire, "steps_per_s": round(t.steps_per_s, 4),
                "median_step_s": round(t.median_s, 6), "measured_steps": len(t.step_times), "best": int(best),
                "phase": t.phase, "vs_best": t.vs_best, "verdict": t.verdict}

    def _write_log(self) -> None:
        if self.log_path is None or self.world.rank != 0:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=LOG_COLUMNS)
            w.writeheader()
            w.writerows(self.rows())


def encode(s: Setting | None) -> list[float]:
    """A setting (None: stop) as numbers, for a broadcast."""
    if s is None:
        return [1.0, 0.0, 0.0, 0.0, 0.0]
    return [0.0, float(_MODES.index(s.mode)), s.bucket_mb, float(s.comm_num), float(_WIRES.index(s.wire))]


def decode(code: list[float]) -> Setting | None:
    """`encode`'s inverse."""
    if code[0]:
        return None
    return Setting(_MODES[int(code[1])], code[2], int(code[3]), _WIRES[int(code[4])])


def _decode(code: list[float]) -> str:
    s = decode(code)
    return "to stop" if s is None else s.label()

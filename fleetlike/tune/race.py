"""The online tuner's decision rule: is a challenger faster than the incumbent, beyond the noise?

A trial's step times (each the slowest rank's, so every rank holds the same numbers) vary from
step to step: other processes on the cores, the link, the allocator. One short trial cannot tell
settings a few percent apart where that noise is larger (4 ranks sharing 2 cores), while a long
trial for every candidate makes tuning cost a multiple of itself where it is not. So candidates
race: `compare` estimates the challenger's gain (the log ratio of the two medians) and a
confidence interval for it from the per-step spread (a robust standard error of each median:
1.2533 x 1.4826 x MAD / sqrt(n), with Student's t for the few steps of a trial), and

- ``FASTER``: the gain is at least ``min_gain`` and its interval excludes no gain;
- ``NOT_FASTER``: even the interval's upper end is below ``race_gain``, the smallest gain worth
  more steps (a challenger clearly slower, or a tie measured precisely, stops at once);
- ``UNRESOLVED``: the difference is within the noise.

`Race` runs the contenders of one comparison: the challenger's trial against the incumbent's
last one; unless that settles it, the incumbent is timed again (load drifts during a job), then
blocks of steps alternate between the two while the comparison is unresolved, up to
``race_blocks`` blocks each (a win needs two agreeing looks: against the earlier trial too, or
two blocks each: steps in a row share their load, so one slow block of the incumbent must not
decide); then the point estimate decides (the challenger wins only by
``min_gain``). ``race_blocks = 1`` is the rule without races: one trial each, the medians
decide, a win confirmed against the incumbent timed again. Every input is the max-reduced step times, so every rank reaches the same moves.

Example:
    >>> race = Race([0.50, 0.51, 0.49, 0.50, 0.52], [0.56, 0.55, 0.57, 0.56, 0.55])
    >>> race.next()                    # the incumbent's times are from an earlier trial: re-time it
    <Move.RUN_INCUMBENT: 'run_incumbent'>
    >>> race.add(Contender.INCUMBENT, [0.55, 0.57, 0.56, 0.56, 0.58]); race.next(), race.last.text()
    (<Move.SWITCH: 'switch'>, '+12.0% +- 6.4%')
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from collections.abc import Sequence

__all__ = ["Comparison", "Contender", "Move", "Race", "Verdict", "compare", "median_rel_se", "t_quantile"]

#: the standard error of a median over that of a mean (normal data): sqrt(pi / 2)
_MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)
#: the MAD of normal data times this is its standard deviation
_MAD_TO_SD = 1.4826


class Verdict(str, enum.Enum):
    """What one comparison of two contenders' step times shows."""

    FASTER = "faster"
    NOT_FASTER = "not_faster"
    UNRESOLVED = "unresolved"


class Move(str, enum.Enum):
    """What a race does next."""

    SWITCH = "switch"  # the challenger replaces the incumbent
    KEEP = "keep"  # the incumbent stays
    RUN_INCUMBENT = "run_incumbent"  # measure one more block of the incumbent
    RUN_CHALLENGER = "run_challenger"  # measure one more block of the challenger


class Contender(str, enum.Enum):
    CHALLENGER = "challenger"
    INCUMBENT = "incumbent"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The challenger's estimated gain (log of the incumbent's median over its own: 0.05 is
    about 5% more steps/s), the half width of its confidence interval, and the verdict."""

    gain: float
    half_width: float
    verdict: Verdict

    def text(self) -> str:
        return f"{math.expm1(self.gain):+.1%} +- {math.expm1(self.half_width):.1%}"


def t_quantile(confidence: float, dof: int) -> float:
    """Student's t two-sided quantile (Cornish-Fisher expansion of the normal one: within 1% of
    the exact value from 3 degrees of freedom up at 95%), so a 5-step trial is not read as
    precisely as a 50-step one."""
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    v = max(int(dof), 1)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def median_rel_se(times: Sequence[float]) -> float:
    """The standard error of the median of ``times`` relative to it, from their MAD (robust: one
    step slowed by another process on the machine widens it little)."""
    n = len(times)
    if n < 2:
        return math.inf
    med = statistics.median(times)
    mad = statistics.median(abs(t - med) for t in times)
    return _MEDIAN_EFFICIENCY * _MAD_TO_SD * mad / math.sqrt(n) / med


def compare(challenger: Sequence[float], incumbent: Sequence[float], *, min_gain: float, race_gain: float,
            confidence: float) -> Comparison:
    """The verdict on ``challenger``'s step times against ``incumbent``'s (see the module docstring)."""
    if not challenger or not incumbent:
        raise ValueError("compare needs at least one step time of each contender")
    gain = math.log(statistics.median(incumbent)) - math.log(statistics.median(challenger))
    se = math.hypot(median_rel_se(challenger), median_rel_se(incumbent))
    half = t_quantile(confidence, min(len(challenger), len(incumbent)) - 1) * se if math.isfinite(se) else math.inf
    if gain - half > 0 and gain >= math.log1p(min_gain):
        verdict = Verdict.FASTER
    elif gain + half < math.log1p(race_gain):
        verdict = Verdict.NOT_FASTER
    else:
        verdict = Verdict.UNRESOLVED
    return Comparison(gain, half, verdict)


@dataclasses.dataclass
class Race:
    """One challenger against the incumbent (see the module docstring). ``incumbent`` starts as
    the incumbent's last trial; its first block in this race replaces it."""

    challenger: list[float]
    incumbent: list[float]
    max_blocks: int = 3
    min_gain: float = 0.02
    race_gain: float = 0.05
    confidence: float = 0.95
    challenger_blocks: int = 1
    incumbent_blocks: int = 0  # 0: the incumbent's times are from before this race
    #: the comparison behind the last move, and whether the step budget decided it
    last: Comparison | None = None
    by_budget: bool = False
    #: the verdict against the incumbent's earlier trial (None until judged)
    first: Verdict | None = None

    def __post_init__(self) -> None:
        self.challenger = list(self.challenger)
        self.incumbent = list(self.incumbent)
        if self.max_blocks < 1:
            raise ValueError(f"race_blocks={self.max_blocks}: each contender runs at least one block. Fix: >= 1")

    def add(self, who: Contender, times: Sequence[float]) -> None:
        """One more block of ``who``'s step times."""
        if who is Contender.CHALLENGER:
            self.challenger += list(times)
            self.challenger_blocks += 1
        elif self.incumbent_blocks == 0:
            self.incumbent = list(times)
            self.incumbent_blocks = 1
        else:
            self.incumbent += list(times)
            self.incumbent_blocks += 1

    def next(self) -> Move:
        """The next move from the times so far."""
        c = compare(self.challenger, self.incumbent, min_gain=self.min_gain, race_gain=self.race_gain,
                    confidence=self.confidence)
        self.last = c
        if self.max_blocks == 1:  # no re-runs: the medians decide, a win is checked once
            self.by_budget = c.verdict is Verdict.UNRESOLVED
            win = c.gain >= math.log1p(self.min_gain)
            if self.incumbent_blocks == 0:
                return Move.RUN_INCUMBENT if win else Move.KEEP
            return Move.SWITCH if win else Move.KEEP
        if self.incumbent_blocks == 0:  # against an earlier trial: a loss stands, a win is checked
            self.first = c.verdict
            return Move.KEEP if c.verdict is Verdict.NOT_FASTER else Move.RUN_INCUMBENT
        # a win needs two agreeing looks: the earlier trial's verdict, or a second trial each.
        # Steps in a row share their load (one slow trial of the incumbent reads as a clear win
        # from the per-step spread), so one pair of trials that contradicts the earlier one
        # does not decide alone
        if c.verdict is Verdict.FASTER and (self.first is Verdict.FASTER
                                            or min(self.challenger_blocks, self.incumbent_blocks) >= 2):
            return Move.SWITCH
        if c.verdict is Verdict.NOT_FASTER:
            return Move.KEEP
        if self.challenger_blocks >= self.max_blocks and self.incumbent_blocks >= self.max_blocks:
            self.by_budget = True
            return Move.SWITCH if c.gain >= math.log1p(self.min_gain) else Move.KEEP
        if self.challenger_blocks <= self.incumbent_blocks and self.challenger_blocks < self.max_blocks:
            return Move.RUN_CHALLENGER
        if self.incumbent_blocks < self.max_blocks:
            return Move.RUN_INCUMBENT
        return Move.RUN_CHALLENGER

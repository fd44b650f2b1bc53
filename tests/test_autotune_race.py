"""The tuner's decision rule (`fleetlike.tune.race`) on synthetic step times with a known gap and noise.

- Bounded noise and a gap far beyond it: the race ends after the challenger's trial and the
  incumbent's re-timing, with the truly faster one (cheap cells stay cheap).
- Noise of the size a trial cannot resolve (each step's time lognormal with a spread as large as
  the gap, 8-12%): the race picks the truly faster one far more often than one trial each would, whichever
  of the two is faster, and spends more steps only there.
- A tie measured precisely stops at once; a tie in heavy noise stops at the step budget.
- Student's t (the interval's width for a few steps) against its table values.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlike.tune.race import Contender, Move, Race, Verdict, compare, median_rel_se, t_quantile

BLOCK = 5  # steps per trial (auto_tune_configs.steps_per_trial's default)


def _block(rng: random.Random, mean: float, noise: float, uniform: bool) -> list[float]:
    if uniform:
        return [mean * (1 + rng.uniform(-noise, noise)) for _ in range(BLOCK)]
    return [mean * math.exp(rng.gauss(0.0, noise)) for _ in range(BLOCK)]


def _race(rng: random.Random, challenger: float, incumbent: float, noise: float, *, uniform: bool = False,
          max_blocks: int = 3) -> tuple[Move, int]:
    """One race of a challenger against an incumbent with these mean step times: the final move
    and the steps it measured (the incumbent's earlier trial included)."""
    race = Race(_block(rng, challenger, noise, uniform), _block(rng, incumbent, noise, uniform), max_blocks=max_blocks)
    steps = 2 * BLOCK
    while True:
        move = race.next()
        if move in (Move.SWITCH, Move.KEEP):
            return move, steps
        who = Contender.CHALLENGER if move is Move.RUN_CHALLENGER else Contender.INCUMBENT
        race.add(who, _block(rng, challenger if who is Contender.CHALLENGER else incumbent, noise, uniform))
        steps += BLOCK


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), gap=st.floats(0.4, 2.0), noise=st.floats(0.0, 0.03),
       faster=st.booleans(), base=st.floats(1e-3, 10.0))
def test_a_gap_far_beyond_the_noise_is_resolved_at_once(seed, gap, noise, faster, base):
    rng = random.Random(seed)
    slow, fast = base * (1 + gap), base
    move, steps = _race(rng, fast if faster else slow, slow if faster else fast, noise, uniform=True)
    assert move is (Move.SWITCH if faster else Move.KEEP)
    # a clear loss against the incumbent's earlier trial stops at once; a clear win is checked
    # against the incumbent timed again, once
    assert steps == (3 * BLOCK if faster else 2 * BLOCK)


@settings(max_examples=8, deadline=None, derandomize=True)  # fixed draws: a statistical bound, never flaky
@given(seed=st.integers(0, 2**32 - 1), gap=st.sampled_from([0.08, 0.10, 0.12]), faster=st.booleans())
def test_a_gap_within_one_trials_noise_is_raced_to_the_truly_faster_one(seed, gap, faster):
    rng = random.Random(seed)
    noise, n = gap, 400  # each step's time ~ lognormal, sd as large as the gap: one trial cannot tell
    fast, slow = 1.0, 1.0 + gap
    c, b = (fast, slow) if faster else (slow, fast)
    raced = [_race(rng, c, b, noise) for _ in range(n)]
    right = Move.SWITCH if faster else Move.KEEP
    once = [_race(rng, c, b, noise, max_blocks=1) for _ in range(n)]  # one trial each, as without racing
    p_race = sum(m is right for m, _ in raced) / n
    p_once = sum(m is right for m, _ in once) / n
    assert p_race >= (0.88 if faster else 0.97)
    assert p_race >= p_once + (0.03 if faster else 0.0)
    # the budget bounds each race: 3 blocks per contender, the incumbent's earlier trial besides
    assert max(s for _, s in raced) <= 7 * BLOCK
    assert sum(s for _, s in raced) > sum(s for _, s in once)


def test_a_tie_stops_at_once_when_measured_precisely_and_at_the_budget_in_heavy_noise():
    rng = random.Random(7)
    for _ in range(50):
        move, steps = _race(rng, 1.0, 1.0, 0.002)
        assert move is Move.KEEP and steps == 2 * BLOCK
    ends = [_race(rng, 1.0, 1.0, 0.3) for _ in range(100)]
    assert sum(s == 7 * BLOCK for _, s in ends) >= 50  # within the noise to the end, mostly


def test_verdicts_and_the_interval():
    same = [1.0, 1.01, 0.99, 1.0, 1.02]
    assert compare([0.5] * 5, same, min_gain=0.02, race_gain=0.05, confidence=0.95).verdict is Verdict.FASTER
    assert compare([2.0] * 5, same, min_gain=0.02, race_gain=0.05, confidence=0.95).verdict is Verdict.NOT_FASTER
    wide = [0.7, 1.3, 1.0, 0.8, 1.2]
    c = compare(wide, same, min_gain=0.02, race_gain=0.05, confidence=0.95)
    assert c.verdict is Verdict.UNRESOLVED and c.half_width > 0.1
    # exact times (a fake clock): no noise, the medians decide
    assert compare([1.0] * 3, [1.03] * 3, min_gain=0.02, race_gain=0.05, confidence=0.95).verdict is Verdict.FASTER
    assert compare([1.0] * 3, [1.01] * 3, min_gain=0.02, race_gain=0.05, confidence=0.95).verdict is Verdict.NOT_FASTER
    assert median_rel_se([1.0]) == math.inf
    with pytest.raises(ValueError, match="race_blocks=0"):
        Race([1.0], [1.0], max_blocks=0)


@pytest.mark.parametrize("dof, want", [(3, 3.182), (4, 2.776), (9, 2.262), (14, 2.145), (29, 2.045), (200, 1.972)])
def test_t_quantile_matches_the_table(dof, want):
    assert t_quantile(0.95, dof) == pytest.approx(want, rel=0.01)

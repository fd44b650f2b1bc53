"""The replay that splits a pipeline's measured idle into bubble, jitter and handoff latency
(`bench.pipeline_timeline`): checked against the schedules' closed forms."""

from __future__ import annotations

import pytest

from bench.pipeline_timeline import (Op, StageTimes, expected_idle, handoff_latency, median_durations, replay,
                                     with_extra_warmup)
from fleetlike.pipeline.runner import op_order


def _order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """torch's op order on ``stage``: GPipe all forwards then all backwards; 1F1B
    ``stages - stage`` warm-up forwards, then one backward and one forward in turn."""
    if schedule == "FThenB":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, stages - stage)
    out, f, b = [("F", i) for i in range(warm)], warm, 0
    while f < m:
        out += [("B", b), ("F", f)]
        b, f = b + 1, f + 1
    return out + [("B", i) for i in range(b, m)]


def _ops(schedule: str, stages: int, m: int, fwd: float = 1.0, bwd: float = 2.0) -> list[list[Op]]:
    return [[Op(k, i, 0.0, fwd if k == "F" else bwd) for k, i in _order(schedule, s, stages, m)]
            for s in range(stages)]


@pytest.mark.parametrize("schedule", ["1F1B", "FThenB"])
@pytest.mark.parametrize("stages,m", [(2, 4), (2, 16), (4, 8)])
def test_equal_stages_without_latency_idle_the_bubble(schedule: str, stages: int, m: int) -> None:
    r = replay(_ops(schedule, stages, m))
    assert r.span == pytest.approx((m + stages - 1) * 3.0)
    for idle in r.idle:
        assert idle / r.span == pytest.approx((stages - 1) / (m + stages - 1))


def test_1f1b_pays_a_round_trip_per_micro_batch_gpipe_only_at_fill_and_drain() -> None:
    m, lat = 16, 0.1
    base = replay(_ops("1F1B", 2, m)).span
    # 1F1B's steady state is a loop with no slack: stage 1's forward of micro-batch i+2 waits
    # for its gradient of i to reach stage 0 and stage 0's forward of i+2 to come back, a round
    # trip every 2 micro-batches
    assert replay(_ops("1F1B", 2, m), lat).span == pytest.approx(base + lat * m)
    assert replay(_ops("FThenB", 2, m), lat).span == pytest.approx(base + 2 * lat)
    # one more forward in flight on stage 0 gives the loop a micro-batch of slack
    ahead = [with_extra_warmup(_ops("1F1B", 2, m)[0]), _ops("1F1B", 2, m)[1]]
    assert [(o.kind, o.micro) for o in ahead[0][:5]] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3)]
    assert replay(ahead, lat).span == pytest.approx(base + 2 * lat)


def test_recorded_durations_medians_and_latency() -> None:
    ops = _ops("FThenB", 2, 4)
    slow = [[Op(o.kind, o.micro, 0.0, 3.0 if (s, o.kind, o.micro) == (0, "F", 1) else o.end) for o in st]
            for s, st in enumerate(ops)]
    # one slow forward on stage 0 delays stage 1 by the 2 s it is late; the medians do not see it
    assert replay(slow).span == pytest.approx(replay(ops).span + 2.0)
    assert replay(slow, 0.0, median_durations([slow])).span == pytest.approx(replay(ops).span)
    # a timeline laid out by the replay itself, each handoff 0.25 s late, gives back 0.25 s
    timed = _timeline(ops, 0.25)
    assert handoff_latency([timed]) == pytest.approx(0.25)


def _timeline(ops: list[list[Op]], lat: float) -> list[list[Op]]:
    """``ops`` with start and end times as a run with handoff latency ``lat`` would have them."""
    ends: dict[tuple[int, str, int], float] = {}
    free, out, nxt = [0.0] * len(ops), [[] for _ in ops], [0] * len(ops)
    while any(n < len(o) for n, o in zip(nxt, ops)):
        for s, st in enumerate(ops):
            while nxt[s] < len(st):
                op = st[nxt[s]]
                need = (s - 1, "F", op.micro) if op.kind == "F" else (s + 1, "B", op.micro)
                if 0 <= need[0] < len(ops) and need not in ends:
                    break
                start = max(free[s], ends[need] + lat) if need in ends else free[s]
                free[s] = start + op.seconds
                ends[(s, op.kind, op.micro)] = free[s]
                out[s].append(Op(op.kind, op.micro, start, free[s]))
                nxt[s] += 1
    return out


def test_an_order_that_cannot_run_is_refused() -> None:
    ops = [[Op("B", 0, 0.0, 1.0), Op("F", 0, 0.0, 1.0)], [Op("F", 0, 0.0, 1.0), Op("B", 0, 0.0, 1.0)]]
    with pytest.raises(ValueError, match="deadlock"):
        replay(ops)


@pytest.mark.parametrize("schedule", ["1F1B", "FThenB"])
@pytest.mark.parametrize("stages,m", [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_the_runner_runs_torchs_op_order(schedule: str, stages: int, m: int) -> None:
    for s in range(stages):
        assert op_order(schedule, m, stages, s) == _order(schedule, s, stages, m)


@pytest.mark.parametrize("schedule", ["1F1B", "FThenB"])
@pytest.mark.parametrize("stages,m", [(2, 4), (2, 16), (4, 8)])
def test_expected_idle_of_equal_stages_is_the_bubble(schedule: str, stages: int, m: int) -> None:
    got = expected_idle(schedule, m, [StageTimes(1.0, 2.0)] * stages)
    assert got == pytest.approx([(stages - 1) / (m + stages - 1)] * stages)


@pytest.mark.parametrize("schedule", ["1F1B", "FThenB"])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_expected_idle_of_two_unequal_stages(schedule: str, m: int) -> None:
    # stage 1 slower in both directions (t1 = 3.5 per micro-batch against t0 = 2.5): it idles
    # t0 / (t0 + m t1) (the fill and the drain), the faster stage the rest of the period too
    fast, slow = StageTimes(1.0, 1.5), StageTimes(1.25, 2.25)
    t0, t1 = 2.5, 3.5
    period = t0 + m * t1
    assert expected_idle(schedule, m, [fast, slow]) == pytest.approx([(period - m * t0) / period, t0 / period])


def test_time_outside_the_schedule_dilutes_the_idle() -> None:
    # equal stages, each with an update u after its last backward: the idle per step stays
    # the fill and the drain (f + b), the period grows by u
    m, u = 8, 5.0
    got = expected_idle("FThenB", m, [StageTimes(1.0, 2.0, u)] * 2)
    assert got == pytest.approx([3.0 / ((m + 1) * 3.0 + u)] * 2)
    # 1F1B at 2 stages pays a handoff's round trip every 2 micro-batches (see above), GPipe 2
    lat = 0.1
    assert expected_idle("FThenB", m, [StageTimes(1.0, 2.0)] * 2, latency=lat) == pytest.approx(
        [(3.0 + 2 * lat) / ((m + 1) * 3.0 + 2 * lat)] * 2)
    with pytest.raises(ValueError, match="steps=1"):
        expected_idle("FThenB", m, [StageTimes(1.0, 2.0)] * 2, steps=1)

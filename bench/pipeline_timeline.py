"""Where a pipeline's idle time comes from: its stages' recorded timelines replayed on the
schedule's dependencies.

A measured idle fraction above the bubble ``(p-1)/(m+p-1)`` has four possible causes, and a
replay separates them. Each stage records, for every step, its forwards and backwards in the
order it ran them (``Op``: kind, micro-batch, start, end, on the one monotonic clock every
process shares). `replay` runs the same orders again with chosen durations and a chosen handoff
latency -- a forward waits for the previous stage's forward of its micro-batch, a backward for
the next stage's backward of its micro-batch, plus the latency -- and returns each stage's idle:

- every op at its stage's median duration, no latency: the bubble at the stages' balance;
- every op at its recorded duration, no latency: plus the micro-batch-to-micro-batch jitter
  (a stage that computes one micro-batch late holds its neighbour up);
- the recorded durations and the recorded handoff latency (`handoff_latency`): plus the time
  the activations and gradients take between the stages where the schedule waits for them;
- what remains against the measured idle: the schedule's own work between ops, and wake-ups.

Example:
    >>> ops = [[Op("F", 0, 0.0, 1.0), Op("B", 0, 3.0, 4.0)], [Op("F", 0, 1.0, 2.0), Op("B", 0, 2.0, 3.0)]]
    >>> replay(ops, latency=0.0).idle
    [2.0, 2.0]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Op", "Replay", "StageTimes", "expected_idle", "handoff_latency", "median_durations", "replay",
           "with_extra_warmup"]


@dataclass(frozen=True)
class Op:
    """One forward (``kind`` "F") or backward ("B") of micro-batch ``micro`` on a stage, from
    ``start`` to ``end`` seconds."""

    kind: str
    micro: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Replay:
    """A replayed step: ``span`` from the first op's start to the last op's end, and each
    stage's ``idle`` inside it (the span less its ops' time)."""

    span: float
    idle: list[float]


def _needs(kind: str, micro: int, stage: int, stages: int) -> tuple[int, str, int] | None:
    """The op on a neighbour that ``kind`` of ``micro`` on ``stage`` waits for, or None (an
    update, "U", waits for nobody)."""
    if kind == "U":
        return None
    if kind == "F":
        return (stage - 1, "F", micro) if stage > 0 else None
    return (stage + 1, "B", micro) if stage < stages - 1 else None


def replay(ops: Sequence[Sequence[Op]], latency: float = 0.0,
           seconds: Callable[[int, Op], float] | None = None) -> Replay:
    """Run each stage's ``ops`` in their recorded order, each taking ``seconds(stage, op)``
    (default: its recorded time), starting when the stage's previous op ends and the
    neighbour's op it needs has ended ``latency`` seconds before."""
    stages = len(ops)
    took = seconds or (lambda _s, op: op.seconds)
    ends: dict[tuple[int, str, int], float] = {}
    nxt = [0] * stages
    free = [0.0] * stages
    busy = [0.0] * stages
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for s in range(stages):
            while nxt[s] < len(ops[s]):
                op = ops[s][nxt[s]]
                need = _needs(op.kind, op.micro, s, stages)
                if need is not None and need not in ends:
                    break
                ready = free[s] if need is None else max(free[s], ends[need] + latency)
                t = took(s, op)
                free[s] = ready + t
                busy[s] += t
                ends[(s, op.kind, op.micro)] = free[s]
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"the stages' op orders deadlock: next ops {[o[n] if n < len(o) else None for o, n in zip(ops, nxt)]}")
    span = max(free)
    return Replay(span, [span - b for b in busy])


@dataclass(frozen=True)
class StageTimes:
    """One stage's typical seconds: a micro-batch's ``forward`` and ``backward`` (each with its
    share of the schedule's work between ops), and ``outside``: the step's time outside its
    forwards, backwards and waits (the optimizer's update, the loss's handoff, the batch's
    slicing), which the stage spends once per step."""

    forward: float
    backward: float
    outside: float = 0.0


def expected_idle(schedule: str, m: int, stages: Sequence[StageTimes], steps: int = 6,
                  latency: float = 0.0) -> list[float]:
    """Each stage's idle fraction of a step in the steady state of back-to-back steps, when
    every op takes its stage's ``stages[s]`` time and each handoff ``latency`` seconds (default
    free): the bubble at the stages' own balance. Equal stages with nothing outside the ops give (p-1)/(m+p-1); a slower
    stage idles less than that, a faster one more (it waits for the slower every micro-batch),
    and time outside the schedule (the update) dilutes every stage's fraction.

    The period is the step-to-step increment of the replayed span (``steps`` vs ``steps - 1``
    steps, each stage's ops in `fleetlike.pipeline.runner.op_order`, an update after its last
    backward); a stage's idle is the period less its ops and its outside time.

    Example:
        >>> expected_idle("FThenB", 4, [StageTimes(1.0, 2.0), StageTimes(1.0, 2.0)])  # 1/(4+1)
        [0.2, 0.2]
        >>> [round(x, 3) for x in expected_idle("FThenB", 4, [StageTimes(1, 1.5), StageTimes(1, 2)])]
        [0.31, 0.172]
    """
    from fleetlike.pipeline.runner import op_order

    p = len(stages)

    def ops(n: int) -> list[list[Op]]:
        out = []
        for s, t in enumerate(stages):
            seq = []
            for k in range(n):
                seq += [Op(kind, k * m + i, 0.0, t.forward if kind == "F" else t.backward)
                        for kind, i in op_order(schedule, m, p, s)]
                seq.append(Op("U", k, 0.0, t.outside))
            out.append(seq)
        return out

    if steps < 2:
        raise ValueError(f"expected_idle: steps={steps}; the period needs at least 2 steps")
    period = replay(ops(steps), latency).span - replay(ops(steps - 1), latency).span
    return [(period - m * (t.forward + t.backward) - t.outside) / period for t in stages]


def median_durations(steps: Sequence[Sequence[Sequence[Op]]]) -> Callable[[int, Op], float]:
    """Each stage's median forward and median backward over ``steps`` (each a list of stages'
    ops), as a ``seconds`` for `replay`: the stages' balance without the jitter."""
    med: dict[tuple[int, str], float] = {}
    stages = len(steps[0])
    for s in range(stages):
        for kind in ("F", "B"):
            times = [op.seconds for step in steps for op in step[s] if op.kind == kind]
            med[(s, kind)] = statistics.median(times) if times else 0.0
    return lambda s, op: med[(s, op.kind)]


def handoff_latency(steps: Sequence[Sequence[Sequence[Op]]]) -> float:
    """The median time from a stage's op ending to the neighbour's op that needs it starting,
    over the handoffs where that neighbour was already waiting (its previous op had ended):
    the send, the receive and the schedule's bookkeeping between them. NaN with none."""
    gaps: list[float] = []
    for step in steps:
        stages = len(step)
        end_of = {(s, op.kind, op.micro): op.end for s in range(stages) for op in step[s]}
        for s in range(stages):
            prev_end = None
            for op in step[s]:
                need = _needs(op.kind, op.micro, s, stages)
                if need is not None and need in end_of and prev_end is not None and prev_end < end_of[need]:
                    gaps.append(op.start - end_of[need])
                prev_end = op.end
    return statistics.median(gaps) if gaps else float("nan")


def with_extra_warmup(ops: Sequence[Op]) -> list[Op]:
    """A 1F1B stage's ``ops`` reordered to run one more forward before its first backward
    (and each later forward one backward earlier): what one more micro-batch of activations
    in flight on that stage would buy, in a schedule whose sends never hold up a receive (the
    replay has no sends: torch's 1F1B waits for a send with the next receive, and a gloo send
    completes only when the neighbour posts its receive). Durations are kept; the times are no
    longer meaningful as times, only as durations."""
    fwd = [op for op in ops if op.kind == "F"]
    bwd = [op for op in ops if op.kind == "B"]
    first_b = next((i for i, op in enumerate(ops) if op.kind == "B"), len(ops))
    warm = min(first_b + 1, len(fwd))
    out = fwd[:warm]
    f, b = warm, 0
    while f < len(fwd):
        out += [bwd[b], fwd[f]]
        b, f = b + 1, f + 1
    return out + bwd[b:]

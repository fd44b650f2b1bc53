"""Predict a pipeline before running it: step time (the bubble and the stage imbalance) and
each stage's memory, for every shape ``dp x pp`` of a world.

The model is split as ``fleet.distributed_model`` would split it (`fleetlike.pipeline.split`).
Each stage's forward and backward of one micro-batch are timed in this process (the stages one
after another, each on the previous stage's output), its saved activations counted (each
storage once, parameters not, as `fleetlike.plan.memory` counts them), and its optimizer state
measured after one real update. Then, with ``t_s`` = stage ``s``'s forward + backward and the
sends of its micro-batch:

* step time = ``sum_s t_s + (m - 1) x max_s t_s`` (the first micro-batch crosses every stage,
  the others follow at the pace of the slowest stage) + the slowest stage's update + the
  average over ``dp`` pipelines of the largest stage's gradients. With equal stages the idle
  fraction is the bubble ``(p-1)/(m+p-1)``; unequal stages add ``imbalance`` = max / mean;
* memory of stage ``s`` = parameters + gradients + optimizer state + activations of
  ``min(m, p - s)`` micro-batches under 1F1B, all ``m`` under GPipe (FThenB).

Sends and averages are costed with the link figures of `fleetlike.plan.cost.Links` (a send as
a broadcast within two ranks) when given, and the stages' compute and update are scaled by its
``compute_scale`` (the probe's slowdown of compute when every rank of a node computes at once,
as a pipeline's stages do; ``python -m bench.pipeline_plan`` puts a stage timed alone at
0.72-1.10x, median 0.96, of its compute in a 2-stage job on two shared cores); without links
sends count as free and compute as timed alone.

The activations counted are what a stage holds for a micro-batch in flight: every storage its
blocks save, the first stage's input left out (it is the caller's batch, held anyway); a later
stage's input is the buffer the micro-batch arrived in, held until its backward. Checked
against real jobs in tests/test_pipeline_plan.py and ``python -m bench.pipeline_plan``.

Example:
    >>> rows = rank_shapes(net, x, y, F.cross_entropy, world=4, micro_batches=8)
    >>> print(format_pipeline_table(rows))
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.pipeline.split import plan_stages
from fleetlike.plan.cost import Links, group_kind
from fleetlike.plan.memory import MemoryBreakdown, activation_bytes, optimizer_state_bytes
from fleetlike.plan.spec import Cluster
from fleetlike.plan.temporaries import update_temporaries

__all__ = ["PipelinePrediction", "StagePrediction", "format_pipeline_table", "pipeline_step_seconds",
           "predict_pipeline", "rank_shapes", "stage_memory"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class StagePrediction:
    """One stage: its blocks, measured seconds per micro-batch and bytes per rank."""

    stage: int
    blocks: tuple[str, ...]
    params: int
    forward_s: float
    backward_s: float
    send_s: float
    activation_bytes: int
    held_micro_batches: int
    param_bytes: int
    optimizer_bytes: int
    #: the optimizer update's temporaries (`fleetlike.plan.temporaries`): after the backward,
    #: never beside the activations
    update_bytes: int = 0

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s + self.send_s

    @property
    def peak_bytes(self) -> int:
        return stage_memory(self).peak


@dataclasses.dataclass(frozen=True)
class PipelinePrediction:
    """A ``dp x pp`` shape with ``m`` micro-batches: predicted step and per-stage memory."""

    dp: int
    pp: int
    micro_batches: int
    schedule: str
    stages: tuple[StagePrediction, ...]
    update_s: float
    average_s: float

    @property
    def step_s(self) -> float:
        return pipeline_step_seconds([s.seconds for s in self.stages], self.micro_batches) + self.update_s + self.average_s

    @property
    def bubble(self) -> float:
        """``(p-1)/(m+p-1)``: the idle fraction of equal stages."""
        return (self.pp - 1) / (self.micro_batches + self.pp - 1)

    @property
    def imbalance(self) -> float:
        """The slowest stage's time over the mean (1 = balanced)."""
        times = [s.seconds for s in self.stages]
        return max(times) / (sum(times) / len(times))

    @property
    def peak_bytes(self) -> int:
        return max(s.peak_bytes for s in self.stages)

    @property
    def name(self) -> str:
        return f"dp{self.dp} x pp{self.pp} {self.schedule} m={self.micro_batches}"


def stage_memory(stage: StagePrediction) -> MemoryBreakdown:
    """A stage's bytes per rank by kind, as the planner's table counts them: parameters,
    gradients, optimizer state, and the larger of the activations its schedule keeps in flight
    and the update's temporaries."""
    return MemoryBreakdown(stage.param_bytes, stage.param_bytes, stage.optimizer_bytes, 0,
                           stage.held_micro_batches * stage.activation_bytes, 0, 0, update=stage.update_bytes)


def pipeline_step_seconds(stage_seconds: Sequence[float], micro_batches: int) -> float:
    """``sum(t) + (m-1) max(t)``: ``(m+p-1) t`` for ``p`` equal stages."""
    return sum(stage_seconds) + (micro_batches - 1) * max(stage_seconds)


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def predict_pipeline(model: torch.nn.Sequential, x: torch.Tensor, y: Any, loss_fn: LossFn, *, pp: int,
                     micro_batches: int, schedule: str = "1F1B", dp: int = 1, split_points: Sequence[str] = (),
                     optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, links: Links | None = None,
                     cluster: Cluster | None = None, reps: int = 3) -> PipelinePrediction:
    """Predict ``model`` split into ``pp`` stages for the batch ``(x, y)`` of one pipeline (see
    the module docstring). ``model`` is copied, not consumed."""
    if schedule not in ("1F1B", "FThenB"):
        raise ValueError(f"schedule={schedule!r}: write '1F1B' or 'FThenB'")
    if x.shape[0] % micro_batches:
        raise ValueError(f"a batch of {x.shape[0]} rows does not cut into {micro_batches} micro-batches")
    # the stages compute at once on the ranks of a node: the slowdown the probe measured there
    scale = links.compute_scale if links is not None else 1.0
    net = copy.deepcopy(model)
    plan = plan_stages(net, pp, list(split_points))
    make_opt = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    rows = x.shape[0] // micro_batches
    inp: torch.Tensor = x[:rows]
    target = y[:rows] if isinstance(y, torch.Tensor) else y
    stages, updates = [], []
    for s, blocks in enumerate(plan.stages):
        stage = torch.nn.Sequential(*[m for _, m in blocks])
        params = list(stage.parameters())
        last = s == pp - 1
        src = inp.detach().clone().requires_grad_(s > 0 and inp.is_floating_point())

        def loss_of(out: torch.Tensor, _last: bool = last) -> torch.Tensor:
            return loss_fn(out, target) if _last else (out.float() * 1.0).sum()

        # the first stage's input is the caller's batch, held whether or not autograd saves it;
        # a later stage's is the buffer its micro-batch was received into, held until its backward
        with activation_bytes(stage, skip=(src,) if s == 0 else ()) as counter:
            out = stage(src)
        loss_of(out).backward()
        forward = _median_time(lambda: stage(src), reps)
        total = _median_time(lambda: loss_of(stage(src)).backward(), reps)
        opt = make_opt(params)
        opt.step()
        updates.append(_median_time(opt.step, reps))
        state = optimizer_state_bytes(opt)
        send = 0.0
        if links is not None and cluster is not None and pp > 1:
            ranks = (s, s + 1) if not last else (s - 1, s)
            send = 2 * links.cost(group_kind(ranks, cluster), "broadcast", out.numel() * out.element_size())
        held = micro_batches if schedule == "FThenB" else min(micro_batches, pp - s)
        stages.append(StagePrediction(
            s, tuple(n for n, _ in blocks), sum(p.numel() for p in params), forward * scale,
            max(total - forward, 0.0) * scale, send,
            counter.total, held, sum(p.numel() * p.element_size() for p in params), state,
            update_temporaries(opt, params).bytes))
        with torch.no_grad():
            inp = stage(inp)
    average = 0.0
    if links is not None and cluster is not None and dp > 1:
        worst = max(range(pp), key=lambda s: stages[s].param_bytes)
        ranks = tuple(j * pp + worst for j in range(dp))
        average = links.cost(group_kind(ranks, cluster), "all_reduce", stages[worst].param_bytes)
    return PipelinePrediction(dp, pp, micro_batches, schedule, tuple(stages), max(updates) * scale, average)


def rank_shapes(model: torch.nn.Sequential, x: torch.Tensor, y: Any, loss_fn: LossFn, *, world: int,
                micro_batches: int | Sequence[int], schedules: Sequence[str] = ("1F1B", "FThenB"),
                links: Links | None = None, cluster: Cluster | None = None, memory_limit: int | None = None,
                **kwargs: Any) -> list[PipelinePrediction]:
    """Every ``dp x pp = world`` shape (``pp = 1`` is plain data parallel) under each schedule
    and each micro-batch count of ``micro_batches`` (one, or several to weigh the bubble
    ``(p-1)/(m+p-1)`` against smaller micro-batches), fastest first; shapes over
    ``memory_limit`` bytes per rank, and counts that do not divide a shape's rows, are left out.
    ``(x, y)`` is one pipeline's batch at ``dp = 1``; a shape with ``dp`` pipelines gets ``1/dp`` of it."""
    counts = [micro_batches] if isinstance(micro_batches, int) else list(micro_batches)
    out = []
    for pp in [d for d in range(1, world + 1) if world % d == 0 and d <= len(model)]:
        dp = world // pp
        rows = x.shape[0] // dp
        for m in counts if pp > 1 else counts[:1]:  # one stage: the micro-batches change nothing
            if rows % m:
                continue
            for schedule in schedules if pp > 1 else ("FThenB",):
                if schedule == "1F1B" and m < pp:
                    continue
                pred = predict_pipeline(model, x[:rows], y[:rows] if isinstance(y, torch.Tensor) else y, loss_fn,
                                        pp=pp, micro_batches=m, schedule=schedule, dp=dp, links=links,
                                        cluster=cluster, **kwargs)
                if memory_limit is None or pred.peak_bytes <= memory_limit:
                    out.append(pred)
    return sorted(out, key=lambda p: p.step_s)


def format_pipeline_table(rows: Sequence[PipelinePrediction]) -> str:
    """One line per shape: predicted ms/step, bubble, imbalance, peak MiB on the fullest rank."""
    head = f"{'shape':<28} {'ms/step':>9} {'bubble':>7} {'imbalance':>9} {'peak MiB':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<28} {r.step_s * 1e3:>9.1f} {r.bubble:>7.2f} {r.imbalance:>9.2f} "
                     f"{r.peak_bytes / 2**20:>9.2f}")
    return "\n".join(lines)

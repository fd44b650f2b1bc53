"""Pipeline candidates in the planner's table: one row per ``pp`` degree and micro-batch count.

`fleetlike.plan.pipeline.rank_shapes` predicts each ``dp x pp`` shape of the world (its
stages timed in this process, the bubble ``(p-1)/(m+p-1)`` and the stage imbalance, each
stage's memory); this module turns the shapes with ``pp > 1`` into `PlanRow`s beside the
traced candidates, so the recommendation weighs them against data parallel and sharding under
the same memory limit.

* The batch: the table's candidates run ``batch_size`` rows per rank, so a shape with ``dp``
  pipelines gets ``world x batch_size / dp`` rows per pipeline (the same global batch, the
  same samples per step).
* The schedule: 1F1B where it applies (``m >= pp``: its stages hold at most ``pp - s``
  micro-batches' activations, GPipe's all ``m``, at the same step time), else FThenB (GPipe).
* The step: the stages' measured forward + backward and the update are scaled by the links'
  ``compute_scale`` as the traced candidates' compute is (`predict_pipeline` applies it); the sends between stages and the
  average across pipelines are costed on ``links``.
* The memory: the fullest stage's parameters, gradients, optimizer state and the larger of the
  activations its schedule keeps in flight (`StagePrediction.peak_bytes`) and its update's
  temporaries (`fleetlike.plan.temporaries`, as the traced candidates count them).
* The loss: the builder's ``loss_fn(model, feed)`` is called on the last stage with a stand-in
  model that returns the stage's output and a feed whose labels are the micro-batch's; the feed
  is ``(inputs, labels)`` or a mapping of two entries, inputs first (as the pipelined program
  reads it).

Rows that cannot apply are listed as skipped with the reason: a world of one rank, a model that
is not an ``nn.Sequential`` of blocks, a feed of another shape, a micro-batch count that does
not divide a pipeline's rows.

Example:
    >>> rows, skipped = pipeline_rows(spec, Cluster(1, 4), links, micro_batches=(2, 4, 8))
    >>> [r.name for r in rows][:2]
    ['pipeline_pp2_m2', 'pipeline_pp2_m4']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fleetlike.comm.stats import ring_send_bytes
from fleetlike.plan.cost import Links, StepCost, group_kind
from fleetlike.plan.memory import MemoryBreakdown
from fleetlike.plan.pipeline import PipelinePrediction, pipeline_step_seconds, rank_shapes, stage_memory
from fleetlike.plan.space import Candidate
from fleetlike.plan.spec import Cluster, ModelSpec

__all__ = ["MICRO_BATCHES", "PipelineRow", "pipeline_options", "pipeline_rows"]

#: the micro-batch counts planned by default
MICRO_BATCHES: tuple[int, ...] = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class PipelineRow:
    """One pipeline candidate: its strategy, cost, memory and the prediction it came from."""

    candidate: Candidate
    cost: StepCost
    memory: MemoryBreakdown
    prediction: PipelinePrediction


def pipeline_options(dp: int, pp: int, micro_batches: int, schedule: str) -> dict[str, Any]:
    """The `DistributedStrategy` options of a pipeline candidate (``micro_batch_size`` 0: the
    batch's rows / ``accumulate_steps``)."""
    return {"pipeline": True,
            "pipeline_configs": {"accumulate_steps": micro_batches, "schedule_mode": schedule},
            "hybrid_configs": {"dp_degree": dp, "pp_degree": pp}}


def _split_feed(feed: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(inputs, labels, rebuild)`` where ``rebuild(labels)`` is the feed with other labels."""
    if isinstance(feed, Mapping) and len(feed) == 2:
        (kx, x), (ky, y) = list(feed.items())
        return x, y, lambda labels: {kx: x, ky: labels}
    if isinstance(feed, (tuple, list)) and len(feed) == 2:
        x, y = feed
        return x, y, lambda labels: (x, labels)
    raise ValueError(f"the builder's feed is a {type(feed).__name__}"
                     f"{' of ' + str(len(feed)) if hasattr(feed, '__len__') else ''}: a pipeline reads "
                     "(inputs, labels) or a mapping of two entries, inputs first")


def _row(pred: PipelinePrediction, cluster: Cluster) -> PipelineRow:
    compute = pipeline_step_seconds([s.forward_s + s.backward_s for s in pred.stages],
                                    pred.micro_batches) + pred.update_s
    comm = pred.step_s - compute  # the sends between stages and the average, neither overlapped
    worst = max(pred.stages, key=lambda s: s.param_bytes)
    # the bytes columns count the average across pipelines; the sends between stages are
    # priced in the step time (StagePrediction.send_s) but their sizes are not kept
    sent = ring_send_bytes("all_reduce", worst.param_bytes, pred.dp)
    kind = group_kind(tuple(j * pred.pp for j in range(pred.dp)), cluster) if pred.dp > 1 else "intra"
    intra, inter = (sent, 0.0) if kind == "intra" else (0.0, sent)
    cost = StepCost(pred.step_s, compute, comm, comm, intra, inter, [pred.step_s], {})
    memory = stage_memory(max(pred.stages, key=lambda s: s.peak_bytes))
    name = f"pipeline_pp{pred.pp}_m{pred.micro_batches}"
    return PipelineRow(Candidate(name, pipeline_options(pred.dp, pred.pp, pred.micro_batches, pred.schedule), ()),
                       cost, memory, pred)


def pipeline_rows(spec: ModelSpec, cluster: Cluster, links: Links, *,
                  micro_batches: Sequence[int] = MICRO_BATCHES, reps: int = 3
                  ) -> tuple[list[PipelineRow], list[tuple[str, str]]]:
    """The pipeline candidates of ``cluster`` (``pp > 1`` dividing the world) for each count of
    ``micro_batches``, and the ones that cannot apply with the reason (see the module docstring)."""
    world = cluster.world_size
    if world < 2:
        return [], [("pipeline", "one rank: there is nothing to split the model over")]
    rows_total = world * spec.batch_size
    model, loss_fn, feed = spec.builder(rows_total)
    if not isinstance(model, torch.nn.Sequential):
        return [], [("pipeline", f"the model is a {type(model).__name__}, not an nn.Sequential of blocks the "
                                 "pipeline can split in forward order")]
    try:
        x, y, rebuild = _split_feed(feed)
    except ValueError as exc:
        return [], [("pipeline", str(exc))]

    def stage_loss(out: torch.Tensor, target: Any) -> torch.Tensor:
        return loss_fn(lambda *_a, **_k: out, rebuild(target))

    def make_opt(params: Any) -> torch.optim.Optimizer:
        return spec.optimizer(torch.nn.ParameterList(params))

    skipped: list[tuple[str, str]] = []
    degrees = [d for d in range(2, world + 1) if world % d == 0]
    for pp in [d for d in degrees if d > len(model)]:
        skipped.append((f"pipeline_pp{pp}", f"the model has {len(model)} blocks, fewer than {pp} stages"))
    for pp in [d for d in degrees if d <= len(model)]:
        rows = rows_total // (world // pp)
        skipped += [(f"pipeline_pp{pp}_m{m}", f"{m} micro-batches do not divide a pipeline's {rows} rows "
                                              f"(batch {spec.batch_size}/rank x {pp} stages)")
                    for m in micro_batches if rows % m]
    try:
        shapes = rank_shapes(model, x, y, stage_loss, world=world, micro_batches=tuple(micro_batches),
                             links=links, cluster=cluster, optimizer=make_opt, reps=reps)
    except ValueError as exc:  # the split cannot be made (e.g. a block too large to balance)
        return [], [*skipped, ("pipeline", str(exc))]
    best: dict[tuple[int, int], PipelinePrediction] = {}
    for pred in shapes:
        if pred.pp < 2:
            continue
        key = (pred.pp, pred.micro_batches)
        if key not in best or (pred.schedule == "1F1B" and best[key].schedule != "1F1B"):
            best[key] = pred
    out = [_row(best[k], cluster) for k in sorted(best)]
    return out, skipped

"""The program style of a pipelined model: one pipelined step per ``exe.run(fleet.main_program)``.

``opt.minimize(loss_fn, model)`` on a `PipelineModel` lays its step out as a program:
``pipeline_train_batch`` (the schedule's forwards and backwards over the micro-batches, with the
activations sent between stages, listed under it), the gradient average over the pipelines and
the optimizer update. For a pipelined model ``loss_fn(output, labels)`` is the loss of one
micro-batch computed from the last stage's output (a mean over its rows, as
``F.cross_entropy``), not the ``loss_fn(model, feed)`` of a data-parallel program: no rank holds
the whole model to call. The feed is ``(inputs, labels)`` or a mapping of two entries, inputs
first (``{"x": x, "y": y}``); the fetched ``"loss"`` is the mean micro-batch loss on every rank.

``startup_program`` broadcasts each stage's parameters from its first pipeline; a pipelined
model has no local step, so ``_origin_program`` refuses to run, saying why.

Example:
    >>> opt.minimize(F.cross_entropy, model)
    >>> loss, = exe.run(fleet.main_program, feed={"x": x, "y": y}, fetch_list=["loss"])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fleetlike.collectives import broadcast_coalesced
from fleetlike.program import Op, Program, StepState

__all__ = ["pipeline_programs"]


def _feed_pair(feed: Any) -> tuple[Any, Any]:
    if isinstance(feed, (tuple, list)) and len(feed) == 2:
        return feed[0], feed[1]
    if isinstance(feed, Mapping) and len(feed) == 2:
        x, y = feed.values()
        return x, y
    raise TypeError(
        "a pipelined program's feed is (inputs, labels) or a mapping of two entries, inputs first "
        f"({{'x': x, 'y': y}}); got {type(feed).__name__}"
        f"{f' with keys {list(feed)}' if isinstance(feed, Mapping) else ''}")


def pipeline_programs(model: Any, loss_fn: Any, optimizer: torch.optim.Optimizer) -> tuple[Program, Program, Program]:
    """``(origin, main, startup)`` for ``model`` (a `PipelineModel`) driven by ``optimizer``."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise TypeError(f"minimize: loss_fn must be callable (output, labels) -> loss, got {loss_fn!r}")
        model.loss_fn = loss_fn
    if model.loss_fn is None:
        raise ValueError("minimize on a pipelined model needs loss_fn(output, labels): pass it to minimize or "
                         "to fleet.distributed_model")
    hcg = model.hcg

    def step(st: StepState) -> None:
        x, y = _feed_pair(st.feed)
        loss = model.train_batch((x, y), optimizer)
        st.loss = loss
        st.outputs = {"loss": loss}

    attrs = {"schedule": model.schedule_mode, "micro_batches": model.num_micro, "stage": hcg.stage_id,
             "stages": hcg.pp_degree, "blocks": ",".join(model.stage.names)}
    ops = [Op("pipeline_train_batch", step, attrs)]
    if hcg.pp_degree > 1:
        ops.append(Op("send_v2/recv_v2", None, {"what": "activations forward, their gradients back",
                                                 "group": f"pipeline {hcg.dp_rank}"}, "pipeline_train_batch"))
    if hcg.dp_degree > 1:
        ops.append(Op("c_allreduce_avg", None, {"buckets": len(model._buckets), "over": f"{hcg.dp_degree} pipelines"},
                      "pipeline_train_batch"))
    ops.append(Op("optimizer_update", None, {}, "pipeline_train_batch"))
    main = Program("main", ops, device=model.device)
    main.notes.append(lambda: f"pipeline: stage {hcg.stage_id} of {hcg.pp_degree}, pipeline {hcg.dp_rank} of "
                      f"{hcg.dp_degree}")

    def refuse(st: StepState) -> None:
        raise RuntimeError("a pipelined model has no local step: every step needs the other stages. Fix: run "
                           "fleet.main_program")

    origin = Program("origin", [Op("pipeline_no_local_step", refuse)], device=model.device)

    def broadcast(st: StepState) -> None:
        tensors = [t.data for _, t in model.stage.named_state()]
        broadcast_coalesced(hcg.dp_comm, tensors)

    startup = Program("startup", [Op("broadcast_stage_params", broadcast, {"over": f"{hcg.dp_degree} pipelines"})],
                      device=model.device)
    return origin, main, startup

"""The fleet facade's pipeline calls: build a pipelined model, answer
``get_hybrid_communicate_group``, gather a model's whole state.

Kept apart from `fleetlike.fleet.facade` so that the facade only dispatches: a strategy with
``pipeline`` on makes ``fleet.distributed_model`` return a `PipelineModel` instead of a
`DistributedModel`.

Example:
    >>> full = fleet.full_state_dict(model)   # the unsplit model's state_dict, every stage's tensors
"""

from __future__ import annotations

from typing import Any

import torch

from fleetlike.config import DistributedStrategy, rules
from fleetlike.fleet.context import FleetContext
from fleetlike.pipeline import HybridCommunicateGroup, PipelineModel, agreed_block_seconds, plan_stages, resolve_degrees
from fleetlike.pipeline.checkpoint import load_stage, save_stage
from fleetlike.pipeline.topology import error_store

__all__ = ["build_pipeline", "hybrid_group", "load_pipeline", "save_pipeline"]


def hybrid_group(ctx: FleetContext, strategy: DistributedStrategy) -> HybridCommunicateGroup:
    """The ``dp x pp`` groups of ``strategy`` (collective: every rank calls it once)."""
    cfg = strategy.hybrid_configs
    pp = int(cfg["pp_degree"]) if strategy.pipeline else 1
    resolve_degrees(ctx.role.world_size, int(cfg["dp_degree"]), pp)  # the clear error before any group
    return HybridCommunicateGroup(ctx.groups, ctx.role, int(cfg["dp_degree"]), pp, ctx.timeout,
                                  torch_groups=bool(strategy.pipeline),
                                  p2p=str(strategy.pipeline_configs["p2p"]))


def build_pipeline(ctx: FleetContext, model: torch.nn.Module, strategy: DistributedStrategy, loss_fn: Any,
                   hcg: HybridCommunicateGroup | None, example_input: Any = None) -> tuple[PipelineModel, HybridCommunicateGroup]:
    """``model`` split by ``strategy`` into this rank's stage; errors come before any group
    is formed, the same on every rank. Under ``pipeline_configs.balance = "time"`` rank 0 times
    each block on ``example_input`` (one micro-batch) and every rank splits by its times."""
    rules.refuse_unhonoured(strategy, "pipeline")
    cfg = strategy.hybrid_configs
    _, pp = resolve_degrees(ctx.role.world_size, int(cfg["dp_degree"]), int(cfg["pp_degree"]))
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"fleet.distributed_model: loss_fn must be callable (output, labels) -> loss, got {loss_fn!r}")
    points = tuple(strategy.pipeline_configs["split_points"])
    by_time = str(strategy.pipeline_configs["balance"]) == "time"
    if example_input is not None and not by_time:
        raise ValueError(
            "fleet.distributed_model(example_input=...) is read only to time the blocks, under "
            "pipeline_configs.balance='time' (now 'params'). Fix: set balance='time', or drop example_input")
    if by_time and points:
        plan_stages(model, pp, points, seconds=[])  # the clear error, before any measurement
    seconds = agreed_block_seconds(ctx.world, model, example_input) if by_time else None
    plan = plan_stages(model, pp, points, seconds=seconds)
    if hcg is None or hcg.pp_degree != pp or hcg.get_pipe_parallel_process_group() is None \
            or hcg.p2p != str(strategy.pipeline_configs["p2p"]):
        hcg = hybrid_group(ctx, strategy)
    wrapped = PipelineModel(model, plan, hcg, strategy, loss_fn, ctx.device, error_store(ctx.world))
    return wrapped, hcg


def _optimizer_of(model: PipelineModel, optimizers: list[Any]) -> Any:
    mine = {id(p) for p in model.parameters()}
    return next((o for o in reversed(optimizers) if mine & {id(p) for g in o.param_groups for p in g["params"]}), None)


def save_pipeline(ctx: FleetContext, dirname: str, model: PipelineModel, optimizers: list[Any],
                  registered: dict[str, Any], runs: dict[str, int]) -> None:
    """``fleet.save_persistables`` of a pipelined model: collective (every rank calls it; each
    stage's first pipeline writes its stage file), done on every rank when it returns."""
    extra = {"registered": {name: obj.state_dict() for name, obj in registered.items()}, "runs": runs}
    save_stage(dirname, model, _optimizer_of(model, optimizers), extra)
    ctx.world.barrier()


def load_pipeline(dirname: str, model: PipelineModel, optimizers: list[Any], registered: dict[str, Any]) -> dict[str, int]:
    """``fleet.load_persistables`` of a pipelined model (from stage files of any stage count);
    the program run counters saved."""
    extra = load_stage(dirname, model, _optimizer_of(model, optimizers))
    for name, state in extra.get("registered", {}).items():
        if name in registered:
            registered[name].load_state_dict(state)
    return dict(extra.get("runs", {}))

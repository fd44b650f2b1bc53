"""Other names for `DistributedStrategy` options: Fleet 1.x's, EPL's dotted keys, Paddle's derived switches.

Why a module of its own: an alias is not an option (it is stored nowhere); it reads and writes
the options of `fleetlike.config.options`. A plain alias renames one option; a derived one
(``zero.level``, ``collective_mode``, ``pipeline.num_stages``, ...) reads a value from several
options and writes several back in one assignment, so a strategy set through either name is the
same strategy. EPL's configuration keys come from `fleetlike.config.epl_keys`.

Example:
    >>> s = DistributedStrategy()
    >>> s.use_local_sgd = True          # Fleet 1.x's name of localsgd
    >>> s.localsgd
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetlike.config.choices import (
    CollectiveMode,
    EplPipelineStrategy,
    OffloadLevel,
    PipelineSchedule,
    ZeroLevel,
)
from fleetlike.config.epl_keys import EPL_ALIASES
from fleetlike.config.fields import Alias, Choice, Int

__all__ = ["ALIASES"]


def _read_zero_level(get: Callable[[str], Any]) -> ZeroLevel:
    return ZeroLevel.V1 if get("sharding") else ZeroLevel.OFF


def _write_zero_level(value: Any) -> dict[str, Any]:
    if value is ZeroLevel.V1:  # EPL shards states and gradients over all data-parallel workers
        return {"sharding": True, "sharding_configs.sharding_degree": 0, "sharding_configs.stage": 2}
    return {"sharding": False}


def _read_offload_level(get: Callable[[str], Any]) -> OffloadLevel:
    return OffloadLevel.V0 if get("sharding") and get("sharding_configs.offload_params") else OffloadLevel.OFF


def _write_offload_level(value: Any) -> dict[str, Any]:
    if value is OffloadLevel.V0:  # every parameter in host memory: stage 3 shards, offloaded
        return {"sharding": True, "sharding_configs.sharding_degree": 0, "sharding_configs.stage": 3,
                "sharding_configs.optimize_offload": True, "sharding_configs.offload_params": True}
    return {"sharding_configs.optimize_offload": False, "sharding_configs.offload_params": False}


def _read_collective_mode(get: Callable[[str], Any]) -> CollectiveMode:
    if get("localsgd") or get("adaptive_localsgd"):
        return CollectiveMode.LOCAL_SGD
    return CollectiveMode.GRAD_ALLREDUCE


def _write_collective_mode(value: Any) -> dict[str, Any]:
    if value is CollectiveMode.LOCAL_SGD:
        return {"localsgd": True}
    return {"localsgd": False, "adaptive_localsgd": False}


def _read_num_stages(get: Callable[[str], Any]) -> int:
    return int(get("hybrid_configs.pp_degree")) if get("pipeline") else 1


def _write_num_stages(value: Any) -> dict[str, Any]:
    return {"pipeline": int(value) > 1, "hybrid_configs.pp_degree": int(value)}


def _read_epl_strategy(get: Callable[[str], Any]) -> EplPipelineStrategy:
    mode = get("pipeline_configs.schedule_mode")
    return (EplPipelineStrategy.PREFER_BACKWARD if mode is PipelineSchedule.ONE_F_ONE_B
            else EplPipelineStrategy.PREFER_FORWARD)


def _write_epl_strategy(value: Any) -> dict[str, Any]:
    mode = PipelineSchedule.ONE_F_ONE_B if value is EplPipelineStrategy.PREFER_BACKWARD else PipelineSchedule.F_THEN_B
    return {"pipeline_configs.schedule_mode": mode}


ALIASES: tuple[Alias, ...] = (
    Alias("use_local_sgd", "localsgd", "Fleet 1.x name of localsgd"),
    Alias("local_sgd_steps", "localsgd_configs.k_steps", "Fleet 1.x name of k_steps"),
    Alias("local_sgd_is_warm_steps", "localsgd_configs.begin_step",
          "Fleet 1.x name of begin_step (the warm-up before local SGD starts)"),
    Alias("forward_recompute", "recompute", "Fleet 1.x name of recompute"),
    Alias("recompute_checkpoints", "recompute_configs.checkpoints",
          "Fleet 1.x name of the recompute checkpoints"),
    Alias("use_amp", "amp", "Fleet 1.x name of amp"),
    Alias("amp_loss_scaling", "amp_configs.init_loss_scaling",
          "Fleet 1.x name of the initial loss scale"),
    Alias("exec_strategy", "execution_strategy", "Fleet 1.x name of execution_strategy"),
    Alias(
        "zero.level", None,
        "EPL's ZeRO switch (dotted-key form): 'v1' shards optimizer state and gradients over "
        "every rank (sharding on, sharding_configs.stage = 2, sharding_degree = 0); '' turns "
        "sharding off; reads 'v1' when sharding is on",
        spec=Choice(ZeroLevel), read=_read_zero_level, write=_write_zero_level,
        touches=("sharding", "sharding_configs.sharding_degree", "sharding_configs.stage"),
    ),
    Alias(
        "offload.level", None,
        "EPL's offload switch: 'v0' keeps every parameter in host memory (sharding on at "
        "stage 3 over every rank, optimize_offload and offload_params on); '' turns both "
        "offloads off; reads 'v0' when sharding with offload_params is on",
        spec=Choice(OffloadLevel), read=_read_offload_level, write=_write_offload_level,
        touches=("sharding", "sharding_configs.sharding_degree", "sharding_configs.stage",
                 "sharding_configs.optimize_offload", "sharding_configs.offload_params"),
    ),
    Alias("optimizer.num_apply_group", "num_apply_group", "EPL's name of num_apply_group"),
    Alias("communication.gradients_reduce_method", "sharding_configs.gradients_reduce_method",
          "EPL's name of sharding_configs.gradients_reduce_method"),
    Alias("communication.clip_after_allreduce", "sharding_configs.clip_after_allreduce",
          "EPL's name of sharding_configs.clip_after_allreduce"),
    Alias("io.slicing", "io_configs.slicing", "EPL's name of io_configs.slicing"),
    Alias("io.unbalanced_io_slicing", "io_configs.unbalanced_io_slicing",
          "EPL's name of io_configs.unbalanced_io_slicing"),
    Alias("io.drop_last_files", "io_configs.drop_last_files", "EPL's name of io_configs.drop_last_files"),
    Alias(
        "collective_mode", None,
        "Fleet 1.x switch, derived from localsgd: reads 'local_sgd' when localsgd or "
        "adaptive_localsgd is on, else 'grad_allreduce'; setting 'local_sgd' turns localsgd on; "
        "setting 'grad_allreduce' turns localsgd and adaptive_localsgd off (plain data parallel "
        "by gradient allreduce)",
        spec=Choice(CollectiveMode), read=_read_collective_mode, write=_write_collective_mode,
        touches=("localsgd", "adaptive_localsgd"),
    ),
    Alias("pipeline.num_micro_batch", "pipeline_configs.accumulate_steps",
          "EPL's name of pipeline_configs.accumulate_steps (micro-batches per step)"),
    Alias(
        "pipeline.num_stages", None,
        "EPL's stage count: n > 1 turns pipeline on with hybrid_configs.pp_degree = n; 1 turns "
        "it off; reads pp_degree when pipeline is on, else 1",
        spec=Int(min=1), read=_read_num_stages, write=_write_num_stages,
        touches=("pipeline", "hybrid_configs.pp_degree"),
    ),
    Alias(
        "pipeline.strategy", None,
        "EPL's schedule: 'PreferBackward' (PipeDream-style) is schedule_mode '1F1B', "
        "'PreferForward' (GPipe) is 'FThenB'",
        spec=Choice(EplPipelineStrategy), read=_read_epl_strategy, write=_write_epl_strategy,
        touches=("pipeline_configs.schedule_mode",),
    ),
    *EPL_ALIASES,
)

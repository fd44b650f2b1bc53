"""DistributedStrategy: Paddle defaults, 1.x aliases, strict validation, round trips.

The contract (types and ranges of every option) is restated here independently of the registry
in ``fleetlike.config.options``, so that a registry edit that changes the contract fails a
test instead of silently redefining it.
"""

from __future__ import annotations

import copy
import json
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fleetlike.strategies as strategies_pkg
from fleetlike.strategies import (
    STRATEGY_ENV_VAR,
    CollectiveMode,
    DistributedStrategy,
    HalfDtype,
    StrategyError,
    StrategyTypeError,
    StrategyValueError,
    UnknownAttributeError,
    UnknownOptionError,
)
import fleetlike.config as config_pkg
from fleetlike.config import aliases, choices, epl_keys, fields, formats, options, recipes, rules, section_checks, strategy, view

# ------------------------------------------------------------------ the contract, restated

PADDLE_DEFAULTS: dict[str, Any] = {
    "localsgd": False,
    "localsgd_configs": {"k_steps": 1, "begin_step": 1, "outer_optimizer": "average", "outer_lr": 0.7,
                         "outer_momentum": 0.9, "sync_dtype": "float32", "fragments": 1, "overlap": 0,
                         "overlap_alpha": 0.5},
    "adaptive_localsgd": False,
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1, "outer_optimizer": "average",
                                  "outer_lr": 0.7, "outer_momentum": 0.9, "sync_dtype": "float32"},
    "amp": False,
    "amp_configs": {
        "init_loss_scaling": 32768.0, "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0, "decr_ratio": 0.8, "use_dynamic_loss_scaling": True,
        "custom_white_list": [], "custom_black_list": [], "dtype": "float16",
        "policy": "always", "policy_start_time": 10, "policy_end_time": 0, "policy_hold_time": 100,
        "policy_interval_time": 1000, "policy_interval_hold_time": 100, "policy_loss_fast": 0.5,
        "policy_loss_slow": 0.0, "debug_log": False,
    },
    "recompute": False,
    "recompute_configs": {"checkpoints": [], "check_gradients": False},
    "gradient_merge": False,
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "use_hierarchical_allreduce": False,
    "hierarchical_allreduce_inter_nranks": 0,
    "hierarchical_allreduce_configs": {"algorithm": "reduce_scatter"},
    "nccl_comm_num": 1,
    "fuse_all_reduce_ops": True,
    "fuse_grad_size_in_MB": 32,
    "fuse_grad_max_buckets": 0,
    "fp16_allreduce": False,
    "fp16_allreduce_configs": {"dtype": "float16", "mode": "all", "grad_scale": 1.0},
    "auto_tune": False,
    "auto_tune_configs": {"warmup_steps": 1, "steps_per_trial": 5, "seconds_per_trial": 0.5, "min_gain": 0.02, "race_blocks": 3, "race_gain": 0.05,
                          "confidence": 0.95, "allow_16bit_wire": False,
                          "fixed": []},
    "gossip": False,
    "gossip_configs": {"downsample_n_elements": 4},
    "sharding": False,
    "sharding_configs": {"sharding_degree": 8, "segment_broadcast_MB": 32.0, "gradients_reduce_method": "mean",
                         "clip_norm": 0.0, "clip_after_allreduce": False, "overlap_update": True,
                         "stage": 1, "optimize_offload": False, "offload_params": False},
    "num_apply_group": 1,
    "pipeline": False,
    "pipeline_configs": {"accumulate_steps": 1, "micro_batch_size": 0, "schedule_mode": "1F1B", "split_points": [],
                         "balance": "params", "p2p": "auto", "freeze_heap": True},
    "hybrid_configs": {"dp_degree": -1, "pp_degree": 1, "mp_degree": 1},
    "tensor_parallel": False,
    "sync_batch_norm": False,
    "sync_batch_norm_configs": {"scope": "global"},
    "find_unused_parameters": False,
    "check_nan_inf": False,
    "slow_rank_check": False,
    "slow_rank_check_configs": {"every_n_steps": 100, "factor": 1.5},
    "visible_devices": [],
    "io_configs": {"slicing": True, "unbalanced_io_slicing": True, "drop_last_files": False},
    "mode": "collective",
    "execution_strategy": {"num_threads": 1, "num_iteration_per_drop_scope": 10},
}

# kind, then bounds: ("int", lo, hi), ("float", gt, lt) open bounds, ("choice", values)
KINDS: dict[str, tuple[Any, ...]] = {
    "localsgd": ("bool",),
    "localsgd_configs.k_steps": ("int", 1, 1 << 31),
    "localsgd_configs.begin_step": ("int", 1, None),
    "localsgd_configs.outer_optimizer": ("choice", ["average", "sgd", "nesterov"]),
    "localsgd_configs.outer_lr": ("float", 0.0, None),
    "localsgd_configs.sync_dtype": ("choice", ["float32", "bfloat16", "float16"]),
    # keys whose valid values depend on others (checked across keys): values valid whatever the
    # other keys hold, and invalid ones with their error type
    "localsgd_configs.outer_momentum": ("values", [0.5, 0.9, 0.99],
                                        [(-0.1, ValueError), (1.0, ValueError), ("0.9", TypeError)]),
    "localsgd_configs.fragments": ("values", [1], [(0, ValueError), (1.5, TypeError), (True, TypeError)]),
    "localsgd_configs.overlap": ("values", [0], [(-1, ValueError), ("1", TypeError)]),
    "localsgd_configs.overlap_alpha": ("values", [0.0, 0.25, 0.5, 1],
                                       [(-0.5, ValueError), (1.5, ValueError), (None, TypeError)]),
    "adaptive_localsgd": ("bool",),
    "adaptive_localsgd_configs.init_k_steps": ("int", 1, None),
    "adaptive_localsgd_configs.begin_step": ("int", 1, None),
    "adaptive_localsgd_configs.outer_optimizer": ("choice", ["average", "sgd", "nesterov"]),
    "adaptive_localsgd_configs.outer_lr": ("float", 0.0, None),
    "adaptive_localsgd_configs.outer_momentum": ("values", [0.5, 0.9],
                                                 [(-0.1, ValueError), (1.0, ValueError)]),
    "adaptive_localsgd_configs.sync_dtype": ("choice", ["float32", "bfloat16", "float16"]),
    "amp": ("bool",),
    "amp_configs.init_loss_scaling": ("float", 0.0, None),
    "amp_configs.incr_every_n_steps": ("int", 1, None),
    "amp_configs.decr_every_n_nan_or_inf": ("int", 1, None),
    "amp_configs.incr_ratio": ("float", 1.0, None),
    "amp_configs.decr_ratio": ("float", 0.0, 1.0),
    "amp_configs.use_dynamic_loss_scaling": ("bool",),
    "amp_configs.custom_white_list": ("names", "w"),
    "amp_configs.custom_black_list": ("names", "b"),
    "amp_configs.dtype": ("choice", ["float16", "bfloat16"]),
    "amp_configs.policy": ("choice", ["always", "time", "time_lr", "loss"]),
    "amp_configs.policy_start_time": ("int", 0, None),
    "amp_configs.policy_end_time": ("values", [0], [(-1, ValueError), ("5", TypeError)]),
    "amp_configs.policy_hold_time": ("int", 0, None),
    "amp_configs.policy_interval_time": ("int", 1, None),
    "amp_configs.policy_interval_hold_time": ("int", 0, None),
    "amp_configs.policy_loss_fast": ("values", [0.5, 1.0, 2], [("x", TypeError), (float("nan"), ValueError)]),
    "amp_configs.policy_loss_slow": ("values", [0.0, -0.5], [(None, TypeError), (float("inf"), ValueError)]),
    "amp_configs.debug_log": ("bool",),
    "recompute": ("bool",),
    "recompute_configs.checkpoints": ("checkpoints",),
    "recompute_configs.check_gradients": ("bool",),
    "gradient_merge": ("bool",),
    "gradient_merge_configs.k_steps": ("int", 1, 1 << 31),
    "gradient_merge_configs.avg": ("bool",),
    "use_hierarchical_allreduce": ("bool",),
    "hierarchical_allreduce_inter_nranks": ("int", 0, None),
    "hierarchical_allreduce_configs.algorithm": ("choice", ["reduce_scatter", "reduce_broadcast"]),
    "nccl_comm_num": ("int", 1, 16),
    "fuse_all_reduce_ops": ("bool",),
    "fuse_grad_size_in_MB": ("float", 0.0, float(1 << 30)),
    "fuse_grad_max_buckets": ("int", 0, None),
    "fp16_allreduce": ("bool",),
    "fp16_allreduce_configs.dtype": ("choice", ["float16", "bfloat16"]),
    "fp16_allreduce_configs.mode": ("choice", ["all", "mixed"]),
    "fp16_allreduce_configs.grad_scale": ("float", 0.0, None),
    "auto_tune": ("bool",),
    "auto_tune_configs.warmup_steps": ("int", 0, None),
    "auto_tune_configs.steps_per_trial": ("int", 1, None),
    "auto_tune_configs.allow_16bit_wire": ("bool",),
    "auto_tune_configs.min_gain": ("float_ge", 0.0),
    "auto_tune_configs.race_blocks": ("int", 1, None),
    "auto_tune_configs.race_gain": ("float_ge", 0.0),
    "auto_tune_configs.confidence": ("float", 0.0, 1.0),
    "auto_tune_configs.seconds_per_trial": ("float_ge", 0.0),
    "auto_tune_configs.fixed": ("names", "k"),
    "gossip": ("bool",),
    "gossip_configs.downsample_n_elements": ("int", 2, None),
    "sharding": ("bool",),
    "sharding_configs.sharding_degree": ("int", 0, None),
    "sharding_configs.segment_broadcast_MB": ("float", 0.0, None),
    "sharding_configs.gradients_reduce_method": ("choice", ["mean", "sum"]),
    "sharding_configs.clip_norm": ("float_ge", 0.0),
    "sharding_configs.clip_after_allreduce": ("bool",),
    "sharding_configs.overlap_update": ("bool",),
    "sharding_configs.stage": ("int", 1, 3),
    "sharding_configs.optimize_offload": ("bool",),
    "sharding_configs.offload_params": ("bool",),
    "num_apply_group": ("int", 1, None),
    "pipeline": ("bool",),
    "pipeline_configs.accumulate_steps": ("int", 1, None),
    "pipeline_configs.micro_batch_size": ("int", 0, None),
    "pipeline_configs.schedule_mode": ("choice", ["1F1B", "FThenB"]),
    "pipeline_configs.split_points": ("names", "s"),
    "pipeline_configs.balance": ("choice", ["params", "time"]),
    "pipeline_configs.p2p": ("choice", ["auto", "gloo"]),
    "pipeline_configs.freeze_heap": ("bool",),
    "hybrid_configs.dp_degree": ("values", [-1, 1, 4], [(0, ValueError), (-2, ValueError), ("2", TypeError)]),
    "hybrid_configs.pp_degree": ("int", 1, None),
    "hybrid_configs.mp_degree": ("values", [1], [(2, ValueError), (0, ValueError), (True, TypeError)]),
    "tensor_parallel": ("bool",),
    "sync_batch_norm": ("bool",),
    "sync_batch_norm_configs.scope": ("choice", ["global", "local"]),
    "find_unused_parameters": ("bool",),
    "check_nan_inf": ("bool",),
    "slow_rank_check": ("bool",),
    "slow_rank_check_configs.every_n_steps": ("int", 1, None),
    "slow_rank_check_configs.factor": ("float", 1.0, None),
    "visible_devices": ("values", [[0, 1], [], [2]], [("0,x", ValueError), (3, TypeError), ([1, 1], ValueError)]),
    "io_configs.slicing": ("bool",),
    "io_configs.unbalanced_io_slicing": ("bool",),
    "io_configs.drop_last_files": ("bool",),
    "mode": ("choice", ["nccl2", "collective"]),
    "execution_strategy.num_threads": ("int", 0, None),
    "execution_strategy.num_iteration_per_drop_scope": ("int", 1, None),
}

# Fleet 1.x alias -> (canonical flat path, a non-default value)
ALIASES: dict[str, tuple[str, Any]] = {
    "use_local_sgd": ("localsgd", True),
    "local_sgd_steps": ("localsgd_configs.k_steps", 4),
    "local_sgd_is_warm_steps": ("localsgd_configs.begin_step", 30),
    "forward_recompute": ("recompute", True),
    "recompute_checkpoints": ("recompute_configs.checkpoints", ["encoder.0", "encoder.1"]),
    "use_amp": ("amp", True),
    "amp_loss_scaling": ("amp_configs.init_loss_scaling", 1024.0),
}


def flat(nested: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def get_path(s: DistributedStrategy, path: str) -> Any:
    head, dot, tail = path.partition(".")
    return getattr(s, head)[tail] if dot else getattr(s, head)


# ------------------------------------------------------------------- defaults and registry


def test_defaults_are_paddle_2x() -> None:
    s = DistributedStrategy()
    assert s.to_dict() == PADDLE_DEFAULTS
    assert s.to_dict(flat=True) == flat(PADDLE_DEFAULTS)
    assert s.fuse_all_reduce_ops is True and s.nccl_comm_num == 1
    assert s.amp_configs["dtype"] is HalfDtype.FLOAT16 and s.amp_configs["dtype"] == "float16"


def test_registry_matches_the_restated_contract() -> None:
    assert DistributedStrategy.option_names() == list(flat(PADDLE_DEFAULTS))
    assert set(KINDS) == set(DistributedStrategy.option_names())
    assert set(DistributedStrategy.aliases()) == {*ALIASES, "collective_mode", "exec_strategy", "zero.level",
                                                  "offload.level", "optimizer.num_apply_group",
                                                  "communication.gradients_reduce_method",
                                                  "communication.clip_after_allreduce",
                                                  *(a.name for a in epl_keys.EPL_ALIASES),
                                                  "io.slicing", "io.unbalanced_io_slicing", "io.drop_last_files",
                                                  "pipeline.num_micro_batch", "pipeline.num_stages",
                                                  "pipeline.strategy"}


@pytest.mark.parametrize("module", [strategies_pkg, config_pkg, strategy, fields, choices, options,
                                    section_checks, aliases, formats, view, rules, recipes])
def test_all_is_curated(module: Any) -> None:
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name


def test_config_never_reads_the_environment() -> None:
    for module in (config_pkg, strategy, fields, choices, options, section_checks, aliases, formats, view, rules,
                   recipes):
        source = Path(module.__file__).read_text()
        assert "os.environ" not in source and "getenv" not in source
    assert STRATEGY_ENV_VAR == "FLEETLIKE_STRATEGY"


# --------------------------------------------------------------------------- aliases


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_alias_maps_both_ways(alias: str) -> None:
    path, value = ALIASES[alias]
    s = DistributedStrategy()
    setattr(s, alias, value)
    assert get_path(s, path) == (tuple(value) if isinstance(value, list) else value)
    assert alias not in s.to_dict() and alias not in s.to_dict(flat=True)
    assert s.to_dict(flat=True)[path] == value
    t = DistributedStrategy.from_dict({path: value})
    assert getattr(t, alias) == getattr(s, alias) and t == s
    assert DistributedStrategy.from_dict({alias: value}) == s


def test_exec_strategy_alias_object_and_dict() -> None:
    class ExecutionStrategy:  # shaped like paddle.static.ExecutionStrategy
        num_threads = 4
        num_iteration_per_drop_scope = 50
        use_thread_barrier = False

    s = DistributedStrategy()
    s.exec_strategy = ExecutionStrategy()
    assert s.execution_strategy == {"num_threads": 4, "num_iteration_per_drop_scope": 50}
    s.exec_strategy = {"num_threads": 2}
    assert s.exec_strategy.num_threads == 2
    assert s.exec_strategy["num_iteration_per_drop_scope"] == 50
    assert s.to_dict()["execution_strategy"] == {"num_threads": 2,
                                                 "num_iteration_per_drop_scope": 50}
    names = [i.name for i in s.inactive_settings()]
    assert names == ["execution_strategy"]
    assert "execution_strategy" in str(s) and "without effect" in str(s)
    with pytest.raises(TypeError, match="exec_strategy"):
        s.exec_strategy = object()
    with pytest.raises(UnknownOptionError, match="num_threads"):
        s.exec_strategy = {"num_thread": 1}


def test_collective_mode_is_a_view_of_localsgd() -> None:
    s = DistributedStrategy()
    assert s.collective_mode == "grad_allreduce"
    s.collective_mode = "local_sgd"
    assert s.localsgd is True and s.collective_mode is CollectiveMode.LOCAL_SGD
    s.localsgd, s.adaptive_localsgd = False, True
    assert s.collective_mode == "local_sgd"
    s.collective_mode = CollectiveMode.GRAD_ALLREDUCE
    assert (s.localsgd, s.adaptive_localsgd) == (False, False)
    assert "collective_mode" not in s.to_dict()
    with pytest.raises(ValueError, match="collective_mode.*'local_sgd'"):
        s.collective_mode = "localsgd"
    assert DistributedStrategy.from_dict({"collective_mode": "local_sgd"}).localsgd is True


def test_mode_is_stored_and_reported_inert() -> None:
    s = DistributedStrategy()
    assert s.mode == "collective" and s.inactive_settings() == []
    s.mode = "nccl2"
    assert s.to_dict()["mode"] == "nccl2"
    (item,) = s.inactive_settings()
    assert item.name == "mode" and item.value == "nccl2" and "recorded" in item.reason


def test_alias_and_canonical_in_one_dict_is_rejected() -> None:
    with pytest.raises(ValueError, match="'localsgd' and 'use_local_sgd'"):
        DistributedStrategy.from_dict({"localsgd": True, "use_local_sgd": True})
    with pytest.raises(ValueError, match="amp_configs.dtype"):
        DistributedStrategy.from_dict({"amp_configs": {"dtype": "float16"},
                                       "amp_configs.dtype": "bfloat16"})


# ---------------------------------------------------------------------------- errors

BAD: list[tuple[str, Any, type[Exception], list[str]]] = [
    # name, value, error type, fragments the message must contain (field, value, constraint, fix)
    ("nccl_comm_num", True, TypeError, ["nccl_comm_num", "True", "bool is not accepted", "Fix"]),
    ("nccl_comm_num", 0, ValueError, ["nccl_comm_num", "got 0", "[1, 16]", "Fix"]),
    ("nccl_comm_num", 17, ValueError, ["nccl_comm_num", "17", "[1, 16]", "Fix"]),
    ("nccl_comm_num", 2.0, TypeError, ["nccl_comm_num", "2.0", "int", "whole number"]),
    ("localsgd", 1, TypeError, ["localsgd", "1 (int)", "a bool", "True or False"]),
    ("localsgd", "true", TypeError, ["localsgd", "'true'", "a bool", "True or False"]),
    ("local_sgd_steps", 0, ValueError, ["local_sgd_steps", "localsgd_configs.k_steps", "[1, 2147483648]"]),
    ("fuse_grad_size_in_MB", 0, ValueError, ["fuse_grad_size_in_MB", "bounds excluded", "got 0", "Fix"]),
    ("fuse_grad_size_in_MB", "32", TypeError, ["fuse_grad_size_in_MB", "'32'", "number"]),
    ("fuse_grad_size_in_MB", float("inf"), ValueError, ["fuse_grad_size_in_MB", "finite"]),
    ("amp_configs", {"decr_ratio": 1.0}, ValueError,
     ["amp_configs.decr_ratio", "1.0", "(0, 1)", "strictly between 0 and 1"]),
    ("amp_configs", {"incr_ratio": 1}, ValueError, ["amp_configs.incr_ratio", "> 1"]),
    ("amp_configs", {"dtype": "fp16"}, ValueError,
     ["amp_configs.dtype", "'fp16'", "'float16', 'bfloat16'", "use one of"]),
    ("amp_configs", {"dtype": "Float16"}, ValueError, ["did you mean 'float16'"]),
    ("amp_configs", {"dtype": 16}, TypeError, ["amp_configs.dtype", "16 (int)", "a str"]),
    ("amp_configs", {"custom_white_list": "relu"}, TypeError,
     ["amp_configs.custom_white_list", "'relu'", "list", "['relu']"]),
    ("amp_configs", {"custom_black_list": ["relu", 3]}, TypeError, ["custom_black_list", "3"]),
    ("amp_configs", {"custom_white_list": ["a"], "custom_black_list": ["a"]}, ValueError,
     ["custom_white_list", "custom_black_list", "['a']", "disjoint", "Fix"]),
    ("amp_configs", {"init_loss_scale": 1.0}, KeyError,
     ["amp_configs", "'init_loss_scale'", "did you mean 'init_loss_scaling'"]),
    ("amp_configs", 1024, TypeError, ["amp_configs", "1024 (int)", "a dict", "only the keys"]),
    ("recompute_configs", {"checkpoints": "encoder"}, ValueError,
     ["recompute_configs.checkpoints", "'encoder'", "'auto'", "['encoder']"]),
    ("hierarchical_allreduce_inter_nranks", -1, ValueError, ["inter_nranks", ">= 0", "-1"]),
    ("sync_batch_norm_configs", {"scope": "node"}, ValueError, ["scope", "'global', 'local'"]),
    ("fp16_allreduce_configs", {"mode": "half"}, ValueError, ["fp16_allreduce_configs.mode"]),
    ("slow_rank_check_configs", {"factor": 1.0}, ValueError, ["factor", "> 1"]),
    ("mode", "nccl", ValueError, ["mode", "'nccl'", "did you mean 'nccl2'"]),
]


@pytest.mark.parametrize(("name", "value", "error", "fragments"), BAD,
                         ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_assignment_raises_precisely_and_changes_nothing(
    name: str, value: Any, error: type[Exception], fragments: list[str]
) -> None:
    s = DistributedStrategy(amp=True, localsgd_configs={"k_steps": 3})
    before = s.copy()
    with pytest.raises(error) as info:
        setattr(s, name, value)
    assert isinstance(info.value, StrategyError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert s == before and s.to_dict() == before.to_dict()
    with pytest.raises(error):  # the same through the dict interface
        DistributedStrategy.from_dict({name: value})


def test_error_types_and_attributes() -> None:
    with pytest.raises(StrategyTypeError) as info:
        DistributedStrategy().nccl_comm_num = True
    assert (info.value.field, info.value.value) == ("nccl_comm_num", True)
    assert "int" in info.value.constraint and info.value.fix
    assert issubclass(UnknownOptionError, KeyError) and issubclass(UnknownOptionError, ValueError)
    assert issubclass(UnknownAttributeError, AttributeError)
    assert issubclass(StrategyValueError, ValueError)


def test_unknown_attribute_suggests_nearest() -> None:
    s = DistributedStrategy()
    with pytest.raises(AttributeError, match="'lcoalsgd'.*did you mean 'localsgd'"):
        s.lcoalsgd = True
    with pytest.raises(AttributeError, match="did you mean 'nccl_comm_num'"):
        _ = s.nccl_comm_nums
    with pytest.raises(AttributeError, match="did you mean 'init_loss_scaling'"):
        _ = s.amp_configs.init_loss_scale
    with pytest.raises(AttributeError, match="k_steps"):
        s.localsgd_configs.k_step = 3
    assert not hasattr(s, "nope") and s == DistributedStrategy()


def test_unknown_keys_in_dicts() -> None:
    with pytest.raises(KeyError, match="did you mean 'localsgd'"):
        DistributedStrategy.from_dict({"localsdg": True})
    with pytest.raises(ValueError, match="did you mean 'k_steps'"):
        DistributedStrategy.from_dict({"localsgd_configs.k_step": 2})
    with pytest.raises(KeyError, match="'amp.dtype'"):
        DistributedStrategy.from_dict({"amp.dtype": "float16"})
    with pytest.raises(TypeError, match="option name"):
        DistributedStrategy.from_dict({1: True})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="dict"):
        DistributedStrategy.from_dict([("amp", True)])  # type: ignore[arg-type]


def test_ints_are_floats_but_bools_are_not_ints() -> None:
    s = DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": 1024}
    assert s.amp_configs["init_loss_scaling"] == 1024.0
    assert isinstance(s.amp_configs["init_loss_scaling"], float)
    s.fuse_grad_size_in_MB = 0.5
    assert s.fuse_grad_size_in_MB == 0.5
    for bad in (True, False):
        with pytest.raises(TypeError, match="bool"):
            s.amp_configs = {"incr_every_n_steps": bad}
        with pytest.raises(TypeError, match="bool"):
            s.amp_configs = {"init_loss_scaling": bad}


# ------------------------------------------------------------------------- sections


def test_section_assignment_updates_only_given_keys() -> None:
    s = DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": 1024}
    expected = dict(PADDLE_DEFAULTS["amp_configs"], init_loss_scaling=1024.0)
    assert s.amp_configs == expected
    s.amp_configs = {"dtype": "bfloat16", "custom_white_list": ("matmul",)}
    assert s.amp_configs["init_loss_scaling"] == 1024.0
    assert s.amp_configs["custom_white_list"] == ("matmul",)
    s.amp_configs = {}
    assert s.to_dict(non_default_only=True) == {
        "amp_configs": {"init_loss_scaling": 1024.0, "custom_white_list": ["matmul"],
                        "dtype": "bfloat16"}}


def test_section_is_a_live_validated_view() -> None:
    s = DistributedStrategy()
    view = s.localsgd_configs
    view["k_steps"] = 4
    assert s.localsgd_configs["k_steps"] == 4 and s.local_sgd_steps == 4
    view.begin_step = 30
    assert s.to_dict()["localsgd_configs"] == {**PADDLE_DEFAULTS["localsgd_configs"], "k_steps": 4, "begin_step": 30}
    with pytest.raises(ValueError, match="localsgd_configs.k_steps"):
        view["k_steps"] = 0
    with pytest.raises(ValueError):
        view.update({"k_steps": 8, "begin_step": 0})  # atomic: k_steps stays 4
    assert view == {**PADDLE_DEFAULTS["localsgd_configs"], "k_steps": 4, "begin_step": 30}
    assert dict(view) == view.to_dict()
    with pytest.raises(TypeError, match="reset"):
        del view["k_steps"]
    with pytest.raises(KeyError, match="k_steps"):
        _ = view["k_step"]
    assert view.get("k_step", "missing") == "missing" and "k_steps" in view
    assert list(view) == list(PADDLE_DEFAULTS["localsgd_configs"]) and len(view) == len(list(view))
    with pytest.raises(AttributeError):
        s.amp_configs["custom_white_list"].append("x")  # a tuple: no silent copy edit
    assert repr(view) == repr({**PADDLE_DEFAULTS["localsgd_configs"], "k_steps": 4, "begin_step": 30})


def test_reset() -> None:
    s = DistributedStrategy(amp=True, amp_configs={"dtype": "bfloat16", "incr_ratio": 4},
                            local_sgd_steps=3, nccl_comm_num=2)
    s.reset("amp_configs.dtype")
    assert s.amp_configs["dtype"] == "float16" and s.amp_configs["incr_ratio"] == 4.0
    s.reset("local_sgd_steps")
    s.reset("amp_configs")
    assert s.to_dict(non_default_only=True) == {"amp": True, "nccl_comm_num": 2}
    s.reset()
    assert s == DistributedStrategy()
    with pytest.raises(ValueError, match="derived"):
        s.reset("collective_mode")
    with pytest.raises(KeyError):
        s.reset("nccl_comm_nm")


# ---------------------------------------------------------------------- round trips


def test_flat_dotted_keys() -> None:
    s = DistributedStrategy.from_dict({"localsgd_configs.k_steps": 4, "amp": True})
    assert s.localsgd_configs["k_steps"] == 4 and s.amp is True
    assert s.to_dict(flat=True, non_default_only=True) == {
        "localsgd_configs.k_steps": 4, "amp": True}
    assert DistributedStrategy(**{"exec_strategy.num_threads": 3}).execution_strategy[
        "num_threads"] == 3


def test_save_load_and_override(tmp_path: Path) -> None:
    s = DistributedStrategy(localsgd=True, localsgd_configs={"k_steps": 4, "begin_step": 30},
                            recompute=True, recompute_configs={"checkpoints": "auto"})
    path = tmp_path / "strategy.json"
    s.save(path)
    assert json.loads(path.read_text()) == s.to_dict()
    assert DistributedStrategy.load(path) == s
    assert DistributedStrategy.from_json_or_path(str(path)) == s
    assert DistributedStrategy.from_json_or_path(json.dumps(s.to_dict(flat=True))) == s

    t = s.copy()
    t.update_from_override('  {"amp": true, "localsgd_configs.k_steps": 8}  ')
    assert t.amp is True and t.localsgd_configs == {**PADDLE_DEFAULTS["localsgd_configs"], "k_steps": 8,
                                                     "begin_step": 30}
    assert t.recompute_configs["checkpoints"] == "auto"
    before = t.copy()
    with pytest.raises(ValueError, match=STRATEGY_ENV_VAR):
        t.update_from_override(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="not valid JSON"):
        t.update_from_override("{amp: true}")
    with pytest.raises(TypeError, match="JSON object"):
        DistributedStrategy.load(_write(tmp_path / "list.json", "[1, 2]"))
    with pytest.raises(ValueError, match="localsgd_configs.k_steps"):
        t.update_from_override('{"amp": false, "localsgd_configs.k_steps": 0}')
    assert t == before


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_equality_copy_pickle() -> None:
    s = DistributedStrategy(amp=True, amp_configs={"custom_black_list": ["softmax"]})
    t = s.copy()
    assert t == s and t is not s
    t.amp_configs["custom_black_list"] = []
    assert t != s and s.amp_configs["custom_black_list"] == ("softmax",)
    assert copy.deepcopy(s) == s and copy.copy(s) == s
    assert pickle.loads(pickle.dumps(s)) == s
    assert s != s.to_dict() and DistributedStrategy() == DistributedStrategy()
    with pytest.raises(TypeError):
        hash(s)
    assert eval(repr(s), {"DistributedStrategy": DistributedStrategy}) == s


# -------------------------------------------------------------------- fleet-facing


def test_print_table_marks_enabled_and_changed() -> None:
    s = DistributedStrategy(localsgd=True, local_sgd_steps=4, amp=True, fp16_allreduce=True)
    text = str(s)
    assert "enabled: localsgd, amp, fuse_all_reduce_ops, fp16_allreduce" in text
    rows = {line.split()[0]: line for line in text.splitlines()[4:] if line.strip()}
    assert "*" in rows["localsgd"] and "True" in rows["localsgd"]
    assert "*" in rows["localsgd_configs.k_steps"] and " 4 " in rows["localsgd_configs.k_steps"]
    assert "*" not in rows["localsgd_configs.begin_step"]
    assert set(DistributedStrategy.option_names()) <= set(rows)
    assert "enabled: fuse_all_reduce_ops" in str(DistributedStrategy())


def test_enabled_features() -> None:
    assert DistributedStrategy().enabled_features() == ["fuse_all_reduce_ops"]
    s = DistributedStrategy(fuse_all_reduce_ops=False, fp16_allreduce=True, amp=True,
                            localsgd=True)
    assert s.enabled_features() == ["localsgd", "amp", "fp16_allreduce"]


def test_inactive_settings() -> None:
    s = DistributedStrategy(amp_configs={"dtype": "bfloat16"}, recompute=True,
                            hierarchical_allreduce_inter_nranks=4)
    found = {i.name: i for i in s.inactive_settings()}
    assert set(found) == {"amp_configs.dtype", "recompute", "hierarchical_allreduce_inter_nranks"}
    assert "amp" in found["amp_configs.dtype"].reason and found["amp_configs.dtype"].value == (
        "bfloat16")
    assert "checkpoints" in found["recompute"].reason
    s.amp = True
    s.recompute_configs = {"checkpoints": ["encoder.0"]}
    s.use_hierarchical_allreduce = True
    assert s.inactive_settings() == []


def test_validate_combination() -> None:
    s = DistributedStrategy(localsgd=True, adaptive_localsgd=True)  # assignment order is free
    with pytest.raises(ValueError) as info:
        s.validate_combination()
    assert "localsgd" in str(info.value) and "adaptive_localsgd" in str(info.value)
    assert "Fix" in str(info.value)
    s.localsgd = False
    s.validate_combination()


def test_describe_every_option_and_alias() -> None:
    for name in [*DistributedStrategy.option_names(), *DistributedStrategy.aliases(),
                 *PADDLE_DEFAULTS]:
        text = DistributedStrategy.describe(name)
        assert text.startswith(name) and len(text) > 30, name
    assert "2 across nodes" in DistributedStrategy.describe("nccl_comm_num")
    assert "default 1" in DistributedStrategy.describe("nccl_comm_num")
    assert "localsgd" in DistributedStrategy.describe("use_local_sgd")
    assert DistributedStrategy.nccl_comm_num.__doc__ == DistributedStrategy.describe(
        "nccl_comm_num")
    with pytest.raises(KeyError, match="did you mean 'nccl_comm_num'"):
        DistributedStrategy.describe("ncl_comm_num")
    doc = DistributedStrategy.options_markdown()
    assert all(f"`{name}`" in doc for name in [*KINDS, *ALIASES])


# ------------------------------------------------------------------------ hypothesis

_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=10)


def _valid(path: str) -> st.SearchStrategy[Any]:
    kind = KINDS[path]
    if kind[0] == "bool":
        return st.booleans()
    if kind[0] == "int":
        return st.integers(kind[1], kind[2] if kind[2] is not None else 10**9)
    if kind[0] == "float":
        gt, lt = kind[1], kind[2]
        floats = st.floats(min_value=gt, max_value=lt, exclude_min=True,
                           exclude_max=lt is not None, allow_infinity=False, allow_nan=False)
        ints = st.integers(int(gt) + 1, int(lt) - 1 if lt is not None else 10**6)
        return floats | ints if lt is None or lt - gt > 2 else floats
    if kind[0] == "float_ge":  # a closed lower bound (0 = off)
        return st.floats(min_value=kind[1], max_value=1e9, allow_infinity=False, allow_nan=False) | st.integers(
            int(kind[1]), 10**6)
    if kind[0] in ("choice", "values"):
        return st.sampled_from(kind[1])
    if kind[0] == "names":  # white and black names differ by prefix, so the lists are disjoint
        return st.lists(_NAME.map(lambda n, p=kind[1]: f"{p}_{n}"), max_size=4)
    return st.just("auto") | st.lists(_NAME, max_size=4)


def _invalid(path: str) -> st.SearchStrategy[tuple[Any, type[Exception]]]:
    kind = KINDS[path]

    def typed(values: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, type[Exception]]]:
        return values.map(lambda v: (v, TypeError))

    def valued(values: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, type[Exception]]]:
        return values.map(lambda v: (v, ValueError))

    junk = st.none() | st.lists(st.integers(), max_size=2) | st.dictionaries(_NAME, st.integers())
    if kind[0] == "bool":
        return typed(junk | st.integers(0, 1) | st.sampled_from(["True", "false", 1.0]))
    if kind[0] == "int":
        lo, hi = kind[1], kind[2]
        out = typed(junk | st.booleans() | st.floats() | st.text(max_size=3))
        out |= valued(st.integers(max_value=lo - 1))
        if hi is not None:
            out |= valued(st.integers(min_value=hi + 1))
        return out
    if kind[0] == "float":
        gt, lt = kind[1], kind[2]
        out = typed(junk | st.booleans() | st.text(max_size=3))
        out |= valued(st.floats(max_value=gt) | st.just(float("nan")) | st.just(float("inf")))
        if lt is not None:
            out |= valued(st.floats(min_value=lt))
        return out
    if kind[0] == "values":
        return st.sampled_from(kind[2])
    if kind[0] == "float_ge":
        return typed(junk | st.booleans() | st.text(max_size=3)) | valued(
            st.floats(max_value=kind[1], exclude_max=True) | st.just(float("nan")) | st.just(float("inf")))
    if kind[0] == "choice":
        return typed(junk | st.integers() | st.booleans()) | valued(
            st.text(max_size=8).filter(lambda t, ok=kind[1]: t not in ok))
    items = typed(st.lists(st.integers() | st.none(), min_size=1, max_size=3))
    if kind[0] == "names":
        return items | typed(st.integers() | st.none() | _NAME) | valued(st.just(["ok", " "]))
    return items | typed(st.integers() | st.none()) | valued(_NAME.filter(lambda t: t != "auto"))


_SPELLING = {path: alias for alias, (path, _) in ALIASES.items()}


@st.composite
def valid_options(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """(input dict in a random mix of nested, flat and 1.x spellings, expected flat canonical)."""
    paths = draw(st.lists(st.sampled_from(sorted(KINDS)), unique=True, max_size=len(KINDS)))
    expected = flat(PADDLE_DEFAULTS)
    given_: dict[str, Any] = {}
    for path in paths:
        value = draw(_valid(path))
        expected[path] = value
        form = draw(st.sampled_from(["flat", "nested", "alias"]))
        head, dot, tail = path.partition(".")
        if form == "alias" and path in _SPELLING:
            given_[_SPELLING[path]] = value
        elif form == "alias" and head == "execution_strategy":
            given_.setdefault("exec_strategy", {})[tail] = value
        elif form == "nested" and dot:
            given_.setdefault(head, {})[tail] = value
        else:
            given_[path] = value
    return given_, expected


_SETTINGS = settings(max_examples=200, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(valid_options())
def test_every_valid_dict_round_trips(case: tuple[dict[str, Any], dict[str, Any]]) -> None:
    given_, expected = case
    s = DistributedStrategy.from_dict(given_)
    assert s.to_dict(flat=True) == expected
    nested = s.to_dict()
    assert flat(nested) == expected
    assert DistributedStrategy.from_dict(nested) == s
    assert DistributedStrategy.from_dict(s.to_dict(flat=True)) == s
    assert DistributedStrategy.from_dict(s.to_dict(non_default_only=True)) == s
    assert DistributedStrategy.from_json_or_path(json.dumps(nested)) == s
    with tempfile.TemporaryDirectory() as tmp:
        s.save(Path(tmp) / "s.json")
        assert DistributedStrategy.load(Path(tmp) / "s.json") == s
    assert pickle.loads(pickle.dumps(s)) == s
    t = DistributedStrategy()
    for key, value in given_.items():  # attribute assignment reaches the same state
        if "." in key:
            head, _, tail = key.partition(".")
            getattr(t, head)[tail] = value
        else:
            setattr(t, key, value)
    assert t == s
    str(s)  # the table renders for any valid strategy


@st.composite
def invalid_options(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], type[Exception]]:
    """(a valid base dict, an update with exactly one bad entry, the documented error type)."""
    base, _ = draw(valid_options())
    kind = draw(st.sampled_from(["value", "value", "unknown", "unknown_key", "section"]))
    path = draw(st.sampled_from(sorted(KINDS)))
    head, dot, tail = path.partition(".")
    suffix = draw(st.text(alphabet="qz", min_size=1, max_size=3))
    if kind == "value":
        bad, error = draw(_invalid(path))
        update = {path: bad} if draw(st.booleans()) or not dot else {head: {tail: bad}}
    elif kind == "unknown":
        update, error = {head + suffix: True}, KeyError
    elif kind == "unknown_key" and dot:
        update, error = {head: {tail + suffix: 1}}, KeyError
    elif dot:
        update, error = {head: draw(st.integers() | st.text(max_size=3) | st.none())}, TypeError
    else:
        update, error = {f"{path}.{suffix}": 1}, KeyError
    return base, update, error


@_SETTINGS
@given(invalid_options())
def test_every_invalid_dict_raises_the_documented_error(
    case: tuple[dict[str, Any], dict[str, Any], type[Exception]]
) -> None:
    base, update, error = case
    s = DistributedStrategy.from_dict(base)
    before = s.copy()
    with pytest.raises(error) as info:
        s.update({**{"amp": True}, **update})  # a valid key alongside: still all-or-nothing
    assert isinstance(info.value, StrategyError)
    assert s == before
    with pytest.raises(error):
        DistributedStrategy.from_dict(update)


def test_docstring_examples_run() -> None:
    import doctest

    for module in (strategy, fields, rules):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__

"""Strategies: the `DistributedStrategy` configuration and (later) one pass per feature.

`DistributedStrategy` is the typed, validated config object of API.md section 3; the closed sets
of string choices are `str` enums so that a value can be written either as the enum member or as
its string; the error classes let callers catch configuration mistakes precisely.
"""

from fleetlike.strategies.config import (
    STRATEGY_ENV_VAR,
    ConfigSection,
    DistributedStrategy,
    InactiveSetting,
)
from fleetlike.strategies.fields import (
    StrategyError,
    StrategyTypeError,
    StrategyValueError,
    UnknownAttributeError,
    UnknownOptionError,
)
from fleetlike.strategies.localsgd_recipes import adaptive_local_step, get_local_sgd_steps
from fleetlike.strategies.options import (
    CollectiveMode,
    Fp16AllreduceMode,
    HalfDtype,
    HierarchicalAlgorithm,
    Mode,
    SyncBatchNormScope,
)

__all__ = [
    "STRATEGY_ENV_VAR",
    "CollectiveMode",
    "ConfigSection",
    "DistributedStrategy",
    "Fp16AllreduceMode",
    "HalfDtype",
    "HierarchicalAlgorithm",
    "InactiveSetting",
    "Mode",
    "StrategyError",
    "StrategyTypeError",
    "StrategyValueError",
    "SyncBatchNormScope",
    "UnknownAttributeError",
    "UnknownOptionError",
    "adaptive_local_step",
    "get_local_sgd_steps",
]

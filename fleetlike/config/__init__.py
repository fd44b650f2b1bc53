"""The configuration layer: `DistributedStrategy`, its option registry and the combination rules.

The bottom of the stack: it imports nothing else of fleetlike and never reads the environment,
so a strategy can be built, validated, printed and saved without torch communicators, roles or
a launcher (``fleetlike.strategies`` re-exports the public names for users).

Modules: ``fields`` (value specs and errors), ``choices`` (the options' closed sets of
values), ``options`` (the registry of every option), ``section_checks`` (checks across a
section's keys), ``aliases`` (the options' other names),
``strategy`` (`DistributedStrategy`), ``view`` (live config sections), ``formats`` (tables and
docs), ``rules`` (combinations that cannot work), ``recipes`` (seed 003's manual local SGD
helpers).

Example:
    >>> from fleetlike.config import DistributedStrategy
    >>> DistributedStrategy(amp=True).enabled_features()
    ['amp', 'fuse_all_reduce_ops']
"""

from fleetlike.config.fields import (
    StrategyError,
    StrategyTypeError,
    StrategyValueError,
    UnknownAttributeError,
    UnknownOptionError,
)
from fleetlike.config.choices import (
    CollectiveMode,
    Fp16AllreduceMode,
    HalfDtype,
    HierarchicalAlgorithm,
    Mode,
    SyncBatchNormScope,
)
from fleetlike.config.recipes import adaptive_local_step, get_local_sgd_steps
from fleetlike.config.strategy import (
    STRATEGY_ENV_VAR,
    ConfigSection,
    DistributedStrategy,
    InactiveSetting,
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

"""Strategies: `DistributedStrategy` for users, and one unit per feature that hooks a step.

`DistributedStrategy` (defined in `fleetlike.config`, re-exported here where users import it)
is the typed, validated config object of API.md section 3; the closed sets of string choices are
`str` enums so that a value can be written either as the enum member or as its string; the error
classes let callers catch configuration mistakes precisely. Each feature is one `Unit` module
(``data_parallel``, ``amp``, ``recompute``, ``gradient_merge``, ``localsgd``, ``sync_bn``,
``health``) hooking the points of a training step defined in ``step``; ``engine`` composes them
for a model and drives them in the eager style, ``programs`` lays them out as
``fleet.main_program`` for the program style. A unit imports config, collectives, program and
comm, never another unit and never `fleetlike.fleet`.
"""

from fleetlike.config import *  # noqa: F401,F403  (the names users import from here)
from fleetlike.config import __all__ as _config_all
from fleetlike.strategies.amp_policy import AdaptiveAmpPolicy, MixedPrecision_TrainingPolicy

__all__ = [*_config_all, "AdaptiveAmpPolicy", "MixedPrecision_TrainingPolicy"]

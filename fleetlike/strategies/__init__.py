"""Strategies: `DistributedStrategy` for users, and one pass per feature that rewrites a step.

`DistributedStrategy` (defined in `fleetlike.config`, re-exported here where users import it)
is the typed, validated config object of API.md section 3; the closed sets of string choices are
`str` enums so that a value can be written either as the enum member or as its string; the error
classes let callers catch configuration mistakes precisely. The passes (``compose``,
``data_parallel``, ``amp``, ``recompute``, ``gradient_merge``, ``localsgd``, ``sync_bn``,
``health``) turn a strategy into ``main_program``, using the collectives of
`fleetlike.collectives`.
"""

from fleetlike.config import *  # noqa: F401,F403  (the names users import from here)
from fleetlike.config import __all__ as _config_all

__all__ = list(_config_all)

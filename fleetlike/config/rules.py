"""Which options cannot work together: the one place where option combinations are judged.

Single options are checked on assignment (`fleetlike.config.fields`); combinations are judged
here, and only when the strategy is used (``distributed_optimizer`` / ``minimize``), so a user may
switch one feature on before switching another off. Keeping every rule in one table means the
fleet layer and the pass pipeline cannot disagree about what is allowed.

Rules read the strategy through its option attributes only (`Options`): this module never
imports `DistributedStrategy`, so ``DistributedStrategy.validate_combination`` can call `check`
without an import circle.

Example:
    >>> from fleetlike.config import DistributedStrategy
    >>> check(DistributedStrategy(localsgd=True, fp16_allreduce=True))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fleetlike.config.fields.StrategyValueError: strategy.localsgd and strategy.fp16_allreduce \
cannot both be True: ... Fix: turn fp16_allreduce off ...
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from fleetlike.config.fields import StrategyValueError

__all__ = ["RULES", "Conflict", "Options", "check"]


class Options(Protocol):
    """What the rules need: the strategy's options readable as attributes."""

    def __getattr__(self, name: str) -> Any: ...


class Conflict(NamedTuple):
    """Two on/off options that cannot both be on, why, and what to do instead."""

    first: str
    second: str
    why: str
    fix: str


#: every combination that cannot work, in the order they are checked
RULES: tuple[Conflict, ...] = (
    Conflict("localsgd", "adaptive_localsgd",
             "they are two schedules for the same parameter averaging",
             "turn one off: adaptive_localsgd chooses k itself from loss and learning rate, "
             "localsgd uses the fixed localsgd_configs.k_steps"),
    Conflict("localsgd", "fp16_allreduce",
             "local SGD averages parameters, not gradients; fp16_allreduce compresses gradient "
             "allreduces", "turn fp16_allreduce off and set localsgd_configs.sync_dtype to "
             "'float16' or 'bfloat16' to compress local SGD's traffic"),
    Conflict("adaptive_localsgd", "fp16_allreduce",
             "adaptive local SGD averages parameters, not gradients; fp16_allreduce compresses "
             "gradient allreduces", "turn fp16_allreduce off and set "
             "adaptive_localsgd_configs.sync_dtype to 'float16' or 'bfloat16' to compress local "
             "SGD's traffic"),
)


def check(strategy: Options) -> None:
    """Raise `StrategyValueError` (a ``ValueError``) for the first rule ``strategy`` breaks.

    The error names both options, why they clash and the fix; ``err.field`` is
    ``"<first> and <second>"``."""
    for rule in RULES:
        if getattr(strategy, rule.first) and getattr(strategy, rule.second):
            names = f"{rule.first} and {rule.second}"
            raise StrategyValueError(
                names, (True, True), "at most one of them True", rule.fix,
                f"strategy.{rule.first} and strategy.{rule.second} cannot both be True: "
                f"{rule.why}. Fix: {rule.fix}")

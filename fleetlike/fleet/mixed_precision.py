"""``decorate``: seed 003's way to ask for mixed precision on an optimizer.

``fluid.contrib.mixed_precision.decorate(optimizer, init_loss_scaling=128.0,
use_dynamic_loss_scaling=True)`` in Paddle; here it marks the optimizer, and
``fleet.distributed_optimizer`` turns ``strategy.amp`` on with those settings. It is the same
AMP pass as ``strategy.amp = True``: one implementation.

Example:
    >>> opt = fleetlike.mixed_precision.decorate(torch.optim.SGD(params, lr=0.1), init_loss_scaling=128.0)
    >>> opt = fleet.distributed_optimizer(opt, strategy)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["DecoratedOptimizer", "decorate"]


@dataclasses.dataclass(frozen=True)
class DecoratedOptimizer:
    """An optimizer plus the AMP settings ``decorate`` was given."""

    optimizer: torch.optim.Optimizer
    amp_configs: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def decorate(
    optimizer: torch.optim.Optimizer,
    init_loss_scaling: float = 32768.0,
    use_dynamic_loss_scaling: bool = True,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    dtype: str = "float16",
) -> DecoratedOptimizer:
    """Mark ``optimizer`` for mixed precision (validated when the strategy takes the settings)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"decorate wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return DecoratedOptimizer(optimizer, {
        "init_loss_scaling": init_loss_scaling,
        "use_dynamic_loss_scaling": use_dynamic_loss_scaling,
        "incr_every_n_steps": incr_every_n_steps,
        "decr_every_n_nan_or_inf": decr_every_n_nan_or_inf,
        "incr_ratio": incr_ratio,
        "decr_ratio": decr_ratio,
        "dtype": dtype,
    })

"""`DistributedOptimizer`: wraps the user's optimizer by composition.

Program style: ``minimize(loss_fn, model)`` builds the three programs (strategies layer) and
hands them to the fleet. Eager style: ``backward`` / ``synchronize`` / ``step`` /
``skip_synchronize`` drive the same `GradReducer` that ``fleet.distributed_model`` armed.

Everything else (``param_groups``, ``state_dict``, ``load_state_dict``, ``add_param_group``,
...) is the wrapped optimizer's, so learning-rate schedulers keep working on the wrapper.

Example:
    >>> opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    >>> opt.minimize(loss_fn, model)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from fleetlike.program import Program
from fleetlike.strategies import DistributedStrategy
from fleetlike.strategies.amp import scaler_from_config, unscale_and_check
from fleetlike.strategies.compose import Build, LossFn, build_programs

if TYPE_CHECKING:
    from fleetlike.fleet.facade import Fleet

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """The user's optimizer plus the strategy; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: DistributedStrategy, fleet: Fleet) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"distributed_optimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.inner_optimizer = optimizer
        self.user_defined_strategy = strategy
        self._fleet = fleet
        self._skip_sync = False
        #: eager-style loss scaling (program style keeps its scaler in the AMP pass)
        scaler, dtype = scaler_from_config(strategy.amp_configs) if strategy.amp else (None, None)
        self.scaler = scaler if dtype == torch.float16 else None  # bfloat16: no scaling at all

    # ------------------------------------------------------------------ delegation

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the wrapper: param_groups, state, defaults, ...
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["inner_optimizer"], name)

    def state_dict(self) -> dict[str, Any]:
        return self.inner_optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner_optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.inner_optimizer!r})"

    # ------------------------------------------------------------------ program style

    def minimize(self, loss_fn: LossFn, model: torch.nn.Module) -> tuple[Program, Program]:
        """Build ``fleet.main_program``, ``fleet._origin_program`` and ``fleet.startup_program``.

        ``loss_fn(model, feed)`` returns the scalar loss or a mapping with a ``"loss"`` entry
        (other entries can be fetched by name). Returns ``(main_program, startup_program)``.
        """
        if not callable(loss_fn):
            raise TypeError(f"minimize: loss_fn must be callable (model, feed) -> loss, got {loss_fn!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"minimize: model must be a torch.nn.Module, got {type(model).__name__}")
        ctx = self._fleet._context("distributed_optimizer(...).minimize")
        build = Build(
            model=model,
            optimizer=self.inner_optimizer,
            loss_fn=loss_fn,
            strategy=self.user_defined_strategy,
            groups=ctx.groups,
            role=ctx.role,
            device=ctx.device,
        )
        origin, main, startup = build_programs(build)
        self._fleet._set_programs(build, origin, main, startup)
        return main, startup

    # ------------------------------------------------------------------ eager style

    def _reducer(self) -> Any:
        return self._fleet._eager_reducer()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the reducer armed (and, with AMP, the loss scaled)."""
        reducer = self._reducer()
        reducer.prepare(loss)
        (loss.float() * self.scaler.scale).backward() if self.scaler is not None else loss.backward()

    def synchronize(self) -> bool:
        """Wait until every gradient is averaged over the ranks (before clipping, say).

        With AMP the gradients are also unscaled and checked; returns True when the step is
        finite on every rank (``step()`` then updates; otherwise it skips, on every rank)."""
        reducer = self._reducer()
        reducer.finalize()
        if self.scaler is None:
            return True
        found = unscale_and_check([b.buffer for b in reducer.buckets], self.scaler.scale, reducer.collective_world)
        self._found_inf = found
        return not found

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize again (call ``synchronize()`` first)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Any = None) -> Any:
        if not self._skip_sync:
            self.synchronize()
        if self.scaler is not None:
            found = getattr(self, "_found_inf", False)
            self.scaler.update(found)
            self._found_inf = False
            if found:
                return None
        return self.inner_optimizer.step(closure) if closure is not None else self.inner_optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; they are bucket views under data parallel, so in place."""
        reducer = self._fleet._eager_reducer(required=False)
        if reducer is not None:
            reducer.zero_grad()
        else:
            self.inner_optimizer.zero_grad(set_to_none=set_to_none)

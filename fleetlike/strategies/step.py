"""The step context: what every strategy unit sees, and the points of a training step it hooks.

A training step passes the same points in both faces of fleetlike::

    begin -> forward -> backward -> synchronize -> before_update -> optimizer.step -> after_update -> zero_grad

Program style: the ops of ``fleet.main_program`` are these hooks, in this order (``print`` shows
them). Eager style: the wrapped model's forward runs ``begin`` and the forward, the gradient hooks
run during ``loss.backward()``, ``optimizer.step()`` runs ``synchronize``, the updates and their
hooks, ``optimizer.zero_grad()`` clears. Either way the same `Unit` objects do the work, so a
strategy is written once and means the same thing in every face.

A `Unit` is one strategy (AMP, gradient merge, local SGD, data parallel, ...). It offers `Hook`s
for the phases it cares about, optionally a context around the forward (AMP's autocast), a loss
transform (AMP's scaling), something to do with the model's outputs in eager style (AMP's
gradient scaling, data parallel's arming), and its state for checkpoints. This module imports no
strategy; `fleetlike.strategies.engine` composes the units.

Example:
    >>> class Counter(Unit):
    ...     name = "counter"
    ...     def __init__(self): self.n = 0
    ...     def hooks(self): return [Hook("after_update", "count_steps", self._count)]
    ...     def _count(self, st): self.n += 1
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from fleetlike.collectives import GradReducer
from fleetlike.comm import CommGroups
from fleetlike.config import DistributedStrategy
from fleetlike.program import Op, StepState
from fleetlike.roles import Role

__all__ = ["AppliedEntry", "EXPLICIT_SCALING", "Hook", "Phase", "PHASES", "StepContext", "Unit", "model_grads"]

Phase = Literal["begin", "before_backward", "synchronize", "before_update", "after_update"]
#: the phases in the order a step passes them
PHASES: tuple[Phase, ...] = ("begin", "before_backward", "synchronize", "before_update", "after_update")


@dataclasses.dataclass
class AppliedEntry:
    """One line of ``fleet.applied_strategy()``: an option, whether it acts, and why (not)."""

    name: str
    applied: bool
    detail: str

    def __str__(self) -> str:
        mark = "applied" if self.applied else "NOT applied"
        return f"{self.name}: {mark} ({self.detail})"


@dataclasses.dataclass
class Hook:
    """Work a unit does at one phase of every step.

    ``type`` and ``attrs`` are what the program listing shows (Paddle's op vocabulary where one
    exists); an attr value that is callable is read at print time (the current k, loss scale).
    ``listed=False`` hooks run inside the phase's main op and add their attrs to it instead of
    being listed on their own (data parallel's arming of the backward)."""

    phase: Phase
    type: str
    fn: Callable[[StepState], None]
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    listed: bool = True

    def op(self) -> Op:
        return Op(self.type, self.fn, dict(self.attrs))


@dataclasses.dataclass
class StepContext:
    """Everything a unit may use. ``optimizer`` is the user's (inner) optimizer; in eager style it
    is bound when ``fleet.distributed_optimizer`` meets the wrapped model (None before)."""

    model: torch.nn.Module
    strategy: DistributedStrategy
    groups: CommGroups
    role: Role
    device: torch.device
    optimizer: torch.optim.Optimizer | None = None
    #: the data-parallel reducer, when data parallel runs (its buckets are the gradients)
    reducer: GradReducer | None = None
    applied: list[AppliedEntry] = dataclasses.field(default_factory=list)

    def record(self, name: str, applied: bool, detail: str) -> None:
        self.applied.append(AppliedEntry(name, applied, detail))

    def need_optimizer(self, who: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError(
                f"{who} acts at the optimizer step, but no fleetlike optimizer drives this model: wrap "
                "the optimizer with fleet.distributed_optimizer(optimizer, strategy) and call its step()"
            )
        return self.optimizer

    def grads(self) -> list[torch.Tensor]:
        """This step's gradients: the bucket buffers under data parallel (this rank's kept shards
        at sharding stage 2), else each ``.grad``."""
        if self.reducer is not None:
            return self.reducer.grad_buffers()
        return model_grads(self.model)


class ExplicitScaling:
    """Whether a backward is running whose loss the units scaled themselves (program style's
    backward op, ``optimizer.backward(loss)``). Process-wide, not per model: the graph of one
    loss may pass through several wrapped models, whose gradient hooks must then all stand back.
    Read from autograd's threads, so the count is changed under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1

    def __bool__(self) -> bool:
        return self._depth > 0


EXPLICIT_SCALING = ExplicitScaling()


def model_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter's gradient; this rank's shard where the gradient is sharded (ZeRO stages
    2 and 3), so units scale and check exactly the elements this rank holds."""
    return [g.to_local() if hasattr(g, "to_local") else g for p in model.parameters() if (g := p.grad) is not None]


class Unit:
    """One strategy, as hooks on the points of a training step (see the module docstring).

    Subclasses override what they need; every default does nothing."""

    #: the strategy option this unit implements (its ``fleet.applied_strategy()`` name)
    name: str = ""
    #: True when the unit acts at the optimizer step (so eager style needs a fleetlike optimizer)
    needs_optimizer: bool = False

    def hooks(self) -> list[Hook]:
        return []

    def run_update(self, st: StepState, step: Callable[[], Any]) -> Any:
        """Run the update: ``step()`` is the user's whole ``optimizer.step()``. The engine lets
        the one unit that overrides this run it (sharding steps its partition chunk by chunk,
        broadcasting each chunk as it goes); the default simply calls it."""
        return step()

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that drives the model is known (``minimize``, or in eager style when
        ``fleet.distributed_optimizer`` meets the wrapped model): check it fits the strategy."""

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Around every forward (program: ``loss_fn``; eager: the wrapped model's forward)."""
        yield

    def forward_attrs(self) -> dict[str, Any]:
        """Facts shown on the ``forward`` op (autocast dtype, recompute segments)."""
        return {}

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on (AMP multiplies by the loss scale)."""
        return loss

    def backward_attrs(self) -> dict[str, Any]:
        return {}

    def outputs(self, st: StepState, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Eager style: the wrapped model's forward turned ``inputs`` into ``outputs`` (the
        tensors of each that need grad). Gradient hooks placed here must stand back while
        `EXPLICIT_SCALING` is on."""

    def described_ops(self) -> list[Op]:
        """Ops carried out by another op (bucket allreduces during backward), for the listing."""
        return []

    def startup_ops(self) -> list[Op]:
        """Ops for ``startup_program`` after the broadcast from rank 0 (local SGD's snapshots)."""
        return []

    def notes(self) -> list[Callable[[], str]]:
        """Lines printed under the program header (live strategy state)."""
        return []

    def state_dict(self) -> dict[str, Any] | None:
        """What this unit needs to resume exactly; None when it keeps nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s result."""

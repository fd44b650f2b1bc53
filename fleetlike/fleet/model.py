"""`DistributedModel`: what ``fleet.distributed_model(model)`` returns (the eager style's model).

Like Paddle's ``paddle.DataParallel`` (and DDP), it wraps the user's module: ``model(x)`` runs the
module's forward inside the strategy engine, so a plain PyTorch loop gets every strategy. A
training forward (autograd on, as DDP decides; the module's train/eval mode does not matter)
starts the step, runs it under AMP's
autocast when AMP is on, and arms the gradient buckets for the coming ``loss.backward()``; a
forward under ``torch.no_grad()`` only autocasts. ``state_dict`` / ``load_state_dict`` are the module's own (no
``module.`` prefix, as Paddle), so checkpoints load into the unwrapped model and back; other
attributes are looked up on the module (``model.fc1`` works).

The engine is built at the first forward (or the first ``no_sync``), when the optimizer from
``fleet.distributed_optimizer`` is usually known too, so the strategy can be given to either
call, in either order.

Example:
    >>> model = fleet.distributed_model(Net())
    >>> with model.no_sync():          # DDP's name: this backward's gradients stay local
    ...     loss_fn(model(x0), y0).backward()
    >>> loss_fn(model(x1), y1).backward()   # communicates the sum of both
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from fleetlike.strategies.engine import Engine
from fleetlike.strategies.sharded_init import is_lazy
from fleetlike.strategies.zero import full_state_dict

__all__ = ["DistributedModel"]


class DistributedModel(torch.nn.Module):
    """The user's module, driven by a strategy engine (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, engine_for: Callable[[DistributedModel], Engine], rank: int = 0) -> None:
        super().__init__()
        self.module = module
        #: this process's rank (``_full_state_dict``'s rank0_only)
        self.rank = rank
        self._engine_for = engine_for
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """The strategy engine of this model (built on first use)."""
        if self._engine is None:
            self._engine = self._engine_for(self)
        return self._engine

    def drop_engine(self) -> None:
        """Forget the engine (the fleet's world was replaced): the next forward builds one on
        the new communicators."""
        self._engine = None

    @property
    def built(self) -> bool:
        return self._engine is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # As DDP: a forward with autograd on prepares a backward (model.eval() with frozen
        # BatchNorm still trains); one under torch.no_grad() (validation) only autocasts.
        with self.engine.forward(torch.is_grad_enabled(), (args, kwargs)) as record:
            out = self.module(*args, **kwargs)
            record(out)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: backward passes inside keep their gradients local (they accumulate);
        the first backward after it communicates the sum."""
        engine = self.engine
        engine.no_sync_depth += 1
        try:
            yield
        finally:
            engine.no_sync_depth -= 1

    def _full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The module's parameters and buffers at full size under its own names, as plain
        tensors (what ``fleet.full_state_dict`` returns): sharded ones (stages 2 and 3) are
        gathered, so every rank must call it; with ``rank0_only`` other ranks get ``{}``."""
        if self._engine is None and is_lazy(self.module):
            self.engine  # noqa: B018 - a model built as shards is materialised with its engine
        return full_state_dict(self.module, rank0_only, self.rank)
    def train_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Paddle's pipeline call: refused with the reason (this model is not pipelined)."""
        raise _not_pipelined("model.train_batch")

    def eval_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Paddle's pipeline call: refused with the reason (this model is not pipelined)."""
        raise _not_pipelined("model.eval_batch")

    # the module's own state, without a "module." prefix (as paddle.DataParallel)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def _not_pipelined(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} trains a pipelined model, and this model is not pipelined (strategy.pipeline was "
        "False when fleet.distributed_model wrapped it). Fix: turn pipeline on "
        "(DistributedStrategy(pipeline=True, hybrid_configs={'pp_degree': 2}) or EPL's "
        "'pipeline.num_stages') and wrap with fleet.distributed_model(model, loss_fn=...), or train "
        "this model with loss_fn(model(x), y).backward(); opt.step()")

"""Recompute (activation checkpointing): named submodules' forwards are re-run in backward.

Each checkpointed submodule's forward goes through non-reentrant ``torch.utils.checkpoint``
with the RNG state preserved, so dropout draws the same masks when recomputed and gradients are
unchanged: recompute trades compute for memory and never changes the result. That includes the
module's buffers: a recomputed forward runs BatchNorm again, which would update its running
statistics a second time (``num_batches_tracked`` would count every step twice), so the buffers
of a checkpointed submodule are restored after its recomputation. ``"auto"`` picks the repeated
blocks of the model (EPL's auto mode): the children of the largest ``ModuleList``/``Sequential``
whose children are at least two modules of one class.

Program and eager style patch the same model the same way (``minimize`` or the first training
forward of ``fleet.distributed_model``'s wrapper), so ``_origin_program`` recomputes too.

Example:
    >>> s.recompute = True; s.recompute_configs = {"checkpoints": ["encoder.0", "encoder.1"]}
"""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from fleetlike.strategies.step import StepContext, Unit

__all__ = ["RecomputeUnit", "apply_recompute", "auto_checkpoints", "plain_forwards"]


def auto_checkpoints(model: torch.nn.Module) -> list[str]:
    """Names of the repeated blocks: children of the biggest container of same-class modules."""
    best: tuple[int, list[str]] = (0, [])
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best[0]:
            best = (size, [f"{name}.{child}" if name else child for child, _ in children])
    if not best[1]:
        raise ValueError(
            "recompute_configs.checkpoints='auto' found no repeated blocks (a ModuleList or "
            "Sequential of at least two modules of one class); name the submodules instead"
        )
    return best[1]


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module) -> Iterator[None]:
    """Run a recomputation without leaving a trace in ``module``'s buffers."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def apply_recompute(model: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """Make the forward of each named submodule recompute in backward; returns the names."""
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules or name == "":
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
            hint = f"; close matches: {', '.join(map(repr, close))}" if close else ""
            raise ValueError(f"recompute_configs.checkpoints names {name!r}, which is not a submodule of the model{hint}")
    for name in names:
        module = modules[name]
        if getattr(module, "_fleetlike_recompute", False):
            continue
        plain = module.forward

        def contexts(_module: torch.nn.Module = module) -> tuple[Any, Any]:
            return contextlib.nullcontext(), _buffers_kept(_module)

        @functools.wraps(plain)
        def forward(*args: Any, _plain: Any = plain, _contexts: Any = contexts, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=_contexts, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        module._fleetlike_recompute = True  # type: ignore[attr-defined]
    return list(names)


@contextlib.contextmanager
def plain_forwards(model: torch.nn.Module) -> Iterator[None]:
    """The model without the recompute wrappers for the duration (their instance-level
    ``forward`` cannot be pickled or compiled by TorchScript); put back afterwards.

    Example:
        >>> with plain_forwards(model):
        ...     torch.jit.script(model)
    """
    wrapped = [m for m in model.modules() if getattr(m, "_fleetlike_recompute", False) and "forward" in vars(m)]
    saved = [(m, vars(m).pop("forward"), vars(m).pop("_fleetlike_recompute")) for m in wrapped]
    try:
        yield
    finally:
        for module, forward, marker in saved:
            module.forward = forward  # type: ignore[method-assign]
            module._fleetlike_recompute = marker  # type: ignore[attr-defined]


class RecomputeUnit(Unit):
    """Checkpoints the configured submodules when built; nothing to do per step."""

    name = "recompute"

    def __init__(self, names: list[str]) -> None:
        self.names = names

    @classmethod
    def create(cls, ctx: StepContext) -> RecomputeUnit | None:
        wanted = ctx.strategy.recompute_configs["checkpoints"]
        names = auto_checkpoints(ctx.model) if wanted == "auto" else list(wanted)
        if not names:
            ctx.record("recompute", False, "recompute is on but recompute_configs.checkpoints is empty")
            return None
        apply_recompute(ctx.model, names)
        ctx.record("recompute", True, f"checkpoints: {', '.join(names)}")
        return cls(names)

    def forward_attrs(self) -> dict[str, Any]:
        return {"recompute": f"{len(self.names)} segments"}

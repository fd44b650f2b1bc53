"""Recompute (activation checkpointing): named submodules' forwards are re-run in backward.

Each checkpointed submodule's forward goes through non-reentrant ``torch.utils.checkpoint``
with the RNG state preserved, so dropout draws the same masks when recomputed and gradients are
unchanged: recompute trades compute for memory and never changes the result. ``"auto"`` picks
the repeated blocks of the model (EPL's auto mode): the children of the largest
``ModuleList``/``Sequential`` whose children are at least two modules of one class.

Example:
    >>> s.recompute = True; s.recompute_configs = {"checkpoints": ["encoder.0", "encoder.1"]}
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

from fleetlike.program import Program

if TYPE_CHECKING:
    from fleetlike.strategies.compose import Build

__all__ = ["auto_checkpoints", "apply_recompute", "recompute_pass"]


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

        @functools.wraps(plain)
        def forward(*args: Any, _plain: Any = plain, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
        module._fleetlike_recompute = True  # type: ignore[attr-defined]
    return list(names)


def recompute_pass(program: Program, build: Build) -> Program:
    """Checkpoint the configured submodules (both programs share the model: memory only)."""
    wanted = build.strategy.recompute_configs["checkpoints"]
    names = auto_checkpoints(build.model) if wanted == "auto" else list(wanted)
    if not names:
        build.record("recompute", False, "recompute is on but recompute_configs.checkpoints is empty")
        return program
    apply_recompute(build.model, names)
    main = program.clone()
    main.wrap("forward", recompute=f"{len(names)} segments")
    build.record("recompute", True, f"checkpoints: {', '.join(names)}")
    return main

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
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from fleetlike.strategies.step import StepContext, Unit

__all__ = ["RecomputeUnit", "apply_recompute", "auto_checkpoints", "check_recompute_gradients", "plain_forwards"]


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


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def check_recompute_gradients(name: str, module: torch.nn.Module, plain: Any, args: tuple[Any, ...],
                              kwargs: dict[str, Any], rtol: float = 1e-5, atol: float = 1e-7) -> float:
    """EPL's ``gradient_checkpoint.check_gradients`` for one submodule: run its forward on
    detached copies of the inputs twice, plainly and checkpointed (the same RNG state and
    buffers each time), backpropagate the same random cotangent through both and compare the
    gradients of the inputs and of the module's parameters. Raises `RuntimeError` naming the
    submodule and the tensor on a difference beyond ``rtol``/``atol``; returns the largest
    absolute difference. RNG state and buffers are left as they were, so the step that follows
    draws and updates exactly what it would have without the check."""
    leaves, spec = tree_flatten((args, kwargs))
    copies = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in leaves]
    c_args, c_kwargs = tree_unflatten(copies, spec)
    inputs = [t for t in copies if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    wrt = inputs + params
    devices = sorted({t.device.index for t in _tensors((args, kwargs)) if t.device.type == "cuda"}, key=int)
    with torch.random.fork_rng(devices=devices):
        state = torch.get_rng_state()
        cuda_states = [torch.cuda.get_rng_state(d) for d in devices]

        def run(fn: Any) -> list[torch.Tensor]:
            torch.set_rng_state(state)
            for d, st in zip(devices, cuda_states):
                torch.cuda.set_rng_state(st, d)
            with _buffers_kept(module):
                out = fn()
                outs = [t for t in _tensors(out) if t.requires_grad]
                gen = torch.Generator().manual_seed(0)
                cot = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype) for t in outs]
                if not outs or not wrt:
                    return []
                got = torch.autograd.grad(outs, wrt, cot, allow_unused=True)
            return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt)]

        reference = run(lambda: plain(*c_args, **c_kwargs))
        recomputed = run(lambda: checkpoint(plain, *c_args, use_reentrant=False, preserve_rng_state=True,
                                            context_fn=lambda: (contextlib.nullcontext(), _buffers_kept(module)),
                                            **c_kwargs))
    labels = [f"input {i}" for i in range(len(inputs))] + [f"parameter {n!r}" for n, p in module.named_parameters()
                                                           if p.requires_grad]
    worst = 0.0
    for label, ref, rec in zip(labels, reference, recomputed):
        diff = float((ref.detach().double() - rec.detach().double()).abs().max()) if ref.numel() else 0.0
        worst = max(worst, diff)
        if not torch.allclose(rec, ref, rtol=rtol, atol=atol):
            raise RuntimeError(
                f"recompute_configs.check_gradients: submodule {name!r} gives different gradients when "
                f"recomputed: {label} differs by up to {diff:.3g} from a plain backward (rtol {rtol:g}, "
                f"atol {atol:g}). Its forward does not compute the same thing twice (state changed between "
                "calls, or an RNG/buffer it reads outside torch's); drop it from recompute_configs.checkpoints "
                "or make its forward repeatable")
    return worst


def apply_recompute(model: torch.nn.Module, names: Sequence[str], check_gradients: bool = False) -> list[str]:
    """Make the forward of each named submodule recompute in backward; returns the names.

    ``check_gradients``: each submodule's first training forward first runs
    `check_recompute_gradients` (once per submodule)."""
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

        pending = {"check": check_gradients}

        @functools.wraps(plain)
        def forward(*args: Any, _plain: Any = plain, _contexts: Any = contexts, _name: str = name,
                    _module: torch.nn.Module = module, _pending: dict[str, bool] = pending, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            if _pending["check"]:
                _pending["check"] = False
                check_recompute_gradients(_name, _module, _plain, args, kwargs)
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
        check = bool(ctx.strategy.recompute_configs["check_gradients"])
        apply_recompute(ctx.model, names, check_gradients=check)
        ctx.record("recompute", True, f"checkpoints: {', '.join(names)}")
        if check:
            ctx.record("recompute_configs.check_gradients", True,
                       "each checkpoint's first training forward compares recomputed and plain gradients")
        return cls(names)

    def forward_attrs(self) -> dict[str, Any]:
        return {"recompute": f"{len(self.names)} segments"}

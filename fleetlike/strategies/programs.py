"""The program style's face of the engine: ``minimize`` lays the units' hooks out as ops.

``fleet.main_program`` is one step of the `Engine`, written out: the ``begin`` hooks, ``forward``
(``loss_fn`` inside the units' forward contexts), ``backward`` (armed and scaled by the units),
the ``synchronize`` hooks, the ``before_update`` hooks, ``optimizer_update``, the
``after_update`` hooks and ``clear_grad``. Ops that another op carries out (each bucket's
allreduce during backward) are listed under it. ``print(fleet.main_program)`` therefore shows
exactly what the strategy does, in the order it happens, and the eager style runs the very same
hook functions (`fleetlike.strategies.engine`).

``_origin_program`` is the plain local step (forward, backward, update, clear) with no
collective and no strategy state: the model's rewrites (recompute, sync BN layers, gradient
buffers) are shared, its counters (gradient merge, local SGD) are never touched.
``startup_program`` broadcasts rank 0's parameters and buffers (and takes local SGD's snapshots).

Example:
    >>> origin, main, startup = build_programs(engine, loss_fn)
    >>> print(main)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fleetlike.collectives import broadcast_coalesced
from fleetlike.program import Op, Program, StepState
from fleetlike.strategies.engine import Engine
from fleetlike.strategies.step import EXPLICIT_SCALING

__all__ = ["LossFn", "build_programs"]

LossFn = Callable[[torch.nn.Module, Any], "torch.Tensor | Mapping[str, torch.Tensor]"]


def _outputs(result: Any) -> dict[str, torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return {"loss": result}
    if isinstance(result, Mapping):
        if "loss" not in result:
            raise KeyError(
                f"loss_fn returned a mapping with keys {sorted(result)}; it must contain 'loss' "
                "(the scalar to minimize)"
            )
        return dict(result)
    raise TypeError(
        f"loss_fn must return the scalar loss tensor or a mapping with a 'loss' entry, got "
        f"{type(result).__name__}"
    )


def _forward(loss_fn: LossFn, model: torch.nn.Module, st: StepState) -> None:
    st.outputs = _outputs(loss_fn(model, st.feed))
    loss = st.outputs["loss"]
    if loss.dim() != 0 and loss.numel() != 1:
        raise ValueError(f"loss_fn's 'loss' must be a scalar, got shape {tuple(loss.shape)}")
    st.loss = loss
    st.roots = [loss]


def _loss(st: StepState) -> torch.Tensor:
    if st.loss is None:
        raise RuntimeError("backward ran before forward produced a loss (a program edited out of order?)")
    return st.loss


def build_programs(engine: Engine, loss_fn: LossFn) -> tuple[Program, Program, Program]:
    """Return ``(origin, main, startup)`` for ``engine`` (see the module docstring)."""
    ctx = engine.ctx
    model, opt = ctx.model, ctx.need_optimizer("minimize")
    loss_name = getattr(loss_fn, "__name__", "loss_fn")

    def plain_clear(_: StepState) -> None:
        if ctx.reducer is not None:
            ctx.reducer.zero_grad()  # the gradients are bucket views: zeroed in place
        else:
            opt.zero_grad(set_to_none=True)

    def plain_update(st: StepState) -> None:
        opt.step()

    origin = Program(
        "origin",
        [
            Op("forward", lambda st: _forward(loss_fn, model, st), {"loss_fn": loss_name}),
            Op("backward", lambda st: _loss(st).backward()),
            Op("optimizer_update", plain_update, {"optimizer": type(opt).__name__}),
            Op("clear_grad", plain_clear),
        ],
        device=ctx.device,
    )

    def forward(st: StepState) -> None:
        with engine.forward_context():
            _forward(loss_fn, model, st)

    inline = [h for h in engine.hooks("before_backward") if not h.listed]

    def backward(st: StepState) -> None:
        for hook in inline:
            hook.fn(st)
        with EXPLICIT_SCALING.active():
            engine.scaled(_loss(st)).backward()

    def update(st: StepState) -> None:
        if not (st.skip_update or st.accumulate):
            engine.updater.run_update(st, opt.step)

    def listed(phase: Any) -> list[Op]:
        return [h.op() for h in engine.hooks(phase) if h.listed]

    forward_attrs: dict[str, Any] = {"loss_fn": loss_name}
    backward_attrs: dict[str, Any] = {}
    for u in engine.units:
        forward_attrs.update(u.forward_attrs())
        backward_attrs.update(u.backward_attrs())
    for hook in inline:
        backward_attrs.update(hook.attrs)
    ops = [
        *listed("begin"),
        Op("forward", forward, forward_attrs),
        *listed("before_backward"),
        Op("backward", backward, backward_attrs),
        *listed("synchronize"),
        *listed("before_update"),
        Op("optimizer_update", update, {"optimizer": type(opt).__name__}),
        *listed("after_update"),
        Op("clear_grad", engine.clear),
    ]
    main = Program("main", ops, device=ctx.device)
    for u in engine.units:
        for described in u.described_ops():
            _describe(main, described)
        main.notes.extend(u.notes())
    return origin, main, _startup(engine)


def _describe(program: Program, op: Op) -> None:
    """Put a descriptive op after its parent and the parent's earlier descriptions."""
    if op.parent is None or not program.has(op.parent):
        raise ValueError(f"described op {op.type!r} names parent {op.parent!r}, which program {program.name!r} lacks")
    i = program.index(op.parent) + 1
    while i < len(program.ops) and program.ops[i].fn is None and program.ops[i].parent == op.parent:
        i += 1
    program.ops.insert(i, op)


def _startup(engine: Engine) -> Program:
    """Broadcast rank 0's parameters and buffers (coalesced per dtype), then the units' startup."""
    ctx = engine.ctx
    world = ctx.groups.world
    # sharded parameters (stages 2 and 3) were broadcast whole before sharding; a shard cannot be
    tensors = [p.data for p in ctx.model.parameters() if not hasattr(p, "to_local")] + list(ctx.model.buffers())

    def broadcast(_: StepState) -> None:
        broadcast_coalesced(world, tensors)

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    ops = [Op("broadcast_params", broadcast, {"tensors": len(tensors), "bytes": nbytes, "root": 0, "comm": world.name})]
    for u in engine.units:
        ops += u.startup_ops()
    return Program("startup", ops, device=ctx.device)

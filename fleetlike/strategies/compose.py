"""Build the three programs of ``minimize``: origin (local), main (the passes' rewrite), startup.

The passes run in one fixed, documented order (docs/ARCHITECTURE.md, "Pass order"):

1. ``sync_batch_norm``   converts BatchNorm layers (model rewrite, before anything runs)
2. ``recompute``         rewrites the forward
3. ``amp``               scales the loss; unscale + agreed finite check before the update
4. ``gradient_merge``    accumulates k steps; communicates and updates on the k-th
5. ``data_parallel``     bucketed gradient allreduce overlapping backward (with
                         ``fp16_allreduce`` and ``use_hierarchical_allreduce`` as its collective)
   or ``localsgd`` / ``adaptive_localsgd``: local updates, periodic parameter averaging

A pass is ``apply(program, build) -> program``: it clones and rewrites, never mutating the
program it got, so ``_origin_program`` stays purely local. Each pass records in ``build.applied``
whether it was applied and why not, which is what ``fleet.applied_strategy()`` reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fleetlike.collectives import GradReducer, broadcast_coalesced
from fleetlike.comm import CommGroups
from fleetlike.config import DistributedStrategy, rules
from fleetlike.program import Op, Program, StepState
from fleetlike.roles import Role

__all__ = ["Build", "AppliedEntry", "build_programs", "LossFn"]

LossFn = Callable[[torch.nn.Module, Any], "torch.Tensor | Mapping[str, torch.Tensor]"]


@dataclasses.dataclass
class AppliedEntry:
    name: str
    applied: bool
    detail: str

    def __str__(self) -> str:
        mark = "applied" if self.applied else "NOT applied"
        return f"{self.name}: {mark} ({self.detail})"


@dataclasses.dataclass
class Build:
    """Everything a pass may use, and where passes leave state for save/load and stats."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    strategy: DistributedStrategy
    groups: CommGroups
    role: Role
    device: torch.device
    applied: list[AppliedEntry] = dataclasses.field(default_factory=list)
    #: per-pass state objects with state_dict()/load_state_dict(), saved by save_persistables
    states: dict[str, Any] = dataclasses.field(default_factory=dict)
    reducer: GradReducer | None = None
    #: how the local step clears gradients; the data-parallel pass swaps in the reducer's
    clear_grad: Callable[[], None] | None = None

    def record(self, name: str, applied: bool, detail: str) -> None:
        self.applied.append(AppliedEntry(name, applied, detail))


# ---------------------------------------------------------------------- the local step


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


def local_program(build: Build) -> Program:
    """forward -> backward -> optimizer_update -> clear_grad: one step with no communication."""
    model, opt = build.model, build.optimizer

    def forward(s: StepState) -> None:
        s.outputs = _outputs(build.loss_fn(model, s.feed))
        loss = s.outputs["loss"]
        if loss.dim() != 0 and loss.numel() != 1:
            raise ValueError(f"loss_fn's 'loss' must be a scalar, got shape {tuple(loss.shape)}")
        s.loss = loss

    def backward(s: StepState) -> None:
        assert s.loss is not None  # set by forward, which always runs first
        s.loss.backward()

    def update(s: StepState) -> None:
        if not (s.skip_update or s.accumulate):
            opt.step()

    def clear(s: StepState) -> None:
        if not s.accumulate:
            (build.clear_grad or (lambda: opt.zero_grad(set_to_none=True)))()

    return Program(
        "origin",
        [
            Op("forward", forward, {"loss_fn": getattr(build.loss_fn, "__name__", "loss_fn")}),
            Op("backward", backward),
            Op("optimizer_update", update, {"optimizer": type(opt).__name__}),
            Op("clear_grad", clear),
        ],
        device=build.device,
    )


# ---------------------------------------------------------------------- startup


def startup_program(build: Build) -> Program:
    """Broadcast rank 0's parameters and buffers to every rank (coalesced per dtype)."""
    world = build.groups.world
    tensors = [p.data for p in build.model.parameters()] + [b for b in build.model.buffers()]

    def broadcast(_: StepState) -> None:
        broadcast_coalesced(world, tensors)

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return Program(
        "startup",
        [Op("broadcast_params", broadcast, {"tensors": len(tensors), "bytes": nbytes, "root": 0, "comm": world.name})],
        device=build.device,
    )


# ---------------------------------------------------------------------- composition


def build_programs(build: Build) -> tuple[Program, Program, Program]:
    """Return ``(origin, main, startup)`` for ``build`` (see the module docstring for the order)."""
    from fleetlike.strategies import localsgd
    from fleetlike.strategies.amp import amp_pass
    from fleetlike.strategies.data_parallel import data_parallel_pass
    from fleetlike.strategies.gradient_merge import gradient_merge_pass
    from fleetlike.strategies.health import slow_rank_pass
    from fleetlike.strategies.recompute import recompute_pass

    s = build.strategy
    rules.check(s)
    from fleetlike.strategies.sync_bn import sync_bn_pass

    sync_bn = sync_bn_pass(build) if s.sync_batch_norm else None  # before startup broadcasts buffers
    origin = local_program(build)
    main = origin
    for on, apply in ((s.recompute, recompute_pass), (s.amp, amp_pass), (s.gradient_merge, gradient_merge_pass)):
        if on:
            main = apply(main, build)
    startup = startup_program(build)
    if s.localsgd or s.adaptive_localsgd:
        # replaces data parallel: no gradient communication, periodic parameter averaging
        main = (localsgd.adaptive_localsgd_pass if s.adaptive_localsgd else localsgd.localsgd_pass)(main, build)
        build.record("data_parallel", False, "replaced by local SGD (parameters averaged, not gradients)")
        startup.ops.append(localsgd.snapshot_op(build))  # snapshots = rank 0's broadcast params
    else:
        main = data_parallel_pass(main, build)
    if sync_bn is not None:
        main = main.clone("main")
        main.insert_after("forward", Op("c_sync_batch_norm", None, sync_bn, parent="forward"))
    if s.check_nan_inf and (s.localsgd or s.adaptive_localsgd):
        build.record("check_nan_inf", False, "local SGD communicates parameters, not gradients")
    if s.slow_rank_check:
        main = slow_rank_pass(main, build)
    main.name = "main"
    return origin, main, startup

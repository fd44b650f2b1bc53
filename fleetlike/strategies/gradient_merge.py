"""Gradient merge: k local forward/backward passes, then one communication and one update.

Micro-steps 1..k-1 only accumulate gradients (``StepState.accumulate``: no collective, no update,
no clearing, as inside DDP's ``no_sync``); the k-th communicates the sum and updates, dividing by
k first when ``avg`` is on, so merging k batches of b equals one step on a batch of k*b with a
k-th of the collectives. The micro-step counter and the partial sums are saved and loaded.

Program style: each run of ``main_program`` is one micro-step. Eager style: each
``optimizer.step()`` is one micro-step (it updates on the k-th), and ``optimizer.zero_grad()``
keeps the partial sums until the window is complete, so the user's loop stays unchanged.

Example:
    >>> s.gradient_merge = True; s.gradient_merge_configs = {"k_steps": 4, "avg": True}
"""

from __future__ import annotations

from typing import Any

import torch

from fleetlike.collectives import Accumulation
from fleetlike.program import StepState
from fleetlike.strategies.step import Hook, StepContext, Unit

__all__ = ["GradientMergeUnit"]


class GradientMergeUnit(Unit):
    """Counts micro-steps in the core's `Accumulation`; the k-th communicates and updates (see
    the module docstring)."""

    name = "gradient_merge"
    needs_optimizer = True

    def __init__(self, ctx: StepContext, k_steps: int, avg: bool) -> None:
        self.ctx = ctx
        self.accumulation = Accumulation(k_steps, field="gradient_merge_configs.k_steps", avg=avg)
        self.k_steps = k_steps
        self.avg = avg

    @property
    def micro_step(self) -> int:
        """Micro-steps since the last update."""
        return self.accumulation.count

    @classmethod
    def create(cls, ctx: StepContext) -> GradientMergeUnit | None:
        cfg = ctx.strategy.gradient_merge_configs
        k, avg = int(cfg["k_steps"]), bool(cfg["avg"])
        if k == 1:
            ctx.record("gradient_merge", False, "gradient_merge_configs.k_steps is 1: every step updates")
            return None
        ctx.record("gradient_merge", True, f"update every {k} micro-steps, {'averaged' if avg else 'summed'}")
        return cls(ctx, k, avg)

    def hooks(self) -> list[Hook]:
        return [
            Hook("begin", "gradient_merge_step", self._count,
                 {"k_steps": self.k_steps, "micro_step": lambda: self.micro_step}),
            Hook("before_update", "gradient_merge_average" if self.avg else "gradient_merge_sum", self._average,
                 {"k_steps": self.k_steps}),
        ]

    def _count(self, st: StepState) -> None:
        st.accumulate = not self.accumulation.begin()
        st.info["merge_micro_step"] = self.micro_step

    def _average(self, st: StepState) -> None:
        if st.accumulate:
            return
        self.accumulation.finish(self.ctx.grads())

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.ctx.model.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        # per parameter, not per bucket: the bucket layout depends on the world size (sharding
        # pads per rank), and a checkpoint may be loaded at another one
        return {
            "rank": self.ctx.role.rank,
            "micro_step": self.micro_step,
            "partial_params": [None if p.grad is None else p.grad.detach().clone() for p in self._params()]
            if self.micro_step else [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rank = self.ctx.role.rank
        if state["micro_step"] and state.get("rank", rank) != rank:
            raise ValueError(
                f"this checkpoint was saved by rank {state['rank']} in the middle of a gradient-merge "
                f"window ({state['micro_step']} of {self.k_steps} micro-steps accumulated); those "
                f"partial sums are rank {state['rank']}'s own, so rank {rank} cannot resume from them. "
                "Save on every rank into its own directory (dirname/<worker_index>), or save when "
                "the window is complete"
            )
        self.accumulation.count = int(state["micro_step"])
        if state.get("partial_params"):
            for p, saved in zip(self._params(), state["partial_params"]):
                if saved is None:
                    continue
                if p.grad is None:
                    p.grad = saved.clone()
                else:
                    p.grad.copy_(saved)
            return
        if not state.get("partial"):  # checkpoints before per-parameter partial sums: per bucket
            return
        if self.ctx.reducer is None:
            for p in self.ctx.model.parameters():
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
        for g, saved in zip(self.ctx.grads(), state["partial"]):
            g.copy_(saved)

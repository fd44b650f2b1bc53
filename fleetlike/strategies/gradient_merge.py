"""Gradient merge: k local forward/backward passes, then one communication and one update.

Runs 1..k-1 of ``main_program`` only accumulate gradients (``StepState.accumulate``: no
collective, no update, no clearing); the k-th communicates the sum and updates, dividing by k
first when ``avg`` is on, so merging k batches of b equals one step on a batch of k*b with a
k-th of the collectives. The micro-step counter and the partial sums are saved and loaded.

Example:
    >>> s.gradient_merge = True; s.gradient_merge_configs = {"k_steps": 4, "avg": True}
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from fleetlike.program import Op, Program, StepState

if TYPE_CHECKING:
    from fleetlike.strategies.compose import Build

__all__ = ["MergeState", "gradient_merge_pass"]


@dataclasses.dataclass
class MergeState:
    k_steps: int
    avg: bool
    micro_step: int = 0  # runs since the last update
    build: Any = dataclasses.field(default=None, repr=False)

    def grads(self) -> list[torch.Tensor]:
        reducer = self.build.reducer
        if reducer is not None:
            return [b.buffer for b in reducer.buckets]
        return [p.grad for p in self.build.model.parameters() if p.grad is not None]

    def state_dict(self) -> dict[str, Any]:
        return {
            "rank": self.build.role.rank,
            "micro_step": self.micro_step,
            "partial": [g.detach().clone() for g in self.grads()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rank = self.build.role.rank
        if state["micro_step"] and state.get("rank", rank) != rank:
            raise ValueError(
                f"this checkpoint was saved by rank {state['rank']} in the middle of a gradient-merge "
                f"window ({state['micro_step']} of {self.k_steps} micro-steps accumulated); those "
                f"partial sums are rank {state['rank']}'s own, so rank {rank} cannot resume from them. "
                "Save on every rank into its own directory (dirname/<worker_index>), or save when "
                "the window is complete"
            )
        self.micro_step = state["micro_step"]
        if self.build.reducer is None and state["partial"]:
            for p in self.build.model.parameters():
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
        for g, saved in zip(self.grads(), state["partial"]):
            g.copy_(saved)


def gradient_merge_pass(program: Program, build: Build) -> Program:
    cfg = build.strategy.gradient_merge_configs
    k, avg = int(cfg["k_steps"]), bool(cfg["avg"])
    if k == 1:
        build.record("gradient_merge", False, "gradient_merge_configs.k_steps is 1: every step updates")
        return program
    state = MergeState(k, avg, build=build)
    build.states["gradient_merge"] = state
    main = program.clone()

    def count(st: StepState) -> None:
        state.micro_step += 1
        st.accumulate = state.micro_step < k
        st.info["merge_micro_step"] = state.micro_step

    def average(st: StepState) -> None:
        if st.accumulate:
            return
        if avg:
            for g in state.grads():
                g.div_(k)
        state.micro_step = 0

    main.ops.insert(0, Op("gradient_merge_step", count, {"k_steps": k, "micro_step": lambda: state.micro_step}))
    main.insert_before("optimizer_update", Op("gradient_merge_average" if avg else "gradient_merge_sum", average, {"k_steps": k}))
    build.record("gradient_merge", True, f"update every {k} runs, {'averaged' if avg else 'summed'}")
    return main

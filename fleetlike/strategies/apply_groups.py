"""Grouped update (EPL's ``optimizer.num_apply_group``): the optimizer step in N calls.

An optimizer's update makes temporaries as large as what it steps at once (torch.optim's
multi-tensor ``foreach`` kernels hold a few copies of every gradient they touch). Stepping the
parameters in N groups, one call per group with the other groups' gradients hidden as None
(every ``torch.optim`` optimizer skips a parameter whose ``.grad`` is None), keeps those
temporaries near 1/N of the model. torch.optim's own per-parameter optimizers give exactly the
same result (`fleetlike.strategies.sharding.whole_update_reason` names the ones that may not);
the step counter of Adam-like optimizers is per parameter, so it advances once per step too.

The groups are contiguous runs of the optimizer's parameters balanced by element count
(`split_groups`), the same on every rank. `ApplyGroups` is used by the stage 2 and 3 unit, and
by `ApplyGroupUnit` under data parallel; stage 1 steps its partition in ``N`` chunks itself.

Example:
    >>> groups = ApplyGroups(optimizer, 4)
    >>> groups.run(optimizer.step)      # four calls, each seeing a quarter of the gradients
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.program import StepState
from fleetlike.strategies.sharding import check_num_apply_group
from fleetlike.strategies.step import StepContext, Unit

__all__ = ["ApplyGroupUnit", "ApplyGroups", "check_num_apply_group", "split_groups"]


def split_groups(sizes: Sequence[int], n: int) -> list[range]:
    """``n`` contiguous, non-empty runs of indices into ``sizes``, each about ``sum / n``."""
    if not 1 <= n <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} parameters into {n} groups")
    total = sum(sizes)
    out: list[range] = []
    start, acc = 0, 0
    for i, s in enumerate(sizes):
        acc += s
        left_items, left_groups = len(sizes) - i - 1, n - len(out) - 1
        # close a group at its share of the total, or when the rest only fills the rest
        if left_groups and (acc * n >= total * (len(out) + 1) or left_items == left_groups):
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(sizes)))
    return out


class ApplyGroups:
    """The grouped update of ``optimizer`` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, n: int) -> None:
        params = check_num_apply_group(n, optimizer)
        self.n = n
        self.groups = [[params[i] for i in r] for r in split_groups([p.numel() for p in params], n)]
        self.calls = 0

    def run(self, step: Callable[[], Any]) -> Any:
        """``step()`` once per group, each seeing only its group's gradients; gradients are
        restored after (so a caller reading them after the step sees them all)."""
        if self.n == 1:
            self.calls += 1
            return step()
        held = [[(p, p.grad) for p in group] for group in self.groups]
        for group in held:
            for p, _ in group:
                p.grad = None
        result = None
        try:
            for group in held:
                for p, g in group:
                    p.grad = g
                try:
                    result = step()
                    self.calls += 1
                finally:
                    for p, _ in group:
                        p.grad = None
        finally:
            for group in held:
                for p, g in group:
                    p.grad = g
        return result


class ApplyGroupUnit(Unit):
    """Data parallel's grouped update (stage 2 and 3 group inside their own unit)."""

    name = "num_apply_group"
    needs_optimizer = True

    def __init__(self, ctx: StepContext, n: int) -> None:
        self.ctx = ctx
        self.n = n
        self.groups: ApplyGroups | None = None

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        self.groups = ApplyGroups(optimizer, self.n)
        self.ctx.record("num_apply_group", True, f"the update runs in {self.n} groups of "
                        f"{', '.join(str(len(g)) for g in self.groups.groups)} parameters")

    def run_update(self, st: StepState, step: Callable[[], Any]) -> Any:
        if self.groups is None:
            return step()
        return self.groups.run(step)

"""Gradient accumulation, once for every face: k passes, the k-th communicates their sum.

`Accumulation` is the counter behind Fleet's ``gradient_merge`` (a micro-step per
``optimizer.step()`` or program run), Horovod's ``backward_passes_per_step`` and the DDP hook's
``gradient_merge_configs.k_steps`` (a pass per backward). Passes 1..k-1 keep their gradients
local (they add up in ``.grad``); the k-th communicates the sum, divided by k first when
``avg`` is on, so k passes over batches of b give the gradient of one batch of k*b.

A window either wraps (the pass after the k-th opens the next window: DDP's hook, gradient
merge) or is closed by the owner (``close()``: Horovod's ``step()``), in which case one pass more
raises ``too_many`` (Horovod's message).

`count_passes` tells backward passes apart from a gradient hook, for a face that reduces outside
backward (Horovod's Adasum reduces the update in ``step()``); `GradReducer` does the same inside
its own hook for a face whose reducer arms itself (``gate=``).

Example:
    >>> acc = Accumulation(4, avg=True)
    >>> if acc.begin(): reduce(grads); acc.finish(grads)   # the 4th pass: sum / 4, window closed
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["Accumulation", "count_passes"]


class Accumulation:
    """Counts passes in windows of ``k``; the k-th pass of a window communicates.

    Args:
        k: passes per communication (>= 1); ``field`` names it in the error for a bad value.
        avg: `finish` divides the summed gradients by k (else they stay the sum).
        too_many: the window does not wrap: a pass after the k-th raises AssertionError with
            this message until `close` (None: the pass after the k-th opens a new window).
    """

    def __init__(self, k: int, *, field: str = "k_steps", avg: bool = False, too_many: str | None = None) -> None:
        self.k = self.check(k, field)
        self.avg = bool(avg)
        self.too_many = too_many
        #: passes in the current window (k after its communicating pass, until it is closed)
        self.count = 0
        #: passes ever counted (the clock of what runs once per window, gossip's step)
        self.total = 0

    @staticmethod
    def check(k: Any, field: str) -> int:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{field}={k!r} must be an int >= 1")
        return k

    def set_k(self, k: int, field: str = "k_steps") -> None:
        """Change the window length (Horovod's ``set_backward_passes_per_step``)."""
        self.k = self.check(k, field)

    def begin(self) -> bool:
        """A pass starts: count it; True when it is the window's communicating (k-th) pass."""
        if self.count >= self.k:
            if self.too_many is not None:
                raise AssertionError(self.too_many)
            self.count = 0
        self.count += 1
        self.total += 1
        return self.count == self.k

    @property
    def communicating(self) -> bool:
        """Whether the last pass begun communicates."""
        return self.count == self.k

    @property
    def windows(self) -> int:
        """Completed windows (communicating passes) so far."""
        return self.total // self.k

    def close(self) -> None:
        """The window's gradients are consumed (an update): the next pass opens a new window."""
        self.count = 0

    def finish(self, grads: Iterable[torch.Tensor]) -> None:
        """After the communicating pass: divide the sums by k when ``avg``, close the window."""
        if self.avg and self.k > 1:
            for g in grads:
                g.div_(self.k)
        self.close()

    def resume(self, total: int) -> None:
        """Continue a wrapping count after ``total`` passes (a restored checkpoint)."""
        self.total = int(total)
        self.count = self.total % self.k or (self.k if self.total else 0)

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count, "total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count, self.total = int(state["count"]), int(state.get("total", state["count"]))


def count_passes(params: Sequence[torch.Tensor], accumulation: Accumulation) -> list[Any]:
    """One gradient hook per parameter whose only job is `Accumulation.begin` at the first
    gradient of each backward; returns the hook handles."""
    guard = threading.Lock()  # autograd may run hooks on device threads
    in_pass = [False]

    def end() -> None:
        with guard:
            in_pass[0] = False

    def on_grad(_: torch.Tensor) -> None:
        with guard:
            if in_pass[0]:
                return
            accumulation.begin()  # may raise (a closed window's pass too many)
            in_pass[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(end)

    return [p.register_post_accumulate_grad_hook(on_grad) for p in params]

"""A stage that raises ends the step on every rank with its error, instead of a hang.

The other stages of a pipeline wait on it (for activations or gradients) and the other
pipelines wait on it in the gradient average. So the failing rank writes its error to the job's
store first, then aborts its communicators; a peer blocked on it sees the link close, aborts its
own (reaching its neighbours in turn), finds the first error in the store and raises
`PipelineStageError` with it. The first rank to write is the origin: it re-raises its own
exception unchanged. The model is unusable afterwards (its links are cut): every later call
raises the same error.

Example:
    >>> guard = FailureGuard(store, rank=3, stage=1, abort=[pg.abort, dp_comm._abort])
    >>> loss = guard.run(lambda: schedule.step(x))
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["FailureGuard", "PipelineStageError"]

T = TypeVar("T")
_KEY = "first"


class PipelineStageError(RuntimeError):
    """Another rank's stage raised during a pipelined step; the message is its error."""


class FailureGuard:
    """Runs a step's work; on an exception, publishes or reads the first error and cuts links."""

    def __init__(self, store: Any, rank: int, stage: int, abort: Sequence[Callable[[], None]]) -> None:
        self.store = store
        self.rank = rank
        self.stage = stage
        self.abort = list(abort)
        self.broken: BaseException | None = None

    def run(self, work: Callable[[], T]) -> T:
        if self.broken is not None:
            raise PipelineStageError(
                f"this pipelined model stopped at an earlier error and its links are cut: {self.broken}. "
                "Fix: restart the job (from its last checkpoint)") from self.broken
        try:
            return work()
        except Exception as caught:
            exc = _root(caught)
            mine = (f"stage {self.stage} (rank {self.rank}) raised "
                    f"{''.join(traceback.format_exception_only(type(exc), exc)).strip()}")
            first = self._publish(mine)
            for cut in self.abort:
                try:
                    cut()
                except Exception:  # noqa: BLE001 - best effort: the links are being torn down
                    pass
            if first is None or first == mine:
                self.broken = exc
                if exc is caught:
                    raise
                raise exc from caught
            err = PipelineStageError(f"the pipelined step failed on another rank: {first}")
            self.broken = err
            raise err from caught

    def _publish(self, message: str) -> str | None:
        """Write ``message`` unless an earlier error is there; the error now stored."""
        if self.store is None:
            return None
        try:
            found = self.store.compare_set(_KEY, "", message)
        except Exception:  # noqa: BLE001 - the store itself is gone: keep our own error
            return None
        return found.decode() if isinstance(found, bytes) else str(found)


def _root(exc: BaseException) -> BaseException:
    """The exception a stage's own code raised: torch's schedule wraps it ("[Stage 1] failed to
    run forward") with the original as the cause."""
    seen = {id(exc)}
    while isinstance(exc, RuntimeError) and exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc

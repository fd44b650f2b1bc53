"""Handles of asynchronous collectives: the `Work` protocol and the two handles the grid returns.

Apart from the communicator so that the guard (which wraps handles) and the backends can import
them without importing ``base``.

Thread safety: a handle may be waited on by one thread while another polls ``is_completed``
(a progress or logging thread), or waited on by two threads. The finishing step of a chained
handle (cast back, divide for AVG, copy to ``out``) therefore runs under a lock, exactly once.

Example:
    >>> work = comm.all_reduce_async(t)
    >>> ...                      # compute while the collective runs
    >>> result = work.wait()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Work", "CompletedWork", "ChainedWork", "DONE", "finish"]


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous collective. ``wait()`` blocks and returns the result.

    A protocol rather than a base class, so a backend's own handle (torch's ``Work``, an MPI
    request wrapper) serves directly without another layer per call."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class CompletedWork(Work):
    """A handle whose result is already there (world of one, empty tensors)."""

    __slots__ = ("_result",)

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True


#: A completed handle with no result (what blocking primitives return).
DONE = CompletedWork(None)


def _noop() -> None:
    return None


class ChainedWork(Work):
    """Backend handle + a finishing step (cast back, divide for AVG, copy to ``out``).

    The finishing step runs exactly once, on the first ``wait()``, even when several threads
    wait at once (the others block until it is done and get the same result)."""

    __slots__ = ("_inner", "_finish", "_result", "_done", "_lock")

    def __init__(self, inner: Work, finish: Callable[[], Any]) -> None:
        self._inner = inner
        self._finish = finish
        self._result: Any = None
        self._done = False
        self._lock = threading.Lock()

    def wait(self) -> Any:
        if self._done:  # set only after _result, under the lock: safe to read without it
            return self._result
        with self._lock:
            if not self._done:
                self._inner.wait()
                self._result = self._finish()
                self._finish = _noop  # drop references to the buffers
                self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or self._inner.is_completed()


def finish(inner: Work, step: Callable[[], Any], blocking: bool) -> Any:
    """The end of every grid call: blocking, wait and return the result (no handle object on
    the hot path); otherwise a handle that runs ``step`` on its first ``wait()``."""
    if blocking:
        inner.wait()
        return step()
    return ChainedWork(inner, step)

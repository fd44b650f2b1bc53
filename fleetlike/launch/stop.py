"""The launcher's stop request: a flag its SIGINT/SIGTERM handler sets, and what its waits take.

Why not a `threading.Event`: a handler runs on the main thread between two bytecodes, possibly
inside ``Event.wait`` after it took the event's (non-reentrant) lock; ``Event.set`` there takes
that lock again and the launcher hangs for ever. `SignalFlag` sets one attribute instead. The
launcher's waits (`fleetlike.launch.meeting`, `fleetlike.launch.homesecret`,
`fleetlike.launch.torch_flags`) take any `StopFlag`: a `SignalFlag`, or a `threading.Event`
where no signal handler sets it.

Example:
    >>> stop = SignalFlag()
    >>> stop.wait(0.02), stop.set(), stop.wait(0.02)
    (False, None, True)
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SignalFlag", "StopFlag"]


class StopFlag(Protocol):
    """What a wait of the launcher reads: ``is_set()``, and ``wait(timeout)`` returning it."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class SignalFlag:
    """A `threading.Event` that a signal handler may set (see the module docstring): ``set``
    is one attribute write, and ``wait`` polls it every `SLICE` seconds (a signal's handler runs
    in the sleep's place, and the stop is seen within one slice)."""

    SLICE = 0.01

    def __init__(self) -> None:
        self._flag = False

    def set(self) -> None:
        self._flag = True

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._flag:
            left = self.SLICE if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.SLICE, left))
        return True

"""`CommStats`: what a communicator has moved, safe to update from several threads.

Collectives are issued from the training thread, from autograd's threads (gradient hooks of the
data-parallel reducer) and from helper threads (a data loader's all-reduce, a progress logger);
``calls[op] += 1`` is a read-modify-write that loses counts when two threads interleave, so each
update takes a lock (~0.1 us, against tens of microseconds for the smallest collective).

Example:
    >>> comm.stats.calls          # {"all_reduce": 12, "broadcast": 1}
    >>> comm.stats.snapshot()     # a consistent copy, for logging from another thread
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["CommStats", "ring_send_bytes"]


class CommStats:
    """Collective calls and payload bytes, by op name.

    ``bytes`` counts the payload of each call as seen by this rank (the tensor's size in the
    wire dtype), not what the algorithm puts on the links; `wire_bytes` estimates that from
    the ring algorithm's factors so flat and hierarchical schemes can be compared. ``calls`` and
    ``bytes`` are live dicts: read them from the thread that issues collectives, or use
    `snapshot` from any thread.
    """

    __slots__ = ("calls", "bytes", "wire_bytes", "_lock")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.wire_bytes = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CommStats(calls={self.calls!r}, bytes={self.bytes!r}, wire_bytes={self.wire_bytes})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommStats):
            return NotImplemented
        return self.snapshot() == other.snapshot()

    def __getstate__(self) -> dict[str, Any]:
        return self.snapshot()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.calls, self.bytes, self.wire_bytes = dict(state["calls"]), dict(state["bytes"]), state["wire_bytes"]
        self._lock = threading.Lock()

    def record(self, op: str, nbytes: int, wire: int) -> None:
        """Count one call of ``op`` moving ``nbytes`` (``wire`` bytes sent by the algorithm)."""
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            self.bytes[op] = self.bytes.get(op, 0) + nbytes
            self.wire_bytes += wire

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy: ``{"calls": {...}, "bytes": {...}, "wire_bytes": n}``."""
        with self._lock:
            return {"calls": dict(self.calls), "bytes": dict(self.bytes), "wire_bytes": self.wire_bytes}

    @property
    def total_calls(self) -> int:
        with self._lock:
            return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(self.bytes.values())

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.bytes.clear()
            self.wire_bytes = 0


def ring_send_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends with the ring algorithm (nccl-tests' bus factors times payload)."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * nbytes // n
    if op in ("broadcast", "reduce"):
        return nbytes
    return 0

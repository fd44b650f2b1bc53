"""A deadline for collectives whose backend has none: MPI's and NCCL's.

gloo's collectives time out on their own (`GlooCommunicator` passes the timeout to the process
group), but an MPI collective or an NCCL kernel waits forever for a peer that never arrives: a
rank that skipped an ``all_reduce`` or is stuck in its data loader hangs the whole job until
someone kills it. Neither can cancel a collective, so, like torch's NCCL watchdog, fleetlike's
watchdog ends the job instead: a daemon thread checks the collectives in flight, and the first
one older than its communicator's timeout is reported on stderr (which op, its number, which
communicator, which rank, how long) and handed to the communicator's expiry action. For MPI
that is ``MPI_Abort`` on ``COMM_WORLD``, which makes ``mpiexec`` stop every rank; for NCCL it
aborts the NCCL communicator and exits the process, which makes the launcher stop the job.

An entry ends with `Watchdog.end` (MPI: the call returned or the request completed) or, when it
was registered with ``done`` (NCCL: the kernel's CUDA event; the host does not wait for it),
when the thread finds ``done()`` true.

Cost on the hot path: a dict insert and a dict pop per collective (about a microsecond); the
thread starts with the first tracked collective and wakes every ``min(1 s, timeout / 4)``.

Example:
    >>> key = WATCHDOG.begin(60.0, "world (mpi)", "all_reduce", 17, rank=3, expire=abort)
    >>> ...  # the collective
    >>> WATCHDOG.end(key)
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WATCHDOG", "InFlight", "Watchdog"]


@dataclass(frozen=True)
class InFlight:
    """One collective being watched."""

    started: float
    timeout: float
    comm: str
    op: str
    seq: int
    rank: int
    expire: Callable[[InFlight], None]
    done: Callable[[], bool] | None = None

    def message(self, now: float) -> str:
        return (
            f"fleetlike: collective #{self.seq} {self.op} on {self.comm} has not finished after "
            f"{now - self.started:.1f}s on rank {self.rank} (timeout {self.timeout:g}s): a peer never "
            "joined it (crashed, stuck, or issued a different collective). A running collective "
            "cannot be cancelled, so the job is being aborted. Run with FLEETLIKE_CHECK_COLLECTIVES=1 "
            "to compare the ranks' collective sequences."
        )


class Watchdog:
    """Watches in-flight collectives; calls ``expire`` on the first one past its timeout."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, thread: bool = True) -> None:
        """``thread=False``: no background thread; the owner calls `check` (tests)."""
        self._clock = clock
        self._use_thread = thread
        self._pending: dict[int, InFlight] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._period = 1.0

    def begin(
        self, timeout: float, comm: str, op: str, seq: int, *, rank: int, expire: Callable[[InFlight], None],
        done: Callable[[], bool] | None = None,
    ) -> int:
        """Start watching a collective; returns the key for `end`. With ``done``, the entry also
        ends when the thread finds ``done()`` true."""
        key = next(self._keys)
        self._pending[key] = InFlight(self._clock(), timeout, comm, op, seq, rank, expire, done)
        if self._use_thread and (self._thread is None or timeout / 4 < self._period):
            self._ensure_thread(timeout)
        return key

    def end(self, key: int) -> None:
        """The collective finished (or failed by itself): stop watching it."""
        self._pending.pop(key, None)

    def in_flight(self) -> list[InFlight]:
        return list(self._pending.values())

    def check(self) -> InFlight | None:
        """Expire the oldest overdue collective, if any (what the thread does each period)."""
        now = self._clock()
        for key, item in list(self._pending.items()):
            if item.done is not None and _finished(item.done):
                self._pending.pop(key, None)
            elif now - item.started > item.timeout:
                self._pending.pop(key, None)
                print(item.message(now), file=sys.stderr, flush=True)
                item.expire(item)
                return item
        return None

    def _ensure_thread(self, timeout: float) -> None:
        with self._lock:
            self._period = min(self._period, max(0.05, timeout / 4))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleetlike-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self._period)
            self.check()


def _finished(done: Callable[[], bool]) -> bool:
    try:
        return bool(done())
    except Exception:  # noqa: BLE001 - a failed query (a CUDA error) is the waiter's to report
        return True


#: the process's watchdog (one thread for every watched communicator)
WATCHDOG = Watchdog()

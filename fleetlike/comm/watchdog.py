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
was registered with ``done``, when the thread finds ``done()`` true.

A communicator can instead be watched as a whole (`Watchdog.watch`, NCCL): the thread calls its
``poll(now)`` each period, which looks at the collectives in flight (their CUDA events complete
in launch order on the communicator's one stream, so only the oldest is queried) and at the
backend's own error state (``ncclCommGetAsyncError``: a peer that died or a network error ends
the step within a period, with NCCL's reason, instead of at the deadline), and answers what to
report and expire, if anything. A launch then costs one deque append, no lock.

Cost on the hot path: a dict insert and a dict pop per collective, each under the watchdog's
lock (about a microsecond); the thread starts with the first tracked collective and wakes every
``min(1 s, timeout / 4)``. A check that fails unexpectedly is reported once on stderr with its
traceback and the thread goes on watching: losing the thread would silently remove every
deadline.

Example:
    >>> key = WATCHDOG.begin(60.0, "world (mpi)", "all_reduce", 17, rank=3, expire=abort)
    >>> ...  # the collective
    >>> WATCHDOG.end(key)
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WATCHDOG", "InFlight", "Poll", "Watchdog"]


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


#: a watched communicator's check: ``poll(now)`` -> ``(item, message)`` to expire, or None
Poll = Callable[[float], "tuple[InFlight, str] | None"]


class Watchdog:
    """Watches in-flight collectives; calls ``expire`` on the first one past its timeout.

    Every thread that issues or completes a collective calls `begin` / `end`, and the watchdog
    thread calls `check`, so all shared state (the entries, the period, the thread) lives under
    one lock. Callbacks (``done`` queries and ``expire``) run outside it: ``expire`` may abort
    the process or take its time, and must never block the training threads' `begin` / `end`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, thread: bool = True) -> None:
        """``thread=False``: no background thread; the owner calls `check` (tests)."""
        self._clock = clock
        self._use_thread = thread
        self._lock = threading.Lock()
        self._pending: dict[int, InFlight] = {}  # guarded by _lock
        self._next_key = 0  # guarded by _lock
        self._thread: threading.Thread | None = None  # guarded by _lock
        self._period = 1.0  # guarded by _lock
        self._reported: set[tuple[str, str]] = set()  # touched by the watchdog thread only
        self._sources: dict[int, Poll] = {}  # guarded by _lock

    def watch(self, key: int, poll: Poll, timeout: float | None) -> None:
        """Poll ``poll(now)`` each period until `unwatch` (key: the owner's ``id``); it returns
        ``(item, message)`` to report and expire, or None."""
        with self._lock:
            self._sources[key] = poll
        self.tighten(timeout)

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._sources.pop(key, None)

    def tighten(self, timeout: float | None) -> None:
        """Wake at least every ``timeout / 4`` (at most every second); start the thread."""
        with self._lock:
            if timeout is not None:
                self._period = min(self._period, max(0.05, timeout / 4))
            if self._use_thread and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleetlike-watchdog", daemon=True)
                self._thread.start()

    def begin(
        self, timeout: float, comm: str, op: str, seq: int, *, rank: int, expire: Callable[[InFlight], None],
        done: Callable[[], bool] | None = None,
    ) -> int:
        """Start watching a collective; returns the key for `end`. With ``done``, the entry also
        ends when the thread finds ``done()`` true."""
        item = InFlight(self._clock(), timeout, comm, op, seq, rank, expire, done)
        with self._lock:
            key = self._next_key
            self._next_key += 1
            self._pending[key] = item
            if self._use_thread and (self._thread is None or timeout / 4 < self._period):
                self._period = min(self._period, max(0.05, timeout / 4))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="fleetlike-watchdog", daemon=True)
                    self._thread.start()
        return key

    def end(self, key: int) -> None:
        """The collective finished (or failed by itself): stop watching it."""
        with self._lock:
            self._pending.pop(key, None)

    def in_flight(self) -> list[InFlight]:
        with self._lock:
            return list(self._pending.values())

    def clear(self) -> None:
        """Forget every entry (a test's communicators are gone; nothing of theirs may expire)."""
        with self._lock:
            self._pending.clear()
            self._sources.clear()

    def check(self) -> InFlight | None:
        """Expire the oldest overdue collective, if any (what the thread does each period)."""
        now = self._clock()
        with self._lock:
            snapshot = list(self._pending.items())
        finished = [key for key, item in snapshot if item.done is not None and _finished(item.done)]
        overdue = [
            (key, item) for key, item in snapshot if key not in finished and now - item.started > item.timeout
        ]
        with self._lock:
            for key in finished:
                self._pending.pop(key, None)
            # an entry that `end` removed meanwhile finished in time after all
            expired = next(((k, it) for k, it in overdue if self._pending.pop(k, None) is not None), None)
        if expired is None:
            return self._check_sources(now)
        item = expired[1]
        print(item.message(now), file=sys.stderr, flush=True)
        item.expire(item)
        return item

    def _check_sources(self, now: float) -> InFlight | None:
        with self._lock:
            polls = list(self._sources.items())
        for key, poll in polls:
            found = poll(now)
            if found is None:
                continue
            item, message = found
            with self._lock:
                if self._sources.pop(key, None) is None:  # unwatched meanwhile (closed)
                    continue
            print(message, file=sys.stderr, flush=True)
            item.expire(item)
            return item
        return None

    def _run(self) -> None:
        while True:
            with self._lock:
                period = self._period
            time.sleep(period)
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive one bad check
                self._report(exc)

    def _report(self, exc: Exception) -> None:
        """Say once per distinct failure that a check failed; the watchdog keeps running."""
        signature = (type(exc).__name__, str(exc))
        if signature in self._reported:
            return
        self._reported.add(signature)
        trace = "".join(traceback.format_exception(exc))
        print(f"fleetlike: the collective watchdog's check failed (it keeps watching):\n{trace}",
              file=sys.stderr, flush=True)


def _finished(done: Callable[[], bool]) -> bool:
    try:
        return bool(done())
    except Exception:  # noqa: BLE001 - a failed query (a CUDA error) is the waiter's to report
        return True


#: the process's watchdog (one thread for every watched communicator)
WATCHDOG = Watchdog()

"""What the watchdog does with an NCCL communicator: read NCCL's errors, query its events, and
end a stuck rank.

Why a module of its own: every launched NCCL collective's event is handed to the watchdog
(`fleetlike.comm.watchdog`); one that has not completed after the communicator's timeout, or
an asynchronous error NCCL reports, gets the NCCL communicator aborted and the process ended
with code 1, so the launcher stops the job instead of every rank hanging on a peer that is gone.
Those steps run on the watchdog's thread and must work with a CUDA context that is no longer
trustworthy: the abort gets a grace period on a helper thread, and the exit skips Python's
cleanup.

Example:
    >>> if async_error(nccl, comm.nccl_comm) is not None:   # on the watchdog's thread
    ...     abort_within(comm.nccl_comm, ABORT_GRACE_S, "'world' (nccl)")
    ...     exit_process(1)
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from fleetlike.comm.watchdog import InFlight

__all__ = [
    "ABORT_GRACE_S",
    "NCCL_IN_PROGRESS",
    "abort_within",
    "async_error",
    "event_done",
    "exit_process",
    "init_expired",
]

#: how long the watchdog lets ``ncclCommAbort`` take before it ends the process anyway
ABORT_GRACE_S = 10.0


def abort_within(comm: Any, grace: float, label: str) -> None:
    """``comm.abort()`` on a helper thread, waited for at most ``grace`` seconds.

    On the first GPU run (H100, NCCL 2.28.9) ``ncclCommAbort`` did not return while the
    collective's kernel was still queued behind a running kernel, and the process the watchdog
    meant to end ran on. The exit must not depend on the abort (torch's NCCL watchdog has the
    same escape: a monitor that ends the process when the abort hangs).
    """
    finished = threading.Event()

    def abort() -> None:
        try:
            comm.abort()
        finally:
            finished.set()

    threading.Thread(target=abort, name="fleetlike-nccl-abort", daemon=True).start()
    if not finished.wait(grace):
        print(f"fleetlike: ncclCommAbort on {label} did not return within {grace:g}s; "
              "ending the process without it", file=sys.stderr, flush=True)


def exit_process(code: int) -> None:
    """End this process now, without Python's cleanup (which would wait on the dead stream)."""
    os._exit(code)


#: ncclInProgress: a non-blocking communicator's operation still running, not an error
NCCL_IN_PROGRESS = 7


def async_error(nccl: Any, comm: Any) -> str | None:
    """NCCL's asynchronous error on ``comm`` (``ncclCommGetAsyncError``), or None.

    CuPy 13 turns every non-zero result into ``NcclError`` through a table of names that has
    no ``ncclInProgress`` (NCCL >= 2.14), so that code arrives as a ``KeyError`` while the
    error is built; either form of it means "still running", not a failure.
    """
    try:
        comm.check_async_error()
    except nccl.NcclError as exc:
        if getattr(exc, "status", None) == NCCL_IN_PROGRESS:
            return None
        return str(exc)
    except KeyError:
        return None
    return None


def event_done(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:  # noqa: BLE001 - a failed query (a CUDA error) is the waiter's to report
        return True


def init_expired(item: InFlight) -> None:
    """A rank never joined ``ncclCommInitRank`` (or NCCL's first connect): nothing to abort yet;
    end the process so that the launcher stops the job."""
    exit_process(1)

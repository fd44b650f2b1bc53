"""Horovod's timeline: ``hvd.start_timeline(path)`` records every hvd collective of this rank
until ``hvd.stop_timeline()`` writes them as a Chrome trace (open it in chrome://tracing or
Perfetto).

Each collective shows two spans on the row of its name: ``NEGOTIATE`` (submitted until the
ranks agreed and its data started: time waiting for the other ranks) and its kind
(``ALLREDUCE``, ``ALLGATHER``...: data started until the result was taken). ``mark_cycles`` is
accepted for Horovod's signature; fleetlike has no background cycles to mark. Each rank writes
its own file: give each rank its own path (``f"timeline.{hvd.rank()}.json"``), or only rank 0
records (as Horovod does).

Example:
    >>> hvd.start_timeline(f"/tmp/timeline.{hvd.rank()}.json")
    >>> ...; hvd.stop_timeline()
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

from fleetlike.comm.handles import ChainedWork

__all__ = ["TimedCollective", "record", "recording", "start_env_timeline", "start_timeline", "stop_timeline"]

_LOCK = threading.Lock()
_ACTIVE: dict[str, Any] | None = None  # {"path", "events", "pid"}


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this rank's collectives for ``file_path`` (written by `stop_timeline`)."""
    global _ACTIVE
    from fleetlike.horovod import runtime as _rt

    if _rt._RUNTIME is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    if stop_timeline not in _rt.BEFORE_SHUTDOWN:  # HOROVOD_TIMELINE's file is written at hvd.shutdown()
        _rt.BEFORE_SHUTDOWN.append(stop_timeline)
    if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
        raise ValueError(f"hvd.start_timeline(file_path={file_path!r}): give the path of the trace file to write")
    with _LOCK:
        _ACTIVE = {"path": os.fspath(file_path), "events": [], "pid": _rt._RUNTIME.comm.rank,
                   "mark_cycles": bool(mark_cycles)}


def stop_timeline() -> None:
    """Stop recording and write the trace (nothing happens when no timeline is recording)."""
    global _ACTIVE
    with _LOCK:
        active, _ACTIVE = _ACTIVE, None
    if active is None:
        return
    tmp = f"{active['path']}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"traceEvents": active["events"], "displayTimeUnit": "ms"}, fh)
    os.replace(tmp, active["path"])


def now() -> float:
    return time.perf_counter()


_EPOCH = time.time() - time.perf_counter()


def record(name: str, kind: str, submitted: float, started: float, done: float) -> None:
    """One collective's spans (perf_counter seconds), when a timeline records."""
    active = _ACTIVE
    if active is None:
        return
    us = lambda t: round((t + _EPOCH) * 1e6, 1)  # noqa: E731
    common = {"pid": active["pid"], "tid": name, "cat": "hvd"}
    with _LOCK:
        active["events"].append({"name": "NEGOTIATE", "ph": "X", "ts": us(submitted),
                                 "dur": max(us(started) - us(submitted), 0.0), **common})
        active["events"].append({"name": kind.upper(), "ph": "X", "ts": us(started),
                                 "dur": max(us(done) - us(started), 0.0), **common})


def recording() -> bool:
    """Whether a timeline records now."""
    return _ACTIVE is not None


class TimedCollective:
    """A bucket collective whose allreduces appear on the timeline (row ``gradient bucket i``):
    ``NEGOTIATE`` is empty (the buckets need no agreement), ``ALLREDUCE`` spans its launch to
    the reducer's wait for it. Other members are the inner collective's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def world(self) -> Any:
        return self.inner.world

    def start(self, bucket: Any) -> Any:
        t0 = now()
        work = self.inner.start(bucket)
        return ChainedWork(work, lambda: record(f"gradient bucket {bucket.index}", "allreduce", t0, t0, now()))

    def describe(self, bucket: Any) -> dict[str, Any]:
        return self.inner.describe(bucket)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def start_env_timeline(path: str) -> None:
    """``HOROVOD_TIMELINE=path``: record from ``hvd.init`` on; written by ``hvd.shutdown()`` or,
    if the script never calls it, when the process exits."""
    start_timeline(path)
    atexit.register(stop_timeline)

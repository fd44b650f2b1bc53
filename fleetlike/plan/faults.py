"""Minor page faults of the work one thread runs: its own and its native helper threads'.

The planner times ops on a clock without page faults (`fleetlike.plan.dry`, `fleetlike.plan.trace`):
it takes off a first-touch cost per fault. Counting the whole process's faults
(``getrusage(RUSAGE_SELF)``) also takes off the faults of every other thread of the process
while an op runs: another tracer, a test harness, a loader thread faulting in its own buffers.
Under load that made an op read ~0 s (or less) although it ran for milliseconds. Counting the
calling thread's faults alone (``RUSAGE_THREAD``) misses half of them the other way: torch's
intra-op pool threads write the outputs of a parallel kernel, and first-touch their pages (a
2048 x 2048 matmul and two elementwise ops on 2 intra-op threads: 8,748 of 17,416 faults on the
calling thread). So the count is the calling thread's plus those of the process's threads that
Python did not start (torch's and OpenMP's pools, which run the ops the calling thread issues),
read from ``/proc/self/task`` (listed again when the number of threads changed, and every
`_RELIST` seconds; each helper's ``stat`` kept open and read with one ``pread``: a few
microseconds per reading); a helper thread that ends keeps its
last count, so the total never runs backwards. Without ``/proc``: the calling thread's own.

Example:
    >>> f0 = work_faults(); out = torch.empty(1 << 22).fill_(1); work_faults() - f0 >= 0
    True
"""

from __future__ import annotations

import os
import resource
import threading
import time

__all__ = ["work_faults"]

_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
#: seconds between two listings of the process's threads at most (a listing costs tens of
#: microseconds, inside the interval a clock reading closes); sooner when their number changed
_RELIST = 0.2
_lock = threading.Lock()
#: native helper thread id -> (its ``stat`` opened, its minor faults at the last read)
_helpers: dict[int, tuple[int, int]] = {}
#: the faults of helper threads that ended (their last read count)
_ended = 0
_listed = -_RELIST
#: the thread count at the last listing (``/proc/self/task``'s link count)
_links = -1
_pid = os.getpid()


def _faults_of(fd: int) -> int | None:
    try:
        fields = os.pread(fd, 4096, 0).rsplit(b")", 1)[1].split()
        return int(fields[7])  # minflt, the 10th field; fields[0] is the 3rd (state)
    except (OSError, IndexError, ValueError):
        return None  # the thread ended


def _relist() -> None:
    python = {t.native_id for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        if not tid.isdigit() or int(tid) in python or int(tid) in _helpers:
            continue
        try:
            fd = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
        except OSError:
            continue
        _helpers[int(tid)] = (fd, 0)


def work_faults() -> int:
    """Minor faults so far of the calling thread and of the process's native helper threads
    (module docstring); differences of two calls on one thread count an interval's faults."""
    global _ended, _listed, _pid, _links
    own = resource.getrusage(_WHO).ru_minflt
    if _WHO == resource.RUSAGE_SELF:
        return own
    with _lock:
        if _pid != os.getpid():  # a forked child: the descriptors read its parent's threads
            for fd, _ in _helpers.values():
                os.close(fd)
            _helpers.clear()
            _ended, _listed, _pid, _links = 0, -_RELIST, os.getpid(), -1
        now = time.monotonic()
        try:
            links = os.stat("/proc/self/task").st_nlink  # a stat: a few microseconds
            if links != _links or now - _listed >= _RELIST:
                _listed, _links = now, links
                _relist()
        except OSError:  # no /proc: the calling thread's own
            return own
        total = _ended
        for tid, (fd, last) in list(_helpers.items()):
            count = _faults_of(fd)
            if count is None:
                os.close(fd)
                del _helpers[tid]
                _ended += last
                total += last
                continue
            _helpers[tid] = (fd, count)
            total += count
        return own + total

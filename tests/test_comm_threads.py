"""Objects shared between threads in comm keep every update: stats, numbering, handles.

Collectives are issued from the training thread, autograd's threads (gradient hooks) and helper
threads, and handles are waited on by one thread while another polls them. The switch interval
is made tiny so that an unguarded read-modify-write loses updates within a few thousand rounds.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from fleetlike.comm import CommStats, CompletedWork, SingleCommunicator
from fleetlike.comm.handles import ChainedWork

THREADS = 8
ROUNDS = 3000


@pytest.fixture(autouse=True)
def _fast_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _hammer(fn: Callable[[int], None]) -> None:
    start = threading.Barrier(THREADS)

    def run(i: int) -> None:
        start.wait()
        for _ in range(ROUNDS):
            fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def test_stats_counters_lose_no_counts():
    stats = CommStats()
    _hammer(lambda i: stats.record("all_reduce" if i % 2 else "broadcast", 3, 5))
    n = THREADS * ROUNDS
    assert stats.snapshot() == {"calls": {"all_reduce": n // 2, "broadcast": n // 2},
                                "bytes": {"all_reduce": 3 * n // 2, "broadcast": 3 * n // 2},
                                "wire_bytes": 5 * n}
    assert stats.total_calls == n


class _Counting(SingleCommunicator):
    """A world of one that goes through `_issue` (numbering) like a real backend."""

    calls_backend_at_size_one = True


def test_collectives_from_threads_get_unique_numbers_and_all_counted():
    comm = _Counting()
    seen: list[int] = []
    lock = threading.Lock()
    start = comm._all_reduce_now

    def numbered(buf: torch.Tensor, op):
        with lock:
            seen.append(comm._seq)
        return start(buf, op)

    comm._all_reduce_now = numbered  # type: ignore[method-assign]
    _hammer(lambda i: comm.all_reduce(torch.ones(2)))
    n = THREADS * ROUNDS
    assert comm.stats.calls == {"all_reduce": n}
    assert next(comm._seqs) == n + 1  # every number handed out exactly once


def test_a_handle_waited_on_by_several_threads_finishes_once():
    for _ in range(200):
        runs: list[int] = []

        class Slow(CompletedWork):
            def wait(self):
                time.sleep(0.0001)
                return None

        work = ChainedWork(Slow(None), lambda: runs.append(1) or len(runs))
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(work.wait())) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert runs == [1] and results == [1, 1, 1, 1]
        assert work.is_completed()


def test_stats_pickle_and_compare():
    import pickle

    stats = CommStats()
    stats.record("all_gather", 8, 4)
    copy = pickle.loads(pickle.dumps(stats))
    assert copy == stats and copy.snapshot()["calls"] == {"all_gather": 1}
    copy.record("all_gather", 8, 4)  # its lock came back too
    assert copy.total_calls == 2

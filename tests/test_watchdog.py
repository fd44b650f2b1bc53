"""The collective watchdog on a fake clock: what expires, when, what it says, what it calls."""

from __future__ import annotations

import gc
import sys
import time

import pytest

from fleetlike.comm.watchdog import InFlight, Watchdog

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_only_an_overdue_collective_expires_once_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    dog = Watchdog(clock, thread=False)  # check() driven by hand
    expired: list[InFlight] = []
    a = dog.begin(5.0, "'world' (mpi)", "all_reduce", 7, rank=3, expire=expired.append)
    clock.now += 1.0
    b = dog.begin(1.0, "'intra' (mpi)", "barrier", 2, rank=3, expire=expired.append)
    clock.now += 0.9
    assert dog.check() is None and expired == []  # a: 1.9 s of 5, b: 0.9 s of 1
    dog.end(b)  # b finished in time
    clock.now += 3.2  # a: 5.1 s of 5
    assert dog.check() is not None
    assert [e.seq for e in expired] == [7]
    err = capsys.readouterr().err
    assert err.startswith("fleetlike: collective #7 all_reduce on 'world' (mpi) has not finished after 5.1s on rank 3")
    assert "(timeout 5s)" in err and "FLEETLIKE_CHECK_COLLECTIVES=1" in err
    assert dog.in_flight() == [] and dog.check() is None and len(expired) == 1
    dog.end(a)  # ending an expired entry is harmless


def test_a_collective_that_ends_in_time_never_expires() -> None:
    clock = Clock()
    dog = Watchdog(clock, thread=False)
    key = dog.begin(2.0, "'world' (mpi)", "broadcast", 1, rank=0, expire=lambda _: pytest.fail("expired"))
    clock.now += 2.0
    assert dog.check() is None  # exactly at the timeout: not past it
    dog.end(key)
    clock.now += 100.0
    assert dog.check() is None and dog.in_flight() == []


def test_the_thread_expires_a_real_overdue_collective() -> None:
    import threading

    dog = Watchdog()
    fired = threading.Event()
    dog.begin(0.2, "'world' (mpi)", "all_gather", 1, rank=1, expire=lambda _: fired.set())
    assert fired.wait(5.0)


def test_begin_end_from_many_threads_while_checking_loses_nothing() -> None:
    """A race once seen: `check` iterated the entries while other threads changed them."""
    import threading

    dog = Watchdog(thread=False)
    errors: list[BaseException] = []
    kept: list[list[int]] = [[] for _ in range(4)]
    stop = threading.Event()
    flips = {"n": 0}

    def done() -> bool:  # entries that finish on their own (NCCL's event query), now and then
        flips["n"] += 1
        return flips["n"] % 7 == 0

    class Cycle:  # garbage whose finalizer runs Python code inside any allocation (gc)
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            time.sleep(0)

    def issue(t: int) -> None:
        try:
            for i in range(3000):
                Cycle()
                key = dog.begin(1e9, "'world' (mpi)", "all_reduce", i, rank=t, expire=lambda _: None)
                if i % 100 == 0:
                    kept[t].append(key)  # left in flight: must survive every check
                else:
                    dog.end(key)
                if i % 50 == 0:
                    dog.end(dog.begin(1e9, "'world' (nccl)", "all_reduce", i, rank=t,
                                      expire=lambda _: None, done=done))
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised by the test
            errors.append(exc)

    def watch() -> None:
        try:
            while not stop.is_set():
                assert dog.check() is None  # nothing is overdue
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    switch, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: interleavings, not luck
    gc.set_threshold(1)  # ... including inside C loops, where a collection runs finalizers
    try:
        checker = threading.Thread(target=watch)
        checker.start()
        workers = [threading.Thread(target=issue, args=(t,)) for t in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        checker.join()
    finally:
        sys.setswitchinterval(switch)
        gc.set_threshold(*thresholds)
    assert errors == []
    left = dog.in_flight()
    assert sorted((e.rank, e.seq) for e in left) == sorted((t, i) for t in range(4) for i in range(0, 3000, 100))


def test_the_thread_survives_a_failing_check_and_keeps_expiring(capfd: pytest.CaptureFixture[str]) -> None:
    import threading

    dog = Watchdog()

    def broken(_: InFlight) -> None:
        raise RuntimeError("expire blew up")

    dog.begin(0.1, "'world' (mpi)", "barrier", 1, rank=0, expire=broken)
    dog.begin(0.1, "'world' (mpi)", "barrier", 2, rank=0, expire=broken)  # same failure: said once
    fired = threading.Event()
    deadline = time.monotonic() + 10
    while len(dog.in_flight()) and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.begin(0.1, "'world' (mpi)", "all_gather", 3, rank=0, expire=lambda _: fired.set())
    assert fired.wait(10.0), "the watchdog thread died after a failing check"
    err = capfd.readouterr().err
    assert err.count("the collective watchdog's check failed") == 1
    assert "RuntimeError: expire blew up" in err and "Traceback" in err


def test_an_entry_ended_during_a_check_is_not_expired() -> None:
    """`end` racing the thread: the collective finished in time, so nothing may fire."""
    clock = Clock()
    dog = Watchdog(clock, thread=False)
    key = dog.begin(1.0, "'world' (mpi)", "all_reduce", 1, rank=0, expire=lambda _: pytest.fail("expired"))
    clock.now += 5.0

    def query() -> bool:  # runs inside check(), after the snapshot: the collective ends now
        dog.end(key)
        return False

    dog.begin(1e9, "'world' (nccl)", "all_reduce", 2, rank=0, expire=lambda _: None, done=query)
    assert dog.check() is None

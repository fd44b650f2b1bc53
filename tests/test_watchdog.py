"""The collective watchdog on a fake clock: what expires, when, what it says, what it calls."""

from __future__ import annotations

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

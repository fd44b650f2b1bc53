"""The launcher's stop request: a SIGINT/SIGTERM handler sets it, and it must never hang.

A handler runs on the main thread between two bytecodes, also inside the wait it is to end.
`threading.Event.wait` holds the event's non-reentrant lock for a few bytecodes; a handler that
calls ``Event.set`` there takes it again and the launcher hangs for ever (an elastic agent was
found so, in its handler, under load). These tests run the handler at every line of the wait.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest

from fleetlike.launch.main import _StopRequest
from fleetlike.launch.stop import SignalFlag


def _wait_with_the_handler_at_every_line(stop: _StopRequest, event: Any) -> list[bool]:
    """``event.wait(5)`` on a thread of its own, the stop's handler run at each line executed
    inside the wait (as a signal may); the result, or nothing when the wait hung."""
    done: list[bool] = []

    def tracer(frame: Any, what: str, arg: Any) -> Any:
        if what == "line" and frame.f_code.co_filename != __file__ and not done:
            stop._handle(signal.SIGTERM, frame)
        return tracer

    def waiter() -> None:
        sys.settrace(tracer)
        try:
            result = event.wait(5)
        finally:
            sys.settrace(None)
        done.append(result)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    thread.join(3)
    return done


def test_the_handler_run_inside_the_wait_ends_it() -> None:
    stop = _StopRequest()
    assert _wait_with_the_handler_at_every_line(stop, stop.event) == [True]
    assert stop.signum == signal.SIGTERM and stop.event.is_set()


def test_a_threading_event_hangs_there() -> None:
    """Why the stop is no `threading.Event`: the same handler, setting one, never returns."""
    stop = _StopRequest()
    stop.event = threading.Event()  # type: ignore[assignment]
    assert _wait_with_the_handler_at_every_line(stop, stop.event) == []  # its thread hangs (a daemon)


def test_a_real_signal_ends_a_wait_within_a_slice() -> None:
    stop = _StopRequest()
    stop.install()  # this process's SIGTERM handler until restored
    try:
        sender = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
        start = time.monotonic()
        sender.start()
        assert stop.event.wait(10)
        assert time.monotonic() - start < 2 and stop.signum == signal.SIGTERM
        sender.join()
    finally:
        stop.restore()


@pytest.mark.parametrize("timeout", [0.0, 0.03])
def test_a_wait_without_a_stop_returns_false_after_its_timeout(timeout: float) -> None:
    flag = SignalFlag()
    start = time.monotonic()
    assert flag.wait(timeout) is False
    assert time.monotonic() - start >= timeout
    flag.set()
    assert flag.wait(None) and flag.wait(0)

"""The launcher's stop request: a SIGINT/SIGTERM handler sets it, and it must never hang.

A handler runs on the main thread between two bytecodes, also inside the wait it is to end.
`threading.Event.wait` holds the event's non-reentrant lock for a few bytecodes; a handler that
calls ``Event.set`` there takes it again and the launcher hangs for ever (an elastic agent was
found so, in its handler, under load). These tests run the handler at every line of the wait.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
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


def _both_cases() -> dict[str, list[bool]]:
    """The harness on the stop's own flag, then on a `threading.Event` (whose wait hangs)."""
    stop = _StopRequest()
    flag = _wait_with_the_handler_at_every_line(stop, stop.event)
    stop = _StopRequest()
    stop.event = threading.Event()  # type: ignore[assignment]
    return {"flag": flag, "threading_event": _wait_with_the_handler_at_every_line(stop, stop.event)}


def test_a_threading_event_hangs_there() -> None:
    """Why the stop is no `threading.Event`: the same handler, setting one, never returns. Run in
    a process of its own, since the hung thread holds the event's lock until its process ends;
    the same harness on the stop's own flag in that process returns, so the hang is the event's."""
    proc = subprocess.run([sys.executable, __file__, "both-cases"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"flag": [True], "threading_event": []}


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


_WORKER = r"""
import os, signal, sys, time
out = sys.argv[1]
def on_term(signum, frame):
    with open(os.path.join(out, "terms"), "a") as f:
        f.write(f"{signum}\n")
    time.sleep(0.5)  # a checkpoint saved on SIGTERM takes a while: a second one would run in it
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(out, "ready"), "w").close()
time.sleep(60)
"""

#: the launcher's own start and stop of one worker, in a process of its own (which also ends the
#: guard process the start shares)
_DRIVER = r"""
import json, os, signal, sys, time
from fleetlike.launch.workers import start_worker, stop_workers
out = sys.argv[1]
w = start_worker([sys.executable, os.path.join(out, "worker.py"), out], dict(os.environ), local_rank=0, rank=0,
                 log_path=os.path.join(out, "log"), echo=False)
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(out, "ready")) and time.monotonic() < deadline:
    time.sleep(0.02)
sent = []
kill, killpg = os.kill, os.killpg
os.kill = lambda pid, sig: (sent.append(sig) if pid == w.process.pid else None, kill(pid, sig))[1]
os.killpg = lambda pgid, sig: (sent.append(sig) if pgid == w.process.pid else None, killpg(pgid, sig))[1]
stop_workers([w], grace=20)
print(json.dumps(sent.count(int(signal.SIGTERM))))
"""


def test_a_stopped_worker_gets_one_sigterm(tmp_path) -> None:
    """The worker is in its own group and carries its tag: signalled once, by its group, its
    handler runs once (twice, the second run cut into the first or into the interpreter's exit).
    The sends are counted (deterministic); the handler's runs show what a second one does."""
    (tmp_path / "worker.py").write_text(_WORKER)
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(tmp_path)], capture_output=True, text=True,
                          timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "1"  # SIGTERMs sent to the worker's own process
    assert (tmp_path / "terms").read_text().split() == [str(int(signal.SIGTERM))]


@pytest.mark.parametrize("timeout", [0.0, 0.03])
def test_a_wait_without_a_stop_returns_false_after_its_timeout(timeout: float) -> None:
    flag = SignalFlag()
    start = time.monotonic()
    assert flag.wait(timeout) is False
    assert time.monotonic() - start >= timeout
    flag.set()
    assert flag.wait(None) and flag.wait(0)


if __name__ == "__main__" and sys.argv[1:] == ["both-cases"]:
    print(json.dumps(_both_cases()), flush=True)
    os._exit(0)  # the hung daemon thread holds a lock: leave without waiting on anything

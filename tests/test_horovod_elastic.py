"""A Horovod Elastic script run unchanged (`launch_workers/hvd_elastic_train.py`: hvd.init,
hvd.DistributedOptimizer, hvd.elastic.TorchState, a reset callback, @hvd.elastic.run) under
``python -m fleetlike.launch --nnodes 1:2 --nproc_per_node 2 --max_restarts 1``: one worker
SIGKILLed mid-training is started again, the survivor rolls back to the last commit, the
optimizer's communicators are rebuilt on the re-formed world, and both ranks end with exactly
the parameters of an uninterrupted run. The same script under the launcher without
``--nnodes`` (not an elastic job) runs once, as Horovod's run does outside elastic mode.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from helpers import side_by_side
from test_elastic_nodes import free_port, worker_logs
from test_launch_run import WORKERS, Launchers, assert_all_gone, finish

pytestmark = pytest.mark.timeout(240)

SCRIPT = str(WORKERS / "hvd_elastic_train.py")
EPOCHS, BATCHES = 2, 12


def _start(launchers: Launchers, out: Path, pause: float, *flags: str):  # type: ignore[no-untyped-def]
    return launchers.start(*flags, "--nproc_per_node=2", "--started_port=auto", f"--log_dir=log-{out.name}",
                           SCRIPT, str(out), str(EPOCHS), str(BATCHES), str(pause))


def _elastic(port: int) -> tuple[str, ...]:
    return ("--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{port}", "--node_ip=127.0.0.1", "--rdzv_last_call=1")


def _reports(out: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(p.read_text()) for p in sorted(out.glob("done.*.json"))]


def _steps(out: Path) -> int:
    try:
        return int((out / "progress").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _run(launchers: Launchers, out: Path, *flags: str) -> list[dict]:  # type: ignore[type-arg]
    """Run the script to its end without a kill; its reports."""
    out.mkdir()
    logs = launchers.cwd / f"log-{out.name}"
    code, _, stderr = finish(_start(launchers, out, 0.0, *flags), timeout=120, logs=logs)
    assert code == 0, stderr + worker_logs(logs)
    return _reports(out)


def _killed(launchers: Launchers, out: Path) -> tuple[list[int], list[dict]]:  # type: ignore[type-arg]
    """The elastic job with one worker SIGKILLed after step 5: (the first pids, the reports)."""
    out.mkdir()
    logs = launchers.cwd / f"log-{out.name}"
    proc = _start(launchers, out, 0.15, *_elastic(free_port()), "--max_restarts=1")
    deadline = time.monotonic() + 90
    while _steps(out) < 5:
        assert proc.poll() is None, (proc.communicate(), worker_logs(logs))
        assert time.monotonic() < deadline, "no progress" + worker_logs(logs)
        time.sleep(0.05)
    first = sorted(int(p.name.split(".")[1]) for p in out.glob("pid.*"))
    os.kill(first[-1], signal.SIGKILL)
    code, _, stderr = finish(proc, timeout=150, logs=logs)
    assert code == 0, stderr + worker_logs(logs)
    assert_all_gone(out)
    return first, _reports(out)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The module's three jobs at once (`helpers.side_by_side`: the killed job mostly waits, for
    its paced steps, the failure and the rejoin); each test checks its own."""
    root = tmp_path_factory.mktemp("hvd-elastic")
    runner = Launchers(root)
    try:
        with side_by_side({"reference": lambda: _run(runner, root / "ref", *_elastic(free_port())),
                           "killed": functools.partial(_killed, runner, root / "out"),
                           "plain": functools.partial(_run, runner, root / "plain")}) as futures:
            yield futures
    finally:
        runner.close()


def test_killed_worker_rolls_back_and_ends_with_the_uninterrupted_parameters(jobs: dict[str, Future]) -> None:
    want = jobs["reference"].result(timeout=200)
    assert len(want) == 2 and all(r["world"] == 2 and r["resets"] == [] for r in want)
    np.testing.assert_array_equal(want[0]["params"], want[1]["params"])
    first, got = jobs["killed"].result(timeout=200)
    assert len(got) == 2 and all(r["world"] == 2 for r in got)
    pids = {r["pid"] for r in got}
    assert first[0] in pids and first[-1] not in pids  # the survivor kept running; the killed one restarted
    assert any(r["resets"] for r in got), "no reset callback ran"
    for r in got:
        np.testing.assert_allclose(r["params"], want[0]["params"], rtol=0, atol=1e-6)


def test_the_same_script_outside_an_elastic_job(jobs: dict[str, Future]) -> None:
    got = jobs["plain"].result(timeout=200)
    assert len(got) == 2 and all(r["world"] == 2 and r["resets"] == [] for r in got)
    np.testing.assert_array_equal(got[0]["params"], got[1]["params"])

"""Elastic jobs with real launchers and workers on two loopback "nodes" (127.0.0.1, 127.0.0.2).

A node joins a running job through the rendezvous and is admitted at the next commit; a node is
then lost for good (its launcher SIGKILLed, its workers dying with it) and the job carries on
on the remaining node: the surviving processes are the ones that started (no restart), every
sample of every epoch is seen exactly once across the old and new worlds (the committed steps,
gathered from every rank), and the digits accuracy is within 1 point of an uninterrupted run.
Eager style and program style. Every launcher is stopped by the fixture, and no worker is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fleetlike.elastic.membership import ENV, EVENTS_KEY
from fleetlike.launch.elastic_agent import ELASTIC_ENV
from fleetlike.launch.nodewatch import EVENTS_KEY as LAUNCH_EVENTS_KEY
from test_launch_run import WORKERS, Launchers, assert_all_gone, finish, launchers  # noqa: F401

pytestmark = pytest.mark.timeout(150)

SCRIPT = str(WORKERS / "elastic_digits.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(launchers: Launchers, port: int, ip: str, out: Path, epochs: int, pause: float,
          style: str, *flags: str, until: str | None = None) -> subprocess.Popen[str]:
    """One node's launcher of the digits job (``until``: the event after which the steps stop
    pausing, `launch_workers/elastic_digits.py`)."""
    return launchers.start("--nnodes=1:2", *flags, f"--rdzv_endpoint=127.0.0.1:{port}", f"--node_ip={ip}",
                           "--nproc_per_node=2", "--started_port=auto", "--rdzv_last_call=1",
                           f"--log_dir=log-{ip}-{out.name}", SCRIPT, str(out), str(epochs), str(pause), style,
                           *([until] if until else []))


def progress(out: Path) -> tuple[int, int]:
    try:
        step, world, _ = (out / "progress").read_text().split()
    except (OSError, ValueError):
        return 0, 0
    return int(step), int(world)


def wait_until(what: str, check, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the job ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.1)


def reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("done.*.json"))]


def check_epochs(report: dict, n: int) -> None:
    for epoch, seen in enumerate(report["seen"]):
        assert sorted(seen) == list(range(n)), f"epoch {epoch}: samples missing or seen twice"


def lose_a_node(launchers: Launchers, tmp_path: Path, style: str, epochs: int, pause: float,
                join_late: bool) -> tuple[list[dict], str]:
    """Node A (and B at once, or once A trains); once the world has 4 ranks, B is lost."""
    out = tmp_path / f"out-{style}"
    out.mkdir()
    port = free_port()
    # the steps pause until B is lost (for B to join and train on 4 ranks), then run at full speed
    a = start(launchers, port, "127.0.0.1", out, epochs, pause, style, until="lost")
    if join_late:
        wait_until("node A's first steps", lambda: progress(out)[0] >= 5, a)
    b = start(launchers, port, "127.0.0.2", out, epochs, pause, style, until="lost")
    wait_until("the 4-rank world", lambda: progress(out)[1] == 4, a)
    step = progress(out)[0]
    wait_until("steps on 4 ranks", lambda: progress(out)[0] >= step + 3, a)
    os.killpg(b.pid, signal.SIGKILL)  # the launcher; its workers die with it (PR_SET_PDEATHSIG)
    code, _, stderr = finish(a, timeout=100)
    assert code == 0, stderr
    done = reports(out)
    started_on_a = {int(p.name.split(".")[1]) for p in out.glob("node.*") if p.read_text() == "127.0.0.1"}
    assert {r["pid"] for r in done} == started_on_a  # the survivors are the processes that started
    assert all(r["world"] == 2 for r in done)
    assert_all_gone(out)
    return done, stderr


def summary(stderr: str) -> str:
    """The launcher's last line, its summary (`fleetlike.launch.elastic_agent`)."""
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("fleetlike.launch: summary: ")]
    assert stderr.splitlines()[-1] == line
    return line


@pytest.mark.slow
def test_node_joins_at_a_commit_then_is_lost_eager(launchers: Launchers, tmp_path: Path) -> None:
    reference = tmp_path / "out-reference"
    reference.mkdir()
    proc = start(launchers, free_port(), "127.0.0.1", reference, 3, 0.0, "eager")
    code, _, stderr = finish(proc, timeout=60)
    assert code == 0, stderr
    (uninterrupted,) = {r["accuracy"] for r in reports(reference)}
    assert all(r["resets"] == [] for r in reports(reference))

    # a pause long enough that node B, started once A trains, joins well before the last epoch
    # (with one thread per worker the steps are quick: at 0.03 s A could finish first)
    done, stderr = lose_a_node(launchers, tmp_path, "eager", 3, 0.08, join_late=True)
    assert re.fullmatch(r"fleetlike\.launch: summary: job succeeded; worker failures: -; nodes lost: node "
                        r"127\.0\.0\.2 lost at commit \d+ \(its launcher stopped answering\); nodes "
                        r"joined: node 127\.0\.0\.2 joined at commit \d+", summary(stderr))
    for report in done:
        joined, lost = report["resets"]
        assert joined["cause"] == "workers waiting to join (admitted at a commit)"
        assert (joined["old_size"], joined["new_size"], joined["nodes_joined"]) == (2, 4, ["127.0.0.2"])
        assert lost["cause"].startswith("a collective failure (CollectiveFailedError")
        assert (lost["old_size"], lost["new_size"], lost["nodes_lost"]) == (4, 2, ["127.0.0.2"])
        check_epochs(report, 1400)
        print(f"accuracy {report['accuracy']:.4f} (uninterrupted {uninterrupted:.4f})")
        assert abs(report["accuracy"] - uninterrupted) <= 0.01, (report["accuracy"], uninterrupted)


@pytest.mark.slow
def test_node_lost_program_style(launchers: Launchers, tmp_path: Path) -> None:
    # (the pause lasts until B is lost: B's launcher starts, and the test kills it mid-epoch, in
    # time on a busy machine)
    done, stderr = lose_a_node(launchers, tmp_path, "program", 1, 0.1, join_late=False)
    commit = done[0]["resets"][-1]["commit"]  # the commit the world rolled back to
    assert summary(stderr) == (
        "fleetlike.launch: summary: job succeeded; worker failures: -; nodes lost: node 127.0.0.2 "
        f"lost at commit {commit} (its launcher stopped answering); nodes joined: -")
    for report in done:
        assert report["resets"][-1]["commit"] == commit
        assert report["resets"][-1]["nodes_lost"] == ["127.0.0.2"]
        assert report["resets"][-1]["new_size"] == 2
        check_epochs(report, 1400)


def test_launcher_and_workers_agree_on_names() -> None:
    assert ENV == ELASTIC_ENV
    assert EVENTS_KEY == LAUNCH_EVENTS_KEY


@pytest.mark.slow
def test_worker_killed_in_an_elastic_job_is_restarted_alone(launchers: Launchers, tmp_path: Path) -> None:
    """``--nnodes 1:2 --max_restarts 1``: one of two workers SIGKILLed mid-epoch is started again
    alone (its peer keeps running: the world of MIN=2 re-forms when it is back), the restart uses
    the budget, and the job finishes with every sample seen once; the summary says so."""
    out = tmp_path / "out-restart"
    out.mkdir()
    a = start(launchers, free_port(), "127.0.0.1", out, 1, 0.02, "eager", "--max_restarts=1")
    wait_until("steps on 2 ranks", lambda: progress(out) >= (12, 2), a)
    first = sorted(int(p.name.split(".")[1]) for p in out.glob("pid.*"))
    os.kill(first[-1], signal.SIGKILL)
    code, _, stderr = finish(a, timeout=100)
    assert code == 0, stderr
    done = reports(out)
    assert len(done) == 2 and all(r["world"] == 2 for r in done)
    pids = {r["pid"] for r in done}
    assert first[0] in pids and first[-1] not in pids  # the peer was not restarted; the killed one was
    for report in done:
        check_epochs(report, 1400)
    assert re.fullmatch(r"fleetlike\.launch: summary: job succeeded; worker failures: local rank [01] was "
                        r"killed by signal SIGKILL; restarted 1/1; nodes lost: -; nodes joined: -",
                        summary(stderr)), stderr
    assert "starting it again alone (restart 1 of --max_restarts=1" in stderr
    assert_all_gone(out)


@pytest.mark.slow
def test_node_lost_horovod_face(launchers: Launchers, tmp_path: Path) -> None:
    """hvd.init() in an elastic launch, hvd.elastic.TorchState / @hvd.elastic.run, hvd.size()
    and hvd.allgather_object on the re-formed world."""
    done, _ = lose_a_node(launchers, tmp_path, "horovod", 1, 0.1, join_late=False)
    for report in done:
        assert report["resets"][-1]["nodes_lost"] == ["127.0.0.2"]
        check_epochs(report, 1400)

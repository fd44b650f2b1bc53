"""The trust boundary, on real jobs: what a worker leaves behind, how many workers a flag can
start, and how a stopped node is reported.

A worker's child that calls ``setsid`` (and that child's own child) is gone when the job ends,
however it ends: the workers finish, one fails, the launcher is stopped by SIGTERM or killed
with SIGKILL. A ``--nproc_per_node`` far beyond the machine starts nothing. An elastic node
stopped with SIGSTOP is reported as having stopped answering, never by the code it ended with.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from fleetlike.config import envvars
from test_launch_run import WORKERS, Launchers, alive, clean_env, finish
from test_trust import free_port, launchers  # noqa: F401 - the fixture

# its jobs fill both cores by themselves (see conftest)
pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]


def _pids(out: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in out.iterdir()
            if p.name.startswith(("pid.", "child.", "grandchild.")) and not p.name.endswith(".tmp")}


@pytest.mark.parametrize("ending", ["ok", "fail", "sigterm", "sigkill"])
def test_a_setsid_child_of_a_worker_does_not_outlive_the_job(tmp_path: Path, launchers: Launchers,
                                                            ending: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    mode = {"ok": "ok", "fail": "fail"}.get(ending, "sleep")
    proc = launchers.start("--nproc_per_node=2", "--start_port=auto", str(WORKERS / "setsid_child.py"), str(out), mode)
    deadline = time.monotonic() + 60
    while len(_pids(out)) < 6 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    pids = _pids(out)
    assert len(pids) == 6, pids  # each child's os.setsid() succeeded: it leads a session of its own
    if ending == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif ending == "sigkill":
        proc.kill()
    code, _, stderr = finish(proc, timeout=30)
    assert code == {"ok": 0, "fail": 3, "sigterm": 128 + signal.SIGTERM, "sigkill": -signal.SIGKILL}[ending], stderr
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.05)
    left = {name: pid for name, pid in pids.items() if alive(pid)}
    for pid in left.values():
        os.kill(pid, signal.SIGKILL)
    assert left == {}


def test_a_worker_count_beyond_the_bound_starts_nothing(tmp_path: Path, launchers: Launchers) -> None:
    """``--nproc_per_node=1000`` on a small machine: one line naming the flag, the value, the bound
    and the way past it, exit code 2, no worker and no port. The variable moves the bound both ways."""
    out = tmp_path / "out"
    out.mkdir()
    script = [str(WORKERS / "behave.py"), str(out), "--ok"]
    cpus = len(os.sched_getaffinity(0))
    bound = max(8, 4 * cpus)
    proc = launchers.start("--nproc_per_node=1000", "--started_port=auto", *script)
    code, stdout, stderr = finish(proc, timeout=30)
    assert code == 2 and stdout == ""
    assert stderr == (
        f"fleetlike.launch: error: --nproc_per_node=1000 would start 1000 workers on this node; the bound "
        f"is {bound} (4 per usable CPU, {cpus} CPUs, at least 8); give at most {bound}, or set "
        "FLEETLIKE_MAX_NPROC_PER_NODE=1000 to start them anyway\n")
    assert list(out.iterdir()) == [] and not (tmp_path / "log").exists()

    env = clean_env(FLEETLIKE_JOB_SECRET=launchers.secret, FLEETLIKE_MAX_NPROC_PER_NODE="2")
    code, _, stderr = finish(launchers.start("--nproc_per_node=3", "--started_port=auto", *script, env=env), timeout=30)
    assert code == 2 and "the bound is 2 (FLEETLIKE_MAX_NPROC_PER_NODE=2)" in stderr
    assert list(out.iterdir()) == []
    code, _, stderr = finish(launchers.start("--nproc_per_node=2", "--started_port=auto", *script, env=env), timeout=60)
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["pid.0", "pid.1"]
    env[envvars.MAX_NPROC_PER_NODE] = "２"
    code, _, stderr = finish(launchers.start("--nproc_per_node=2", *script, env=env), timeout=30)
    assert code == 2 and "FLEETLIKE_MAX_NPROC_PER_NODE='２' is not a positive integer in ASCII digits" in stderr


@pytest.mark.slow  # two elastic launchers and a heartbeat timeout: half a minute
@pytest.mark.timeout(300)
def test_a_node_lost_to_sigstop_is_summarised_as_stopped_never_by_its_later_exit(tmp_path: Path,
                                                                              launchers: Launchers) -> None:
    """Node B (its launcher and workers) is stopped with SIGSTOP in a 4-rank elastic world; A's
    workers go on without it; B is continued while A still trains. A's summary says B was lost
    because its launcher stopped answering, and for how long, never the code B ended with later."""
    from test_elastic_nodes import progress, start, summary, wait_until, worker_logs

    out = tmp_path / "out-stop"
    out.mkdir()
    port = free_port()
    a = start(launchers, port, "127.0.0.1", out, 3, 0.05, "eager")
    b = start(launchers, port, "127.0.0.2", out, 3, 0.05, "eager")
    wait_until("the 4-rank world", lambda: progress(out)[1] == 4, a)
    on_b = [int(p.name.split(".")[1]) for p in out.glob("node.*") if p.read_text() == "127.0.0.2"]
    assert len(on_b) == 2
    stopped = [b.pid, *on_b]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_until("the world without B", lambda: progress(out)[1] == 2, a)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    logs = tmp_path / f"log-127.0.0.1-{out.name}"
    code, _, stderr = finish(a, timeout=150, logs=logs)
    assert code == 0, stderr + worker_logs(logs)
    line = summary(stderr)
    assert re.search(r"nodes lost: node 127\.0\.0\.2 lost at commit \d+ \(its launcher stopped answering for "
                     r"\d+ s: stopped \(SIGSTOP\), paused or cut off, then answered again\)", line), line
    assert "code 0" not in line

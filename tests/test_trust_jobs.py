"""The trust boundary, on real jobs: what a worker leaves behind, how many workers a flag can
start, and how a stopped node is reported.

A worker's child that calls ``setsid`` (and that child's own child) is gone when the job ends,
however it ends: the workers finish, one fails, the launcher is stopped by SIGTERM or killed
with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from test_launch_run import WORKERS, Launchers, alive, finish
from test_trust import launchers  # noqa: F401 - the fixture

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

"""An elastic job whose node loses its *link* (its processes keep running): two nodes in network
namespaces (`bench.netns`: 10.77.0.1 and 10.77.0.2 joined by a veth pair), ``--nnodes 1:2`` with
2 workers each; once the 4-rank world trains, node B's end of the veth is set down. Node A's
workers see B's heartbeats stop, re-form a world of 2 and finish the epoch with every sample
seen exactly once (the same checks as test_elastic_nodes' lost node); A's launcher reports B
lost because its launcher stopped answering, while B's launcher process is still alive.

Needs root and ``ip`` (skipped with the reason otherwise). The fixture stops every launcher
(their workers die with them) and deletes the namespaces, also when the test fails.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetlike.launch.preload import PRELOAD_ENV, SOCKET_ENV
from test_elastic_nodes import SCRIPT, check_epochs, progress, reports, summary, wait_until
from test_launch_run import PY, ROOT, Launchers, alive, clean_env, finish, launchers, recorded_pids  # noqa: F401

A, B = "10.77.0.1", "10.77.0.2"
PORT = 29411  # inside node A's own fresh namespace: nothing else listens there


@pytest.fixture()
def two(tmp_path: Path) -> Iterator[object]:
    from bench import netns

    why = netns.unavailable()
    if why:
        pytest.skip(why)
    with netns.TwoNodes(rate="", prefix=f"ec{os.getpid() % 10000}") as nodes:
        try:
            yield nodes
        finally:  # after the launchers fixture's own stop; then nothing recorded may live on
            for pid in recorded_pids(tmp_path / "out-netns"):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_link_cut_node_is_lost_and_the_job_goes_on(two, launchers: Launchers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out-netns"
    out.mkdir()

    def launch(node: int, ip: str) -> subprocess.Popen[str]:
        argv = ["ip", "netns", "exec", two.ns[node], PY, "-m", "fleetlike.launch", "--nnodes=1:2",
                f"--rdzv_endpoint={A}:{PORT}", f"--node_ip={ip}", "--nproc_per_node=2",
                "--started_port=auto", "--rdzv_last_call=1", "--kill_grace=1", f"--log_dir=log-{ip}",
                SCRIPT, str(out), "1", "0.1", "program", "lost"]
        # the session's preload server lives outside the namespaces: each launcher starts its own
        env = {k: v for k, v in clean_env(PYTHONPATH=str(ROOT)).items() if k != SOCKET_ENV}
        env[PRELOAD_ENV] = "torch"
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        launchers.procs.append(proc)  # stopped by the fixture whatever happens
        return proc

    a = launch(0, A)
    b = launch(1, B)
    wait_until("the 4-rank world", lambda: progress(out)[1] == 4, a)
    step = progress(out)[0]
    wait_until("steps on 4 ranks", lambda: progress(out)[0] >= step + 3, a)
    subprocess.run(["ip", "-n", two.ns[1], "link", "set", two.dev[1], "down"], check=True, timeout=10)
    code, _, stderr = finish(a, timeout=100)
    assert code == 0, stderr
    assert b.poll() is None  # node B was cut off, not stopped: its launcher still runs
    done = reports(out)
    on_a = {int(p.name.split(".")[1]) for p in out.glob("node.*") if p.read_text() == A}
    assert {r["pid"] for r in done} == on_a  # A's processes carried on; none of B's finished
    commit = done[0]["resets"][-1]["commit"]
    for report in done:
        assert report["world"] == 2
        lost = report["resets"][-1]  # (B may have joined at a commit: the first round can close without it)
        assert (lost["old_size"], lost["new_size"], lost["nodes_lost"], lost["commit"]) == (4, 2, [B], commit)
        check_epochs(report, 1400)
    assert re.fullmatch(
        rf"fleetlike\.launch: summary: job succeeded; worker failures: -; nodes lost: node {B} lost at "
        rf"commit {commit} \(its launcher stopped answering\); nodes joined: (-|node {B} joined at commit \d+)",
        summary(stderr)), stderr
    on_a_pids = [pid for pid in recorded_pids(out) if pid in on_a]
    assert not any(alive(pid) for pid in on_a_pids)

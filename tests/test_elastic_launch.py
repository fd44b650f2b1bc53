"""``--max_restarts``: real launcher, real workers; a killed worker's job restarts and resumes
from `fleetlike.elastic`'s on-disk commit to exactly the parameters of an uninterrupted run;
restarts that run out, and a failure at step 0 at every start, end the job with the named cause.

The jobs run at once (one module fixture); every launcher is stopped by it, and each job checks
that no worker of its own is left.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from fleetlike.elastic import PROGRESS_DIR_VAR
from fleetlike.launch import main as launch_main
from fleetlike.launch.elastic_agent import PROGRESS_DIR_VAR as AGENT_PROGRESS_DIR_VAR
from helpers import side_by_side
from test_launch_run import WORKERS, Launchers, assert_all_gone, finish

pytestmark = pytest.mark.timeout(120)


def _run(launchers: Launchers, out: Path, mode: str, *flags: str) -> tuple[int, str]:
    out.mkdir()
    proc = launchers.start("--nproc_per_node=2", "--started_port=auto", f"--log_dir=log-{out.name}", *flags,
                           str(WORKERS / "elastic_resume.py"), str(out), mode)
    code, _, stderr = finish(proc, timeout=100, logs=launchers.cwd / f"log-{out.name}")
    assert_all_gone(out, within=2)
    return code, stderr


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Future]]]:
    """This module's four jobs at once (`helpers.side_by_side`: most of their time is process
    starts, a rendezvous and a stopped worker's grace); each test checks its own. (root, futures)"""
    root = tmp_path_factory.mktemp("elastic-launch")
    runner = Launchers(root)
    try:
        with side_by_side({mode: functools.partial(_run, runner, root / f"out-{mode}", mode, *flags)
                           for mode, flags in (("none", ["--max_restarts=1"]), ("kill", ["--max_restarts=1"]),
                                               ("killall", ["--max_restarts=1"]),
                                               ("raise", ["--max_restarts=5"]))}) as futures:
            yield root, futures
    finally:
        runner.close()


@pytest.mark.slow
def test_killed_worker_restarts_and_resumes_exactly(jobs: tuple[Path, dict[str, Future]]) -> None:
    root, futures = jobs
    code, stderr = futures["none"].result(timeout=110)
    assert code == 0, stderr
    code, stderr = futures["kill"].result(timeout=110)
    assert code == 0, stderr
    out, reference = root / "out-kill", root / "out-none"
    lines = [ln for ln in stderr.splitlines() if ln.startswith("fleetlike.launch:")]
    assert lines[0].startswith("fleetlike.launch: rank 1 (local 1) was killed by signal SIGKILL")
    assert lines[1].startswith("fleetlike.launch: worker failure at start 1 (rank 1 was killed by "
                               "signal SIGKILL); restarting all 2 workers as generation 1 (restart 1 "
                               "of --max_restarts=1")
    assert lines[2] == ("fleetlike.launch: job succeeded at start 2 after 1 worker failure(s) "
                        "(start 1: rank 1 was killed by signal SIGKILL)")
    assert lines[3] == ("fleetlike.launch: summary: job succeeded; worker failures: rank 1 was killed "
                        "by signal SIGKILL at start 1; restarted 1/1")  # no nodes: not an elastic job
    starts = (out / "starts.0").read_text().splitlines()
    assert starts == ["gen 0 resumed False at step 0", "gen 1 resumed True at step 8"]
    assert (root / "log-out-kill" / "restart1" / "workerlog.1").exists()
    mine, theirs = torch.load(out / "final.pt"), torch.load(reference / "final.pt")
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.slow
def test_restarts_run_out_and_step_zero_failures_are_not_retried(jobs: tuple[Path, dict[str, Future]]) -> None:
    root, futures = jobs
    code, stderr = futures["killall"].result(timeout=110)
    assert code == 128 + signal.SIGKILL
    assert stderr.splitlines()[-2:] == [
        "fleetlike.launch: --max_restarts=1 exhausted: 2 worker failures (start 1: rank 1 was "
        "killed by signal SIGKILL; start 2: rank 1 was killed by signal SIGKILL); the job is stopped",
        "fleetlike.launch: summary: job ended with code 137; worker failures: rank 1 was killed by "
        "signal SIGKILL at start 1, rank 1 was killed by signal SIGKILL at start 2; restarted 1/1"]
    code, stderr = futures["raise"].result(timeout=110)
    assert code == 1
    assert stderr.splitlines()[-2] == (
        "fleetlike.launch: not retryable: starts 1 and 2 both failed before any worker reported "
        "progress (no State.commit() / mark_progress()), rank 0 the same way (exited with code 1; "
        "last line: RuntimeError: bad configuration found at step 0); stopping after 2 worker "
        "failure(s) (start 1: rank 0 exited with code 1; start 2: rank 0 exited with code 1)")
    assert stderr.splitlines()[-1] == (
        "fleetlike.launch: summary: job ended with code 1; worker failures: rank 0 exited with code 1 "
        "at start 1, rank 0 exited with code 1 at start 2; restarted 1/5")
    assert len((root / "out-raise" / "starts.0").read_text().splitlines()) == 2  # two starts, not six


def test_flags_and_names_agree() -> None:
    assert PROGRESS_DIR_VAR == AGENT_PROGRESS_DIR_VAR
    assert launch_main(["--max_restarts=-1", "x.py"]) == 2
    assert launch_main(["--max_restarts=1", "--cluster_node_ips=127.0.0.1,127.0.0.2", "x.py"]) == 2


@pytest.mark.slow
def test_node_watch_tells_why_a_node_left() -> None:
    """Three launchers' watches on one real store: one ends with code 7, one stops answering
    (its heartbeat stops, no goodbye), and the workers' records name both lost and one joiner."""
    import json
    import time

    from fleetlike.comm import host_store
    from fleetlike.launch.nodewatch import EVENTS_KEY, NodeWatch

    store = host_store("127.0.0.1", "watch-test")
    endpoint = f"127.0.0.1:{store.port}"
    here = NodeWatch(endpoint, "127.0.0.1", store=store)
    silent, ended = NodeWatch(endpoint, "127.0.0.2"), NodeWatch(endpoint, "127.0.0.3")
    for watch in (here, silent, ended):
        watch.start()
    time.sleep(2.5)
    ended.finish(7)
    silent._stopping.set()  # its heartbeat stops without a "done": as if its link were cut
    for record in ({"nodes_lost": ["127.0.0.2", "127.0.0.3"], "nodes_joined": [], "commit": 4},
                   {"nodes_lost": [], "nodes_joined": ["127.0.0.4"], "commit": 9}):
        store.set(f"{EVENTS_KEY}/{store.add(EVENTS_KEY, 1)}", json.dumps(record))
    here.finish(0)
    assert here.summary() == (
        "nodes lost: node 127.0.0.2 lost at commit 4 (its launcher stopped answering), node 127.0.0.3 "
        "lost at commit 4 (its launcher ended with code 7); nodes joined: node 127.0.0.4 joined at commit 9")

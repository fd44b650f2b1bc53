"""Elastic jobs with real launchers and workers on two loopback "nodes" (127.0.0.1, 127.0.0.2).

A node joins a running job through the rendezvous and is admitted at the next commit; a node is
then lost for good (its launcher SIGKILLed, its workers dying with it) and the job carries on
on the remaining node: the surviving processes are the ones that started (no restart), every
sample of every epoch is seen exactly once across the old and new worlds (the committed steps,
gathered from every rank), and the digits accuracy is within 1 point of an uninterrupted run.
Eager style, program style and the Horovod face; a worker killed in an elastic job, restarted
alone; a node found by ``--host_discovery_script`` mid-job, started and admitted at a commit; a
node that loses its *link* (two network namespaces) is lost while its launcher still runs.

The jobs mostly wait (steps that pause until an event, heartbeats, a rendezvous's last call), so
they run at once (`jobs`); each test checks its own job. Every launcher is stopped by the
fixture, and no worker is left.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from fleetlike.elastic.membership import ENV, EVENTS_KEY
from fleetlike.launch.elastic_agent import ELASTIC_ENV
from fleetlike.launch.nodewatch import EVENTS_KEY as LAUNCH_EVENTS_KEY
from amp_common import DIGITS_FILE_ENV, save_digits
from helpers import side_by_side
from fleetlike.launch.preload import PRELOAD_ENV, SOCKET_ENV
from test_launch_run import PY, ROOT, WORKERS, Launchers, alive, assert_all_gone, clean_env, finish, recorded_pids

pytestmark = [pytest.mark.timeout(300), pytest.mark.alone]

SCRIPT = str(WORKERS / "elastic_digits.py")
LOCAL_SHELL = "env NODE_UNDER_TEST={host} sh -c"  # "runs on {host}": here, as --node_ip says
#: node A and B of the link-cut job (`bench.netns`), and the rendezvous port inside A's fresh
#: namespace (nothing else listens there)
NETNS_A, NETNS_B, NETNS_PORT = "10.77.0.1", "10.77.0.2", 29411
#: these jobs run several at a time on the machine's cores: a worker left unscheduled for the
#: default 3 s would be taken for lost and its world re-formed once more than a test expects
#: (the default's detection: test_elastic_heartbeat; a cut link found after this: the netns job)
TOLERANT = "--heartbeat_timeout=10"
#: the last call of a job whose node joins at a commit. A worker waiting to join looks at the
#: rendezvous once a second (torch's dynamic rendezvous polls so), and the re-formed round closes
#: a last call after its minimum is there: with 1 s, a waiting worker left unscheduled for a
#: moment misses the round and joins at the next commit, one re-formation more than these tests
#: expect (node B's workers then join one at a time). 3 s, the launcher's default, leaves each
#: waiting worker two more looks.
JOIN_LAST_CALL = 3.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(launchers: Launchers, port: int, ip: str, out: Path, epochs: int, pause: float,
          style: str, *flags: str, until: str | None = None, last_call: float = 1.0) -> subprocess.Popen[str]:
    """One node's launcher of the digits job (``until``: the event after which the steps stop
    pausing, `launch_workers/elastic_digits.py`)."""
    return launchers.start("--nnodes=1:2", TOLERANT, *flags, f"--rdzv_endpoint=127.0.0.1:{port}", f"--node_ip={ip}",
                           "--nproc_per_node=2", "--started_port=auto", f"--rdzv_last_call={last_call:g}",
                           f"--log_dir=log-{ip}-{out.name}", SCRIPT, str(out), str(epochs), str(pause), style,
                           *([until] if until else []))


def progress(out: Path) -> tuple[int, int]:
    try:
        step, world, _ = (out / "progress").read_text().split()
    except (OSError, ValueError):
        return 0, 0
    return int(step), int(world)


def wait_until(what: str, check, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Wait for ``check()`` while ``proc`` runs. The bound only catches a job that will never get
    there: three of these jobs run at once, so on a loaded machine a world forms in a minute."""
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the job ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout}s"
        time.sleep(0.1)


def worker_logs(logs: Path, lines: int = 30) -> str:
    """The last lines of every worker log under ``logs`` (for a failed job's message: the
    launcher's own output names the failure, the log says what the worker printed)."""
    return "".join(f"\n--- {path} (last lines) ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                   for path in sorted(logs.rglob("workerlog.*")) if path.is_file())


def reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("done.*.json"))]


def check_epochs(report: dict, n: int) -> None:
    for epoch, seen in enumerate(report["seen"]):
        assert sorted(seen) == list(range(n)), f"epoch {epoch}: samples missing or seen twice"


def lose_a_node(launchers: Launchers, tmp_path: Path, style: str, epochs: int, pause: float,
                join_late: bool) -> tuple[list[dict], str]:
    """Node A (and B at once, or once A trains: B's workers then join at a commit, all at once,
    `JOIN_LAST_CALL`); once the world has 4 ranks, B is lost."""
    out = tmp_path / f"out-{style}"
    out.mkdir()
    port = free_port()
    last_call = JOIN_LAST_CALL if join_late else 1.0
    # the steps pause until B is lost (for B to join and train on 4 ranks), then run at full speed
    a = start(launchers, port, "127.0.0.1", out, epochs, pause, style, until="lost", last_call=last_call)
    if join_late:
        wait_until("node A's first steps", lambda: progress(out)[0] >= 5, a)
    b = start(launchers, port, "127.0.0.2", out, epochs, pause, style, until="lost", last_call=last_call)
    wait_until("the 4-rank world", lambda: progress(out)[1] == 4, a)
    step = progress(out)[0]
    wait_until("steps on 4 ranks", lambda: progress(out)[0] >= step + 3, a)
    os.killpg(b.pid, signal.SIGKILL)  # the launcher; its workers die with it (PR_SET_PDEATHSIG)
    logs = tmp_path / f"log-127.0.0.1-{out.name}"
    code, _, stderr = finish(a, timeout=100, logs=logs)
    assert code == 0, stderr + worker_logs(logs)
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


def reference_job(launchers: Launchers, root: Path) -> tuple[list[dict], str]:
    """The eager job of `joined_then_lost_job` uninterrupted: one node, 3 epochs, no pause."""
    reference = root / "out-reference"
    reference.mkdir()
    proc = start(launchers, free_port(), "127.0.0.1", reference, 3, 0.0, "eager")
    logs = root / f"log-127.0.0.1-{reference.name}"
    code, _, stderr = finish(proc, timeout=100, logs=logs)
    assert code == 0, stderr + worker_logs(logs)
    return reports(reference), stderr


def joined_then_lost_job(launchers: Launchers, root: Path) -> tuple[list[dict], str]:
    # a pause long enough that node B, started once A trains, joins well before the last epoch
    # (with one thread per worker the steps are quick: at 0.03 s A could finish first)
    return lose_a_node(launchers, root, "eager", 3, 0.08, join_late=True)


def restart_job(launchers: Launchers, root: Path) -> tuple[list[int], list[dict], str]:
    """``--max_restarts 1``: one of two workers SIGKILLed mid-epoch; (the first workers' pids,
    the reports, the launcher's stderr)."""
    out = root / "out-restart"
    out.mkdir()
    a = start(launchers, free_port(), "127.0.0.1", out, 1, 0.02, "eager", "--max_restarts=1")
    wait_until("steps on 2 ranks", lambda: progress(out) >= (12, 2), a)
    first = sorted(int(p.name.split(".")[1]) for p in out.glob("pid.*"))
    os.kill(first[-1], signal.SIGKILL)
    logs = root / f"log-127.0.0.1-{out.name}"
    code, _, stderr = finish(a, timeout=100, logs=logs)
    assert code == 0, stderr + worker_logs(logs)
    return first, reports(out), stderr


def discovery_script(tmp_path: Path, hosts: Path, body: str | None = None) -> Path:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + (body if body is not None else f"cat {hosts}\n"))
    script.chmod(0o755)
    return script


def discovered_job(launchers: Launchers, root: Path) -> tuple[str, list[dict], dict[int, str]]:
    """Node A with ``--host_discovery_script`` (a script that cats a file); once A trains, the
    test adds ``127.0.0.2:2`` to the file and A's launcher starts that node's launcher through a
    ``--remote_shell`` template that runs the command here. (A's stderr, the reports, the node
    of each pid)"""
    out = root / "out-discovered"
    out.mkdir()
    hosts = root / "hosts"
    hosts.write_text("127.0.0.1:2\n")  # this node: already running
    script = discovery_script(root, hosts)
    logs = root / "log-discovered"
    a = launchers.start("--nnodes=1:2", TOLERANT, f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--node_ip=127.0.0.1",
                        "--nproc_per_node=2", "--started_port=auto", f"--rdzv_last_call={JOIN_LAST_CALL:g}",
                        f"--host_discovery_script={script}", "--discovery_interval=0.5",
                        f"--remote_shell={LOCAL_SHELL}", f"--log_dir={logs}", SCRIPT, str(out), "2", "0.25", "eager",
                        "joined")
    # 2 epochs, 0.25 s a step until the world is full (44 s at least): the new node's launcher and
    # workers start well before A would end, also beside this module's other jobs
    wait_until("node A's first steps", lambda: progress(out)[0] >= 5, a)
    assert progress(out)[1] == 2
    hosts.write_text("127.0.0.1:2\n127.0.0.2:2\n")
    wait_until("the 4-rank world", lambda: progress(out)[1] == 4, a)
    code, _, stderr = finish(a, timeout=60, logs=logs)
    assert code == 0, stderr + worker_logs(logs)
    assert (logs / "node-127.0.0.2" / "workerlog.0").is_file()
    nodes = {int(p.name.split(".")[1]): p.read_text() for p in out.glob("node.*")}
    done = reports(out)
    assert_all_gone(out)
    return stderr, done, nodes


def link_cut_job(root: Path) -> dict:
    """Two nodes in network namespaces (`bench.netns`: 10.77.0.1 and 10.77.0.2 joined by a veth
    pair), ``--nnodes 1:2`` with 2 workers each; once the 4-rank world trains, node B's end of
    the veth is set down. Every launcher is stopped and the namespaces deleted when it ends,
    also on failure. {"skip": why} where namespaces cannot be made."""
    from bench import netns

    why = netns.unavailable()
    if why:
        return {"skip": why}
    out = root / "out-netns"
    out.mkdir()
    runner = Launchers(root)
    with netns.TwoNodes(rate="", prefix=f"ec{os.getpid() % 10000}") as two:
        def launch(node: int, ip: str) -> subprocess.Popen[str]:
            argv = ["ip", "netns", "exec", two.ns[node], PY, "-m", "fleetlike.launch", "--nnodes=1:2", TOLERANT,
                    f"--rdzv_endpoint={NETNS_A}:{NETNS_PORT}", f"--node_ip={ip}", "--nproc_per_node=2",
                    "--started_port=auto", "--rdzv_last_call=1", "--kill_grace=1", f"--log_dir=log-netns-{ip}",
                    SCRIPT, str(out), "1", "0.1", "program", "lost"]
            # the session's preload server lives outside the namespaces: each launcher starts its own
            env = {k: v for k, v in clean_env(PYTHONPATH=str(ROOT)).items() if k != SOCKET_ENV}
            env[PRELOAD_ENV] = "torch"
            proc = subprocess.Popen(argv, cwd=root, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            runner.procs.append(proc)  # stopped below whatever happens
            return proc

        try:
            a = launch(0, NETNS_A)
            b = launch(1, NETNS_B)
            wait_until("the 4-rank world", lambda: progress(out)[1] == 4, a)
            step = progress(out)[0]
            wait_until("steps on 4 ranks", lambda: progress(out)[0] >= step + 3, a)
            subprocess.run(["ip", "-n", two.ns[1], "link", "set", two.dev[1], "down"], check=True, timeout=10)
            logs = root / f"log-netns-{NETNS_A}"
            code, _, stderr = finish(a, timeout=100, logs=logs)
            assert code == 0, stderr + worker_logs(logs)
            b_runs = b.poll() is None
            done = reports(out)
            on_a = {int(p.name.split(".")[1]) for p in out.glob("node.*") if p.read_text() == NETNS_A}
            left_on_a = [pid for pid in recorded_pids(out) if pid in on_a and alive(pid)]
            return {"stderr": stderr, "b_runs": b_runs, "done": done, "on_a": on_a, "left_on_a": left_on_a}
        finally:  # the launchers first (their workers die with them); then nothing recorded may live on
            runner.close()
            for pid in recorded_pids(out):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """This module's jobs (`helpers.side_by_side`): most of their time is spent waiting (steps
    that pause until a node is lost, heartbeats, a rendezvous's last call), so they run at once,
    in two waves; each test checks its own job. The eager job's uninterrupted reference runs
    beside it (its accuracy does not depend on timing: `launch_workers/elastic_digits.py`)."""
    root = tmp_path_factory.mktemp("elastic-nodes")
    runner = Launchers(root)
    with pytest.MonkeyPatch.context() as env:  # the workers read the digits without scikit-learn
        env.setenv(DIGITS_FILE_ENV, str(save_digits(root / "digits.npz")))
        yield from _jobs(runner, root)


def _jobs(runner: Launchers, root: Path) -> Iterator[dict[str, Future]]:
    """`jobs` in two waves; every launcher stopped and no worker left after them."""
    try:
        with side_by_side({"reference": functools.partial(reference_job, runner, root),
                           "eager": functools.partial(joined_then_lost_job, runner, root),
                           "program": functools.partial(lose_a_node, runner, root, "program", 1, 0.1, False),
                           "discovered": functools.partial(discovered_job, runner, root)},
                          {"horovod": functools.partial(lose_a_node, runner, root, "horovod", 1, 0.1, False),
                           "restart": functools.partial(restart_job, runner, root),
                           "netns": functools.partial(link_cut_job, root)}) as futures:
            yield futures
    finally:
        runner.close()
    for out in root.glob("out-*"):
        assert_all_gone(out)


@pytest.mark.slow
def test_node_joins_at_a_commit_then_is_lost_eager(jobs: dict[str, Future]) -> None:
    reference, _ = jobs["reference"].result(timeout=200)
    (uninterrupted,) = {r["accuracy"] for r in reference}
    assert all(r["resets"] == [] for r in reference)

    done, stderr = jobs["eager"].result(timeout=200)
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
def test_node_lost_program_style(jobs: dict[str, Future]) -> None:
    # (the pause lasts until B is lost: B's launcher starts, and the test kills it mid-epoch, in
    # time on a busy machine.) A and B start together, but the first round closes one second after its minimum (node A):
    # when B's launcher is slower than that, B joins at a commit instead, which the summary says
    done, stderr = jobs["program"].result(timeout=200)
    commit = done[0]["resets"][-1]["commit"]  # the commit the world rolled back to
    assert re.fullmatch(
        r"fleetlike\.launch: summary: job succeeded; worker failures: -; nodes lost: node 127\.0\.0\.2 "
        rf"lost at commit {commit} \(its launcher stopped answering\); nodes joined: "
        r"(-|node 127\.0\.0\.2 joined at commit \d+)", summary(stderr)), stderr
    for report in done:
        *joined, lost = report["resets"]
        assert [r["nodes_joined"] for r in joined] in ([], [["127.0.0.2"]])
        assert report["resets"][-1]["commit"] == commit
        assert report["resets"][-1]["nodes_lost"] == ["127.0.0.2"]
        assert report["resets"][-1]["new_size"] == 2
        check_epochs(report, 1400)


def test_launcher_and_workers_agree_on_names() -> None:
    assert ENV == ELASTIC_ENV
    assert EVENTS_KEY == LAUNCH_EVENTS_KEY


@pytest.mark.slow
def test_worker_killed_in_an_elastic_job_is_restarted_alone(jobs: dict[str, Future]) -> None:
    """``--nnodes 1:2 --max_restarts 1``: one of two workers SIGKILLed mid-epoch is started again
    alone (its peer keeps running: the world of MIN=2 re-forms when it is back), the restart uses
    the budget, and the job finishes with every sample seen once; the summary says so."""
    first, done, stderr = jobs["restart"].result(timeout=300)
    assert len(done) == 2 and all(r["world"] == 2 for r in done)
    pids = {r["pid"] for r in done}
    assert first[0] in pids and first[-1] not in pids  # the peer was not restarted; the killed one was
    for report in done:
        check_epochs(report, 1400)
    assert re.fullmatch(r"fleetlike\.launch: summary: job succeeded; worker failures: local rank [01] was "
                        r"killed by signal SIGKILL; restarted 1/1; nodes lost: -; nodes joined: -",
                        summary(stderr)), stderr
    assert "starting it again alone (restart 1 of --max_restarts=1" in stderr


@pytest.mark.slow
def test_node_lost_horovod_face(jobs: dict[str, Future]) -> None:
    """hvd.init() in an elastic launch, hvd.elastic.TorchState / @hvd.elastic.run, hvd.size()
    and hvd.allgather_object on the re-formed world."""
    done, _ = jobs["horovod"].result(timeout=300)
    for report in done:
        assert report["resets"][-1]["nodes_lost"] == ["127.0.0.2"]
        check_epochs(report, 1400)


@pytest.mark.slow
def test_discovered_node_joins_at_a_commit(jobs: dict[str, Future]) -> None:
    """``--host_discovery_script``: the world grows 2 -> 4 at a commit, every sample of the
    epoch is seen exactly once, and all four ranks end with the same model."""
    stderr, done, nodes = jobs["discovered"].result(timeout=200)
    assert "host discovery: started the launcher of 127.0.0.2" in stderr
    assert sorted(nodes[r["pid"]] for r in done) == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2
    assert sorted(r["rank"] for r in done) == [0, 1, 2, 3] and all(r["world"] == 4 for r in done)
    assert [r["heartbeat_timeout"] for r in done] == [10.0] * 4  # the discovered node's launcher passed it on
    for report in done:
        for seen in report["seen"]:
            assert sorted(seen) == list(range(1400)), "samples missing or seen twice"
        if nodes[report["pid"]] == "127.0.0.1":
            (joined,) = report["resets"]
            assert joined["cause"] == "workers waiting to join (admitted at a commit)"
            assert (joined["old_size"], joined["new_size"], joined["nodes_joined"]) == (2, 4, ["127.0.0.2"])
    assert len({(r["accuracy"], r["steps"]) for r in done}) == 1  # one model, one step count


@pytest.mark.slow
def test_link_cut_node_is_lost_and_the_job_goes_on(jobs: dict[str, Future]) -> None:
    """Node A's workers see B's heartbeats stop, re-form a world of 2 and finish the epoch with
    every sample seen exactly once (the checks of the lost node above); A's launcher reports B
    lost because its launcher stopped answering, while B's launcher process is still alive.
    Needs root and ``ip`` (skipped with the reason otherwise)."""
    got = jobs["netns"].result(timeout=300)
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got["b_runs"]  # node B was cut off, not stopped: its launcher still runs
    done = got["done"]
    assert {r["pid"] for r in done} == got["on_a"]  # A's processes carried on; none of B's finished
    commit = done[0]["resets"][-1]["commit"]
    for report in done:
        assert report["world"] == 2 and report["heartbeat_timeout"] == 10.0  # B found silent after 10 s
        lost = report["resets"][-1]  # (B may have joined at a commit: the first round can close without it)
        assert (lost["old_size"], lost["new_size"], lost["nodes_lost"], lost["commit"]) == (4, 2, [NETNS_B], commit)
        check_epochs(report, 1400)
    assert re.fullmatch(
        rf"fleetlike\.launch: summary: job succeeded; worker failures: -; nodes lost: node {NETNS_B} lost at "
        rf"commit {commit} \(its launcher stopped answering\); nodes joined: (-|node {NETNS_B} joined at commit \d+)",
        summary(got["stderr"])), got["stderr"]
    assert got["left_on_a"] == []

"""The trust boundary against what a local user or a network observer can do to a running job.

Each test runs a real job (launchers, workers) and attacks it with what a stranger can learn
without the job's secret: the launchers' command lines (``/proc/PID/cmdline``), the bytes that
cross the loopback, the worker logs, and the public keys of the store. Every attempt is refused
or harmless, no payload runs (its marker file never appears), and the job ends as it would
have without the stranger, or within seconds with an error naming the interference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from test_launch_run import PY, WORKERS, Launchers, clean_env, finish

pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]


@pytest.fixture()
def launchers(tmp_path: Path):
    runner = Launchers(tmp_path)
    yield runner
    runner.close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def intruder(mode: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    report, marker = tmp_path / f"intruder-{mode}.json", tmp_path / "payload-ran"
    done = subprocess.run([PY, str(WORKERS / "intruder.py"), mode, str(report), str(marker), *args],
                          cwd=tmp_path, env=env or clean_env(FLEETLIKE_SECRET_DIR=str(tmp_path / "intruder-home")),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(report.read_text())


def wait_for(check, what: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"the launcher ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s"
        time.sleep(0.05)


def _store_up(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_an_elastic_job_without_an_exported_secret_cannot_be_entered_from_its_flags(
        tmp_path: Path, launchers: Launchers) -> None:
    """docs/elastic.md's example with no FLEETLIKE_JOB_SECRET: a process that read the
    launcher's flags from /proc cannot compute the job's secret (it is random, shared through a
    0600 file of the user's private directory), so it is refused; a second launcher of the same
    user on 127.0.0.2 joins, and a launcher that cannot read that directory (another machine)
    refuses to start, saying how to share a secret."""
    port, out, go, home = free_port(), tmp_path / "out", tmp_path / "go", tmp_path / "home"
    out.mkdir()
    env = clean_env(FLEETLIKE_SECRET_DIR=str(home))
    flags = ["--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{port}", "--nproc_per_node=1", "--rdzv_last_call=2",
             "--heartbeat_timeout=10"]
    # a plain process (not forked from the preload server): its flags are in /proc/PID/cmdline
    a = subprocess.Popen([PY, "-m", "fleetlike.launch", *flags, "--node_ip=127.0.0.1", "--log_dir=log-a",
                          str(WORKERS / "elastic_wait.py"), str(out), str(go)], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    launchers.procs.append(a)
    wait_for(lambda: _store_up(port), "rendezvous store", a)
    report = intruder("cmdline", tmp_path, str(a.pid))
    assert report["flags"]["--rdzv_endpoint"] == f"127.0.0.1:{port}"
    assert not report["join"]["ok"], report["join"]
    assert "does not hold this job's secret" in report["join"]["error"]
    # another machine: no access to this user's private directory
    started = time.monotonic()
    c = launchers.start(*flags, "--node_ip=127.0.0.3", "--log_dir=log-c", str(WORKERS / "elastic_wait.py"),
                        str(out), str(go), env=clean_env(FLEETLIKE_SECRET_DIR=str(tmp_path / "elsewhere")))
    code, _, said = finish(c, timeout=60)
    assert code == 2, said
    assert time.monotonic() - started < 30
    assert "cannot read it there (no such file)" in said and "Nothing was started" in said
    assert "export FLEETLIKE_JOB_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')" in said
    b = launchers.start(*flags, "--node_ip=127.0.0.2", "--log_dir=log-b", str(WORKERS / "elastic_wait.py"),
                        str(out), str(go), env=env)
    wait_for(lambda: len(list(home.glob("*.secret"))) == 1 and b.poll() is None and _joined(tmp_path / "log-b"),
             "node B's worker", b)
    go.touch()
    for proc in (a, b):
        code, _, said = finish(proc, timeout=90)
        assert code == 0, said
    got = sorted((json.loads(p.read_text()) for p in out.iterdir()), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["sum"]) for r in got] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert all(r["synced"] == {"state": "from rank 0"} for r in got)
    assert not (tmp_path / "payload-ran").exists()
    assert list(home.glob("*.secret")) == []  # node A's launcher removed the file at its exit
    assert os.stat(home).st_mode & 0o777 == 0o700


def _joined(log_dir: Path) -> bool:
    return (log_dir / "workerlog.0").exists()


def _raw_sockets() -> bool:
    import socket

    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003)).close()
        return True
    except (OSError, AttributeError):
        return False


@pytest.mark.skipif(not _raw_sockets(), reason="reading the loopback needs CAP_NET_RAW (run as root)")
def test_a_key_prefix_read_off_the_wire_writes_nothing_a_member_takes(tmp_path: Path, launchers: Launchers) -> None:
    """The job's key prefix crosses the loopback in clear; an intruder that reads it there (a
    raw socket) and writes a pickle where torch's elastic rendezvous keeps its state (torch
    unpickles that state) is refused: every value under the prefix is signed with the secret,
    so the worker refuses the planted state unread, naming the interference. No payload runs,
    no log quotes the prefix, and the logs are readable by their owner only."""
    port, out, go = free_port(), tmp_path / "out", tmp_path / "go"
    out.mkdir()
    a = launchers.start("--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{port}", "--node_ip=127.0.0.1",
                        "--nproc_per_node=1", "--rdzv_last_call=1", "--job_id=demo", "--log_dir=log",
                        str(WORKERS / "elastic_wait.py"), str(out), str(go))
    wait_for(lambda: _store_up(port), "rendezvous store", a)
    report = intruder("sniff", tmp_path, f"127.0.0.1:{port}", "demo")
    assert report["prefix"].startswith("fleetlike/")
    assert report["plant state"]["ok"]  # the write itself cannot be stopped; its use can
    go.touch()
    code, _, said = finish(a, timeout=120)
    assert code != 0, said
    log = (tmp_path / "log" / "workerlog.0").read_text()
    assert "is not signed with this job's secret" in log and "torch.rendezvous.demo" in log
    assert not (tmp_path / "payload-ran").exists()
    secret_part = report["prefix"].split("/")[1]
    for path in (tmp_path / "log").rglob("*"):
        if path.is_file():
            assert secret_part not in path.read_text(errors="replace"), path
            assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))


def _can_mount() -> bool:
    return os.geteuid() == 0 and subprocess.run(["which", "mount"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="a 1 MiB tmpfs log folder needs root")
@pytest.mark.parametrize("printing", ["0", "1"], ids=["echoed-rank", "logged-rank"])
def test_a_full_log_disk_ends_the_job_naming_the_log(tmp_path: Path, launchers: Launchers, printing: str) -> None:
    """A log folder on a 1 MiB tmpfs: the rank that fills it (rank 0, whose output the launcher
    copies to its log and console; or rank 1, which writes its log itself) makes the launcher end
    the job within 10 s with one line naming the log file and the cause; nothing blocks on a
    pipe nobody reads."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    logs.mkdir()
    out.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(logs)], check=True)
    try:
        proc = launchers.start("--nproc_per_node=2", "--started_port=auto", f"--log_dir={logs}",
                               str(WORKERS / "chatty.py"), str(out), printing)
        wait_for(lambda: (out / f"start.{printing}").exists(), "the printing rank", proc)
        started = time.monotonic()
        code, _, said = finish(proc, timeout=60)
        took = time.monotonic() - started
    finally:
        launchers.close()
        subprocess.run(["umount", "-l", str(logs)], check=False)
    assert code != 0, said
    lines = [ln for ln in said.splitlines() if "cannot be written" in ln]
    assert len(lines) == 1, said[-3000:]
    assert f"{logs}/workerlog.{printing}" in lines[0] and "No space left on device" in lines[0], lines
    assert took < 10, (took, said[-2000:])


def test_a_deleted_marker_stalls_nobody_and_refusal_records_are_escaped(tmp_path: Path, launchers: Launchers) -> None:
    """A stranger deletes the store's public marker before the late rank arrives, and leaves a
    refusal record whose text would forge log lines: the late rank (which holds the secret)
    joins at once all the same, the job finishes with the right answers, and rank 0's log shows
    the record on one escaped line."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out, go = tmp_path / "out", tmp_path / "go"
    out.mkdir()
    proc = launchers.start("--nproc_per_node=2", f"--started_port={port}", "--log_dir=log",
                           str(WORKERS / "secure_job.py"), str(out), str(go))
    wait_for(lambda: _store_up(port), "the job's store", proc)
    time.sleep(0.5)  # rank 0 greeted: the marker exists
    report = intruder("marker", tmp_path, f"127.0.0.1:{port}")
    assert report["delete marker"]["ok"] and report["knock"]["ok"], report
    go.touch()
    started = time.monotonic()
    code, _, said = finish(proc, timeout=60)
    assert code == 0, said
    assert time.monotonic() - started < 20
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["sum"] == 3.0 and r["gathered"] == [0, 1] for r in results)
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    refused = [ln for ln in log0.splitlines() if "refused a process without this job's secret" in ln]
    assert len(refused) == 1 and "\\nfleetlike.launch: summary: job succeeded\\x1b[2J" in refused[0], log0
    assert not any(ln.startswith(("fleetlike.launch: summary", "forged")) for ln in log0.splitlines())
    assert "\x1b" not in log0


def test_a_rendezvous_file_left_by_a_killed_run_is_replaced_whichever_node_starts_first(
        tmp_path: Path, launchers: Launchers) -> None:
    """Node 0's launcher is SIGKILLed after writing --rendezvous_file; in the next run node 1's
    launcher starts first and finds that stale file (its store is gone): it must not take the
    dead run's job id, so when node 0's new launcher replaces the file both meet and finish."""
    import signal

    rdzv, out = tmp_path / "rdzv", tmp_path / "out"
    out.mkdir()

    def node(ip: str, log: str):
        return launchers.start("--cluster_node_ips=127.0.0.1,127.0.0.2", f"--node_ip={ip}", "--started_port=auto",
                               f"--rendezvous_file={rdzv}", "--nproc_per_node=1", "--rendezvous_timeout=60",
                               f"--log_dir={log}", str(WORKERS / "env_allreduce.py"), str(out),
                               env=clean_env())  # no exported secret: node 0's file carries it

    killed = node("127.0.0.1", "log-killed")
    wait_for(rdzv.exists, "the rendezvous file", killed)
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate(timeout=30)
    assert rdzv.exists()  # stale: its store died with the launcher
    second = node("127.0.0.2", "log1")
    time.sleep(1.5)  # node 1 reads the stale file first
    assert second.poll() is None
    first = node("127.0.0.1", "log0")
    for proc in (first, second):
        code, _, said = finish(proc, timeout=60)
        assert code == 0, said
    assert sorted((out / f"sum.{r}").read_text() for r in range(2)) == ["3.0", "3.0"]

"""``--host_discovery_script``: a node found by the script mid-job is started and admitted.

End to end (a discovered node joins a running job at a commit):
test_elastic_nodes.py::test_discovered_node_joins_at_a_commit, beside that module's other jobs.
Here the discovery loop alone (a fake remote shell that sleeps): bad
output is logged once and retried, at most MAX nodes are started, a host whose launcher ended is
not started again, and the whole-job stop ends the launchers it started. Then bad input at start
(exit 2, nothing started).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from fleetlike.launch.config import LaunchConfig, parse_config
from fleetlike.launch.flags import LaunchInputError
from fleetlike.launch.discovery import HostDiscovery
from fleetlike.launch.main import main
from test_elastic_nodes import discovery_script, free_port

pytestmark = pytest.mark.timeout(90)


def until(check, timeout: float = 10.0) -> None:
    """Poll ``check`` (every 50 ms) until it holds, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


def _config(tmp_path: Path, script: Path, **changes) -> LaunchConfig:
    fields = dict(training_script="t.py", min_nodes=1, max_nodes=2, rdzv_endpoint="127.0.0.1:1",
                  nproc_per_node=2, host_discovery_script=str(script), discovery_interval=0.1,
                  log_dir=str(tmp_path / "log"), kill_grace=0.5,
                  remote_shell=f"sh -c 'echo {{host}} >> {tmp_path}/started; exec sleep 60'")
    return LaunchConfig(**{**fields, **changes})


def test_discovery_loop_retries_caps_and_stops(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2\n")
    discovery = HostDiscovery(_config(tmp_path, discovery_script(tmp_path, hosts)))
    discovery.check()
    discovery.start()
    try:
        hosts.write_text("127.0.0.2:3\n")
        until(lambda: "127.0.0.2 has 3 slots" in discovery._last_error)
        time.sleep(0.6)  # ~6 more polls, still one line said
        hosts.write_text("127.0.0.1:2\n10.9.9.2:2\n10.9.9.3:2\n")  # MAX=2: one more node only
        started = tmp_path / "started"
        until(lambda: started.exists())
        time.sleep(0.6)  # ~6 more polls: still that one node
        assert started.read_text().split() == ["10.9.9.2"]
        (proc,) = discovery._procs.values()
        proc.kill()  # its launcher ends: not started again, 10.9.9.3 now may be
        until(lambda: len(started.read_text().split()) > 1)
        time.sleep(0.3)  # (and no third start after a few more polls)
        assert started.read_text().split() == ["10.9.9.2", "10.9.9.3"]
        running = [p for p in discovery._procs.values() if p.poll() is None]
        assert len(running) == 1
    finally:
        discovery.close(wait=0)
    assert all(p.poll() is not None for p in discovery._procs.values())
    err = capfd.readouterr().err
    assert err.count("127.0.0.2 has 3 slots, but every node runs --nproc_per_node=2") == 1, err
    assert "retrying every 0.1 s" in err
    assert "the launcher of 10.9.9.2 was killed by signal SIGKILL; it is not started again" in err


@pytest.mark.parametrize("body, said", [
    ("exit 3\n", "exited with code 3"),
    ("echo 127.0.0.2:4\n", "127.0.0.2 has 4 slots, but every node runs --nproc_per_node=2"),
    ("echo '127.0.0.2:two'\n", "has slots 'two', not an integer"),
    (None, "cannot run"),
])
def test_bad_script_at_start_is_an_input_error(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, body: str | None, said: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("raise SystemExit('never started')\n")
    script = discovery_script(tmp_path, tmp_path / "hosts", body or "")
    if body is None:
        script.chmod(0o644)
    before = set(threading.enumerate())
    code = main(["--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--nproc_per_node=2",
                 "--started_port=auto", f"--host_discovery_script={script}", "t.py"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert f"error: --host_discovery_script={script}" in err and said in err, err
    assert not (tmp_path / "log").exists() or not any((tmp_path / "log").glob("workerlog.*"))
    # nothing of the job goes on beating on its store (a thread inside a store call when the
    # interpreter ends aborts the process)
    assert [t.name for t in set(threading.enumerate()) - before if t.name.startswith("fleetlike-")] == []


@pytest.mark.parametrize("flags, said", [
    ([], "finds nodes for an elastic job; add --nnodes=MIN:MAX"),
    (["--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:5", "--node_ip=127.0.0.2"],
     "run it on the launcher that hosts --rdzv_endpoint=127.0.0.1:5"),
    (["--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:5", "--remote_shell=ssh"], "has no {host}"),
    (["--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:5", "--discovery_interval=0"], "must be > 0 seconds"),
])
def test_discovery_flags_checked(flags: list[str], said: str) -> None:
    with pytest.raises(LaunchInputError, match=said.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")):
        parse_config([*flags, "--host_discovery_script=d.sh", "t.py"])


def test_remote_agent_argv_is_the_hosts_form_one(tmp_path: Path) -> None:
    """The discovered node's agent is started like an -np/-H one: the same agent module, cwd and
    stdin watch, the job's elastic flags, this interpreter."""
    from fleetlike.launch.discovery import node_launcher_args
    from fleetlike.launch.remote import agent_argv

    config = _config(tmp_path, tmp_path / "d.sh", training_script_args=("a b",), started_port=None,
                     preload="torch")
    argv = agent_argv(node_launcher_args(config, "10.0.0.7"), cwd="/job", env={"PYTHONPATH": "/src"})
    assert argv[:7] == [sys.executable, "-m", "fleetlike.launch.agent", "--chdir", "/job", "--watch_stdin",
                        "--secret_stdin"]  # the job's secret comes on stdin, never on the command line
    rest = argv[argv.index("--") + 1:]
    assert rest[-2:] == ["t.py", "a b"]
    assert {"--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:1", "--node_ip=10.0.0.7", "--nproc_per_node=2",
            "--started_port=auto", f"--log_dir={tmp_path}/log/node-10.0.0.7"} <= set(rest)
    # the parsed form of those flags is the node's config
    node = parse_config(rest, environ={"FLEETLIKE_JOB_SECRET": config.job_secret})
    assert (node.node_ip, node.min_nodes, node.max_nodes, node.host_discovery_script) == ("10.0.0.7", 1, 2, None)
    assert node.preload == "torch"  # a discovered node starts its workers as this one does

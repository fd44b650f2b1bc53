"""``--host_discovery_script``: a node found by the script mid-job is started and admitted.

End to end on loopback: node A (127.0.0.1) runs an elastic job whose discovery script cats a
file; the test adds ``127.0.0.2:2`` to the file once A trains, and A's launcher starts that
node's launcher through a ``--remote_shell`` template that runs the command here. The world
grows 2 -> 4 at a commit, every sample of the epoch is seen exactly once, and all four ranks
end with the same model. Then the discovery loop alone (a fake remote shell that sleeps): bad
output is logged once and retried, at most MAX nodes are started, a host whose launcher ended is
not started again, and the whole-job stop ends the launchers it started. Then bad input at start
(exit 2, nothing started).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fleetlike.launch.config import LaunchConfig, LaunchInputError, parse_config
from fleetlike.launch.discovery import HostDiscovery
from fleetlike.launch.main import main
from test_elastic_nodes import SCRIPT, free_port, progress, reports, wait_until
from test_launch_run import Launchers, assert_all_gone, finish, launchers  # noqa: F401

pytestmark = pytest.mark.timeout(90)

LOCAL_SHELL = "env FLEETLIKE_TEST_HOST={host} sh -c"  # "runs on {host}": here, as --node_ip says


def discovery_script(tmp_path: Path, hosts: Path, body: str | None = None) -> Path:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + (body if body is not None else f"cat {hosts}\n"))
    script.chmod(0o755)
    return script


@pytest.mark.slow
def test_discovered_node_joins_at_a_commit(launchers: Launchers, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:2\n")  # this node: already running
    script = discovery_script(tmp_path, hosts)
    a = launchers.start("--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--node_ip=127.0.0.1",
                        "--nproc_per_node=2", "--started_port=auto", "--rdzv_last_call=1",
                        f"--host_discovery_script={script}", "--discovery_interval=0.5",
                        f"--remote_shell={LOCAL_SHELL}", "--log_dir=log-a", SCRIPT, str(out), "2", "0.1", "eager",
                        "joined")
    # 2 epochs, 0.1 s a step until the world is full: the new node's three interpreters start
    # well before A would end
    wait_until("node A's first steps", lambda: progress(out)[0] >= 5, a)
    assert progress(out)[1] == 2
    hosts.write_text("127.0.0.1:2\n127.0.0.2:2\n")
    wait_until("the 4-rank world", lambda: progress(out)[1] == 4, a)
    code, _, stderr = finish(a, timeout=60, logs=tmp_path / "log-a")
    assert code == 0, stderr
    assert "host discovery: started the launcher of 127.0.0.2" in stderr
    done = reports(out)
    nodes = {int(p.name.split(".")[1]): p.read_text() for p in out.glob("node.*")}
    assert sorted(nodes[r["pid"]] for r in done) == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2
    assert sorted(r["rank"] for r in done) == [0, 1, 2, 3] and all(r["world"] == 4 for r in done)
    for report in done:
        for seen in report["seen"]:
            assert sorted(seen) == list(range(1400)), "samples missing or seen twice"
        if nodes[report["pid"]] == "127.0.0.1":
            (joined,) = report["resets"]
            assert joined["cause"] == "workers waiting to join (admitted at a commit)"
            assert (joined["old_size"], joined["new_size"], joined["nodes_joined"]) == (2, 4, ["127.0.0.2"])
    assert len({(r["accuracy"], r["steps"]) for r in done}) == 1  # one model, one step count
    assert (tmp_path / "log-a" / "node-127.0.0.2" / "workerlog.0").is_file()
    assert_all_gone(out)


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
        time.sleep(0.6)  # ~6 polls, one line said
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
    code = main(["--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--nproc_per_node=2",
                 "--started_port=auto", f"--host_discovery_script={script}", "t.py"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert f"error: --host_discovery_script={script}" in err and said in err, err
    assert not (tmp_path / "log").exists() or not any((tmp_path / "log").glob("workerlog.*"))


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

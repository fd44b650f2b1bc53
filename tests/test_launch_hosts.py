"""The ``-np/-H`` form of ``python -m fleetlike.launch`` (horovodrun's / perseusrun's).

Two simulated nodes are network namespaces joined by a veth pair (`bench.netns`); the launcher
runs inside node A (10.77.0.1), so A's slots are started directly and B's (10.77.0.2) through the
remote-shell template, here a script that runs a command line inside B's namespace (what ``ssh``
does on a real cluster). Every job is checked against what its workers report independently:
rank, world size, node count, the namespace each rank really ran in, and an all-reduced sum.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetlike.launch.flags import LaunchInputError
from fleetlike.launch.hostrun import cli, mpiexec_command
from fleetlike.launch.hosts import Mode, is_hosts_form, parse_host_list, parse_hosts
from helpers import side_by_side

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "launch_workers" / "hosts_job.py"
PY = sys.executable
A, B = "10.77.0.1", "10.77.0.2"


def _parse(*argv: str, **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("local", lambda h: h == A)
    kw.setdefault("resolves", lambda h: h != "nosuchhost.invalid")
    return parse_hosts(list(argv), **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- input errors (nothing starts)


@pytest.mark.parametrize("argv, words", [
    (["-np", "5", "-H", f"{A}:2,{B}:2"], ["-np=5", "4 slots", "lower -np"]),
    (["-np", "3", "-H", f"{A}:2,{B}:2"], ["-np=3", f"{A}:2,{B}:1", "same number"]),
    (["-np", "0", "-H", f"{A}:2"], ["-np=0", ">= 1"]),
    (["-np", "x", "-H", f"{A}:2"], ["-np='x'", "integer"]),
    (["-np", "2", "-H", f"{A}:two"], ["'two'", "HOST:SLOTS"]),
    (["-np", "4", "-H", f"{A}:2,{A}:2"], ["twice"]),
    (["-np", "4", "-H", f"{A}:2,nosuchhost.invalid:2"], ["nosuchhost.invalid", "unknown", "/etc/hosts"]),
    (["-np", "4", "-H", f"localhost:2,{B}:2"], ["localhost", "loopback", "reach"]),
    (["-np", "4", "-H", f"{A}:2,{B}:2", "--remote_shell", "ssh"], ["--remote_shell='ssh'", "{host}"]),
    (["-np", "4", "-H", f"{A}:2,{B}:2", "--remote_shell", "no-such-rsh {host}"], ["no-such-rsh", "PATH"]),
    (["-np", "2", "-H", f"{A}:2", "--", "./train.sh"], ["--gloo", "'./train.sh'", "--mpi"]),
    (["-np", "2", "-H", f"{A}:2", "--", "python", "missing_script.py"], ["missing_script.py", "not found"]),
    (["-np", "2", "-H", f"{A}:2", "--gloo", "--mpi"], ["--mpi", "--gloo"]),
    (["-np", "2", "-H", f"{A}:2", "-x", "FLEETLIKE_NOT_SET_ANYWHERE"], ["-x", "FLEETLIKE_NOT_SET_ANYWHERE"]),
    (["-np", "2", "-H", f"{A}:2"], ["no command"]),
])
def test_bad_input_names_field_value_and_fix(argv: list[str], words: list[str]) -> None:
    if "--" not in argv and "no command" not in words:
        argv = [*argv, "--", "python", str(WORKER)]
    with pytest.raises(LaunchInputError) as err:
        _parse(*argv)
    for word in words:
        assert word in str(err.value)


def test_missing_mpiexec_and_exit_code_2_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LaunchInputError, match="--mpi: no mpiexec.*pip install mpich"):
        _parse("-np", "2", "-H", f"{A}:2", "--mpi", "--", "python", str(WORKER), mpiexec=lambda: None)
    # through the command line: exit code 2, one error line, no log directory made
    log = tmp_path / "log"
    code = cli(["-np", "3", "-H", "localhost:2", f"--log_dir={log}", "--", "python", str(WORKER), str(tmp_path)])
    assert code == 2
    assert "fleetlike.launch: error: -np=3 is more than the 2 slots" in capsys.readouterr().err
    assert not log.exists()


def test_hostfile_and_fill_order(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two nodes\n{A} slots=2\n{B}:2  # second\n10.77.0.3 slots=4\n")
    job = _parse("-np", "4", "--hostfile", str(hostfile), "--mpi", "--", "python", str(WORKER), mpiexec=lambda: "/x/mpiexec")
    assert [(h.name, h.slots, h.procs, h.local) for h in job.hosts] == [(A, 2, 2, True), (B, 2, 2, False)]
    argv = mpiexec_command(job, "/tmp/rsh")
    assert argv[:7] == ["/x/mpiexec", "-launcher", "ssh", "-launcher-exec", "/tmp/rsh", "-localhost", A]
    assert argv[argv.index("-hosts") + 1] == f"{A}:2,{B}:2"
    segments = " ".join(argv).split(" : ")
    assert [s.split("-env FLEETLIKE_NODE_IP ")[1].split()[0] for s in segments] == [A, B]
    assert job.mode is Mode.MPI


@given(st.lists(st.sampled_from(["-H", "-np", "--x", "--y=1", "--", "train.py", "4", "h:2", "--mpi"]), max_size=8))
def test_hosts_form_only_when_its_flag_precedes_the_script(argv: list[str]) -> None:
    """The scan's answer equals a direct reading: a marker before the first positional / ``--``,
    where a non-switch flag without ``=`` swallows the next word as its value."""
    expected, i = False, 0
    while i < len(argv):
        word = argv[i]
        if word == "--" or not word.startswith("-"):
            break
        if word in ("-H", "-np", "--mpi"):
            expected = True
            break
        i += 1 if "=" in word or word == "--mpi" else 2
    assert is_hosts_form(argv) == expected
    assert not is_hosts_form(["--nproc_per_node=2", "train.py", "-np", "4", "-H", "x:1"])


def test_host_list_round_trip() -> None:
    assert parse_host_list("a:2, b:3,c") == [("a", 2), ("b", 3), ("c", 1)]
    assert parse_host_list("[fe80::1]:2,::1") == [("fe80::1", 2), ("::1", 1)]


# ---------------------------------------------------------------- two simulated nodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(namespace of node A, remote-shell script reaching A or B by address)."""
    from bench import netns

    why = netns.unavailable()
    if why:
        pytest.skip(why)
    with netns.TwoNodes(rate="", prefix=f"lh{os.getpid() % 10000}") as two:
        rsh = tmp_path_factory.mktemp("rsh") / "nsexec"
        rsh.write_text(
            "#!/bin/sh\n# HOST CMDLINE: run CMDLINE in the namespace simulating HOST (like ssh)\n"
            f'case "$1" in {A}) ns={two.ns[0]};; {B}) ns={two.ns[1]};; '
            '*) echo "no simulated host $1" >&2; exit 255;; esac\n'
            'exec ip netns exec "$ns" sh -c "$2"\n'
        )
        rsh.chmod(0o755)
        yield two.ns[0], rsh


def _clean_env() -> dict[str, str]:
    prefixes = ("PADDLE_", "OMPI_", "PMI_", "SLURM_", "FLEETLIKE_", "MPI_LOCAL", "TORCHELASTIC")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _launch(ns: str, rsh: Path, cwd: Path, mode: str, port: int, *worker_args: str,
            timeout: float = 90) -> tuple[int, str, float]:
    argv = ["ip", "netns", "exec", ns, PY, "-m", "fleetlike.launch", "-np", "4", "-H", f"{A}:2,{B}:2",
            mode, "--remote_shell", f"{rsh} {{host}}", "--kill_grace", "1", "--started_port", str(port),
            "--", "python", str(WORKER), str(cwd / "out"), *worker_args]
    (cwd / "out").mkdir()
    env = _clean_env()
    if mode == "--gloo":
        # each node's agent forks its workers from a preload server of its own, in its node's
        # namespace (the session's server runs outside them): one torch import per node
        env["FLEETLIKE_PRELOAD"] = "torch"
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, text, time.monotonic() - t0


def _all_gone(out: Path) -> list[int]:
    alive = []
    for pid_file in out.glob("pid.*"):
        pid = int(pid_file.read_text())
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.default_port
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["--gloo", "--mpi"])
def test_two_nodes_run_and_a_remote_failure_ends_both(mode: str, nodes: tuple[str, Path], tmp_path: Path) -> None:
    ns, rsh = nodes
    ok, bad = tmp_path / "ok", tmp_path / "bad"
    ok.mkdir()
    bad.mkdir()
    # the two jobs at once (`helpers.side_by_side`), on ports of their own: one job's interpreter
    # starts fill the other's waits (remote shell, rendezvous, ending the failed job)
    with side_by_side({"ok": functools.partial(_launch, ns, rsh, ok, mode, 6170),
                       "bad": functools.partial(_launch, ns, rsh, bad, mode, 6270, "--fail", "3", "7")}) as jobs:
        pass
    code, text, _ = jobs["ok"].result()
    assert code == 0, text
    roles = [json.loads((ok / "out" / f"role.{r}.json").read_text()) for r in range(4)]
    for r, role in enumerate(roles):
        node = (A, B)[r // 2]
        assert (role["rank"], role["world"], role["node_num"], role["local_rank"]) == (r, 4, 2, r % 2)
        assert role["netns"] == node  # really ran on its simulated node
        assert role["sum"] == 1 + 2 + 3 + 4
        assert [e.rsplit(":", 1)[0] for e in role["endpoints"]] == [A, A, B, B]
    if mode == "--gloo":  # each node's agent logged its workers in its own directory
        assert (ok / "log" / "node1" / "workerlog.1").exists()
        assert "as a plain process" not in text, text  # every worker forked, on both nodes
    code, text, took = jobs["bad"].result()
    assert code == 7, text  # the failed rank's own code, in both modes
    assert len(list((bad / "out").glob("pid.*"))) == 4
    deadline = time.monotonic() + 10
    while _all_gone(bad / "out") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _all_gone(bad / "out") == []  # the sleeping ranks on both nodes were ended
    assert took < 60, text  # not by their own 120 s sleep
    if mode == "--gloo":
        assert f"host {B} (node 1, ranks 2..3) exited with code 7" in text
        assert "rank 3 (local 1) exited with code 7" in text  # node B's agent named the rank
    else:
        assert "rank 3 exited with code 7; ending the job" in text  # its guard, through hydra

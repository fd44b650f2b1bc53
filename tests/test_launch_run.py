"""The launcher with real processes on the loopback "cluster" (127.0.0.1 and 127.0.0.2).

Each test records every process it caused (workers write pid files, their children too) and ends
by asserting that none is left running. No test chooses a port: every job runs with
``--started_port=auto``, the two-node ones meeting through a ``--rendezvous_file`` under tmp_path.
The jobs that succeed run two at a time (the module's `jobs`): pairs of launches whose ports are
chosen at the same moment, each test checking its own job.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from fleetlike.launch import main
from helpers import popen_job, preload_env, side_by_side

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "launch_workers"
PY = sys.executable


# --------------------------------------------------------------------------- helpers


def alive(pid: int) -> bool:
    """True if ``pid`` runs; zombies (exited, not yet reaped by init) count as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def recorded_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("*.*") if p.name.startswith(("pid.", "child."))
            and not p.name.endswith(".tmp") and p.read_text()]


def assert_all_gone(out: Path, within: float = 5.0) -> None:
    """Every recorded process ends within ``within`` s; stragglers are killed, then reported."""
    pids = recorded_pids(out)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    leftovers = [p for p in pids if alive(p)]
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert leftovers == []


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher's role variables, plus ``extra``."""
    prefixes = ("PADDLE_", "OMPI_", "PMI_", "SLURM_", "FLEETLIKE_", "MPI_LOCAL", "TORCHELASTIC")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GROUP_RANK", "FLAGS_selected_gpus", "CUDA_VISIBLE_DEVICES"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env.setdefault("OMP_NUM_THREADS", "1")  # else the launcher notes that it sets it (stderr)
    env.update(preload_env())
    env.update(extra)
    return env


class Launchers:
    """Starts launcher subprocesses and makes sure none outlives the test."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.procs: list[subprocess.Popen[str]] = []
        #: the secret every launcher of the test's job shares (several nodes' launchers need one)
        self.secret = secrets.token_hex(32)

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        # forked from the session's preload server (`helpers.popen_job`): the launcher's own
        # torch import is not what these tests are about; its stdout and stderr stay apart
        proc = popen_job([PY, "-m", "fleetlike.launch", *args], cwd=self.cwd,
                         env=env or clean_env(FLEETLIKE_JOB_SECRET=self.secret))
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the launcher stops its workers
        for proc in self.procs:
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # it may end between the two
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


@pytest.fixture()
def launchers(tmp_path: Path) -> Iterator[Launchers]:
    runner = Launchers(tmp_path)
    yield runner
    runner.close()
    assert_all_gone(tmp_path / "out")


@pytest.fixture()
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def finish(proc: subprocess.Popen[str], timeout: float = 60, logs: Path | None = None) -> tuple[int, str, str]:
    """The launcher's exit code and output; past ``timeout`` the test fails with what it printed
    so far and the last lines of every log file under ``logs``, so a job that hangs says where."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        said = [f"--- {name} ---\n{(text or b'').decode(errors='replace') if isinstance(text, bytes) else text}"
                for name, text in (("stdout", exc.output), ("stderr", exc.stderr))]
        if logs is not None:
            said += [f"--- {path} (last lines) ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
                     for path in sorted(logs.rglob("*log*")) if path.is_file()]
        raise AssertionError(f"the launcher did not end within {timeout:g} s\n" + "\n".join(said)) from None
    return proc.returncode, stdout, stderr


def job_output(proc: subprocess.Popen[str], exc: subprocess.TimeoutExpired) -> str:
    said = [f"--- {name} ---\n{text if isinstance(text, str) else (text or b'').decode(errors='replace')}"
            for name, text in (("stdout", exc.output), ("stderr", exc.stderr))]
    cwd = Path(proc.args[0]).parent if False else None  # noqa: F841 - the cwd is not on Popen
    return "\n".join(said)


def expected_env(ips: list[str], node: int, per: int, local: int, ports: list[int], job: str,
                 auto: bool = False, endpoints: list[str] | None = None) -> dict[str, str]:
    """The contract of API.md §5, written out independently of fleetlike.launch.worker_env.

    ``ports`` are the local ranks' ports (the same on every node): ``started_port + i``, or with
    ``--started_port=auto`` the ones the launcher chose (read back from the workers). On several
    nodes with ``auto`` each node's ports differ: give every rank's ``endpoints`` instead."""
    rank = node * per + local
    if endpoints is None:
        endpoints = [f"{ip}:{port}" for ip in ips for port in ports]
    ports = [int(endpoints[0].rsplit(":", 1)[1])]
    env = {
        "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints), "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_NODE_NUM": str(len(ips)), "FLAGS_selected_gpus": "",
        "RANK": str(rank), "WORLD_SIZE": str(len(endpoints)), "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(node),
        "MASTER_ADDR": ips[0], "MASTER_PORT": str(ports[0]),
        "FLEETLIKE_JOB_ID": job, "FLEETLIKE_NODE_IP": ips[node], "FLEETLIKE_TEST_MARKER": "kept",
    }
    if auto:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def met_endpoints(out: Path, ips: list[str], per: int) -> list[str]:
    """Every rank's endpoint in a two-node ``auto`` job, as rank 0 saw them: node by node, each
    node's ports distinct and chosen by its own launcher."""
    listed = json.loads((out / "env.0.json").read_text())["env"]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert [e.rsplit(":", 1)[0] for e in listed] == [ip for ip in ips for _ in range(per)]
    for node in range(len(ips)):
        ports = {int(e.rsplit(":", 1)[1]) for e in listed[node * per:(node + 1) * per]}
        assert len(ports) == per and all(1 <= p <= 65535 for p in ports)
    return listed


def start_two_nodes(launchers: Launchers, out: Path, rdzv: Path, *flags: str,
                    script: str = "env_allreduce.py", log: str = "log",
                    env: dict[str, str] | None = None) -> list[subprocess.Popen[str]]:
    """One launcher per loopback "node", ports chosen by the launchers, meeting through ``rdzv``."""
    return [
        launchers.start(
            "--cluster_node_ips=127.0.0.1,127.0.0.2", f"--node_ip={ip}", "--started_port=auto",
            f"--rendezvous_file={rdzv}", "--nproc_per_node=2", f"--log_dir={log}{node}", *flags,
            str(WORKERS / script), str(out), "--flag", "x y", env=env,
        )
        for node, ip in enumerate(("127.0.0.1", "127.0.0.2"))
    ]


def chosen_ports(out: Path, per: int) -> list[int]:
    """The ports an ``auto`` launcher gave its workers, as rank 0 saw them: distinct, real."""
    listed = json.loads((out / "env.0.json").read_text())["env"]["PADDLE_TRAINER_ENDPOINTS"]
    ports = [int(e.rsplit(":", 1)[1]) for e in listed.split(",")]
    assert len(ports) == per and len(set(ports)) == per and all(1 <= p <= 65535 for p in ports)
    return ports


PROXIES = {name: "http://proxy.invalid:3128" for name in
           ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")}


def check_worker(out: Path, rank: int, env: dict[str, str], world: int) -> None:
    dump = json.loads((out / f"env.{rank}.json").read_text())
    assert dump["env"] == env
    assert dump["argv"] == ["--flag", "x y"] and dump["executable"] == PY
    assert dump["detected_same"] is True
    assert float((out / f"sum.{rank}").read_text()) == world * (world + 1) / 2


# --------------------------------------------------------------------------- jobs that succeed


def four_workers_job(launchers: Launchers, root: Path) -> tuple[int, str, str]:
    """One node, four workers, the job id given, a proxy in the environment (not passed on)."""
    (root / "out-four").mkdir()
    proc = launchers.start(
        "--nproc_per_node=4", "--started_port=auto", "--job_id=job-1n", "--log_dir=logs-four",
        str(WORKERS / "env_allreduce.py"), str(root / "out-four"), "--flag", "x y",
        env=clean_env(FLEETLIKE_TEST_MARKER="kept", **PROXIES),
    )
    return finish(proc)


def pair_job(launchers: Launchers, root: Path) -> tuple[int, str, str]:
    """One node, two workers: started at the same moment as `four_workers_job`."""
    (root / "out-pair").mkdir()
    proc = launchers.start("--nproc_per_node=2", "--started_port=auto", "--log_dir=logs-pair",
                           str(WORKERS / "env_allreduce.py"), str(root / "out-pair"), "--flag", "x y")
    return finish(proc)


def two_node_job(launchers: Launchers, root: Path, j: int) -> list[tuple[int, str, str]]:
    """Two loopback nodes meeting through their own rendezvous file; job 0 with a marker and a
    proxy in its environment."""
    out = root / f"out-nodes{j}"
    out.mkdir()
    env = clean_env(FLEETLIKE_TEST_MARKER="kept", **PROXIES) if j == 0 else None
    procs = start_two_nodes(launchers, out, root / f"rdzv{j}", log=f"job{j}-log", env=env)
    return [finish(p, timeout=150) for p in procs]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Future]]]:
    """The successful jobs of this module, in two waves (`helpers.side_by_side`): two one-node
    jobs started at once, then two two-node jobs started at once (their launchers choose ports
    at the same moment, which two of the tests are about); each of the four tests checks its own
    job. (root directory, futures by name)"""
    root = tmp_path_factory.mktemp("launch-run")
    runner = Launchers(root)
    try:
        with side_by_side({"four": functools.partial(four_workers_job, runner, root),
                           "pair": functools.partial(pair_job, runner, root)},
                          {"nodes0": functools.partial(two_node_job, runner, root, 0),
                           "nodes1": functools.partial(two_node_job, runner, root, 1)}) as futures:
            yield root, futures
    finally:
        runner.close()
    for out in root.glob("out-*"):
        assert_all_gone(out)


@pytest.mark.slow
def test_one_node_four_workers(jobs: tuple[Path, dict[str, Future]]) -> None:
    root, futures = jobs
    out = root / "out-four"
    code, stdout, stderr = futures["four"].result(timeout=80)
    assert code == 0, stderr
    ports = chosen_ports(out, 4)
    for local in range(4):
        check_worker(out, local, expected_env(["127.0.0.1"], 0, 4, local, ports, "job-1n", auto=True), 4)
        log = (root / "logs-four" / f"workerlog.{local}").read_text()
        assert f"worker {local} sum 10.0" in log
    # local rank 0 is echoed with its prefix; the others only go to their logs
    assert "[rank 0] worker 0 ready" in stdout and "[rank 0] worker 0 sum 10.0" in stdout
    assert "[rank 1]" not in stdout and "worker 1" not in stdout
    assert stderr == ""


@pytest.mark.slow
def test_two_nodes_two_workers_each(jobs: tuple[Path, dict[str, Future]]) -> None:
    """Each node's launcher chooses and holds its own ports; node 0's hosts the store and writes
    its address to the rendezvous file, and both publish their endpoints there before any worker
    starts, so every worker of both nodes gets the same endpoint list."""
    root, futures = jobs
    out = root / "out-nodes0"
    ips = ["127.0.0.1", "127.0.0.2"]
    results = futures["nodes0"].result(timeout=170)
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    ids = {json.loads((out / f"env.{r}.json").read_text())["env"]["FLEETLIKE_JOB_ID"] for r in range(4)}
    assert len(ids) == 1  # both launchers derived the same id
    job = ids.pop()
    endpoints = met_endpoints(out, ips, 2)
    for node in range(2):
        for local in range(2):
            rank = node * 2 + local
            want = expected_env(ips, node, 2, local, [], job, auto=True, endpoints=endpoints)
            check_worker(out, rank, want, 4)
            assert (root / f"job0-log{node}" / f"workerlog.{local}").exists()
    assert "[rank 0] worker 0 ready" in results[0][1] and "[rank 2] worker 2 ready" in results[1][1]
    assert [r[2] for r in results] == ["", ""]
    assert not (root / "rdzv0").exists()  # node 0 removed it once both nodes had joined


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_two_node_jobs_started_at_once_both_succeed(jobs: tuple[Path, dict[str, Future]]) -> None:
    """Concurrent jobs on several nodes: two 2-node jobs (4 launchers) on the same two loopback nodes,
    started at the same moment with the same flags but their own rendezvous files, each choosing
    its ports as it binds them: neither can take the other's, and neither joins the other."""
    root, futures = jobs
    outs = [root / f"out-nodes{j}" for j in range(2)]
    results = [r for j in range(2) for r in futures[f"nodes{j}"].result(timeout=170)]
    assert [r[0] for r in results] == [0] * 4, [r[2] for r in results]
    met = []
    for o in outs:
        met.append(met_endpoints(o, ["127.0.0.1", "127.0.0.2"], 2))
        for rank in range(4):
            dump = json.loads((o / f"env.{rank}.json").read_text())["env"]
            assert dump["PADDLE_TRAINER_ENDPOINTS"] == ",".join(met[-1])
            assert float((o / f"sum.{rank}").read_text()) == 10.0
        assert_all_gone(o)
    assert not set(met[0]) & set(met[1])
    assert not any(root.glob("rdzv*"))


@pytest.mark.slow
def test_a_rendezvous_file_that_never_appears(in_process, out: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Node 1 alone: no node 0 ever writes the file. One line names the file and the timeout,
    exit code 1 within the timeout (plus start-up), and no worker was ever started."""
    rdzv = tmp_path / "rdzv"
    code, stdout, stderr, elapsed = in_process(
        "--cluster_node_ips=127.0.0.1,127.0.0.2", "--node_ip=127.0.0.2", "--started_port=auto",
        f"--rendezvous_file={rdzv}", "--rendezvous_timeout=2", "--nproc_per_node=2",
        str(WORKERS / "behave.py"), str(out), "--ok")
    assert code == 1 and elapsed < 15
    assert stderr == (
        f"fleetlike.launch: node 1 (127.0.0.2): --rendezvous_file={rdzv} does not exist after "
        "waiting 2s (--rendezvous_timeout). Node 0's launcher (127.0.0.1) writes it once it hosts "
        "the store: start it with the same --cluster_node_ips, --nproc_per_node and "
        "--rendezvous_file, at a path on a filesystem every node shares\n"
    )
    assert stdout == "" and recorded_pids(out) == []


@pytest.mark.slow
def test_signal_while_waiting_for_the_other_node(launchers: Launchers, out: Path, tmp_path: Path) -> None:
    """Node 0 waits for a node 1 that never comes; SIGTERM ends it at once, file removed."""
    rdzv = tmp_path / "rdzv"
    proc = launchers.start("--cluster_node_ips=127.0.0.1,127.0.0.2", "--started_port=auto",
                           f"--rendezvous_file={rdzv}", "--nproc_per_node=2",
                           str(WORKERS / "behave.py"), str(out), "--ok")
    deadline = time.monotonic() + 20
    while not rdzv.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rdzv.exists() and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    code, _, stderr = finish(proc, timeout=15)
    assert code == 128 + signal.SIGTERM
    assert stderr == ("fleetlike.launch: received SIGTERM; stopped while waiting for the other "
                      "nodes; no worker was started\n")
    assert not rdzv.exists() and recorded_pids(out) == []


@pytest.mark.slow
@pytest.mark.gpu
def test_seed_command_on_gpus(launchers: Launchers, out: Path) -> None:
    """Seed 003's command as written (127.0.0.x addresses), one process per visible GPU (max 4)."""
    from fleetlike.launch.checks import cuda_device_count

    count = min(cuda_device_count(), 4)
    if count == 0:
        pytest.skip("needs a CUDA device: torch.cuda.device_count() is 0")
    gpus = ",".join(str(i) for i in range(count))
    proc = launchers.start(
        "--cluster_node_ips=127.0.0.1", "--node_ip=127.0.0.1", "--started_port=auto",
        f"--selected_gpus={gpus}", str(WORKERS / "env_allreduce.py"), str(out),
        "--flag", "x y", env=clean_env(FLEETLIKE_TEST_MARKER="kept"),
    )
    code, _, stderr = finish(proc)
    assert code == 0, stderr
    ports = chosen_ports(out, count)
    for local in range(count):
        env = expected_env(["127.0.0.1"], 0, count, local, ports, "unused", auto=True)
        env.update(FLAGS_selected_gpus=str(local), CUDA_VISIBLE_DEVICES=gpus)
        dump = json.loads((out / f"env.{local}.json").read_text())
        env["FLEETLIKE_JOB_ID"] = dump["env"]["FLEETLIKE_JOB_ID"]
        assert dump["env"] == env
        visible, doubled = (out / f"cuda.{local}").read_text().split()
        assert int(visible) == count and float(doubled) == 2.0 * (local + 1)


def test_in_process_main_and_leftover_children(
    out: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Workers that exit 0 but leave a child behind: the job still ends with nothing running."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name not in clean_env():
            monkeypatch.delenv(name)
    code = main(["--nproc_per_node=2", "--started_port=auto", "--print_config",
                 str(WORKERS / "behave.py"), str(out), "--child", "--ok"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert stdout.startswith("fleetlike.launch configuration\n")
    assert "[rank 0] worker 0 of 2 started" in stdout
    assert len(recorded_pids(out)) == 4
    assert_all_gone(out, within=0.5)


@pytest.mark.slow
def test_two_auto_jobs_started_at_once_both_succeed(jobs: tuple[Path, dict[str, Future]]) -> None:
    """A CI failure made impossible: two jobs choose their ports at the same
    moment, and each holds them from the choice to the end, so neither can take the other's."""
    root, futures = jobs
    endpoints = []
    for name, world in (("four", 4), ("pair", 2)):
        code, _, stderr = futures[name].result(timeout=80)
        assert code == 0, stderr
        o = root / f"out-{name}"
        endpoints.append(chosen_ports(o, world))
        for rank in range(world):
            assert float((o / f"sum.{rank}").read_text()) == world * (world + 1) / 2
        assert_all_gone(o)
    assert not set(endpoints[0]) & set(endpoints[1])


# --------------------------------------------------------------------------- jobs that fail


@pytest.fixture()
def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """The launcher's `main` run in this process (no interpreter to start: the launcher's own
    behaviour is the same), in the test's directory and clean environment: a function of the
    command line returning (exit code, stdout, stderr, seconds)."""
    monkeypatch.chdir(tmp_path)
    env = clean_env()
    for name in list(os.environ):
        if name not in env:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def run(*args: str) -> tuple[int, str, str, float]:
        capsys.readouterr()
        started = time.monotonic()
        code = main(list(args))
        stdout, stderr = capsys.readouterr()
        return code, stdout, stderr, time.monotonic() - started

    return run


def run_failing(in_process, out: Path, nproc: int, *flags: str,  # type: ignore[no-untyped-def]
                launcher_flags: tuple[str, ...] = ()) -> tuple[int, str, float]:
    code, _, stderr, elapsed = in_process(f"--nproc_per_node={nproc}", "--started_port=auto", *launcher_flags,
                                          str(WORKERS / "behave.py"), str(out), *flags)
    assert_all_gone(out, within=0.5)
    return code, stderr, elapsed


def test_worker_error_ends_the_job(in_process, out: Path) -> None:  # type: ignore[no-untyped-def]
    code, stderr, elapsed = run_failing(in_process, out, 3, "--fail", "1", "3")
    assert code == 3 and elapsed < 10
    assert stderr == (
        "fleetlike.launch: rank 1 (local 1) exited with code 3; log: log/workerlog.1; "
        "last line: worker 1 failing on purpose\n"
    )
    assert len(recorded_pids(out)) == 3


@pytest.mark.slow
def test_worker_killed_by_sigkill(in_process, out: Path) -> None:  # type: ignore[no-untyped-def]
    code, stderr, elapsed = run_failing(in_process, out, 3, "--sigkill", "2")
    assert code == 128 + signal.SIGKILL and elapsed < 10
    assert stderr.startswith(
        "fleetlike.launch: rank 2 (local 2) was killed by signal SIGKILL; log: log/workerlog.2"
    )
    assert stderr.count("\n") == 1


@pytest.mark.slow
def test_grandchildren_that_ignore_sigterm_are_killed(in_process, out: Path) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 fails while the others (and every worker's child) sleep and ignore SIGTERM."""
    code, stderr, elapsed = run_failing(
        in_process, out, 2, "--fail", "0", "5", "--child", "--ignore-term",
        launcher_flags=("--kill_grace=1",),
    )
    assert code == 5 and elapsed < 10
    assert stderr.startswith("fleetlike.launch: rank 0 (local 0) exited with code 5; log: log/workerlog.0")
    assert stderr.count("\n") == 1
    assert len(recorded_pids(out)) == 4


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_every_worker(launchers: Launchers, out: Path, sig: int) -> None:
    proc = launchers.start("--nproc_per_node=2", "--start_port=auto",
                           str(WORKERS / "behave.py"), str(out), "--child")
    deadline = time.monotonic() + 20
    while len(recorded_pids(out)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(recorded_pids(out)) == 4
    proc.send_signal(sig)
    code, _, stderr = finish(proc, timeout=15)
    assert code == 128 + sig
    assert stderr == f"fleetlike.launch: received {signal.Signals(sig).name}; stopped all 2 local workers\n"
    assert_all_gone(out, within=0.5)


@pytest.mark.slow
def test_workers_die_with_a_sigkilled_launcher(launchers: Launchers, out: Path) -> None:
    """A launcher killed outright cannot clean up; the kernel's parent-death signal does."""
    proc = launchers.start("--nproc_per_node=2", "--start_port=auto",
                           str(WORKERS / "behave.py"), str(out))
    deadline = time.monotonic() + 20
    while len(recorded_pids(out)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(recorded_pids(out)) == 2
    proc.kill()
    finish(proc, timeout=15)
    assert_all_gone(out, within=5.0)

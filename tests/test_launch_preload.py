"""``--preload=torch``: a worker forked from the preload server is started, ends, restarts and is
signalled exactly as a plain one. One job per mode covers an exception, a kill -9, two restarts
and the launcher's SIGTERM; the records the workers write and the launcher's lines must agree."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetlike.launch import LaunchInputError, parse_config
from fleetlike.launch.env import tuned_glibc_tunables
from fleetlike.launch.preload import PRELOAD_ENV, SOCKET_ENV, start_preloaded
from fleetlike.launch.preload_server import receive
from fleetlike.testing import preload_server
from helpers import popen_job, preload_env, run_jobs, side_by_side, start_job

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "launch_workers" / "preload_probe.py"
#: differ from run to run whatever the start: ports, the job's id, the agent's folders
_PER_RUN = ("PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT", "MASTER_PORT", "FLEETLIKE_JOB_ID",
            "FLEETLIKE_PROGRESS_DIR", "FLEETLIKE_PROCESS_TAG")


def _run(tmp: Path, mode: str) -> tuple[int, list[str], dict[str, dict], str]:
    """The launcher with ``--preload=mode`` until generation 2 is up, then its SIGTERM."""
    out = tmp / mode
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (PRELOAD_ENV, SOCKET_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        # a grace the handlers' files outlast on a loaded machine: SIGKILL never cuts one short
        [sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=2", "--started_port=auto",
         "--max_restarts=2", "--kill_grace=20", f"--preload={mode}", f"--log_dir={out}/log", str(PROBE), str(out)],
        cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((out / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [ln.replace(str(out), "OUT") for ln in stderr.splitlines() if ln.startswith("fleetlike.launch:")]
    records = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("gen*-rank*.json"))}
    terms = {r: (out / f"term-{r}").read_text() for r in (0, 1)}
    assert terms == {0: str(int(signal.SIGTERM)), 1: str(int(signal.SIGTERM))}, terms
    return proc.returncode, lines, records, stdout


@pytest.mark.slow  # the fast tier starts every launcher job's workers preloaded
def test_preloaded_workers_start_end_and_restart_as_plain_ones(tmp_path: Path) -> None:
    # the two jobs at once (`helpers.side_by_side`): each mostly waits on its workers' starts
    with side_by_side({"off": functools.partial(_run, tmp_path, "off"),
                       "torch": functools.partial(_run, tmp_path, "torch")}) as jobs:
        pass
    plain, fast = jobs["off"].result(), jobs["torch"].result()
    code, lines, records, stdout = plain
    assert code == 128 + signal.SIGTERM
    assert any("exited with code 1" in ln and "ValueError: generation 0 fails" in ln for ln in lines), lines
    assert any("was killed by signal SIGKILL" in ln for ln in lines), lines
    assert any("received SIGTERM; stopped all 2 local workers" in ln for ln in lines), lines
    assert fast[0] == code
    assert fast[1] == lines  # the same failures, restarts and summary, and no fall-back line
    assert sorted(records) == sorted(fast[2]) == [f"gen{g}-rank{r}" for g in range(3) for r in range(2)]
    for recs in (records, fast[2]):  # the default generators are seeded afresh in each worker
        for key in ("np_draw", "torch_seed", "torch_draw"):
            assert len({str(rec[key]) for rec in recs.values()}) == len(recs), key
    for name, mine in records.items():
        theirs = fast[2][name]
        assert mine.pop("preloaded") is False and theirs.pop("preloaded") is True, name
        for record in (mine, theirs):
            for key in _PER_RUN:
                record["env"].pop(key, None)
            record["argv"][1] = record["argv"][1].replace(str(tmp_path / "off"), "OUT").replace(
                str(tmp_path / "torch"), "OUT")
            record["orig_argv_tail"][1] = record["argv"][1]
            record["env"][PRELOAD_ENV] = record["env"].get(PRELOAD_ENV)
            for key in ("np_draw", "torch_seed", "torch_draw"):
                del record[key]
        assert theirs == mine, name
    assert [ln for ln in stdout.splitlines() if "started" in ln] == [
        ln for ln in fast[3].splitlines() if "started" in ln]  # rank 0's echo to the console


def test_what_a_preloaded_start_cannot_honour_starts_plainly_saying_why(tmp_path: Path, capfd) -> None:
    log = open(tmp_path / "log", "wb")
    # the server's start-up environment (tests/conftest.py), so that only what each case changes differs
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "GLIBC_TUNABLES": tuned_glibc_tunables(os.environ.get("GLIBC_TUNABLES"))}
    env.pop(SOCKET_ENV, None)
    assert start_preloaded(["/bin/sh", "-c", "true"], env, stdout=log.fileno(), rank=0) is None
    assert start_preloaded([sys.executable, "-c", "pass"], env, stdout=log.fileno(), rank=1) is None
    with contextlib.ExitStack() as stack:  # the session's server, else one of this test's own
        path = preload_env().get(SOCKET_ENV) or stack.enter_context(preload_server(env))
        env[SOCKET_ENV] = path
        env["PYTHONHASHSEED"] = "7"  # read once at interpreter start: the server's differs
        assert start_preloaded([sys.executable, "-u", str(PROBE)], env, stdout=log.fileno(), rank=2) is None
        env.pop("PYTHONHASHSEED")
        missing = tmp_path / "missing.py"
        assert start_preloaded([sys.executable, "-u", str(missing)], env, stdout=log.fileno(), rank=3) is None
    log.close()
    said = [ln for ln in capfd.readouterr().err.splitlines() if "--preload=torch" in ln]
    assert len(said) == 4, said
    assert "is not this interpreter" in said[0] and "(rank 0) as a plain process" in said[0]
    assert "'-c'" in said[1]
    assert "differs from the server's in PYTHONHASHSEED" in said[2]
    assert "missing.py" in said[3] and "is not a .py file" in said[3]


def test_preload_flag_and_its_variable() -> None:
    assert parse_config(["x.py"], environ={}).preload == "off"
    assert parse_config(["x.py"], environ={PRELOAD_ENV: "torch"}).preload == "torch"
    assert parse_config(["--preload=off", "x.py"], environ={PRELOAD_ENV: "torch"}).preload == "off"
    with pytest.raises(LaunchInputError, match=f"{PRELOAD_ENV}='numpy'.*off, torch"):
        parse_config(["x.py"], environ={PRELOAD_ENV: "numpy"})
    with pytest.raises(LaunchInputError, match="--preload"):
        parse_config(["--preload=yes", "x.py"], environ={})


def test_a_preloaded_worker_ends_as_a_plain_interpreter(tmp_path: Path) -> None:
    """Exit status, output, a non-daemon thread, atexit and files left open: a child forked
    from the preload server (which ends without the interpreter's teardown) against the same
    script started plainly."""
    probe = ROOT / "tests" / "launch_workers" / "exit_probe.py"
    modes = ("normal", "exit3", "exit_text", "raise", "ctrl_c")
    env = {**os.environ, **preload_env(), "OMP_NUM_THREADS": "1"}  # the server's start-up setting
    assert env.get(SOCKET_ENV), "the suite's preload server is running (tests/conftest.py)"
    ends = {}
    for way in ("plain", "preloaded"):
        out = tmp_path / way
        out.mkdir()
        done = run_jobs([[sys.executable, "-u", str(probe), m, str(out)] for m in modes], cwd=tmp_path,
                        envs=[env] * len(modes), timeout=60, preload=way == "preloaded")
        for d in done:
            assert d.stdout.startswith(f"preloaded: {way == 'preloaded'}\n"), d.stdout
        ends[way] = {m: (d.returncode, d.stdout.split("\n", 1)[1].replace(str(out), "OUT"),
                         (out / f"{m}.order").read_text(), gzip.open(out / f"{m}.gz", "rt").read())
                     for m, d in zip(modes, done)}
    assert ends["preloaded"] == ends["plain"]
    codes = {m: e[0] for m, e in ends["plain"].items()}
    assert codes == {"normal": 0, "exit3": 3, "exit_text": 1, "raise": 1, "ctrl_c": -signal.SIGINT}
    for mode, (_, output, order, packed) in ends["plain"].items():
        assert output.startswith(f"{mode}: main done"), output
        assert order == "thread ended\natexit ran\n" and packed == f"{mode} " * 1000
    assert "leaving with a message" in ends["plain"]["exit_text"][1]
    assert "ValueError: the script failed" in ends["plain"]["raise"][1]
    # stdout and stderr apart (`helpers.popen_job`, the server's second descriptor): the same two
    # streams as from a plain `subprocess.Popen`
    apart = {}
    for way in ("plain", "preloaded"):
        out = tmp_path / f"{way}-apart"
        out.mkdir()
        procs = [popen_job([sys.executable, "-u", str(probe), m, str(out)], cwd=tmp_path, env=env,
                           preload=way == "preloaded") for m in ("exit_text", "raise")]
        apart[way] = [(p.communicate(timeout=60), p.returncode) for p in procs]
        assert [type(p).__name__ == "Popen" for p in procs] == [way == "plain"] * 2
    for (outs, code), (theirs, their_code) in zip(apart["plain"], apart["preloaded"]):
        assert code == their_code == 1
        assert outs[0].split("\n", 1)[1] == theirs[0].split("\n", 1)[1]
        assert outs[1].replace("plain-apart", "OUT") == theirs[1].replace("preloaded-apart", "OUT")
    (text_out, text_err), _ = apart["preloaded"][0]
    (raise_out, raise_err), _ = apart["preloaded"][1]
    assert "leaving with a message" in text_err and "leaving with a message" not in text_out
    assert "ValueError: the script failed" in raise_err and "Traceback" not in raise_out
    assert text_out.startswith("preloaded: True\nexit_text: main done")


def test_workers_started_side_by_side_run_in_the_folder_each_names(tmp_path: Path) -> None:
    """``start_preloaded(cwd=...)`` as ``Popen``'s ``cwd``: threads starting workers in different
    folders at once get each its own (a relative script is found there), and the caller's
    directory never moves (a process-wide ``chdir`` around each start would race)."""
    env = {**os.environ, **preload_env(), "OMP_NUM_THREADS": "1"}  # the server's start-up setting
    env["GLIBC_TUNABLES"] = tuned_glibc_tunables(env.get("GLIBC_TUNABLES"))
    assert env.get(SOCKET_ENV), "the suite's preload server is running (tests/conftest.py)"
    folders = [tmp_path / f"job{i}" for i in range(4)]
    for folder in folders:
        folder.mkdir()
        (folder / "where.py").write_text("import os\nprint(os.getcwd())\n")
    here = os.getcwd()

    def start(folder: Path) -> tuple[int, str]:
        proc = start_preloaded([sys.executable, "-u", "where.py"], env, stdout=None, rank=0, cwd=folder)
        assert proc is not None and proc.stdout is not None
        out = proc.stdout.read().decode()
        return proc.wait(30), out.strip()

    with concurrent.futures.ThreadPoolExecutor(len(folders)) as pool:
        got = list(pool.map(start, folders))
    assert got == [(0, str(folder)) for folder in folders]
    assert os.getcwd() == here


def test_an_accelerated_worker_forks_with_the_site_first_on_its_path(tmp_path: Path) -> None:
    """``--accelerate_ddp`` puts its site folder first on the workers' PYTHONPATH: a worker forked
    from a server started without it gets the same ``sys.path``, has ``fleetlike.auto`` imported
    before its script, and the user's ``sitecustomize`` that the folder's shadows has run once in
    its process, as at a plain start (the server ran it; the fork does not run it again)."""
    from fleetlike.launch.env import ACCELERATE_SITE
    from fleetlike.launch.preload import PreloadedProcess

    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import sys\nsys.user_site_runs = getattr(sys, 'user_site_runs', 0) + 1\n")
    probe = tmp_path / "site_probe.py"
    probe.write_text("import json, sys\n"
                     "print(json.dumps({'path': sys.path, 'auto': 'fleetlike.ddp.auto' in sys.modules,\n"
                     "                  'user_site_runs': getattr(sys, 'user_site_runs', 0)}))\n")
    path = os.pathsep.join(p for p in (str(user), os.environ.get("PYTHONPATH")) if p)
    # the server's start-up environment as tests/conftest.py makes it, with the user's folder
    server_env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    server_env.update(OMP_NUM_THREADS="1", PYTHONPATH=path,
                      GLIBC_TUNABLES=tuned_glibc_tunables(os.environ.get("GLIBC_TUNABLES")))
    seen = {}
    with preload_server(server_env) as socket_path:
        env = {**server_env, PRELOAD_ENV: "torch", SOCKET_ENV: socket_path, "FLEETLIKE_ACCELERATE_DDP": "1",
               "PYTHONPATH": ACCELERATE_SITE + os.pathsep + path}
        for way in ("plain", "preloaded"):
            proc, reader = start_job([sys.executable, "-u", str(probe)], cwd=tmp_path, env=env,
                                     preload=way == "preloaded")
            assert isinstance(proc, PreloadedProcess) == (way == "preloaded")
            text = reader.read().decode()
            reader.close()
            assert proc.wait(timeout=60) == 0, text
            seen[way] = json.loads(text.splitlines()[-1])
    assert seen["preloaded"] == seen["plain"]
    assert seen["plain"]["auto"] is True and seen["plain"]["path"][1] == ACCELERATE_SITE
    assert seen["plain"]["user_site_runs"] == 1


@pytest.mark.timeout(120)
def test_a_worker_stopped_as_it_starts_leaves_the_server_serving(tmp_path: Path) -> None:
    """SIGTERM to workers in their first moments (a launcher stopping a job that is still
    starting): each ends by that signal, and the shared server keeps its socket and starts the
    next worker."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(30)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "GLIBC_TUNABLES": tuned_glibc_tunables(os.environ.get("GLIBC_TUNABLES"))}
    log = open(tmp_path / "log", "wb")  # noqa: SIM115 - closed below
    with preload_server(env) as path, log:
        env[SOCKET_ENV] = path
        codes = []
        for rank in range(40):
            proc = start_preloaded([sys.executable, "-u", str(script)], env, stdout=log.fileno(), rank=rank)
            assert proc is not None, f"start {rank} was refused: the server lost its socket"
            proc.terminate()
            codes.append(proc.wait(timeout=30))
        assert os.path.exists(path)
        assert set(codes) == {-signal.SIGTERM}, codes


@pytest.mark.timeout(120)
def test_a_stopped_shared_server_closes_the_launchers_connections(tmp_path: Path) -> None:
    """SIGTERM to the shared server while a launcher is connected (a test session's end): the
    server closes that connection itself, so its exit prints no ResourceWarning (one per
    launcher connection did, at the end of every test session's output)."""
    path = str(tmp_path / "server.sock")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default::ResourceWarning",
           "GLIBC_TUNABLES": tuned_glibc_tunables(os.environ.get("GLIBC_TUNABLES"))}
    code = f"from fleetlike.launch.preload import serve_forever\nserve_forever({path!r})\n"
    server = subprocess.Popen([sys.executable, "-u", "-c", code], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert server.poll() is None and time.monotonic() < deadline, "the server never bound its socket"
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(path)
            hello, _ = receive(sock)  # sent once the server serves (its imports done)
            assert hello is not None and hello["op"] == "hello"
            server.terminate()
            _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 128 + signal.SIGTERM, stderr
    assert "ResourceWarning" not in stderr, stderr
    assert not os.path.exists(path)

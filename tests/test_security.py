"""Who may join a job: a process without the job's secret is refused at every door.

A real launched job (two ranks, the second starting late) while a stranger, a process without
the secret, reads the store, overwrites keys, tries to take the late rank's seat with
``hvd.init()`` and sends pickled payloads; an elastic rendezvous the stranger tries to join; a
payload signed with another secret inside a formed world. Every attempt is refused or harmless,
no payload runs (its marker file never appears) and the jobs finish with the right results. The
forged ``--rendezvous_file`` is in test_launch_meeting.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fleetlike.comm import host_store
from fleetlike.comm.secret import JobSecret, PayloadRefused, new_secret
from fleetlike.testing import run_ranks
from helpers import popen_job, preload_env, run_job, run_jobs

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "launch_workers"
PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PADDLE_", "FLEETLIKE_", "TORCHELASTIC", "OMPI_", "PMI_", "SLURM_"))
           and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def _free_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _wait_for_store(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import datetime

    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                pass
            raw = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=5))
            if raw.check(["fleetlike/job"]):
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the job's store on port {port} never came up (launcher: {proc.poll()})")


def _stranger(endpoint: str, marker: Path, report: Path, *args: str) -> dict[str, Any]:
    # forked from the session's preload server: how the stranger starts is not the question
    done = run_job([PY, str(WORKERS / "stranger.py"), endpoint, str(marker), str(report), *args],
                   cwd=report.parent, env=_env(**preload_env()), timeout=90)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads(report.read_text())


@pytest.mark.timeout(240)
def test_a_stranger_cannot_enter_a_launched_job(tmp_path: Path) -> None:
    port = _free_pair()
    out, go, marker = tmp_path / "out", tmp_path / "go", tmp_path / "payload-ran"
    out.mkdir()
    # forked from the session's preload server, as its workers are (`helpers.popen_job`)
    launcher = popen_job(
        [PY, "-m", "fleetlike.launch", "--nproc_per_node=2", f"--started_port={port}",
         f"--log_dir={tmp_path / 'log'}", str(WORKERS / "secure_job.py"), str(out), str(go)],
        cwd=tmp_path, env=_env(**preload_env()))
    try:
        _wait_for_store(port, launcher)
        endpoints = f"127.0.0.1:{port},127.0.0.1:{port + 1}"
        report = _stranger(f"127.0.0.1:{port}", marker, tmp_path / "report.json", "store", endpoints)
        go.touch()  # now the late rank arrives
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
            launcher.communicate()
    assert launcher.returncode == 0, stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:  # the job's own answer, as without the stranger
        assert res["gathered"] == [0, 1] and res["size"] == 2 and res["sum"] == 3.0
        assert res["broadcast"] == {"from": 0, "epoch": 7}
    assert not marker.exists()  # no payload was ever unpickled anywhere
    job_id = results[0]["job_id"]
    # what the stranger could read: no job id, no key of the job
    assert report["read"]["fleetlike/job_id"] is None
    assert job_id not in json.dumps(report["read"])
    for name in ("join_wrong_secret", "join_no_secret"):  # refused, with the reason
        assert not report[name]["ok"], report[name]
        assert "SecretMismatchError" in report[name]["error"]
    assert "does not hold this job's secret" in report["join_wrong_secret"]["error"]
    assert "FLEETLIKE_JOB_SECRET" in report["join_no_secret"]["error"]
    # overwriting the public keys was possible, and harmless: the job finished above
    assert report["set fleetlike/job"]["ok"]
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    assert "refused a process without this job's secret" in log0
    assert f"it says it is 127.0.0.1:{port + 1}" in log0  # the stranger's address, in rank 0's log


@pytest.mark.timeout(180)
def test_a_stranger_cannot_join_an_elastic_rendezvous(tmp_path: Path) -> None:
    """The stranger cannot become a member (so never rank 0, the root of the state sync); the
    state it plants where torch's rendezvous kept it without a prefix is never read."""
    secret = new_secret()
    store = host_store("127.0.0.1", "elastic-job", 30.0, secret=JobSecret(secret))
    endpoint = f"127.0.0.1:{store.port}"
    marker = tmp_path / "payload-ran"
    report = _stranger(endpoint, marker, tmp_path / "report.json", "elastic", "elastic-job")
    assert not report["join_wrong_secret"]["ok"]
    assert "does not hold this job's secret" in report["join_wrong_secret"]["error"]
    assert report["plant state"]["ok"]
    env = _env(FLEETLIKE_JOB_SECRET=secret, FLEETLIKE_ELASTIC_STORE=endpoint, FLEETLIKE_ELASTIC_MIN_WORKERS="2",
               FLEETLIKE_ELASTIC_MAX_WORKERS="2", FLEETLIKE_ELASTIC_LAST_CALL="1",
               FLEETLIKE_ELASTIC_RUN_ID="elastic-job", FLEETLIKE_NODE_IP="127.0.0.1")
    out = tmp_path / "out"
    out.mkdir()
    members = run_jobs([[PY, str(WORKERS / "elastic_member.py"), str(out)]] * 2, cwd=tmp_path, timeout=120,
                       envs=[{**env, **preload_env(), "LOCAL_RANK": str(i),
                              "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{40000 + i}"} for i in range(2)])
    for proc in members:
        assert proc.returncode == 0, proc.stdout[-3000:]
    got = sorted((json.loads(p.read_text()) for p in out.iterdir()), key=lambda r: r["rank"])
    assert [r["rank"] for r in got] == [0, 1] and all(r["size"] == 2 and r["sum"] == 3.0 for r in got)
    assert [r["endpoint"] for r in got] == ["127.0.0.1:40000", "127.0.0.1:40001"]  # members only
    assert all(r["synced"] == {"state": "from rank 0"} for r in got)
    assert not marker.exists()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def _forged_payloads(role: Any, marker: str) -> dict[str, str]:
    """Inside a formed world, rank 1 signs with another secret (as a process without the job's
    would have to): rank 0 refuses every payload before unpickling it."""
    import fleetlike.horovod as hvd
    from fleetlike.comm import secret as job_secret
    from fleetlike.horovod.runtime import runtime

    hvd.init(role_maker=role)
    world = runtime("test").comm
    if role.rank == 1:
        job_secret.set_current(JobSecret(new_secret()))
    seen: dict[str, str] = {}
    for name, call in [("allgather_object", lambda: hvd.allgather_object(_Payload(marker))),
                       ("broadcast_object", lambda: hvd.broadcast_object(_Payload(marker), root_rank=1))]:
        try:
            call()
            seen[name] = "loaded"
        except PayloadRefused as exc:
            seen[name] = str(exc)
    blob = job_secret.dumps_signed(_Payload(marker), "elastic.sync", 1) if role.rank == 1 else b""
    size = world.broadcast(torch.tensor([len(blob)], dtype=torch.int64), 1)
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(int(size.item()), dtype=torch.uint8)
    data = world.broadcast(buf, 1).numpy().tobytes()
    if role.rank == 0:
        try:
            job_secret.loads_signed(data, "elastic.sync", 1)
            seen["elastic.sync"] = "loaded"
        except PayloadRefused as exc:
            seen["elastic.sync"] = str(exc)
    hvd.shutdown()
    return seen


@pytest.mark.timeout(120)
def test_payloads_signed_with_another_secret_are_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    results = run_ranks(_forged_payloads, 2, str(marker), timeout=90)
    for name in ("allgather_object", "broadcast_object", "elastic.sync"):
        assert "does not carry this job's signature" in results[0][name]
        assert "from rank 1" in results[0][name]
    assert not marker.exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(90)
def test_kill_9_of_the_launcher_takes_the_workers_children_too(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [PY, "-m", "fleetlike.launch", "--nproc_per_node=1", "--started_port=auto",
         f"--log_dir={tmp_path / 'log'}", str(WORKERS / "with_child.py"), str(tmp_path)],
        cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids.0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p) for p in (tmp_path / "pids.0").read_text().split()]
        assert all(_alive(p) for p in pids)
        launcher.kill()  # SIGKILL: the launcher cannot clean up
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a worker or its child outlived the launcher"
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except OSError:
                pass

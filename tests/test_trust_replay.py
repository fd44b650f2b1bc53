"""Values of one run of a job written back into the next run of the same job.

A job that exports the same ``FLEETLIKE_JOB_SECRET`` for every run uses the same store keys
every run, and its key prefix crosses the wire in clear. So a network observer can read a
signed value in one run and write its bytes back at the same key in the next. Every signed
value also carries the run's nonce (the random greeting the store's host writes when it creates
the store), so such a value is refused, naming the key; rank 0's admission is not stalled by a
counter a stranger moved or a proof slot it filled.
"""

from __future__ import annotations

import datetime
import json
import secrets
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fleetlike.comm import JobSecret, job_store
from fleetlike.comm.rendezvous import greet
from fleetlike.comm.signed_store import StoreTampered

from test_launch_run import PY, WORKERS, Launchers, clean_env, finish
from test_trust import free_port, launchers, wait_for  # noqa: F401 - launchers is a fixture

pytestmark = [pytest.mark.timeout(180), pytest.mark.alone]

_SECOND = datetime.timedelta(seconds=2)


def _server(secret: JobSecret) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", 0, None, True, _SECOND)
    greet(store, secret, "job")
    return store


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, _SECOND)


def test_a_value_of_an_earlier_run_is_refused_naming_its_key() -> None:
    """Same secret, same key, two stores (two runs): the bytes signed in the first verify
    there and are refused in the second; a value signed in the second run verifies."""
    secret = JobSecret(secrets.token_hex(32))
    first, second = _server(secret), _server(secret)
    job_store(_client(first), secret).set("torch.rendezvous.demo", b"state of run 1")
    captured = _client(first).get(secret.prefix + "/torch.rendezvous.demo")  # what the wire shows
    assert job_store(_client(first), secret).get("torch.rendezvous.demo") == b"state of run 1"
    _client(second).set(secret.prefix + "/torch.rendezvous.demo", captured)
    member = job_store(_client(second), secret)
    with pytest.raises(StoreTampered, match="the value of 'torch.rendezvous.demo' .* not signed with this "
                                            "job's secret for this run: .* captured in an earlier run"):
        member.get("torch.rendezvous.demo")
    member.set("torch.rendezvous.demo", b"state of run 2")
    assert job_store(_client(second), secret).get("torch.rendezvous.demo") == b"state of run 2"


def test_a_deleted_greeting_is_an_error_not_a_wait() -> None:
    """A member that must check a value but finds no greeting (a stranger deleted it) says so
    at once instead of waiting for the store's timeout."""
    secret = JobSecret(secrets.token_hex(32))
    server = _server(secret)
    job_store(server, secret).set("x", b"1")
    _client(server).delete_key(secret.prefix + "/challenge")
    member = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=60))
    started = time.monotonic()
    with pytest.raises(StoreTampered, match="holds no greeting"):
        job_store(member, secret).get("x")
    assert time.monotonic() - started < 10  # not the store's 60 s wait


def _greeted(port: int, secret: JobSecret) -> bool:
    try:
        raw = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=1))
        return bool(raw.check([secret.prefix + "/challenge"]))
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def test_torch_rendezvous_state_captured_in_one_run_is_refused_in_the_next(
        tmp_path: Path, launchers: Launchers) -> None:
    """Two runs of one elastic job with the same exported secret and job id. In the first, an
    observer who learned the key prefix off the wire reads the raw bytes of torch's rendezvous
    state (a value torch unpickles); in the second, it writes them back at the same key before
    the worker joins. The worker refuses them unread, naming the key, and nothing of the first
    run is used."""
    secret = JobSecret(launchers.secret)
    key = "torch.rendezvous.demo"
    out1, out2, go, hold = tmp_path / "out1", tmp_path / "out2", tmp_path / "go", tmp_path / "hold"
    out1.mkdir()
    out2.mkdir()
    go.touch()
    flags = ["--nnodes=1:2", "--node_ip=127.0.0.1", "--nproc_per_node=1", "--rdzv_last_call=1", "--job_id=demo"]
    port = free_port()
    first = launchers.start(*flags, f"--rdzv_endpoint=127.0.0.1:{port}", "--log_dir=log1",
                            str(WORKERS / "elastic_wait.py"), str(out1), str(go), str(hold))
    wait_for(lambda: any(out1.glob("formed*")), "formed world in the first run", first)
    raw = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    captured = raw.get(secret.prefix + "/" + key)
    assert job_store(raw, secret).get(key)  # a genuine value of the first run
    hold.touch()
    code, _, said = finish(first, timeout=90)
    assert code == 0, said
    go.unlink()
    port = free_port()
    second = launchers.start(*flags, f"--rdzv_endpoint=127.0.0.1:{port}", "--log_dir=log2",
                             str(WORKERS / "elastic_wait.py"), str(out2), str(go))
    wait_for(lambda: _greeted(port, secret), "the second run's store", second)
    attacker = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    attacker.set(secret.prefix + "/" + key, captured)
    go.touch()
    code, _, said = finish(second, timeout=120)
    assert code != 0, said
    log = (tmp_path / "log2" / "workerlog.0").read_text()
    assert f"the value of '{key}'" in log and "captured in an earlier run" in log, log[-3000:]
    assert list(out2.iterdir()) == []  # no world was formed from the first run's state


def _ranks(tmp_path: Path, secret: str, spoil) -> tuple[list[dict], str]:
    """Two ranks meeting through the rendezvous: rank 0 starts at once, rank 1 when ``spoil``
    (the stranger's move, given a raw client and the job's key space as the wire shows it) is
    done. The ranks' reports and rank 0's output."""
    from helpers import preload_env, run_jobs

    port = free_port()
    endpoints = f"127.0.0.1:{port},127.0.0.1:{free_port()}"
    go, env = tmp_path / "go", {**clean_env(FLEETLIKE_JOB_SECRET=secret), **preload_env()}
    cmds = [[PY, str(WORKERS / "admit_rank.py"), str(r), endpoints, "jobx", str(go if r else tmp_path / "now"),
             str(tmp_path / f"rank{r}.json")] for r in (0, 1)]
    (tmp_path / "now").touch()
    spoiler = threading.Thread(target=_after_greeting, args=(port, JobSecret(secret), spoil, go), daemon=True)
    spoiler.start()
    done = run_jobs(cmds, cwd=tmp_path, envs=[env, env], timeout=90)
    spoiler.join(10)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)], done[0].stdout


def _after_greeting(port: int, secret: JobSecret, spoil, go: Path) -> None:
    deadline = time.monotonic() + 60
    while not _greeted(port, secret) and time.monotonic() < deadline:
        time.sleep(0.02)
    raw = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    try:
        spoil(raw, secret.prefix + "/job/jobx/0//")  # the meeting's key space, as the wire shows it
    finally:
        go.touch()


def test_a_moved_counter_and_a_forged_proof_do_not_stall_admission(tmp_path: Path) -> None:
    """A holder of the key prefix moves the proofs' counter by a million (slots nobody writes)
    and fills the next slot with a proof it cannot sign, before rank 1 arrives: rank 0 drops
    that proof with a line in its log, waits for none of the empty slots, and seats rank 1."""
    def spoil(raw: dist.TCPStore, space: str) -> None:
        assert raw.add(space + "proofs", 1_000_000) == 1_000_000
        raw.set(space + "proof/1000000", json.dumps({"rank": 1, "endpoint": "10.6.6.6:1", "fresh": "0",
                                                    "tag": "0" * 64}))

    reports, said = _ranks(tmp_path, secrets.token_hex(32), spoil)
    assert reports[0]["ok"] and reports[1]["ok"], reports
    assert reports[0]["other"] == "from rank 1" and reports[1]["other"] == "from rank 0"
    assert reports[0]["seconds"] < 15, reports
    assert "rank 0 dropped proof 1000000: it is not a proof signed with this job's secret" in said, said[-2000:]


def test_a_counter_made_a_non_number_is_a_clear_error_within_seconds(tmp_path: Path) -> None:
    """A counter overwritten with text makes the store drop the connection of whoever counts
    next: both ranks stop within seconds, naming the counter and the interference, rather than
    waiting for the rendezvous timeout."""
    reports, _ = _ranks(tmp_path, secrets.token_hex(32),
                        lambda raw, space: raw.set(space + "proofs", "not a number"))
    for report in reports:
        assert not report["ok"], reports
        assert "the job's counter 'proofs'" in report["error"] and "interference" in report["error"], report
        assert report["seconds"] < 10, reports

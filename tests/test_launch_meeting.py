"""``--started_port=auto`` on several nodes, in one process: the launchers of two loopback "nodes"
(127.0.0.1 and 127.0.0.2) meet through a rendezvous file (`fleetlike.launch.meeting`), and a
file left by another job or an earlier run is never joined, nor one forged to name a store outside
the cluster (in process, and with real launcher processes). The jobs of real launchers that
succeed are in test_launch_run.py."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetlike.launch import LaunchConfig, MeetingError, format_config, meet, worker_env
from fleetlike.launch.checks import host_ports
from fleetlike.launch.meeting import StoreAddress, read_address, remove_address, write_address
from fleetlike.launch.ports import HostedEndpoints
from helpers import preload_env, start_job

pytestmark = pytest.mark.timeout(60)

IPS = ("127.0.0.1", "127.0.0.2")


def node_config(node: int, rdzv: Path, timeout: float = 20.0, job: str = "jm") -> LaunchConfig:
    return LaunchConfig("train.py", cluster_node_ips=IPS, node_ip=IPS[node], started_port=None,
                        nproc_per_node=2, job_id=job, rendezvous_file=str(rdzv),
                        rendezvous_timeout=timeout)


@pytest.fixture()
def held() -> Iterator[Callable[[LaunchConfig], tuple[LaunchConfig, HostedEndpoints]]]:
    """host_ports, with everything it bound released when the test ends."""
    opened: list[HostedEndpoints] = []

    def bind(config: LaunchConfig) -> tuple[LaunchConfig, HostedEndpoints]:
        config, hosted = host_ports(config)
        opened.append(hosted)
        return config, hosted

    yield bind
    for hosted in opened:
        hosted.close()


def meet_in_thread(config: LaunchConfig, hosted: HostedEndpoints) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["config"] = meet(config, hosted)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_two_nodes_meet_and_agree_on_every_endpoint(tmp_path: Path, held) -> None:
    rdzv = tmp_path / "rdzv"
    first, hosted0 = held(node_config(0, rdzv))
    second, hosted1 = held(node_config(1, rdzv))
    assert hosted0.store is not None and hosted1.store is None  # only node 0 hosts
    with pytest.raises(ValueError, match="known once the launchers have met"):
        second.endpoints  # noqa: B018
    rows = format_config(second)
    assert "master_endpoint     chosen at start" in rows
    assert f"rendezvous_file     {rdzv} (timeout 20 s)" in rows
    thread, result = meet_in_thread(second, hosted1)  # the other node may well start first
    met0 = meet(first, hosted0)
    thread.join(30)
    met1 = result["config"]
    assert met0.endpoints == met1.endpoints == hosted0.endpoints + hosted1.endpoints
    assert met0.master_endpoint == f"127.0.0.1:{hosted0.store.port}"
    assert not rdzv.exists()  # removed once every node had joined
    env = worker_env(met1, 1, base={})
    assert env["PADDLE_TRAINER_ENDPOINTS"] == ",".join(met0.endpoints)
    assert env["PADDLE_CURRENT_ENDPOINT"] == hosted1.endpoints[1]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(hosted0.store.port))
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    here = ",".join(map(str, hosted1.ports))
    assert f"auto ({here} here; store hosted by node 0's launcher)" in format_config(met1)


def test_the_file_is_written_atomically_and_removed_only_by_its_writer(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    mine = StoreAddress("127.0.0.1:4000", "j", "t1", "ab" * 32)
    write_address(str(path), mine)
    write_address(str(path), dataclasses.replace(mine, token="t2"))  # replaces, never appends
    assert read_address(str(path)) == dataclasses.replace(mine, token="t2")
    assert [p.name for p in tmp_path.iterdir()] == ["rdzv"]  # no temporary file left behind
    assert path.stat().st_mode & 0o777 == 0o600  # it holds the job's secret
    path.chmod(0o666)
    with pytest.raises(ValueError, match="nobody else may write it"):
        read_address(str(path))  # a file others may write is never trusted
    path.chmod(0o600)
    assert not remove_address(str(path), "t1") and path.exists()  # a later job's file stays
    assert remove_address(str(path), "t2") and not path.exists()
    assert read_address(str(path)) is None
    path.write_text("host=1.2.3.4\n")
    with pytest.raises(ValueError, match="not JSON"):
        read_address(str(path))


def test_a_file_that_never_appears_fails_within_the_timeout(tmp_path: Path, held) -> None:
    config, hosted = held(node_config(1, tmp_path / "rdzv", timeout=0.5))
    with pytest.raises(MeetingError) as info:
        meet(config, hosted)
    assert str(info.value).startswith(
        f"node 1 (127.0.0.2): --rendezvous_file={tmp_path / 'rdzv'} does not exist after waiting "
        "0.5s (--rendezvous_timeout). Node 0's launcher (127.0.0.1) writes it")


def test_a_stale_file_is_never_joined(tmp_path: Path, held) -> None:
    """Left by an earlier run of the same job: its store is gone, or (the earlier run still
    running) alive with another token; and a file of another job. Each makes the launcher wait
    for node 0's own file, and says what it found if that never comes."""
    rdzv = tmp_path / "rdzv"
    earlier, hosted_earlier = held(node_config(0, tmp_path / "earlier"))
    assert hosted_earlier.store is not None
    live = StoreAddress(hosted_earlier.endpoints[0], "jm", "the-earlier-runs-token", earlier.job_secret)
    dead = dataclasses.replace(live, store="127.0.0.1:1")
    other_job = dataclasses.replace(live, job_id="someone-else")
    second, hosted1 = held(node_config(1, rdzv, timeout=0.6))
    for stale, found in [
        (dead, "names the store at 127.0.0.1:1, where nothing answers"),
        (live, f"names the store at {live.store}, which belongs to another run"),
        (other_job, "names job 'someone-else', not this launcher's 'jm'"),
        (dataclasses.replace(live, secret="cd" * 32),
         f"names the store at {live.store}, which does not greet with the file's secret"),
    ]:
        write_address(str(rdzv), stale)
        with pytest.raises(MeetingError, match=re.escape(found)):
            meet(second, hosted1)
    # the same stale file, replaced by node 0's launcher while node 1 waits: node 1 joins
    write_address(str(rdzv), live)
    slow = dataclasses.replace(second, rendezvous_timeout=20.0)
    thread, result = meet_in_thread(slow, hosted1)
    first, hosted0 = held(node_config(0, rdzv))
    met0 = meet(first, hosted0)
    thread.join(30)
    assert result["config"].endpoints == met0.endpoints
    assert result["config"].master_endpoint == hosted0.endpoints[0] != live.store


def test_a_second_launcher_for_the_same_node_is_refused(tmp_path: Path, held) -> None:
    rdzv = tmp_path / "rdzv"
    first, hosted0 = held(node_config(0, rdzv, timeout=3))
    twice = [held(node_config(1, rdzv, timeout=3)) for _ in range(2)]
    threads = [meet_in_thread(config, hosted) for config, hosted in twice]
    met0 = meet(first, hosted0)
    for thread, _ in threads:
        thread.join(30)
    outcomes = sorted((("config" in r), str(r.get("error", ""))) for _, r in threads)
    assert outcomes[1][0] and not outcomes[0][0]
    assert "another launcher already joined job 'jm' as node 1" in outcomes[0][1]
    assert met0.endpoints[2:] in {h.endpoints for _, h in twice}


def test_node_0_reports_the_nodes_that_never_joined(tmp_path: Path, held) -> None:
    config, hosted = held(node_config(0, tmp_path / "rdzv", timeout=0.5))
    with pytest.raises(MeetingError) as info:
        meet(config, hosted)
    assert (f"at the store {hosted.endpoints[0]} of job 'jm', but node(s) 1 (127.0.0.2) did not "
            "join") in str(info.value)
    assert not (tmp_path / "rdzv").exists()  # node 0 leaves no file behind


def test_a_forged_file_naming_a_store_outside_the_cluster_is_refused(tmp_path: Path, held) -> None:
    """Whoever can write the file hosts a store at an address outside --cluster_node_ips (its
    own secret, its own job id in the file): node 1 never joins it, says so naming both
    addresses, and meets node 0 once node 0's launcher writes the real file."""
    from fleetlike.comm import host_store
    from fleetlike.comm.secret import JobSecret, new_secret

    rdzv = tmp_path / "rdzv"
    forged_secret = new_secret()
    outside = host_store("127.0.0.77", "jm", 10.0, secret=JobSecret(forged_secret))
    forged = StoreAddress(f"127.0.0.77:{outside.port}", "jm", "forged-token", forged_secret)
    outside_job = dataclasses.replace(node_config(1, rdzv, timeout=0.6), job_id_from_file=True)
    second, hosted1 = held(outside_job)
    write_address(str(rdzv), forged)
    with pytest.raises(MeetingError) as info:
        meet(second, hosted1)
    assert (f"names a store at 127.0.0.77:{outside.port}, but node 0 is --cluster_node_ips[0]=127.0.0.1"
            in str(info.value))
    from fleetlike.comm.rendezvous import job_store
    forged_space = job_store(outside, JobSecret(forged_secret))
    assert not forged_space.check(["launch/jm/claim/1"])  # node 1 published nothing there
    thread, result = meet_in_thread(dataclasses.replace(second, rendezvous_timeout=20.0), hosted1)
    first, hosted0 = held(node_config(0, rdzv))
    met0 = meet(first, hosted0)
    thread.join(30)
    met1 = result["config"]
    assert met1.endpoints == met0.endpoints and met1.master_endpoint == hosted0.endpoints[0]
    assert met1.job_secret == first.job_secret and met1.job_id == "jm"  # node 0's, from its file


def _launcher(rdzv: Path, node: int, timeout: float, out: Path, secret: str, *, plain: bool = False) -> Any:
    """Node ``node``'s launcher: forked from the session's preload server (a `helpers.start_job`
    pair: process, reader of its output), or with ``plain`` a `subprocess.Popen` with its own
    stderr."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PADDLE_", "FLEETLIKE_", "TORCHELASTIC", "OMPI_", "PMI_", "SLURM_"))
           and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(OMP_NUM_THREADS="1", FLEETLIKE_JOB_SECRET=secret, **preload_env())
    cmd = [sys.executable, "-m", "fleetlike.launch", f"--cluster_node_ips={','.join(IPS)}",
           f"--node_ip={IPS[node]}", "--started_port=auto", f"--rendezvous_file={rdzv}", "--nproc_per_node=1",
           "--job_id=jr", f"--rendezvous_timeout={timeout:g}", f"--log_dir={out}/log{node}",
           str(Path(__file__).parent / "launch_workers" / "behave.py"), str(out), "--ok"]
    if not plain:
        return start_job(cmd, cwd=out, env=env)
    return subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _ended(started: Any, timeout: float) -> tuple[int, str]:
    """A forked launcher's exit code and output, once it has ended (within ``timeout`` s)."""
    proc, reader = started
    text: list[bytes] = []
    drain = threading.Thread(target=lambda: text.append(reader.read()), daemon=True)
    drain.start()
    drain.join(timeout)
    assert not drain.is_alive(), f"the launcher (pid {proc.pid}) did not end in {timeout:g}s"
    reader.close()
    return proc.wait(timeout=10), text[0].decode(errors="replace")


@pytest.mark.timeout(120)
def test_real_launchers_refuse_a_forged_file_and_publish_nothing_there(tmp_path: Path) -> None:
    """Node 0's launcher (127.0.0.1) writes the file; someone rewrites it to name a store they
    host on 127.0.0.3 (their own secret and token, this job's id). Node 1's launcher (127.0.0.2)
    refuses it, naming both addresses, and the stranger's store never receives a key. With node
    0's file back, node 1's launcher joins and the job finishes."""
    from fleetlike.comm import host_store
    from fleetlike.comm.secret import JobSecret, new_secret

    rdzv, out, secret = tmp_path / "rdzv", tmp_path / "out", new_secret()
    out.mkdir()
    forged_secret = new_secret()
    stranger = host_store("127.0.0.3", "jr", 60.0, secret=JobSecret(forged_secret))
    forged = StoreAddress(f"127.0.0.3:{stranger.port}", "jr", "forged-token", forged_secret)
    first = _launcher(rdzv, 0, 90, out, secret)
    late: Any = None
    refused: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 60
        while not rdzv.exists() and time.monotonic() < deadline and first[0].poll() is None:
            time.sleep(0.05)
        real = read_address(str(rdzv))
        assert real is not None and real.store.startswith("127.0.0.1:") and real.secret == secret
        keys = stranger.num_keys()
        write_address(str(rdzv), forged)
        # the refusing launcher starts plainly: its error is on its own stderr
        refused = _launcher(rdzv, 1, 1, out, secret, plain=True)
        _, stderr = refused.communicate(timeout=60)
        assert refused.returncode == 1
        assert stderr.startswith(
            f"fleetlike.launch: node 1 (127.0.0.2): --rendezvous_file={rdzv} names a store at "
            f"{forged.store}, but node 0 is --cluster_node_ips[0]=127.0.0.1: the store's host must be "
            "node 0; refusing a file that would send this node elsewhere (forged, or written by another "
            "job) after waiting 1s (--rendezvous_timeout)"), stderr
        assert stranger.num_keys() == keys  # node 1 published nothing there
        assert not (out / "pid.1").exists() and first[0].poll() is None  # no worker; node 0 waits on
        write_address(str(rdzv), real)  # node 0's own file, put back
        late = _launcher(rdzv, 1, 60, out, secret)
        for started in (first, late):
            code, said = _ended(started, 60)
            assert code == 0, said
        assert sorted(p.name for p in out.glob("pid.*")) == ["pid.0", "pid.1"] and not rdzv.exists()
        assert stranger.num_keys() == keys
    finally:
        for proc in (first[0], late and late[0], refused):
            if proc and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

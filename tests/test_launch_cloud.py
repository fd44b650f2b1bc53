"""``--use_paddlecloud``: the node layout read from PaddleCloud's environment as Paddle's launcher
reads it (``cloud_utils.get_cloud_cluster``: PADDLE_TRAINERS_NUM, PADDLE_TRAINERS, POD_IP,
PADDLE_TRAINER_ID, TRAINER_PORTS_NUM, PADDLE_PORT, DISTRIBUTED_TRAINER_ENDPOINTS), every missing
or contradictory variable an input error naming it, and a real two-"node" job on the loopback
cluster whose launchers know only the cloud's variables (ports chosen by the launchers, meeting
through a rendezvous file: no test chooses a port)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from examples_common import clean_env

from fleetlike.launch import LaunchInputError, main, parse_config, worker_env

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "launch_workers"


def cloud(node: int = 1, nodes: int = 2, **extra: str) -> dict[str, str]:
    """The variables PaddleCloud sets on node ``node`` of ``nodes`` (10.0.0.1, 10.0.0.2, ...)."""
    ips = [f"10.0.0.{i + 1}" for i in range(nodes)]
    env = {"PADDLE_TRAINERS_NUM": str(nodes), "PADDLE_TRAINERS": ",".join(ips), "POD_IP": ips[node],
           "PADDLE_TRAINER_ID": str(node), "TRAINER_PORTS_NUM": "4", "PADDLE_PORT": "7100",
           "FLEETLIKE_JOB_SECRET": "5e" * 32}  # the job's nodes share it (fixed ports: nothing else could)
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def parse(env: dict[str, str], *flags: str, nproc: int = 2):
    return parse_config(["--use_paddlecloud", f"--nproc_per_node={nproc}", *flags, "train.py"],
                        device_count=lambda: 0, environ=env)


def test_the_cloud_decides_nodes_this_node_and_ports() -> None:
    c = parse(cloud(node=1))
    assert (c.cluster_node_ips, c.node_ip, c.node_index, c.started_port) == (("10.0.0.1", "10.0.0.2"), "10.0.0.2", 1, 7100)
    assert c.endpoints == ("10.0.0.1:7100", "10.0.0.1:7101", "10.0.0.2:7100", "10.0.0.2:7101")
    env = worker_env(c, 1, base=cloud(node=1))
    # the workers get their own rank and the world size, not the cloud's node-level values
    assert (env["PADDLE_TRAINER_ID"], env["PADDLE_TRAINERS_NUM"], env["PADDLE_CURRENT_ENDPOINT"]) == (
        "3", "4", "10.0.0.2:7101")
    # without PADDLE_PORT, --started_port decides (Paddle: args.started_port, else 6170)
    assert parse(cloud(PADDLE_PORT=None), "--started_port=7300").endpoints[0] == "10.0.0.1:7300"
    assert parse(cloud(PADDLE_PORT=None)).started_port == 6170
    # the flags may repeat what the cloud says
    same = parse(cloud(), "--node_ip=10.0.0.2", "--cluster_node_ips=10.0.0.1,10.0.0.2", "--started_port=7100")
    assert same == parse(cloud())
    # several-node job ids are a digest of the layout: every node derives the same
    assert parse(cloud(node=0)).job_id == parse(cloud(node=1)).job_id


def test_distributed_trainer_endpoints_fix_every_port() -> None:
    listed = "10.0.0.1:9000,10.0.0.1:9005,10.0.0.1:9007,10.0.0.2:8000,10.0.0.2:8100,10.0.0.2:8200"
    c = parse(cloud(node=1, TRAINER_PORTS_NUM="3", DISTRIBUTED_TRAINER_ENDPOINTS=listed))
    # the first nproc of each node's reserved ports, as Paddle's get_cluster takes them
    assert c.endpoints == ("10.0.0.1:9000", "10.0.0.1:9005", "10.0.0.2:8000", "10.0.0.2:8100")
    assert c.local_ports == (8000, 8100)
    assert worker_env(c, 0, base={})["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:8000"


def test_a_single_node_cloud_job_uses_the_flags() -> None:
    c = parse({"PADDLE_TRAINERS_NUM": "1", "POD_IP": "10.9.9.9"}, "--started_port=7000")
    assert (c.cluster_node_ips, c.node_ip, c.endpoints) == (("127.0.0.1",), "127.0.0.1", ("127.0.0.1:7000", "127.0.0.1:7001"))
    assert c.use_paddlecloud


@pytest.mark.parametrize("env, flags, message", [
    ({}, (), "PADDLE_TRAINERS_NUM is not set; --use_paddlecloud reads the job from PaddleCloud's environment"),
    (cloud(PADDLE_TRAINERS=None), (), "PADDLE_TRAINERS is not set"),
    (cloud(POD_IP=None), (), "POD_IP is not set"),
    (cloud(PADDLE_TRAINER_ID=None), (), "PADDLE_TRAINER_ID is not set"),
    (cloud(TRAINER_PORTS_NUM=None), (), "TRAINER_PORTS_NUM is not set"),
    (cloud(PADDLE_TRAINERS_NUM="two"), (), "PADDLE_TRAINERS_NUM='two' is not an integer"),
    (cloud(PADDLE_TRAINERS_NUM="3"), (), "PADDLE_TRAINERS='10.0.0.1,10.0.0.2' lists 2 node(s) but PADDLE_TRAINERS_NUM=3"),
    (cloud(POD_IP="10.0.0.9"), (), "POD_IP=10.0.0.9 is not in PADDLE_TRAINERS=10.0.0.1,10.0.0.2"),
    (cloud(PADDLE_TRAINER_ID="0"), (), "PADDLE_TRAINER_ID=0 contradicts POD_IP=10.0.0.2, which is node 1"),
    (cloud(TRAINER_PORTS_NUM="1"), (), "TRAINER_PORTS_NUM=1 reserves fewer ports than the 2 processes per node"),
    (cloud(PADDLE_PORT="65535"), (), "PADDLE_PORT=65535 with 2 processes per node needs ports above 65535"),
    (cloud(PADDLE_TRAINERS="10.0.0.1,10.0.0.1", POD_IP="10.0.0.1"), (), "lists a node twice"),
    (cloud(DISTRIBUTED_TRAINER_ENDPOINTS="10.0.0.1:1,10.0.0.2:2"), (),
     "DISTRIBUTED_TRAINER_ENDPOINTS lists 2 endpoints but PADDLE_TRAINERS has 2 node(s) and TRAINER_PORTS_NUM=4"),
    (cloud(TRAINER_PORTS_NUM="2", DISTRIBUTED_TRAINER_ENDPOINTS="10.0.0.2:1,10.0.0.2:2,10.0.0.1:3,10.0.0.1:4"), (),
     "DISTRIBUTED_TRAINER_ENDPOINTS: 10.0.0.2:1 is in node 0's block but PADDLE_TRAINERS says node 0 is 10.0.0.1"),
    (cloud(), ("--node_ip=10.0.0.1",), "--node_ip=10.0.0.1 contradicts POD_IP=10.0.0.2"),
    (cloud(), ("--cluster_node_ips=10.0.0.1,10.0.0.3",), "--cluster_node_ips=10.0.0.1,10.0.0.3 contradicts PADDLE_TRAINERS=10.0.0.1,10.0.0.2"),
    (cloud(), ("--started_port=7200",), "--started_port=7200 contradicts PADDLE_PORT (the cloud reserved port 7100"),
    (cloud(), ("--started_port=auto",), "--started_port=auto contradicts PADDLE_PORT"),
])
def test_missing_or_contradictory_variables_are_input_errors(
    env: dict[str, str], flags: tuple[str, ...], message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    with pytest.raises(LaunchInputError) as info:
        parse(env, *flags)
    assert message in str(info.value)
    # and through the command line: exit 2, one line naming it, nothing started
    for name in ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINERS", "POD_IP", "PADDLE_TRAINER_ID", "TRAINER_PORTS_NUM",
                 "PADDLE_PORT", "DISTRIBUTED_TRAINER_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    code = main(["--use_paddlecloud", "--nproc_per_node=2", *flags, str(script)], device_count=lambda: 0)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("fleetlike.launch: error:")
    assert not (tmp_path / "log").exists()


def test_without_the_flag_the_cloud_variables_are_not_read() -> None:
    c = parse_config(["--nproc_per_node=2", "train.py"], device_count=lambda: 0, environ=cloud(POD_IP="bad ip"))
    assert c.cluster_node_ips == ("127.0.0.1",) and not c.use_paddlecloud


@pytest.mark.slow
def test_two_cloud_nodes_run_a_job(tmp_path: Path) -> None:
    """Two launchers on the loopback "nodes" 127.0.0.1 / 127.0.0.2 given the same command; each
    knows its node only from POD_IP / PADDLE_TRAINER_ID. The workers' detected roles agree with
    the cloud's layout."""
    out = tmp_path / "out"
    out.mkdir()
    ips = "127.0.0.1,127.0.0.2"
    procs = []
    for node, ip in enumerate(ips.split(",")):
        env = clean_env(PADDLE_TRAINERS_NUM="2", PADDLE_TRAINERS=ips, POD_IP=ip, PADDLE_TRAINER_ID=str(node),
                        TRAINER_PORTS_NUM="2")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fleetlike.launch", "--use_paddlecloud", "--nproc_per_node=2",
             "--started_port=auto", f"--rendezvous_file={tmp_path / 'rdzv'}", f"--log_dir={tmp_path / f'log{node}'}",
             str(WORKERS / "print_role.py"), str(out)],
            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    try:
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0], [r[1] for r in results]
    roles = [json.loads((out / f"role.{r}.json").read_text())["role"] for r in range(4)]
    assert [r["rank"] for r in roles] == [0, 1, 2, 3]
    assert {r["world_size"] for r in roles} == {4}
    endpoints = roles[0]["endpoints"]
    assert [e.rsplit(":", 1)[0] for e in endpoints] == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2
    assert all(r["endpoints"] == endpoints for r in roles)
    assert [r["node_index"] for r in roles] == [0, 0, 1, 1] and [r["local_rank"] for r in roles] == [0, 1, 0, 1]

"""Role makers: every source of a role (arguments, Paddle/launcher env, torchrun, Open MPI,
MPICH, Slurm, MPI itself) gives the same answers for the same job, and bad input fails with a
message that names the variable and the value."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fleetlike.role_maker
from fleetlike import roles
from fleetlike.launch import LaunchConfig, worker_env
from fleetlike.roles import (
    EnvRoleMaker,
    MPIRoleMaker,
    PaddleCloudRoleMaker,
    Role,
    UserDefinedCollectiveRoleMaker,
    UserDefinedRoleMaker,
    detect_role,
    detect_source,
    expand_nodelist,
    parse_tasks_per_node,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "launch_workers"
PY = sys.executable


def shape(role: Role) -> tuple[int, int, int, int, int, int]:
    return (role.rank, role.world_size, role.local_rank, role.local_size, role.node_index, role.node_num)


def message(exc_info: pytest.ExceptionInfo[BaseException]) -> str:
    return str(exc_info.value)


# --------------------------------------------------------------------------- user-defined


def test_user_defined_answers_every_question() -> None:
    eps = ["10.0.0.1:6170", "10.0.0.1:6171", "10.0.0.2:6170", "10.0.0.2:6171"]
    m = UserDefinedRoleMaker(current_id=3, worker_endpoints=eps)
    assert m.worker_index() == 3 and m.worker_num() == 4
    assert m.worker_endpoints() == eps
    assert m.worker_endpoints(to_string=True) == ",".join(eps)
    assert not m.is_first_worker()
    assert (m.local_rank(), m.local_size(), m.node_index(), m.node_num()) == (1, 2, 1, 2)
    assert m.generate_role() is m.role and m.role.source == "user"
    assert m.current_endpoint() == "10.0.0.2:6171"
    assert m.is_worker() and not m.is_server() and m.server_num() == 0
    assert UserDefinedRoleMaker(0, ",".join(eps)).is_first_worker()
    assert UserDefinedCollectiveRoleMaker is UserDefinedRoleMaker
    assert "rank=3, world_size=4" in repr(m)


@pytest.mark.parametrize(
    "args, error, text",
    [
        ((2, ["127.0.0.1:1", "127.0.0.1:2"]), ValueError,
         "current_id=2 is out of range 0..1 for 2 worker_endpoints"),
        ((-1, ["127.0.0.1:1"]), ValueError, "current_id=-1 is out of range 0..0 for 1 worker_endpoints"),
        (("0", ["127.0.0.1:1"]), TypeError, "current_id must be an int, got str '0'"),
        ((0, None), ValueError,
         "worker_endpoints is required: the ip:port of every worker, in rank order"),
        ((0, []), ValueError, "worker_endpoints is empty: give at least one 'ip:port'"),
        ((0, ["127.0.0.1"]), ValueError,
         "worker_endpoints[0]='127.0.0.1' is not 'ip:port' (example: 127.0.0.1:6170)"),
        ((0, ["127.0.0.1:1", "127.0.0.1:x"]), ValueError,
         "worker_endpoints[1]='127.0.0.1:x': port 'x' is not an integer (example: 127.0.0.1:6170)"),
        ((0, ["127.0.0.1:1", "127.0.0.1:1"]), ValueError,
         "worker_endpoints has '127.0.0.1:1' twice (positions 0 and 1); every rank needs its own ip:port"),
    ],
)
def test_user_defined_rejects_bad_input(args, error, text) -> None:
    with pytest.raises(error) as info:
        UserDefinedRoleMaker(*args)
    assert message(info) == text


# --------------------------------------------------------------------------- Paddle env

PADDLE_2x2 = {
    "PADDLE_TRAINER_ID": "2",
    "PADDLE_TRAINERS_NUM": "4",
    "PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171",
    "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6170",
    "FLAGS_selected_gpus": "0",
    "FLEETLIKE_JOB_ID": "job7",
}


def test_paddle_cloud_reads_the_launcher_environment() -> None:
    m = PaddleCloudRoleMaker(is_collective=True, environ=PADDLE_2x2)
    assert shape(m.role) == (2, 4, 0, 2, 1, 2)
    assert m.role.selected_gpus == (0,) and m.role.job_id == "job7"
    assert m.role.master_endpoint == "10.0.0.1:6170" and m.role.source == "paddle"
    # the id alone or the current endpoint alone is enough
    only_id = {k: v for k, v in PADDLE_2x2.items() if k != "PADDLE_CURRENT_ENDPOINT"}
    only_ep = {k: v for k, v in PADDLE_2x2.items() if k != "PADDLE_TRAINER_ID"}
    assert PaddleCloudRoleMaker(environ=only_id).role == m.role
    assert PaddleCloudRoleMaker(environ=only_ep).role == m.role


def test_paddle_cloud_without_variables_is_one_worker() -> None:
    m = PaddleCloudRoleMaker(environ={})
    assert shape(m.role) == (0, 1, 0, 1, 0, 1)
    assert m.worker_endpoints() == ["127.0.0.1:6170"] and m.role.job_id == "default"
    assert m.is_first_worker() and m.role.selected_gpus == ()
    # empty values count as unset
    assert PaddleCloudRoleMaker(environ={"PADDLE_TRAINER_ID": ""}).worker_num() == 1


@pytest.mark.default_port
@pytest.mark.timeout(60)
def test_a_plain_run_leaves_the_default_port_to_launched_jobs(tmp_path: Path) -> None:
    """Two plain ``python train.py`` runs (no launcher's variables) that form torch's group
    through fleetlike, at once, while a launched job holds 6170: each meets its world of one on a
    port the OS picks."""
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLEETLIKE_", "OMPI_", "PMI_",
                                                                       "SLURM_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["FLEETLIKE_SECRET_DIR"] = str(tmp_path)
    code = ("import fleetlike, torch.distributed as dist; fleetlike.init_process_group();"
            "print('ok', dist.get_world_size(), dist.get_rank())")
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # in use already: by another job, which serves as well
            held.bind(("127.0.0.1", 6170))
            held.listen(1)
        runs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
        ends = [r.communicate(timeout=50) for r in runs]
    for r, (out, err) in zip(runs, ends):
        assert r.returncode == 0 and out.strip() == "ok 1 0", err[-2000:]


def test_paddle_cloud_refuses_parameter_server_mode() -> None:
    with pytest.raises(ValueError) as info:
        PaddleCloudRoleMaker(is_collective=False, environ={})
    assert message(info) == (
        "PaddleCloudRoleMaker(is_collective=False) asks for parameter-server mode, which "
        "fleetlike does not support; use is_collective=True (collective training)"
    )


def _with(**changes: str | None) -> dict[str, str]:
    env = dict(PADDLE_2x2)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


@pytest.mark.parametrize(
    "env, text",
    [
        (_with(PADDLE_CURRENT_ENDPOINT="10.0.0.3:6170"),
         "PADDLE_CURRENT_ENDPOINT='10.0.0.3:6170' is not in PADDLE_TRAINER_ENDPOINTS="
         "'10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171'"),
        (_with(PADDLE_TRAINER_ID="4", PADDLE_CURRENT_ENDPOINT=None),
         "PADDLE_TRAINER_ID=4 is out of range 0..3 for 4 endpoint(s) in PADDLE_TRAINER_ENDPOINTS"),
        (_with(PADDLE_TRAINER_ID="1"),
         "PADDLE_TRAINER_ID=1 but PADDLE_CURRENT_ENDPOINT='10.0.0.2:6170' is at position 2 of "
         "PADDLE_TRAINER_ENDPOINTS; they must agree"),
        (_with(PADDLE_TRAINERS_NUM="3"),
         "PADDLE_TRAINERS_NUM=3 but PADDLE_TRAINER_ENDPOINTS lists 4 endpoint(s); they must agree"),
        (_with(PADDLE_TRAINER_ENDPOINTS="10.0.0.1:6170,10.0.0.1:6170,10.0.0.2:6170,10.0.0.2:6171"),
         "PADDLE_TRAINER_ENDPOINTS='10.0.0.1:6170,10.0.0.1:6170,10.0.0.2:6170,10.0.0.2:6171' lists "
         "'10.0.0.1:6170' twice (positions 0 and 1); every trainer needs its own ip:port"),
        (_with(PADDLE_TRAINER_ENDPOINTS="10.0.0.1:6170,10.0.0.1,10.0.0.2:6170,10.0.0.2:6171"),
         "PADDLE_TRAINER_ENDPOINTS[1]='10.0.0.1' is not 'ip:port' (example: 127.0.0.1:6170)"),
        (_with(PADDLE_TRAINER_ENDPOINTS="10.0.0.1:6170,10.0.0.1:99999,10.0.0.2:6170,10.0.0.2:6171"),
         "PADDLE_TRAINER_ENDPOINTS[1]='10.0.0.1:99999': port 99999 is outside 1..65535"),
        (_with(PADDLE_TRAINER_ID="two"), "PADDLE_TRAINER_ID='two' is not an integer"),
        (_with(PADDLE_CURRENT_ENDPOINT="10.0.0.2"),
         "PADDLE_CURRENT_ENDPOINT='10.0.0.2' is not 'ip:port' (example: 127.0.0.1:6170)"),
        (_with(PADDLE_TRAINER_ID=None, PADDLE_CURRENT_ENDPOINT=None),
         "PADDLE_TRAINER_ID is not set and PADDLE_CURRENT_ENDPOINT is not set either; set "
         "PADDLE_TRAINER_ID to this trainer's index in PADDLE_TRAINER_ENDPOINTS"),
        ({"PADDLE_TRAINER_ID": "1", "PADDLE_TRAINERS_NUM": "2"},
         "PADDLE_TRAINER_ENDPOINTS is not set but PADDLE_TRAINER_ID=1 / PADDLE_TRAINERS_NUM=2 are; "
         "set the comma-separated ip:port list of all trainers (python -m fleetlike.launch does this)"),
        ({"PADDLE_TRAINERS_NUM": "2"},
         "PADDLE_TRAINER_ENDPOINTS is not set but PADDLE_TRAINERS_NUM=2 is; set the comma-separated "
         "ip:port list of all trainers (python -m fleetlike.launch does this)"),
        (_with(FLAGS_selected_gpus="0,x"),
         "FLAGS_selected_gpus='0,x': 'x' is not a GPU id (a non-negative integer)"),
        (_with(FLAGS_selected_gpus="1,1"),
         "FLAGS_selected_gpus='1,1' lists GPU 1 twice; each GPU may appear once"),
    ],
)
def test_paddle_cloud_rejects_contradictions(env, text) -> None:
    with pytest.raises(ValueError) as info:
        PaddleCloudRoleMaker(environ=env)
    assert message(info) == text


# --------------------------------------------------------------------------- torchrun / MPI


def test_torchrun_single_node_endpoints_start_after_master_port() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "rdzv9"}
    role = detect_role(env)
    assert role.source == "torchrun" and shape(role) == (1, 3, 1, 3, 0, 1)
    assert role.endpoints == ("127.0.0.1:29501", "127.0.0.1:29502", "127.0.0.1:29503")
    assert role.master_endpoint == "127.0.0.1:29501" and role.job_id == "rdzv9"
    # FLEETLIKE_MASTER_PORT is used as is (no +1)
    assert detect_role({**env, "FLEETLIKE_MASTER_PORT": "7000"}).endpoints[0] == "127.0.0.1:7000"


def test_torchrun_multi_node_uses_stand_in_hosts_and_master_addr() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500"}
    role = detect_role(env)
    assert shape(role) == (5, 8, 1, 4, 1, 2)
    assert role.endpoints[4:6] == ("node1:29501", "node1:29502")
    assert role.master_endpoint == "10.1.1.1:29501"
    named = detect_role({**env, "FLEETLIKE_NODE_IPS": "10.1.1.1,10.1.1.2"})
    assert named.endpoints[5] == "10.1.1.2:29502" and shape(named) == shape(role)


@pytest.mark.parametrize(
    "env, text",
    [
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
         "the torchrun job spans 2 nodes but no rendezvous address is known: set "
         "FLEETLIKE_MASTER_ADDR (or MASTER_ADDR) to the first node's IP, or FLEETLIKE_NODE_IPS to "
         "every node's IP in node order"),
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
          "GROUP_RANK": "0", "MASTER_ADDR": "h"},
         "GROUP_RANK=0 does not hold RANK=5 in a block layout of 4 per node (expected node 1)"),
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h"},
         "LOCAL_RANK=2 but RANK=5 with 4 per node is local rank 1; ranks must be laid out node by node"),
        ({"RANK": "1", "WORLD_SIZE": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
         "WORLD_SIZE=5 is not a multiple of LOCAL_WORLD_SIZE=2: nodes with different process counts "
         "cannot be laid out from the environment alone (use the same count on every node, or "
         "MPIRoleMaker with mpi4py)"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is out of range 0..1 (WORLD_SIZE=2)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "bad host!"},
         "MASTER_ADDR='bad host!' is neither an IP address nor a host name"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "65535"}, "MASTER_PORT gives port 65536, outside 1..65535"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "FLEETLIKE_NODE_IPS": "10.0.0.1"},
         "FLEETLIKE_NODE_IPS='10.0.0.1' names 1 nodes but the torchrun environment describes 2; "
         "list one address per node, in node order"),
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "FLEETLIKE_MASTER_PORT": "65534"},
         "base port 65534 with 4 ranks per node needs ports above 65535; set FLEETLIKE_MASTER_PORT lower"),
    ],
)
def test_env_layouts_reject_contradictions(env, text) -> None:
    with pytest.raises(ValueError) as info:
        detect_role(env)
    assert message(info) == text


def test_openmpi_and_mpich_environments() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "FLEETLIKE_MASTER_ADDR": "10.0.0.1", "FLEETLIKE_MASTER_PORT": "7000"}
    role = detect_role(ompi)
    assert role.source == "openmpi" and shape(role) == (3, 4, 1, 2, 1, 2)
    assert role.master_endpoint == "10.0.0.1:7000" and role.current_endpoint == "node1:7001"
    mpich = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}
    role = detect_role(mpich)
    assert role.source == "mpich" and shape(role) == (2, 3, 2, 3, 0, 1)
    assert role.endpoints == ("127.0.0.1:6170", "127.0.0.1:6171", "127.0.0.1:6172")
    # MPIRoleMaker reads the same variables when told not to use mpi4py
    assert MPIRoleMaker(environ=mpich, use_mpi4py=False).role == dataclasses.replace(role, source="mpich")
    assert MPIRoleMaker(environ={}, use_mpi4py=False).role.world_size == 1


# --------------------------------------------------------------------------- Slurm


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu5", ["gpu5"]),
        ("a[1-2],b,c[009-011]", ["a1", "a2", "b", "c009", "c010", "c011"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_expand_nodelist(text, hosts) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text, error",
    [
        ("node[01-03", "SLURM_JOB_NODELIST='node[01-03': '[' is never closed"),
        ("node01]", "SLURM_JOB_NODELIST='node01]': ']' without '[' at position 6"),
        ("node[a-b]", "SLURM_JOB_NODELIST='node[a-b]': 'a-b' is not a number or a range like 01-03"),
        ("node[5-3]", "SLURM_JOB_NODELIST='node[5-3]': range '5-3' runs backwards"),
    ],
)
def test_expand_nodelist_errors(text, error) -> None:
    with pytest.raises(ValueError) as info:
        expand_nodelist(text)
    assert message(info) == error


def test_tasks_per_node() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError) as info:
        parse_tasks_per_node("2(3)")
    assert message(info) == "SLURM_TASKS_PER_NODE='2(3)': '2(3)' is not 'N' or 'N(xM)'"


def test_slurm_uneven_nodes_and_default_port() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_TASKS_PER_NODE": "2(x2),2",
           "SLURM_STEP_NODELIST": "gpu[1-3]", "SLURM_JOB_ID": "123456"}
    role = detect_role(env)
    assert role.source == "slurm" and shape(role) == (5, 6, 1, 2, 2, 3)
    port = 20000 + 123456 % 20000
    assert role.current_endpoint == f"gpu3:{port + 1}"  # the step's list wins over the job's
    assert role.master_endpoint == f"gpu1:{port}" and role.job_id == "123456"
    assert detect_role({**env, "FLEETLIKE_JOB_ID": "mine"}).job_id == "mine"


@pytest.mark.parametrize(
    "change, text",
    [
        ({"SLURM_PROCID": "3"},
         "SLURM_PROCID=3 is not task 1 of node 2 in a block layout (expected 5); launch with "
         "srun --distribution=block"),
        ({"SLURM_TASKS_PER_NODE": "2(x2)"},
         "SLURM_TASKS_PER_NODE='2(x2)' gives 4 tasks on 2 nodes, but SLURM_NTASKS=6 on 3 nodes"),
        ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 is out of range for 3 nodes (SLURM_JOB_NODELIST)"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is out of range for 2 tasks on node 2"),
        ({"SLURM_TASKS_PER_NODE": None, "SLURM_NTASKS": "7", "SLURM_PROCID": "6"},
         "SLURM_NTASKS=7 tasks do not divide evenly over 3 nodes and SLURM_TASKS_PER_NODE is not set"),
    ],
)
def test_slurm_rejects_contradictions(change, text) -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "node[01-03]", "SLURM_TASKS_PER_NODE": "2(x3)"}
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(ValueError) as info:
        detect_role(env)
    assert message(info) == text


# --------------------------------------------------------------------------- detection


def test_detection_order_and_job_id_precedence() -> None:
    env = {
        **PADDLE_2x2,
        "RANK": "0", "WORLD_SIZE": "1",
        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
        "PMI_RANK": "0", "PMI_SIZE": "1",
        "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "42",
        "TORCHELASTIC_RUN_ID": "tr",
    }
    order = []
    for drop in (
        [k for k in env if k.startswith("PADDLE_")],
        ["RANK", "WORLD_SIZE"],
        ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"],
        ["PMI_RANK", "PMI_SIZE"],
        ["SLURM_PROCID", "SLURM_NTASKS"],
    ):
        order.append(detect_source(env))
        assert detect_role(env).source == order[-1] == EnvRoleMaker(env).role.source
        assert detect_role(env).job_id == "job7"  # FLEETLIKE_JOB_ID first
        env = {k: v for k, v in env.items() if k not in drop}
    order.append(detect_source(env))
    assert order == ["paddle", "torchrun", "openmpi", "mpich", "slurm", "single"]
    assert detect_role(env).job_id == "job7"
    del env["FLEETLIKE_JOB_ID"]
    assert detect_role(env).job_id == "42"
    del env["SLURM_JOB_ID"]
    assert detect_role(env).job_id == "tr"
    assert detect_role({}).job_id == "default"
    assert detect_role({"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "1234"}).endpoints == ("10.9.9.9:1234",)


def test_as_role_and_module_alias() -> None:
    m = UserDefinedRoleMaker(0, ["127.0.0.1:1"])
    assert roles.as_role(m) is m.role and roles.as_role(m.role) is m.role
    assert roles.as_role(None) == detect_role()
    with pytest.raises(TypeError) as info:
        roles.as_role("x")  # type: ignore[arg-type]
    assert "got str" in message(info)
    assert fleetlike.role_maker.PaddleCloudRoleMaker is PaddleCloudRoleMaker
    assert set(fleetlike.role_maker.__all__) == set(roles.__all__)
    for name in roles.__all__:
        assert getattr(roles, name).__doc__, name


# --------------------------------------------------------------------------- one job, six sources

layouts = st.integers(1, 4).flatmap(
    lambda nodes: st.integers(1, 4).flatmap(
        lambda per: st.tuples(st.just(nodes), st.just(per), st.integers(0, nodes * per - 1))
    )
)


def _compressed(hosts_num: int, style: int) -> str:
    if style == 0:
        return ",".join(f"n{i:02d}" for i in range(1, hosts_num + 1))
    if style == 1 or hosts_num < 3:
        return f"n[01-{hosts_num:02d}]"
    return f"n[01-02,03-{hosts_num:02d}]"


@settings(max_examples=60, deadline=None)
@given(layouts, st.integers(0, 2))
def test_every_source_agrees_on_the_same_job(layout, style) -> None:
    nodes, per, rank = layout
    world = nodes * per
    node, local = divmod(rank, per)
    eps = [f"10.0.0.{n + 1}:{6170 + i}" for n in range(nodes) for i in range(per)]
    expected = (rank, world, local, per, node, nodes)
    makers = {
        "user": UserDefinedRoleMaker(rank, eps).role,
        "paddle": PaddleCloudRoleMaker(environ={
            "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(eps), "PADDLE_CURRENT_ENDPOINT": eps[rank]}).role,
        "torchrun": detect_role({
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(node),
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}),
        "openmpi": detect_role({
            "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per),
            "MASTER_ADDR": "10.0.0.1"}),
        "mpich": MPIRoleMaker(use_mpi4py=False, environ={
            "PMI_RANK": str(rank), "PMI_SIZE": str(world), "MPI_LOCALRANKID": str(local),
            "MPI_LOCALNRANKS": str(per), "FLEETLIKE_NODE_IPS": ",".join(
                f"10.0.0.{n + 1}" for n in range(nodes))}).role,
        "slurm": EnvRoleMaker({
            "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": _compressed(nodes, style),
            "SLURM_TASKS_PER_NODE": f"{per}(x{nodes})", "SLURM_JOB_ID": "77"}).role,
    }
    config = LaunchConfig(
        training_script="train.py",
        cluster_node_ips=tuple(f"10.0.0.{n + 1}" for n in range(nodes)),
        node_ip=f"10.0.0.{node + 1}",
        started_port=6170,
        nproc_per_node=per,
    )
    launched = worker_env(config, local, base={})
    makers["launcher"] = PaddleCloudRoleMaker(environ=launched).role
    makers["launcher-torchrun"] = detect_role(
        {k: v for k, v in launched.items() if not k.startswith("PADDLE_")}
    )
    for name, role in makers.items():
        assert shape(role) == expected, name
        assert role.node_ranks() == list(range(node * per, node * per + per)), name
    assert makers["launcher"].endpoints == makers["user"].endpoints == makers["paddle"].endpoints


# --------------------------------------------------------------------------- real launchers


def _clean_env() -> dict[str, str]:
    prefixes = ("PADDLE_", "OMPI_", "PMI_", "SLURM_", "FLEETLIKE_", "MPI_LOCAL", "TORCHELASTIC")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GROUP_RANK", "FLAGS_selected_gpus"}
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}


@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_role_maker_under_mpiexec(tmp_path: Path) -> None:
    mpiexec = Path(PY).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip(f"no mpiexec next to {PY} (pip install mpich)")
    port = 6170  # only named: print_role.py never binds it
    env = {**_clean_env(), "FLEETLIKE_MASTER_PORT": str(port)}
    proc = subprocess.run(
        [str(mpiexec), "-n", "3", PY, str(WORKERS / "print_role.py"), str(tmp_path), "--mpi"],
        env=env, capture_output=True, text=True, timeout=45,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in range(3):
        data = json.loads((tmp_path / f"role.{rank}.json").read_text())
        role = data["role"]
        assert data["mpi_comm"] is True and role["source"] == "mpi"
        assert (role["rank"], role["world_size"], role["local_rank"], role["local_size"]) == (rank, 3, rank, 3)
        assert role["endpoints"] == [f"127.0.0.1:{port + i}" for i in range(3)]
        # reading MPICH's variables alone gives the same job
        env_role = data["env_role"]
        assert env_role["source"] == "mpich" and env_role["endpoints"] == role["endpoints"]


@pytest.mark.slow
def test_detect_role_under_torchrun(tmp_path: Path) -> None:
    torchrun = Path(PY).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip(f"no torchrun next to {PY}")
    # --standalone: torchrun's agent binds its store on a port the OS chooses (no port handed in)
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", str(WORKERS / "print_role.py"), str(tmp_path)],
        env=_clean_env(), capture_output=True, text=True, timeout=45,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        data = json.loads((tmp_path / f"role.{rank}.json").read_text())
        role, port = data["role"], int(data["MASTER_PORT"])
        assert role["source"] == "torchrun"
        assert (role["rank"], role["world_size"], role["local_rank"], role["node_num"]) == (rank, 2, rank, 1)
        host = data["MASTER_ADDR"]
        assert role["endpoints"] == [f"{host}:{port + 1}", f"{host}:{port + 2}"]
        assert role["job_id"] != "default"  # torchrun's run id


@pytest.mark.parametrize("module", ["role", "base", "detect", "mpi", "paddle", "slurm", "_env"])
def test_every_roles_module_curates_its_exports(module: str) -> None:
    import importlib

    mod = importlib.import_module(f"fleetlike.roles.{module}")
    assert mod.__doc__ and mod.__all__
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name}"


def test_as_role_lives_beside_detection_without_an_import_circle() -> None:
    import fleetlike.roles.base as base
    import fleetlike.roles.detect as detect

    assert not hasattr(base, "as_role") and roles.as_role is detect.as_role
    assert "detect" not in base.__dict__  # base imports nothing of detection


def test_the_mpi_and_torchrun_readers_are_one_table() -> None:
    from fleetlike.roles.detect import LAUNCHER_VARS, mpich_role, openmpi_role

    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    pmi = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "10.0.0.1"}
    a, b = openmpi_role(ompi), mpich_role(pmi)
    assert (a.rank, a.local_rank, a.node_index, a.source) == (3, 1, 1, "openmpi")
    assert (b.rank, b.local_rank, b.node_index, b.source) == (3, 1, 1, "mpich")
    assert set(LAUNCHER_VARS) == {"torchrun", "openmpi", "mpich"}

"""torch's launcher flags beside Paddle's, without starting workers: TI-ACC's and AIACC's lines
(``--nnodes N --node_rank R --master_addr A --master_port P``, ``--use_env``, ``--standalone``)
translate into one node layout each, the elastic ``--nnodes MIN:MAX`` keeps its meaning, flags of
the two forms that describe the nodes twice are refused (exit 2, naming both), two nodes'
launchers derive the same job from the same flags, and perseusrun's ``-np N`` without ``-H`` is
one node."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetlike.launch import main, parse_config, worker_env
from fleetlike.launch.hosts import parse_hosts

pytestmark = pytest.mark.timeout(30)

TORCH = ["--nproc_per_node=2", "--nnodes=2", "--master_addr=127.0.0.1", "--master_port=29611"]


@pytest.fixture()
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLEETLIKE_JOB_SECRET", raising=False)
    monkeypatch.delenv("FLEETLIKE_JOB_ID", raising=False)
    (tmp_path / "main.py").write_text("print('never run')\n")
    return "main.py"


def test_tiaccs_two_node_line_is_a_static_job_of_four_ranks(script: str) -> None:
    node1 = parse_config([*TORCH, "--node_rank=1", "--node_ip=127.0.0.2", script, "--lr", "1"])
    assert node1.static_nodes is not None and node1.static_nodes.pending
    assert (node1.node_index, node1.node_num, node1.world_size, node1.rank(0)) == (1, 2, 4, 2)
    assert node1.started_port == 29612  # the workers' ports follow the meeting's
    assert node1.min_nodes == 0 and node1.training_script_args == ("--lr", "1")
    node0 = parse_config([*TORCH, "--node_rank=0", script])
    assert (node0.node_ip, node0.node_index) == ("127.0.0.1", 0)
    # no shared secret: nothing is derived from the flags (anyone can read them); node 0's
    # launcher makes a random secret and the other reads it from the user's private folder
    assert node0.secret_at_home and node1.secret_at_home
    assert node0.job_secret != node1.job_secret
    from fleetlike.launch.homesecret import meeting_point
    assert meeting_point(node0) == ("127.0.0.1:29611", True) and meeting_point(node1) == ("127.0.0.1:29611", False)
    # after the meeting (the real addresses), the workers' environment is torchrun's and Paddle's
    met = node1.__class__(**{**node1.__dict__, "cluster_node_ips": ("127.0.0.1", "127.0.0.2")})
    env = worker_env(met, 1, base={})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("3", "4", "1", "127.0.0.1")
    assert env["PADDLE_TRAINER_ENDPOINTS"] == "127.0.0.1:29612,127.0.0.1:29613,127.0.0.2:29612,127.0.0.2:29613"


def test_aiaccs_one_node_lines(script: str) -> None:
    one = parse_config(["--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=localhost",
                        "--master_port=6006", "--use_env", script])
    assert (one.node_num, one.node_ip, one.started_port, one.static_nodes.pending) == (1, "localhost", 6007, False)
    alone = parse_config(["--nproc_per_node=2", "--standalone", script])
    assert alone.auto_ports and alone.world_size == 2
    plain = parse_config(["--nproc_per_node=2", "--master_port=6006", script])  # --nnodes defaults to 1
    assert plain.started_port == 6007 and plain.node_num == 1


def test_elastic_nnodes_keeps_its_meaning(script: str) -> None:
    ranged = parse_config(["--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:29400", script])
    exact = parse_config(["--nnodes=2", "--rdzv_endpoint=127.0.0.1:29400", script])
    assert (ranged.min_nodes, ranged.max_nodes, ranged.static_nodes) == (1, 2, None)
    assert (exact.min_nodes, exact.max_nodes, exact.static_nodes) == (2, 2, None)


@pytest.mark.parametrize(("argv", "said"), [
    (["--nnodes=2", "--node_rank=1"], ["--nnodes=2", "needs --master_addr", "--rdzv_endpoint"]),
    ([*TORCH, "--node_rank=2"], ["--node_rank=2", "0..1"]),
    ([*TORCH, "--node_rank=1"], ["--node_rank=1", "--master_addr's", "--node_ip"]),
    ([*TORCH, "--node_rank=0", "--node_ip=127.0.0.5"], ["--node_rank=0", "--node_ip=127.0.0.5"]),
    ([*TORCH, "--cluster_node_ips=127.0.0.1,127.0.0.2"], ["--cluster_node_ips", "Paddle's form", "one of them"]),
    ([*TORCH, "--started_port=7000"], ["--started_port=7000", "--master_port", "drop --started_port"]),
    (["--standalone", "--nnodes=2"], ["--standalone", "--nnodes=2", "drop --standalone"]),
    (["--master_addr=127.0.0.1", "--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:5"], ["static job", "elastic", "one of them"]),
    (["--master_port=x"], ["--master_port='x'", "not an integer"]),
    (["--nnodes=0"], ["--nnodes=0", ">= 1"]),
])
def test_flags_that_contradict_are_refused_naming_both(script: str, argv: list[str], said: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*argv, script], device_count=lambda: 0)
    err = capsys.readouterr().err
    assert code == 2, err
    for text in said:
        assert text in err, (text, err)


def test_perseusrun_np_without_hosts_is_this_machine(script: str) -> None:
    job = parse_hosts(["-np", "2", "--", "python", script])
    assert [(h.name, h.procs, h.local) for h in job.hosts] == [("localhost", 2, True)]
    assert parse_hosts(["-np", "2", "-H", "localhost:2", "--", "python", script]).hosts == job.hosts

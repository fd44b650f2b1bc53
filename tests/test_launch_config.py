"""The launcher's contract without starting workers: flags, defaults, input errors (exit code 2
with exact messages, nothing started), the worker environment and the printed configuration."""

from __future__ import annotations

import dataclasses
import re
import socket
from pathlib import Path

import pytest

import fleetlike.launch as launch
from fleetlike.launch import (
    LaunchConfig,
    LaunchInputError,
    default_job_id,
    open_job_warning,
    format_config,
    main,
    parse_config,
    worker_env,
)

pytestmark = pytest.mark.timeout(30)


SECRET = "5e" * 32


@pytest.fixture(autouse=True)
def _shared_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several nodes' launchers share a secret through the environment (the tests below about
    its absence remove it); no job id from the environment."""
    monkeypatch.setenv("FLEETLIKE_JOB_SECRET", SECRET)
    monkeypatch.delenv("FLEETLIKE_JOB_ID", raising=False)


@pytest.fixture()
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never run')\n")
    return "train.py"


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str], gpus: int = 0) -> tuple[int, str, str]:
    code = main(argv, device_count=lambda: gpus)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_shows_the_two_node_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    for text in ("--cluster_node_ips=192.168.1.2,192.168.1.3", "--node_ip=192.168.1.2",
                 "--started_port=6170", "--selected_gpus=0,1,2,3", "train_with_fleet.py",
                 "--ips", "--gpus", "--start_port", "--nproc_per_node", "--log_dir", "--job_id",
                 "--rendezvous_file", "--rendezvous_timeout", "--started_port=auto \\",
                 "--rendezvous_file=/shared/jobs/resnet.rdzv"):
        assert text in out


def test_defaults_on_cpu(script: str) -> None:
    c = parse_config([script, "--lr", "0.1"], device_count=lambda: 0)
    assert (c.cluster_node_ips, c.node_ip, c.started_port, c.nproc_per_node, c.selected_gpus) == (
        ("127.0.0.1",), "127.0.0.1", 6170, 1, ())
    assert c.training_script_args == ("--lr", "0.1") and c.log_dir == "log"
    assert re.fullmatch(r"[0-9a-f]{12}", c.job_id)
    # random per job without a secret shared through the environment
    assert parse_config([script], device_count=lambda: 0, environ={}).job_id != parse_config(
        [script], device_count=lambda: 0, environ={}).job_id
    assert c.endpoints == ("127.0.0.1:6170",) and c.log_path(0) == "log/workerlog.0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.node_ip = "x"  # type: ignore[misc]


def test_aliases_and_multi_node_layout(script: str) -> None:
    long = parse_config(["--cluster_node_ips=10.0.0.1,10.0.0.2", "--node_ip=10.0.0.2",
                         "--started_port=7000", "--selected_gpus=0,1", script], device_count=lambda: 2)
    short = parse_config(["--ips=10.0.0.1,10.0.0.2", "--node_ip=10.0.0.2", "--start_port=7000",
                          "--gpus=0,1", script], device_count=lambda: 2)
    assert long == short
    assert long.endpoints == ("10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.2:7000", "10.0.0.2:7001")
    assert [long.rank(i) for i in range(2)] == [2, 3] and long.node_index == 1
    # every node's launcher derives the same job id from the secret they share, not from flags
    other = parse_config(["--ips=10.0.0.1,10.0.0.2", "--node_ip=10.0.0.1", "--start_port=7000",
                          "--gpus=0,1", script], device_count=lambda: 2)
    assert long.job_id == other.job_id == default_job_id(("10.0.0.1", "10.0.0.2"), 7000, 2)
    assert long.job_secret == SECRET
    moved = parse_config(["--ips=10.0.0.1,10.0.0.2", "--node_ip=10.0.0.1", "--start_port=7000",
                          "--gpus=0,1", script], device_count=lambda: 2,
                         environ={"FLEETLIKE_JOB_SECRET": "77" * 32})
    assert moved.job_id != long.job_id  # another secret, another id: the flags alone say nothing
    assert parse_config(["--job_id=abc", script], device_count=lambda: 0).job_id == "abc"


def test_default_job_ids_are_random_without_a_shared_secret(script: str) -> None:
    ids = {parse_config([script], environ={}).job_id for _ in range(3)}
    assert len(ids) == 3
    secrets_ = {parse_config([script], environ={}).job_secret for _ in range(2)}
    assert len(secrets_) == 2 and all(len(s) == 64 for s in secrets_)
    assert parse_config([script], environ={"FLEETLIKE_JOB_ID": "given"}).job_id == "given"
    assert "job_secret" not in repr(parse_config([script], environ={}))  # never shown


@pytest.mark.parametrize("argv, other_node", [
    (["--ips=10.0.0.1,10.0.0.2", "--node_ip=10.0.0.2", "--started_port=7000"], "--node_ip=10.0.0.1"),
    (["--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:5", "--node_ip=127.0.0.2"], "--node_ip=127.0.0.3"),
])
def test_several_launchers_without_a_shared_secret_share_a_random_one_privately(script: str, argv, other_node) -> None:
    """Paddle's launch form (each node's launcher started on its own, nothing shared but the
    flags) still runs, but its secret is never derived from the flags: each launcher makes a
    random one, the store's host keeps its own and the others read it from this user's private
    directory (`fleetlike.launch.homesecret`, test_trust.py); each launcher says so."""
    here = parse_config([*argv, script], environ={})
    there = parse_config([*argv[:-1], other_node, script] if "--nnodes" in argv[0] else
                         [argv[0], other_node, argv[2], script], environ={})
    assert here.secret_at_home and there.secret_at_home
    assert here.job_secret != there.job_secret  # random, not computable from the flags
    assert here.job_secret != parse_config([*argv, script], environ={}).job_secret
    note = open_job_warning(here)
    assert note is not None and "no FLEETLIKE_JOB_SECRET is set" in note
    assert "export FLEETLIKE_JOB_SECRET with the same random value on every node" in note
    shared = parse_config([*argv, script], environ={"FLEETLIKE_JOB_SECRET": "77" * 32})
    assert not shared.secret_at_home and open_job_warning(shared) is None
    assert shared.job_secret == "77" * 32
    assert open_job_warning(parse_config([script], environ={})) is None  # one node: its own secret
    with pytest.raises(LaunchInputError, match="at least 32 hexadecimal digits"):
        parse_config([*argv, script], environ={"FLEETLIKE_JOB_SECRET": "short"})


@pytest.mark.parametrize(
    "argv, visible, gpus, nproc",
    [
        ([], 4, (0, 1, 2, 3), 4),                   # all GPUs by default
        (["--nproc_per_node=2"], 4, (0, 1), 2),     # the first N GPUs
        (["--nproc_per_node=8"], 4, (), 8),         # more processes than GPUs: CPU
        (["--nproc_per_node=3"], 0, (), 3),
        (["--gpus=2,3"], 4, (2, 3), 2),
    ],
)
def test_device_defaults(script: str, argv, visible, gpus, nproc) -> None:
    c = parse_config([*argv, script], device_count=lambda: visible)
    assert (c.selected_gpus, c.nproc_per_node) == (gpus, nproc)


def _listening(host: str) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s


SEED_2_NODE = ["--cluster_node_ips=127.0.0.1,127.0.0.2", "--node_ip=127.0.0.1", "--started_port=6170",
               "--selected_gpus=0,1,2,3", "train.py", "--model=ResNet50", "--data_dir=./ImageNet"]


@pytest.mark.parametrize(
    "argv, visible, text",
    [
        (["--cluster_node_ips=127.0.0.1,127.0.0.2", "--node_ip=127.0.0.3", "train.py"], 0,
         "--node_ip=127.0.0.3 is not in --cluster_node_ips=127.0.0.1,127.0.0.2; give this machine's "
         "address from that list"),
        (["--ips=127.0.0.1,127.0.0.1", "train.py"], 0,
         "--cluster_node_ips=127.0.0.1,127.0.0.1 lists 127.0.0.1 twice; each node must appear once"),
        (["--ips=127.0.0.1,bad ip", "train.py"], 0,
         "--cluster_node_ips=127.0.0.1,bad ip: 'bad ip' is neither an IP address nor a host name"),
        (["--started_port=0", "train.py"], 0, "--started_port=0 is outside 1..65535"),
        (["--start_port=70000", "train.py"], 0, "--started_port=70000 is outside 1..65535"),
        (["--started_port=abc", "train.py"], 0, "--started_port='abc' is not an integer"),
        (["--started_port=65535", "--nproc_per_node=2", "train.py"], 0,
         "--started_port=65535 with 2 processes per node needs ports up to 65536, above 65535; "
         "choose a lower --started_port"),
        (["--nproc_per_node=0", "train.py"], 0, "--nproc_per_node=0 must be >= 1"),
        (["--nproc_per_node=-2", "train.py"], 0, "--nproc_per_node=-2 must be >= 1"),
        (["--nproc_per_node=3", "--gpus=0,1", "train.py"], 2,
         "--nproc_per_node=3 does not match --selected_gpus=0,1 (2 GPUs, one process each); drop "
         "--nproc_per_node or make them agree"),
        (["--gpus=0,a", "train.py"], 2, "--selected_gpus='0,a': 'a' is not a GPU id (a non-negative integer)"),
        (["--gpus=0,0", "train.py"], 2, "--selected_gpus='0,0' lists GPU 0 twice; each GPU may appear once"),
        (["--gpus=,", "train.py"], 2, "--selected_gpus=',' names no GPU; drop it to run on CPU"),
        (["--gpus=0,3", "train.py"], 2,
         "--selected_gpus=0,3 but torch.cuda sees 2 CUDA device(s), so GPU 3 does not exist; choose "
         "ids below 2, or drop --selected_gpus and use --nproc_per_node to run on CPU"),
        (SEED_2_NODE, 0,
         "--selected_gpus=0,1,2,3 but torch.cuda sees 0 CUDA device(s), so GPU 0 does not exist; "
         "choose ids below 0, or drop --selected_gpus and use --nproc_per_node to run on CPU"),
        (["missing.py"], 0,
         "training script 'missing.py' does not exist (looked for {cwd}/missing.py); use -m to run a module"),
        (["--ips=192.0.2.1", "--started_port=6170", "train.py"], 0,
         "--node_ip=192.0.2.1 is not an address of this machine (cannot bind 192.0.2.1:6170); run "
         "each node's launcher with its own IP"),
        (["--kill_grace=-1", "train.py"], 0, "--kill_grace=-1.0 must be a finite number of seconds >= 0 (a worker that ignores "
         "SIGTERM would otherwise never be killed); e.g. --kill_grace=3"),
        (["--kill_grace=inf", "train.py"], 0, "--kill_grace=inf must be a finite number of seconds >= 0 (a worker that ignores "
         "SIGTERM would otherwise never be killed); e.g. --kill_grace=3"),
        (["--kill_grace=nan", "train.py"], 0, "--kill_grace=nan must be a finite number of seconds >= 0 (a worker that ignores "
         "SIGTERM would otherwise never be killed); e.g. --kill_grace=3"),
        (["--ips=127.0.0.1,127.0.0.2", "--start_port=auto", "train.py"], 0,
         "--started_port=auto with --cluster_node_ips=127.0.0.1,127.0.0.2 (2 nodes) needs "
         "--rendezvous_file=PATH, where the first node's launcher writes the address of the store "
         "it hosts for the others; add it, the same path on every node, on a filesystem they all "
         "share (or give every node the same port number, e.g. --started_port=6170)"),
        (["--ips=127.0.0.1,127.0.0.2", "--started_port=7000", "--rendezvous_file=r", "train.py"], 0,
         "--rendezvous_file=r is used only with --started_port=auto, but --started_port=7000 "
         "already fixes every port; drop --rendezvous_file, or use --started_port=auto"),
        (["--ips=127.0.0.1,127.0.0.2", "--started_port=auto", "--rendezvous_file= ", "train.py"], 0,
         "--rendezvous_file is empty; give a path on a filesystem every node shares"),
        (["--ips=127.0.0.1,127.0.0.2", "--started_port=auto", "--rendezvous_file=no/dir/r",
          "--node_ip=127.0.0.2", "train.py"], 0,
         "--rendezvous_file=no/dir/r: its directory {cwd}/no/dir does not exist on this node; give "
         "a path in a directory that exists on a filesystem every node shares"),
        (["--ips=127.0.0.1,127.0.0.2", "--started_port=auto", "--rendezvous_file=.", "train.py"], 0,
         "--rendezvous_file=. is a directory; give a path in a directory that exists on a "
         "filesystem every node shares, plus a file name"),
        (["--ips=127.0.0.1,127.0.0.2", "--started_port=auto", "--rendezvous_file=r",
          "--rendezvous_timeout=0", "train.py"], 0,
         "--rendezvous_timeout=0 must be a finite number of seconds > 0"),
        (["--rendezvous_timeout=soon", "train.py"], 0,
         "--rendezvous_timeout='soon' is not a number of seconds"),
        (["--ips=192.0.2.1", "--started_port=auto", "train.py"], 0,
         "--node_ip=192.0.2.1 is not an address of this machine (cannot bind a port on it for "
         "--started_port=auto); give one of this machine's IPs"),
        ([], 0, "no training script given; usage: python -m fleetlike.launch [flags] train.py "
         "[script args] (see --help)"),
        (["--no_such_flag=1", "train.py"], 0, "unrecognized arguments: --no_such_flag=1"),
        (["--malloc_tuning=yes", "train.py"], 0,
         "argument --malloc_tuning: invalid choice: 'yes' (choose from 'on', 'off')"),
    ],
)
@pytest.mark.default_port
def test_input_errors_exit_2_before_anything_starts(
    script: str, capsys: pytest.CaptureFixture[str], argv, visible, text
) -> None:
    code, out, err = run_main(argv, capsys, gpus=visible)
    assert code == 2 and out == ""
    assert err == f"fleetlike.launch: error: {text.format(cwd=Path.cwd())}\n"
    assert not Path("log").exists()


def test_port_in_use_is_reported_with_its_rank(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    with _listening("127.0.0.1") as busy:
        port = busy.getsockname()[1]
        code, _, err = run_main([f"--started_port={port - 1}", "--nproc_per_node=2", script], capsys)
    assert code == 2
    assert err == (
        f"fleetlike.launch: error: port {port} on 127.0.0.1 (for local rank 1) is already in use; "
        "free it or choose another --started_port\n"
    )


def test_launch_config_validates_direct_construction() -> None:
    with pytest.raises(LaunchInputError) as info:
        LaunchConfig("t.py", cluster_node_ips=("10.0.0.1",), node_ip="10.0.0.2")
    assert str(info.value) == (
        "--node_ip=10.0.0.2 is not in --cluster_node_ips=10.0.0.1; give this machine's address "
        "from that list"
    )
    with pytest.raises(LaunchInputError):
        LaunchConfig("t.py", job_id="")


TWO_BY_TWO = LaunchConfig(
    "train.py",
    cluster_node_ips=("127.0.0.1", "127.0.0.2"),
    node_ip="127.0.0.2",
    started_port=7100,
    nproc_per_node=2,
    job_id="j1",
)

BASE = {
    "PATH": "/bin", "FOO": "bar", "http_proxy": "http://p:1", "https_proxy": "http://p:2",
    "HTTP_PROXY": "http://p:3", "HTTPS_PROXY": "http://p:4", "all_proxy": "socks://p:5",
    "ALL_PROXY": "socks://p:6", "no_proxy": "localhost", "RANK": "99",
}


def test_worker_env_is_exactly_the_contract() -> None:
    env = worker_env(TWO_BY_TWO, 1, base=BASE)
    assert env == {
        "PATH": "/bin", "FOO": "bar", "no_proxy": "localhost",
        "PADDLE_TRAINER_ID": "3",
        "PADDLE_TRAINERS_NUM": "4",
        "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:7100,127.0.0.1:7101,127.0.0.2:7100,127.0.0.2:7101",
        "PADDLE_CURRENT_ENDPOINT": "127.0.0.2:7101",
        "PADDLE_NODE_NUM": "2",
        "FLAGS_selected_gpus": "",
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "7102",  # after node 0's endpoints: torch's store
        "FLEETLIKE_JOB_ID": "j1", "FLEETLIKE_NODE_IP": "127.0.0.2",
        "OMP_NUM_THREADS": "1",  # unset in BASE, 2 workers: torchrun's default
        "FLEETLIKE_JOB_SECRET": TWO_BY_TWO.job_secret,
        "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0",
    }
    with pytest.raises(ValueError) as info:
        worker_env(TWO_BY_TWO, 2, base=BASE)
    assert str(info.value) == "local_rank=2 is out of range 0..1 (nproc_per_node=2)"


def test_worker_env_on_gpus_keeps_the_launchers_device_numbering() -> None:
    gpu = dataclasses.replace(TWO_BY_TWO, selected_gpus=(2, 3))
    env = worker_env(gpu, 1, base={})
    assert env["FLAGS_selected_gpus"] == "3" and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    env = worker_env(gpu, 0, base={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert env["FLAGS_selected_gpus"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_malloc_tuning_adds_to_glibc_tunables_and_keeps_the_users_choice(script: str) -> None:
    assert parse_config([script]).malloc_tuning is True
    off = parse_config(["--malloc_tuning=off", script])
    assert off.malloc_tuning is False
    assert "GLIBC_TUNABLES" not in worker_env(off, 0, base={})
    assert worker_env(off, 0, base={"GLIBC_TUNABLES": "x=1"})["GLIBC_TUNABLES"] == "x=1"
    on = parse_config([script])
    cases = {
        None: "glibc.malloc.tcache_count=0",
        "": "glibc.malloc.tcache_count=0",
        "glibc.malloc.arena_max=2": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0",
        "glibc.malloc.tcache_count=5:glibc.malloc.arena_max=2": "glibc.malloc.tcache_count=5:glibc.malloc.arena_max=2",
        # glibc ignores these two (a space in the name, no "="), so they are not the user's choice
        " glibc.malloc.tcache_count=5": " glibc.malloc.tcache_count=5:glibc.malloc.tcache_count=0",
        "glibc.malloc.tcache_count": "glibc.malloc.tcache_count:glibc.malloc.tcache_count=0",
    }
    for given, want in cases.items():
        base = {} if given is None else {"GLIBC_TUNABLES": given}
        assert worker_env(on, 0, base=base)["GLIBC_TUNABLES"] == want, given
        assert launch.tuned_glibc_tunables(given) == want
    rows = format_config(off)
    assert re.search(r"^malloc_tuning\s+off$", rows, re.M)


_TCACHE_PROBE = """
import ctypes
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(40) for _ in range(5)]
used = libc.mallinfo2().uordblks
for b in blocks:
    libc.free(b)
print(used - libc.mallinfo2().uordblks)
"""


def test_workers_start_with_glibcs_thread_cache_off(script: str) -> None:
    """glibc really reads it: small blocks freed by a worker go back to the arena (counted free)
    instead of into the per-thread cache (which glibc counts as still in use)."""
    import os
    import subprocess
    import sys

    def freed(config: LaunchConfig) -> int:
        env = worker_env(config, 0, base={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
        out = subprocess.run([sys.executable, "-c", _TCACHE_PROBE], env=env, capture_output=True, text=True,
                             timeout=30, check=True)
        return int(out.stdout)

    assert freed(parse_config([script])) == 5 * 48  # five 40-byte requests, 48-byte chunks
    assert freed(parse_config(["--malloc_tuning=off", script])) == 0


def test_worker_env_docstring_lists_every_variable_it_sets() -> None:
    doc = worker_env.__doc__ or ""
    gpu = dataclasses.replace(TWO_BY_TWO, selected_gpus=(0, 1))
    for name in worker_env(gpu, 0, base={}):
        assert re.search(rf"^\s*{name}\b", doc, re.M), name
    for name in launch.PROXY_VARIABLES:
        assert name in BASE
    assert "http_proxy" in doc


def test_print_config_table(script: str) -> None:
    table = format_config(TWO_BY_TWO)
    lines = table.splitlines()
    assert lines[0] == "fleetlike.launch configuration"
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines[2:])
    assert rows["node_index"] == "1 of 2" and rows["ranks on this node"] == "2..3"
    assert rows["master_endpoint"] == "127.0.0.1:7100" and rows["device"] == "cpu"
    assert rows["job_id"] == "j1" and rows["world_size"] == "4"


def test_public_names_are_documented() -> None:
    for name in launch.__all__:
        assert getattr(launch, name).__doc__, name


@pytest.mark.parametrize("module", ["config", "flags", "checks", "env", "main", "meeting", "ports", "workers"])
def test_every_launch_module_curates_its_exports(module: str) -> None:
    import importlib

    mod = importlib.import_module(f"fleetlike.launch.{module}")
    assert mod.__doc__ and mod.__all__
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name}"


def test_auto_ports_are_held_from_their_choice_to_the_end_of_the_job(script: str) -> None:
    import datetime

    import torch.distributed as dist

    from fleetlike.comm.rendezvous import read_job_id
    from fleetlike.comm.secret import JobSecret
    from fleetlike.launch.checks import host_ports

    config = parse_config(["--start_port=auto", "--nproc_per_node=3", "--job_id=jA", script])
    assert config.started_port is None and config.auto_ports
    with pytest.raises(ValueError, match="chosen when the launcher binds them"):
        config.endpoints  # noqa: B018 - unknown until bound
    assert format_config(config).count("auto (not yet chosen; store hosted by the launcher)") == 1
    chosen, hosted = host_ports(config)
    try:
        ports = chosen.local_ports
        assert len(set(ports)) == 3 and ports == hosted.ports
        for port in ports:  # every port is this job's: nobody else can bind it, even with REUSEADDR
            assert not _bindable("127.0.0.1", port)
        # rank 0's port is a store of this job, already serving
        client = dist.TCPStore("127.0.0.1", ports[0], None, False, datetime.timedelta(seconds=5))
        assert read_job_id(client, JobSecret(config.job_secret)) == "jA"  # only with the secret
        assert read_job_id(client, JobSecret("01" * 32)) is None
        env = worker_env(chosen, 1, base={"TORCHELASTIC_USE_AGENT_STORE": "False"})
        assert env["PADDLE_TRAINER_ENDPOINTS"] == ",".join(f"127.0.0.1:{p}" for p in ports)
        assert env["PADDLE_CURRENT_ENDPOINT"] == f"127.0.0.1:{ports[1]}"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(ports[0]))
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        role = _paddle_role(env)
        assert role.master_hosted and role.rank == 1 and role.master_endpoint == f"127.0.0.1:{ports[0]}"
        assert f"auto ({','.join(map(str, ports))}; store hosted by the launcher)" in format_config(chosen)
    finally:
        hosted.close()
    assert all(_bindable("127.0.0.1", p) for p in ports[1:])  # released with the job
    # a fixed-port job never tells its rank 0 that the store is hosted, whatever it inherited
    fixed = worker_env(TWO_BY_TWO, 0, base={"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert "TORCHELASTIC_USE_AGENT_STORE" not in fixed and not _paddle_role(fixed).master_hosted


def _paddle_role(env: dict[str, str]):
    from fleetlike.roles.paddle import paddle_role

    return paddle_role(env)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True

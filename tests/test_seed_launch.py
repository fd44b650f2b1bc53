"""The seed products' own DDP and Horovod usage, run as their users run it, with only the vendor's
lines changed (tests/launch_workers/seed_ddp.py, hvd_unchanged.py); every job is real (2 CPU
ranks over gloo, or 2x2 on 127.0.0.1 / 127.0.0.2) and every rank's parameters are compared with
plain torch DDP's run of the same script (within 1e-6; fp32 sums of two agree exactly here) or,
for the Horovod script, with one process training on both ranks' batches.

* Light (000): ``@light_init(params={"training_framework": "pytorch_ddp", ...})`` with the
  ``init_process_group`` call deleted, accelerated (a fleetlike comm hook; ``Torch-NLP``'s 64 MiB
  buckets) or not (``enable_optimizations=False``: plain DDP);
* TI-ACC (001) / AIACC (004): the mpirun path, one init line at the top of a DDP script that keeps
  its own ``init_process_group``, under ``mpiexec`` and under Slurm's variables;
* the launch lines of all five pages: Paddle's fixed-port two-node form (003), TI-ACC's and
  AIACC's torch lines (one node; two nodes in the slow 2x2 test), AIACC's ``perseusrun`` forms
  (``-np 2`` with and without ``-H``), Light's ``launch trainer.py``;
* Light's "Horovod calls need no code change": a Horovod script under ``--accelerate_horovod``,
  and without the flag ``import horovod`` finds nothing.
"""

from __future__ import annotations

import functools
import socket
import threading
from pathlib import Path

import pytest
import torch

from examples_common import BIN, PY, clean_env, launcher, mpi_missing, mpiexec, run
from helpers import run_job, run_jobs, side_by_side

# its jobs fill both cores by themselves (see conftest)
pytestmark = pytest.mark.alone

WORKERS = Path(__file__).resolve().parent / "launch_workers"
SEED = WORKERS / "seed_ddp.py"
HVD = WORKERS / "hvd_unchanged.py"

_HANDED: set[int] = set()
_LOCK = threading.Lock()


def _ports(n: int) -> int:
    """p with p .. p+n-1 free on 127.0.0.1 and 127.0.0.2, given to no other job of this file
    (below the ephemeral range, so nothing outgoing takes them meanwhile)."""
    with _LOCK:
        for base in range(33000 - 40 * 50, 32700, 7):
            if base < 26000 or any(p in _HANDED for p in range(base, base + n)):
                continue
            try:
                for port in range(base, base + n):
                    for host in ("127.0.0.1", "127.0.0.2"):
                        with socket.socket() as probe:
                            probe.bind((host, port))
            except OSError:
                continue
            _HANDED.update(range(base, base + n))
            return base
    raise RuntimeError("no free ports")


def _ok(procs: list, logs: Path | None = None) -> str:
    text = "".join(p.stdout + p.stderr for p in procs)
    if logs is not None:
        text += "".join(f.read_text() for f in sorted(logs.rglob("workerlog.*")))
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    return text


def _params(out: Path, name: str, n: int = 2) -> list[list[torch.Tensor]]:
    return [torch.load(out / f"{name}.{r}.pt") for r in range(n)]


def _close(got: list[list[torch.Tensor]], ref: list[list[torch.Tensor]], what: str) -> None:
    assert len(got) == len(ref), what
    for r, (a, b) in enumerate(zip(got, ref)):
        diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
        assert diff <= 1e-6, (what, r, diff)


def _launch(out: Path, name: str, *args: str, flags: tuple[str, ...] = (), nproc: int = 2) -> str:
    if args[:1] == ("plain",):  # plain torch DDP's workers as plain interpreters (tests/helpers.py says why)
        flags = ("--preload=off", *flags)
    cmd = launcher(*flags, str(SEED), str(out), name, *args, log_dir=out / f"{name}.log", nproc=nproc)
    return _ok([run_job(cmd, cwd=out, env=clean_env(), timeout=150)], out / f"{name}.log")


def _mpi(out: Path, name: str) -> str:
    # the rendezvous port: mpiexec tells none, and jobs side by side must not share the default
    env = clean_env(FLEETLIKE_MASTER_PORT=str(_ports(3)))
    return _ok([run(mpiexec(str(SEED), str(out), name, "tiacc"), cwd=out, env=env, timeout=150)])


def _slurm(out: Path, name: str) -> str:
    port = _ports(3)
    envs = [clean_env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_NTASKS_PER_NODE="2",
                      SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_NODELIST="127.0.0.1", SLURM_JOB_ID="44",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(2)]
    return _ok(run_jobs([[PY, str(SEED), str(out), name, "tiacc"]] * 2, cwd=out, envs=envs, timeout=150))


@pytest.mark.timeout(600)
def test_light_and_tiacc_ddp_scripts_equal_plain_ddp(tmp_path: Path) -> None:
    jobs = {
        "plain": functools.partial(_launch, tmp_path, "plain", "plain"),
        "light": functools.partial(_launch, tmp_path, "light", "light", "Torch-NLP", "1"),
        "light_off": functools.partial(_launch, tmp_path, "light_off", "light", "default", "0"),
        "tiacc_slurm": functools.partial(_slurm, tmp_path, "tiacc_slurm"),
    }
    if not mpi_missing():
        jobs["tiacc_mpi"] = functools.partial(_mpi, tmp_path, "tiacc_mpi")
    names = list(jobs)
    with side_by_side({n: jobs[n] for n in names[:3]}, {n: jobs[n] for n in names[3:]}) as futures:
        pass
    said = {name: futures[name].result() for name in names}
    ref = _params(tmp_path, "plain")
    assert "hook=False" in said["plain"] and "hook=True" not in said["plain"]
    for name in names[1:]:
        _close(_params(tmp_path, name), ref, name)
    # Light accelerated: fleetlike's hook, Torch-NLP's buckets; not accelerated: plain DDP
    assert "hook=True" in said["light"] and f"bucket_bytes={64 << 20}" in said["light"], said["light"]
    assert "hook=False" in said["light_off"] and "hook=True" not in said["light_off"], said["light_off"]
    for name in names[3:]:
        assert "hook=True" in said[name] and "answered by the group fleetlike formed" in said[name], said[name]
        assert "local_rank=1" in said[name]  # torchrun's variables exported for the script


def _hvd_reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = []
    for r in range(2):
        g = torch.Generator().manual_seed(10 + r)
        batches.append((torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)))
    for _ in range(3):
        opt.zero_grad()
        sum(torch.nn.functional.mse_loss(model(x), y) for x, y in batches).div(2).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(300)
def test_a_horovod_script_runs_unchanged_only_under_accelerate_horovod(tmp_path: Path) -> None:
    def job(flag: tuple[str, ...], name: str):  # noqa: ANN202
        cmd = launcher(*flag, str(HVD), str(tmp_path), name, log_dir=tmp_path / f"{name}.log")
        return run_job(cmd, cwd=tmp_path, env=clean_env(), timeout=150)

    def hosts(name: str, *mode: str):  # noqa: ANN202 - horovodrun's form, as Horovod's users start it
        cmd = [PY, "-m", "fleetlike.launch", "-np", "2", *mode, "--accelerate_horovod", f"--started_port={_ports(3)}",
               f"--log_dir={tmp_path / name}.log", "--", "python", str(HVD), str(tmp_path), name]
        return run_job(cmd, cwd=tmp_path, env=clean_env(), timeout=150)

    jobs = {"on": lambda: job(("--accelerate_horovod",), "on"), "off": lambda: job((), "off"),
            "hosts": lambda: hosts("hosts")}
    if not mpi_missing():
        jobs["hosts_mpi"] = lambda: hosts("hosts_mpi", "--mpi")
    with side_by_side(jobs) as futures:
        pass
    ref = _hvd_reference()
    for name in [n for n in jobs if n != "off"]:
        done = futures[name].result()
        assert done.returncode == 0, (name, done.stdout)
        _close(_params(tmp_path, name), [ref, ref], name)
    assert "horovod is fleetlike.horovod" in futures["on"].result().stdout
    off = futures["off"].result()
    assert off.returncode == 3 and "no horovod: No module named 'horovod'" in off.stdout, off.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_launch_lines_of_all_five_pages_start_two_rank_jobs(tmp_path: Path) -> None:
    plain = clean_env(FLEETLIKE_PRELOAD="off")  # plain torch DDP's workers unforked: tests/helpers.py says why

    def paddle() -> str:  # 003: one launcher per node, each with the node list
        port = _ports(4)
        cmds = [[PY, "-m", "fleetlike.launch", "--cluster_node_ips=127.0.0.1,127.0.0.2", f"--node_ip={ip}",
                 f"--started_port={port}", "--nproc_per_node=1", f"--log_dir={tmp_path / 'paddle.log' / ip}",
                 str(SEED), str(tmp_path), "paddle", "plain"] for ip in ("127.0.0.1", "127.0.0.2")]
        return _ok(run_jobs(cmds, cwd=tmp_path, envs=[plain] * 2, timeout=150), tmp_path / "paddle.log")

    def torch_line(name: str, *flags: str) -> str:
        cmd = [PY, "-m", "fleetlike.launch", "--nproc_per_node=2", *flags, f"--log_dir={tmp_path / name}.log",
               str(SEED), str(tmp_path), name, "plain"]
        return _ok([run_job(cmd, cwd=tmp_path, env=plain, timeout=150)], tmp_path / f"{name}.log")

    def perseusrun(name: str, *hosts: str) -> str:
        cmd = [PY, "-m", "fleetlike.launch", "-np", "2", *hosts, f"--started_port={_ports(3)}",
               f"--log_dir={tmp_path / name}.log", "--",
               "python", str(SEED), str(tmp_path), name, "plain"]
        return _ok([run_job(cmd, cwd=tmp_path, env=plain, timeout=150)], tmp_path / f"{name}.log")

    jobs = {
        "reference": functools.partial(_launch, tmp_path, "reference", "plain"),
        "paddle": paddle,
        "tiacc": lambda: torch_line("tiacc", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
                                    f"--master_port={_ports(4)}"),
        "aiacc_launch": lambda: torch_line("aiacc_launch", "--nnodes=1", "--node_rank=0", "--master_addr=localhost",
                                           f"--master_port={_ports(4)}", "--use_env"),
        "aiacc_standalone": lambda: torch_line("aiacc_standalone", "--standalone"),
        "perseusrun": lambda: perseusrun("perseusrun"),
        "perseusrun_hosts": lambda: perseusrun("perseusrun_hosts", "-H", "localhost:2"),
        "light": functools.partial(_launch, tmp_path, "light", "light"),
    }
    names = list(jobs)
    with side_by_side(*({n: jobs[n] for n in names[i:i + 3]} for i in range(0, len(names), 3))) as futures:
        pass
    for name in names:
        futures[name].result()
    ref = _params(tmp_path, "reference")
    for name in names[1:]:
        _close(_params(tmp_path, name), ref, name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torch_style_two_nodes_of_two_equal_plain_ddp_on_four_ranks(tmp_path: Path) -> None:
    port = _ports(4)

    def nodes(name: str, vendor: str) -> str:
        plain = ["--preload=off"] if vendor == "plain" else []  # tests/helpers.py says why
        cmds = [[PY, "-m", "fleetlike.launch", *plain, "--nproc_per_node=2", "--nnodes=2", f"--node_rank={k}",
                 "--master_addr=127.0.0.1", f"--master_port={port if vendor == 'light' else port + 20}",
                 *([f"--node_ip=127.0.0.{k + 1}"] if k else []), f"--log_dir={tmp_path / name}.log/{k}",
                 str(SEED), str(tmp_path), name, vendor] for k in range(2)]
        return _ok(run_jobs(cmds, cwd=tmp_path, envs=[clean_env()] * 2, timeout=200), tmp_path / f"{name}.log")

    def mpi_nodes(name: str) -> str:  # TI-ACC's mpirun path on two hosts: a block of 2 ranks per address
        block = [PY, str(SEED), str(tmp_path), name, "tiacc"]
        cmd = [str(BIN / "mpiexec"), "-launcher", "fork", "-bind-to", "none",
               "-n", "2", "-env", "FLEETLIKE_NODE_IP", "127.0.0.1", *block,
               ":", "-n", "2", "-env", "FLEETLIKE_NODE_IP", "127.0.0.2", *block]
        return _ok([run(cmd, cwd=tmp_path, env=clean_env(FLEETLIKE_MASTER_PORT=str(_ports(3))), timeout=200)])

    second = {"plain": lambda: nodes("plain", "plain")}
    if not mpi_missing():
        second["tiacc_mpi"] = lambda: mpi_nodes("tiacc_mpi")
    with side_by_side({"reference": lambda: _launch(tmp_path, "reference", "plain", nproc=4),
                       "light": lambda: nodes("light", "light")}, second) as futures:
        pass
    said = {name: futures[name].result() for name in ("reference", "light", *second)}
    ref = _params(tmp_path, "reference", 4)
    _close(_params(tmp_path, "light", 4), ref, "light 2x2")
    _close(_params(tmp_path, "plain", 4), ref, "plain DDP under torch's two-node line")
    assert "DDP gradients through fleetlike (4 ranks, 2 node(s))" in said["light"], said["light"]
    assert "no FLEETLIKE_JOB_SECRET is set, so the launcher that hosts" in said["plain"]  # every node says how the secret is shared
    if "tiacc_mpi" in said:
        _close(_params(tmp_path, "tiacc_mpi", 4), ref, "the init line under mpiexec, 2x2")
        assert "DDP gradients through fleetlike (4 ranks, 2 node(s))" in said["tiacc_mpi"], said["tiacc_mpi"]

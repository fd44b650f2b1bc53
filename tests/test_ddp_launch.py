"""One unmodified DDP script (tests/launch_workers/ddp_script.py: the DDP tutorial's and the ImageNet
example's shape, BatchNorm, DistributedSampler, a checkpoint saved and loaded) under every way a
DDP job starts, plain and with ``import fleetlike.auto`` first; every rank's final parameters
and buffers are compared with plain DDP's (fp32, 2 ranks: gloo's sum of two is the same in any
order, so the bound is 0).

Ways: torchrun (one node), ``mp.spawn`` with MASTER_ADDR / MASTER_PORT set by the script,
``init_method="tcp://"`` and ``"file://"`` with rank and size from the command line, mpiexec
(rank from PMI_RANK), Slurm variables (SLURM_PROCID / SLURM_NTASKS), fleetlike's launcher with
``--started_port=auto`` and with fixed ports (its default form ``--nproc_per_node=2``, and the
``--cluster_node_ips ... --node_ip ... --started_port=P`` form).

Before the DDP face met the script's own group, ``mp.spawn``, ``tcp://`` and ``file://`` trained
each rank alone (different parameters on each rank, exit 0), and both fixed-port launcher forms
died with "Address already in use" (torch's store and fleetlike's rendezvous on one port).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from examples_common import PY, clean_env, launcher, mpi_missing, mpiexec, run, torchrun
from helpers import run_job, run_jobs, torchrun_module
from fleetlike.testing import free_ports

SCRIPT = Path(__file__).resolve().parent / "launch_workers" / "ddp_script.py"


def _free_run(n: int) -> int:
    """A port p with p .. p+n-1 all free on 127.0.0.1 (the launcher's fixed ports)."""
    for base in range(23000, 60000, 97):
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def _pair(cmds: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> str:
    """Start one process per command (a rank each), wait for all; their output."""
    procs = run_jobs(cmds, cwd=cwd, envs=envs, timeout=120)
    text = "".join(p.stdout for p in procs)
    assert all(p.returncode == 0 for p in procs), text
    return text


def _job(way: str, out: Path, name: str, auto: bool) -> str:
    flag = ["--auto"] if auto else []
    args = [str(SCRIPT), str(out), name]
    env = clean_env()
    if way == "torchrun":  # the console script, plainly started (the reference); the same code as a module, forked
        cmd = (torchrun_module if auto else torchrun)(*args, "--init", "env", *flag)
        proc = run_job(cmd, cwd=out, env=env, timeout=120)
    elif way == "spawn":
        proc = run_job([PY, *args, "--init", "spawn", "--port", str(free_ports(1)[0]), *flag], cwd=out, env=env,
                       timeout=120)
    elif way in ("tcp", "file"):
        port = str(free_ports(1)[0])
        return _pair([[PY, *args, "--init", way, "--port", port, "--rank", str(r), "--world", "2", *flag]
                      for r in range(2)], [env, env], out)
    elif way in ("mpi", "slurm"):
        port = str(free_ports(1)[0])
        if way == "mpi":
            proc = run(mpiexec(*args, "--init", "mpi", "--port", port, *flag), cwd=out, env=env, timeout=120)
        else:
            envs = [{**env, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                     "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
                     "SLURM_JOB_NODELIST": socket.gethostname(), "SLURM_JOB_ID": "77"} for r in range(2)]
            return _pair([[PY, *args, "--init", "slurm", "--port", port, *flag]] * 2, envs, out)
    elif way == "launch_auto":
        proc = run_job(launcher(*args, "--init", "env", *flag, log_dir=out / f"{name}.log"), cwd=out, env=env,
                       timeout=120)
    elif way == "launch_fixed":
        port = _free_run(3)
        proc = run_job([PY, "-m", "fleetlike.launch", "--nproc_per_node=2", f"--started_port={port}",
                    f"--log_dir={out / name}.log", *args, "--init", "env", *flag], cwd=out, env=env, timeout=120)
    elif way == "launch_ips":
        port = _free_run(3)
        proc = run_job([PY, "-m", "fleetlike.launch", "--cluster_node_ips=127.0.0.1", "--node_ip=127.0.0.1",
                    f"--started_port={port}", "--nproc_per_node=2", f"--log_dir={out / name}.log",
                    *args, "--init", "env", *flag], cwd=out, env=env, timeout=120)
    else:
        raise ValueError(way)
    logs = "".join(f.read_text() for f in sorted((out / f"{name}.log").glob("workerlog.*"))) if "launch" in way else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    return proc.stdout + proc.stderr + logs


def _params(out: Path, name: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{name}.{r}.pt") for r in range(2)]


WAYS = ["torchrun", "spawn", "tcp", "file", "mpi", "slurm", "launch_auto", "launch_fixed", "launch_ips"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_launch_way_equals_plain_ddp(tmp_path: Path) -> None:
    plain = {}
    for way in ("torchrun", "tcp"):
        _job(way, tmp_path, f"plain_{way}", False)
        plain[way] = _params(tmp_path, f"plain_{way}")
    ref = plain["torchrun"]  # per rank: BatchNorm's running stats are each rank's own last batch's
    for way, ranks in plain.items():  # plain DDP itself: the same under every way
        for r, got in enumerate(ranks):
            for k in ref[r]:
                assert torch.equal(got[k], ref[r][k]), (way, r, k)
    assert all(torch.equal(ref[0][k], ref[1][k]) for k in ref[0] if not k.startswith("bn.running"))
    for way in WAYS:
        if way == "mpi" and mpi_missing():
            continue
        said = _job(way, tmp_path, f"auto_{way}", True)
        assert "fleetlike.auto: DDP gradients through fleetlike (2 ranks" in said, (way, said)
        for r, got in enumerate(_params(tmp_path, f"auto_{way}")):
            for k in ref[r]:
                assert torch.equal(got[k], ref[r][k]), (way, r, k, float((got[k].double() - ref[r][k].double()).abs().max()))

"""One unmodified DDP script (tests/launch_workers/ddp_script.py: the DDP tutorial's and the ImageNet
example's shape, BatchNorm, DistributedSampler, a checkpoint saved and loaded) under every way a
DDP job starts with ``import fleetlike.auto`` first; every rank's final parameters and buffers
are compared with plain DDP's (fp32, 2 ranks: gloo's sum of two is the same in any order, so the
bound is 0), itself run under two ways (fleetlike's launcher and ``tcp://``) that must agree.
Plain DDP under the ``torchrun`` console script is in test_ddp_example.py.

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

import functools
import socket
import threading
from pathlib import Path

import pytest
import torch

from examples_common import PY, clean_env, launcher, mpi_missing, mpiexec, run
from helpers import run_job, run_jobs, side_by_side, torchrun_module

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
    """Start one process per command (a rank each), wait for all; their output. Plain DDP's ranks
    start as plain interpreters (tests/helpers.py says why)."""
    plain = cmds[0][3].startswith("plain")
    procs = run_jobs(cmds, cwd=cwd, envs=envs, timeout=120, preload=not plain)
    text = "".join(p.stdout for p in procs)
    assert all(p.returncode == 0 for p in procs), text
    return text


_HANDED: set[int] = set()
_HANDING = threading.Lock()


def _port() -> int:
    """A free port no other job of this test was given (they start at once), below the kernel's
    ephemeral range (32768-60999 by default): a port the OS picked and the test released can be
    taken meanwhile by any outgoing connection or ``bind(0)`` of the jobs beside it, and a rank
    that cannot bind its store's port leaves its peer waiting for the whole timeout."""
    with _HANDING:
        for port in range(30000, 32700):
            if port in _HANDED:
                continue
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED.add(port)
            return port
    raise RuntimeError("no free port in 30000-32699")


def _job(way: str, out: Path, name: str, auto: bool) -> str:
    """Run the script as ``way`` starts it; what the job printed."""
    flag = ["--auto"] if auto else []
    args = [str(SCRIPT), str(out), name]
    env = clean_env()
    port = _port() if way in ("spawn", "tcp", "file", "mpi", "slurm") else 0
    if way == "torchrun":  # as a module, the agent forked; its workers are plain interpreters
        proc = run_job(torchrun_module(*args, "--init", "env", *flag), cwd=out, env=env, timeout=120)
    elif way == "spawn":
        proc = run_job([PY, *args, "--init", "spawn", "--port", str(port), *flag], cwd=out, env=env, timeout=120)
    elif way in ("tcp", "file"):
        return _pair([[PY, *args, "--init", way, "--port", str(port), "--rank", str(r), "--world", "2", *flag]
                      for r in range(2)], [env, env], out)
    elif way in ("mpi", "slurm"):
        if way == "mpi":
            proc = run(mpiexec(*args, "--init", "mpi", "--port", str(port), *flag), cwd=out, env=env, timeout=120)
        else:
            envs = [{**env, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                     "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
                     "SLURM_JOB_NODELIST": socket.gethostname(), "SLURM_JOB_ID": "77"} for r in range(2)]
            return _pair([[PY, *args, "--init", "slurm", "--port", str(port), *flag]] * 2, envs, out)
    elif way == "launch_auto":
        plain = ["--preload=off"] if name.startswith("plain") else []  # tests/helpers.py says why
        proc = run_job(launcher(*plain, *args, "--init", "env", *flag, log_dir=out / f"{name}.log"), cwd=out,
                       env=env, timeout=120)
    elif way == "launch_fixed":
        base = _free_run(3)
        proc = run_job([PY, "-m", "fleetlike.launch", "--nproc_per_node=2", f"--started_port={base}",
                    f"--log_dir={out / name}.log", *args, "--init", "env", *flag], cwd=out, env=env, timeout=120)
    elif way == "launch_ips":
        base = _free_run(3)
        proc = run_job([PY, "-m", "fleetlike.launch", "--cluster_node_ips=127.0.0.1", "--node_ip=127.0.0.1",
                    f"--started_port={base}", "--nproc_per_node=2", f"--log_dir={out / name}.log",
                    *args, "--init", "env", *flag], cwd=out, env=env, timeout=120)
    else:
        raise ValueError(way)
    logs = "".join(f.read_text() for f in sorted((out / f"{name}.log").glob("workerlog.*"))) if "launch" in way else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    return proc.stdout + proc.stderr + logs


def _params(out: Path, name: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{name}.{r}.pt") for r in range(2)]


WAYS = ["torchrun", "spawn", "tcp", "file", "mpi", "slurm", "launch_auto", "launch_fixed", "launch_ips"]
#: the jobs in three waves (`helpers.side_by_side`): a job mostly waits (interpreter starts,
#: rendezvous, the agent's polling), so several at once; the jobs that start plain interpreters
#: (torchrun, mp.spawn, mpiexec) spread over the waves, and the two fixed-port launcher jobs,
#: which choose their ports by one scan, in different waves
WAVES = (("plain_launch_auto", "plain_tcp", "auto_tcp", "auto_file", "auto_slurm"),
         ("auto_torchrun", "auto_spawn", "auto_launch_auto", "auto_launch_fixed"),
         ("auto_mpi", "auto_launch_ips"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_launch_way_equals_plain_ddp(tmp_path: Path) -> None:
    assert sorted(n.split("_", 1)[1] for wave in WAVES for n in wave if n.startswith("auto_")) == sorted(WAYS)
    skip = {"auto_mpi"} if mpi_missing() else set()
    with side_by_side(*({n: functools.partial(_job, n.split("_", 1)[1], tmp_path, n, n.startswith("auto_"))
                         for n in wave if n not in skip} for wave in WAVES)) as futures:
        pass
    plain = {}
    for way in ("launch_auto", "tcp"):
        futures[f"plain_{way}"].result()
        plain[way] = _params(tmp_path, f"plain_{way}")
    ref = plain["launch_auto"]  # per rank: BatchNorm's running stats are each rank's own last batch's
    for way, ranks in plain.items():  # plain DDP itself: the same under every way
        for r, got in enumerate(ranks):
            for k in ref[r]:
                assert torch.equal(got[k], ref[r][k]), (way, r, k)
    assert all(torch.equal(ref[0][k], ref[1][k]) for k in ref[0] if not k.startswith("bn.running"))
    for way in WAYS:
        if way == "mpi" and mpi_missing():
            continue
        said = futures[f"auto_{way}"].result()
        assert "fleetlike.auto: DDP gradients through fleetlike (2 ranks" in said, (way, said)
        for r, got in enumerate(_params(tmp_path, f"auto_{way}")):
            for k in ref[r]:
                assert torch.equal(got[k], ref[r][k]), (way, r, k, float((got[k].double() - ref[r][k].double()).abs().max()))

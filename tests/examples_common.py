"""Helpers for the tests that run the examples as a user would: real launchers, real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from helpers import preload_env

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent

_ROLE_PREFIXES = ("PADDLE_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "FLEETLIKE_", "MPI_LOCAL", "TORCHELASTIC", "HYDRA_")
_ROLE_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "FLAGS_selected_gpus", "CUDA_VISIBLE_DEVICES", "STEPS", "MODEL_PATH"}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's role variables or example switches, plus ``extra``
    (so a test run inside some job, or with FLEETLIKE_STRATEGY exported, runs what it says)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ROLE_PREFIXES) and k not in _ROLE_NAMES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(preload_env())
    env.update(extra)
    return env


def launcher(*args: str, log_dir: Path, nproc: int = 2) -> list[str]:
    """``python -m fleetlike.launch --nproc_per_node=N --started_port=auto ...`` (the README's)."""
    return [PY, "-m", "fleetlike.launch", f"--nproc_per_node={nproc}", "--started_port=auto",
            f"--log_dir={log_dir}", *args]


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    """torchrun on one node; ``--standalone`` lets its rendezvous pick a free port."""
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *args]


def mpiexec(*args: str, n: int = 2) -> list[str]:
    """The mpich wheel's mpiexec on one machine: fork launcher (no ssh), no core binding."""
    return [str(BIN / "mpiexec"), "-launcher", "fork", "-bind-to", "none", "-n", str(n), PY, *args]


def mpi_missing() -> str | None:
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a missing libmpi
        return f"mpi4py does not import ({exc})"
    if not os.access(BIN / "mpiexec", os.X_OK):
        return f"no mpiexec at {BIN / 'mpiexec'}"
    return None


def run(cmd: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a job to its end in its own session; kill the whole session if it outlives ``timeout``."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout:g}s; killed.\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def costs(log: str, rank: int = 0) -> list[float]:
    """The ``worker_index: R, stepN cost = X`` values of one rank, in step order."""
    found = re.findall(rf"worker_index: {rank}, step(\d+) cost = ([-+0-9.einfa]+)", log)
    return [float(c) for _, c in sorted(found, key=lambda m: int(m[0]))]

"""`MPIRoleMaker`: the role of a process started by ``mpirun`` / ``mpiexec``.

With mpi4py importable, the ranks exchange host names over ``MPI.COMM_WORLD`` (one
``allgather``), so any rank placement works (``--map-by node`` included) and multi-node
endpoints carry real host names. Without mpi4py it falls back to the launcher's variables
(Open MPI's ``OMPI_COMM_WORLD_*`` or MPICH's ``PMI_*``) and their block layout; see
`fleetlike.roles.detect`.

Addresses: a rank's host is ``FLEETLIKE_NODE_IP`` when set, else ``MPI.Get_processor_name()``;
when every rank is on one host, 127.0.0.1 (or the master address) is used instead, so a single
machine needs no name resolution. Ports are ``base + local_rank`` as elsewhere, and the
rendezvous is at ``FLEETLIKE_MASTER_ADDR``/``MASTER_ADDR`` when set, else at rank 0's endpoint.

Constructing an MPIRoleMaker with mpi4py is collective: every rank must construct one.
"""

from __future__ import annotations

import sys
from typing import Any

from fleetlike.config import envvars
from fleetlike.roles import _env
from fleetlike.roles.base import RoleMaker
from fleetlike.roles.detect import is_mpich, is_openmpi, mpich_role, openmpi_role
from fleetlike.roles.paddle import single_role
from fleetlike.roles.role import Role, is_host, topology

__all__ = ["MPIRoleMaker", "mpi_role"]


def _world_comm(environ: _env.Environ, use_mpi4py: bool | None) -> Any | None:
    """``MPI.COMM_WORLD`` when mpi4py should and can be used, else None."""
    if use_mpi4py is False:
        return None
    launched = is_openmpi(environ) or is_mpich(environ)
    if not launched and use_mpi4py is None:
        module = sys.modules.get("mpi4py.MPI")
        if module is None or not module.Is_initialized():
            return None
    try:
        from mpi4py import MPI
    except ImportError as exc:
        if use_mpi4py:
            raise ImportError(
                f"MPIRoleMaker(use_mpi4py=True) needs mpi4py ({exc}); pip install mpi4py mpich"
            ) from exc
        return None
    return MPI.COMM_WORLD


def mpi_role(comm: Any, environ: _env.Environ) -> Role:
    """Build the role from an mpi4py communicator: rank, size and every rank's host."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    own = _env.get(environ, envvars.NODE_IP) or MPI.Get_processor_name()
    hosts = comm.allgather(own)
    bad = sorted({h for h in hosts if not is_host(h)})
    if bad:
        raise ValueError(
            f"MPI host names {bad} are neither IP addresses nor host names usable in ip:port; "
            "set FLEETLIKE_NODE_IP to each node's IP before mpirun (-x / -genv)"
        )
    port = _env.base_port(environ)
    if len(set(hosts)) == 1:
        hosts = [_env.master_addr(environ) or "127.0.0.1"] * size
    # local rank of every rank = its position among the ranks sharing its host
    locals_: list[int] = []
    for r, host in enumerate(hosts):
        locals_.append(hosts[:r].count(host))
    if port + max(locals_) > 65535:
        raise ValueError(f"base port {port} with {max(locals_) + 1} ranks per node exceeds 65535")
    endpoints = [
        f"[{h}]:{port + lr}" if ":" in h else f"{h}:{port + lr}" for h, lr in zip(hosts, locals_)
    ]
    topology(endpoints, rank)  # validates every endpoint
    return _env.role_from_env(environ, rank, endpoints, port, "mpi")


class MPIRoleMaker(RoleMaker):
    """Role from an MPI launch (Open MPI or MPICH ``mpirun``/``mpiexec``).

    Args:
        environ: variables to read (default ``os.environ``).
        use_mpi4py: None (default) uses mpi4py when importable and the process was started by
            an MPI launcher; False reads the environment only; True requires mpi4py.

    ``mpi_comm`` is the mpi4py ``COMM_WORLD`` used (None without mpi4py), so the MPI backend
    can reuse it. Outside any MPI launch this is rank 0 of 1.
    """

    def __init__(
        self, *, environ: _env.Environ | None = None, use_mpi4py: bool | None = None
    ) -> None:
        env = _env.environ_or_default(environ)
        self.mpi_comm = _world_comm(env, use_mpi4py)
        if self.mpi_comm is not None:
            role = mpi_role(self.mpi_comm, env)
        elif is_openmpi(env):
            role = openmpi_role(env)
        elif is_mpich(env):
            role = mpich_role(env)
        else:
            role = single_role(env, "mpi")
        super().__init__(role)

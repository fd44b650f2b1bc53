"""Moving tensors: one `Communicator` interface over gloo, MPI, NCCL (CuPy) and a world of one.

Example:
    >>> from fleetlike.comm import create_world
    >>> world = create_world(role)                 # role from a role maker
    >>> world.all_reduce(torch.ones(4), op="avg")
"""

from fleetlike.comm.base import (
    SUPPORTED_DTYPES,
    CommError,
    CommStats,
    Communicator,
    CompletedWork,
    ReduceOp,
    Work,
)
from fleetlike.comm.rendezvous import JobMismatchError, RendezvousError
from fleetlike.comm.single import SingleCommunicator
from fleetlike.comm.world import DEFAULT_TIMEOUT, Backend, CommGroups, create_world, resolve_backend

__all__ = [
    "SUPPORTED_DTYPES",
    "Backend",
    "CommError",
    "CommGroups",
    "CommStats",
    "Communicator",
    "CompletedWork",
    "DEFAULT_TIMEOUT",
    "JobMismatchError",
    "ReduceOp",
    "RendezvousError",
    "SingleCommunicator",
    "Work",
    "create_world",
    "resolve_backend",
]

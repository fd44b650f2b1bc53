"""Moving tensors: one `Communicator` interface over gloo, MPI, NCCL (CuPy) and a world of one.

Example:
    >>> from fleetlike.comm import create_world
    >>> world = create_world(role)                 # role from a role maker
    >>> world.all_reduce(torch.ones(4), op="avg")
"""

from fleetlike.comm.base import Communicator
from fleetlike.comm.core import divide_
from fleetlike.comm.dtypes import SUPPORTED_DTYPES, dtype_name, parse_choice
from fleetlike.comm.errors import (
    CollectiveError,
    CollectiveFailedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommError,
)
from fleetlike.comm.handles import CompletedWork, Work
from fleetlike.comm.ops import GRID, ReduceOp
from fleetlike.comm.ragged import all_gather_ragged
from fleetlike.comm.rendezvous import (
    JOB_KEY,
    JobMismatchError,
    RendezvousError,
    SecretMismatchError,
    challenge_of,
    host_store,
    job_store,
    knock,
    read_job_id,
)
from fleetlike.comm.secret import (
    SECRET_DIR_ENV,
    SECRET_ENV,
    JobSecret,
    PayloadRefused,
    SecretError,
    dumps_signed,
    loads_signed,
    new_secret,
    read_private,
    secret_file,
    secret_from_env,
    set_current,
    write_private,
)
from fleetlike.comm.single import SingleCommunicator
from fleetlike.comm.stats import CommStats
from fleetlike.comm.world import DEFAULT_TIMEOUT, Backend, CommGroups, create_world, resolve_backend

__all__ = [
    "SecretMismatchError",
    "challenge_of",
    "job_store",
    "knock",
    "read_job_id",
    "SECRET_DIR_ENV",
    "SECRET_ENV",
    "read_private",
    "secret_file",
    "write_private",
    "JobSecret",
    "PayloadRefused",
    "SecretError",
    "dumps_signed",
    "loads_signed",
    "new_secret",
    "secret_from_env",
    "set_current",
    "DEFAULT_TIMEOUT",
    "GRID",
    "SUPPORTED_DTYPES",
    "JOB_KEY",
    "Backend",
    "CollectiveError",
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommError",
    "CommGroups",
    "CommStats",
    "Communicator",
    "CompletedWork",
    "JobMismatchError",
    "ReduceOp",
    "RendezvousError",
    "SingleCommunicator",
    "Work",
    "all_gather_ragged",
    "create_world",
    "divide_",
    "dtype_name",
    "host_store",
    "parse_choice",
    "resolve_backend",
]

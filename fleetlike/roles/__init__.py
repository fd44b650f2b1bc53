"""Who each process is: role makers and the frozen `Role` they produce.

This package is the only place (with `fleetlike.launch`) that reads the environment. Everything
above it receives a `Role`.

Example:
    >>> from fleetlike import roles
    >>> maker = roles.UserDefinedRoleMaker(0, ["127.0.0.1:6170", "127.0.0.1:6171"])
    >>> maker.worker_num(), maker.is_first_worker()
    (2, True)
"""

from fleetlike.roles._env import parse_gpu_list
from fleetlike.roles.base import RoleMaker
from fleetlike.roles.detect import EnvRoleMaker, as_role, detect_role, detect_source
from fleetlike.roles.mpi import MPIRoleMaker
from fleetlike.roles.paddle import (
    PaddleCloudRoleMaker,
    UserDefinedCollectiveRoleMaker,
    UserDefinedRoleMaker,
)
from fleetlike.roles.role import Role, is_host, parse_endpoint, topology
from fleetlike.roles.slurm import expand_nodelist, parse_tasks_per_node

__all__ = [
    "Role",
    "is_host",
    "parse_endpoint",
    "parse_gpu_list",
    "topology",
    "RoleMaker",
    "as_role",
    "PaddleCloudRoleMaker",
    "UserDefinedRoleMaker",
    "UserDefinedCollectiveRoleMaker",
    "MPIRoleMaker",
    "EnvRoleMaker",
    "detect_role",
    "detect_source",
    "expand_nodelist",
    "parse_tasks_per_node",
]

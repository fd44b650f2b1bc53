"""Auto-detection: which launcher started this process, and the `Role` it implies.

Order (the first match wins, because a launcher nested inside another overrides it):

1. fleetlike / Paddle: any ``PADDLE_TRAINER_*`` / ``PADDLE_CURRENT_ENDPOINT`` variable;
2. torchrun: ``RANK`` and ``WORLD_SIZE``;
3. Open MPI: ``OMPI_COMM_WORLD_RANK`` and ``OMPI_COMM_WORLD_SIZE``;
4. MPICH / Hydra (also Intel MPI): ``PMI_RANK`` and ``PMI_SIZE``;
5. Slurm ``srun``: ``SLURM_PROCID`` and ``SLURM_NTASKS``;
6. otherwise a single process, rank 0 of 1.

torchrun, Open MPI and MPICH do not tell a process the addresses of the other nodes, so their
endpoints are synthesized on a block layout (``node_index = rank // local_size``, the default of
all three): the port of local rank i is ``base + i`` where base is ``FLEETLIKE_MASTER_PORT``, else
``MASTER_PORT`` (plus 1 under torchrun, whose own store already listens on ``MASTER_PORT``), else
6170. Under torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True`` (its default) every rank joins the
store torchrun's agent hosts at ``MASTER_ADDR:MASTER_PORT`` on one node (unless
``FLEETLIKE_MASTER_PORT``, or a ``FLEETLIKE_MASTER_ADDR`` other than ``MASTER_ADDR``, is
exported); otherwise, and on several nodes, rank 0 hosts one at ``MASTER_PORT + 1``. Node hosts come from ``FLEETLIKE_NODE_IPS``; a single node uses the master address (or
127.0.0.1); several nodes without it get stand-in names ``node0``, ``node1``, ... that only tell
the nodes apart, and the rendezvous then runs at ``FLEETLIKE_MASTER_ADDR`` / ``MASTER_ADDR``,
which must be set. `MPIRoleMaker` gathers the real host names over MPI instead.

Example:
    >>> detect_role({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
    ...              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).endpoints
    ('127.0.0.1:29501', '127.0.0.1:29502')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fleetlike.config import envvars
from fleetlike.roles import _env
from fleetlike.roles.base import RoleMaker
from fleetlike.roles.paddle import is_paddle, paddle_role, single_role
from fleetlike.roles.role import Role
from fleetlike.roles.slurm import is_slurm, slurm_role

__all__ = [
    "EnvRoleMaker",
    "LAUNCHER_VARS",
    "LauncherVars",
    "as_role",
    "detect_role",
    "detect_source",
    "env_role",
    "torchrun_role",
    "openmpi_role",
    "mpich_role",
    "uniform_role",
    "is_torchrun",
    "is_openmpi",
    "is_mpich",
]


def uniform_role(
    environ: _env.Environ,
    *,
    rank: int,
    world: int,
    local_rank: int,
    local_size: int,
    source: str,
    names: tuple[str, str, str, str],
    node_index: int | None = None,
    port_offset: int = 0,
    joins_agent_store: bool = False,
) -> Role:
    """A role on a block layout with ``local_size`` ranks on every node.

    ``names`` are the variables that held (rank, world, local_rank, local_size), for messages;
    ``node_index`` is torchrun's ``GROUP_RANK`` (the MPIs do not give one);
    ``joins_agent_store``: the launcher may host the store itself (torchrun), and every rank joins
    it when the environment says so (`_env.agent_store_port`) and the job is on one node. On
    several nodes each torchrun agent counts its own restarts (a node whose workers are healthy
    restarts them for a peer's failure without counting), so ``TORCHELASTIC_RESTART_COUNT``
    cannot name a start on every node alike: rank 0 hosts a fresh store for each start there.
    """
    rank_var, world_var, local_var, size_var = names
    if not 0 <= rank < world:
        raise ValueError(f"{rank_var}={rank} is out of range 0..{world - 1} ({world_var}={world})")
    if not 1 <= local_size <= world:
        raise ValueError(f"{size_var}={local_size} must be in 1..{world_var}={world}")
    if not 0 <= local_rank < local_size:
        raise ValueError(
            f"{local_var}={local_rank} is out of range 0..{local_size - 1} ({size_var}={local_size})"
        )
    if world % local_size:
        raise ValueError(
            f"{world_var}={world} is not a multiple of {size_var}={local_size}: nodes with "
            "different process counts cannot be laid out from the environment alone "
            "(use the same count on every node, or MPIRoleMaker with mpi4py)"
        )
    node_num = world // local_size
    expected_node, expected_local = divmod(rank, local_size)
    if node_index is not None and node_index != expected_node:
        raise ValueError(
            f"GROUP_RANK={node_index} does not hold {rank_var}={rank} in a block layout of "
            f"{local_size} per node (expected node {expected_node})"
        )
    if local_rank != expected_local:
        raise ValueError(
            f"{local_var}={local_rank} but {rank_var}={rank} with {local_size} per node is local "
            f"rank {expected_local}; ranks must be laid out node by node"
        )
    hosts, real = _env.node_hosts(environ, node_num, source=source)
    addr = _env.master_addr(environ)
    if not real and addr is None:
        raise ValueError(
            f"the {source} job spans {node_num} nodes but no rendezvous address is known: set "
            "FLEETLIKE_MASTER_ADDR (or MASTER_ADDR) to the first node's IP, or FLEETLIKE_NODE_IPS "
            "to every node's IP in node order"
        )
    port = _env.base_port(environ, offset=port_offset)
    endpoints = _env.block_endpoints(hosts, [local_size] * node_num, port)
    hosted = _env.agent_store_port(environ) if joins_agent_store and node_num == 1 else None
    return _env.role_from_env(environ, rank, endpoints, port, source, hosted_port=hosted)


@dataclasses.dataclass(frozen=True)
class LauncherVars:
    """The variables one launcher sets: (rank, world, local rank, local size), and node index.

    torchrun, Open MPI and MPICH differ only in these names (and torchrun's port offset and the
    store its agent hosts), so one reader, `env_role`, serves all three.
    """

    rank: str
    world: str
    local_rank: str
    local_size: str
    node_index: str | None = None
    port_offset: int = 0
    joins_agent_store: bool = False


#: Name of each launcher -> its variables.
LAUNCHER_VARS: dict[str, LauncherVars] = {
    "torchrun": LauncherVars(envvars.RANK, envvars.WORLD_SIZE, envvars.LOCAL_RANK, envvars.LOCAL_WORLD_SIZE,
                             envvars.GROUP_RANK, 1, True),
    "openmpi": LauncherVars(
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mpich": LauncherVars("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def env_role(environ: _env.Environ, source: str) -> Role:
    """The role from launcher ``source``'s variables (`LAUNCHER_VARS`) on a block layout.

    A missing local size means one node (all ranks local); a missing local rank is
    ``rank % local_size``, the block layout every one of these launchers uses by default.
    """
    names = LAUNCHER_VARS[source]
    world = _env.require_int(environ, names.world, minimum=1)
    rank = _env.require_int(environ, names.rank, minimum=0)
    local_size = _env.get_int(environ, names.local_size, minimum=1) or world
    local_rank = _env.get_int(environ, names.local_rank, minimum=0)
    node_index = None if names.node_index is None else _env.get_int(environ, names.node_index, minimum=0)
    return uniform_role(
        environ,
        rank=rank,
        world=world,
        local_rank=rank % local_size if local_rank is None else local_rank,
        local_size=local_size,
        node_index=node_index,
        source=source,
        names=(names.rank, names.world, names.local_rank, names.local_size),
        port_offset=names.port_offset,
        joins_agent_store=names.joins_agent_store,
    )


def torchrun_role(environ: _env.Environ) -> Role:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK`` from torchrun."""
    return env_role(environ, "torchrun")


def openmpi_role(environ: _env.Environ) -> Role:
    """``OMPI_COMM_WORLD_*`` from Open MPI's ``mpirun``."""
    return env_role(environ, "openmpi")


def mpich_role(environ: _env.Environ) -> Role:
    """``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``/``MPI_LOCALNRANKS`` from MPICH's Hydra."""
    return env_role(environ, "mpich")


def is_torchrun(environ: _env.Environ) -> bool:
    return _env.get(environ, envvars.RANK) is not None and _env.get(environ, envvars.WORLD_SIZE) is not None


def is_openmpi(environ: _env.Environ) -> bool:
    return _env.get(environ, "OMPI_COMM_WORLD_SIZE") is not None


def is_mpich(environ: _env.Environ) -> bool:
    return _env.get(environ, "PMI_SIZE") is not None and _env.get(environ, "PMI_RANK") is not None


_DETECTORS: tuple[tuple[str, Callable[[_env.Environ], bool], Callable[[_env.Environ], Role]], ...] = (
    ("paddle", is_paddle, paddle_role),
    ("torchrun", is_torchrun, torchrun_role),
    ("openmpi", is_openmpi, openmpi_role),
    ("mpich", is_mpich, mpich_role),
    ("slurm", is_slurm, slurm_role),
)


def detect_source(environ: _env.Environ | None = None) -> str:
    """Name of the launcher whose variables are present (``"single"`` when none is)."""
    env = _env.environ_or_default(environ)
    for name, present, _ in _DETECTORS:
        if present(env):
            return name
    return "single"


def detect_role(environ: _env.Environ | None = None) -> Role:
    """The `Role` of this process, from whichever launcher started it (see the module doc)."""
    env = _env.environ_or_default(environ)
    for _, present, build in _DETECTORS:
        if present(env):
            return build(env)
    return single_role(env)


class EnvRoleMaker(RoleMaker):
    """Auto-detecting role maker: fleetlike/Paddle, torchrun, Open MPI, MPICH, Slurm or single.

    ``fleet.init(role_maker=None)`` uses this. ``environ`` defaults to ``os.environ``.
    """

    def __init__(self, environ: _env.Environ | None = None) -> None:
        super().__init__(detect_role(environ))


def as_role(obj: RoleMaker | Role | None) -> Role:
    """Turn what a user passes as ``role_maker`` into a `Role`; None auto-detects.

    It lives beside detection (not in `fleetlike.roles.base`) because None means "detect", and
    detection builds on the role makers: here both are below it, so no import circle.
    """
    if obj is None:
        return detect_role()
    if isinstance(obj, Role):
        return obj
    if isinstance(obj, RoleMaker):
        return obj.role
    raise TypeError(
        f"role_maker must be a fleetlike role maker (e.g. roles.PaddleCloudRoleMaker()), a Role "
        f"or None for auto-detection; got {type(obj).__name__}"
    )

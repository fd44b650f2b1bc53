"""Choosing a backend and building a job's communicators from a `Role`.

`create_world` turns a role into the world communicator; `CommGroups` derives the
sub-communicators the strategies need (intra-node, inter-node, extra rings) by collective splits,
always in the same order on every rank, and caches them.

Backend choice (``backend="auto"``): a job started by MPI (role source "mpi") uses ``mpi`` when
mpi4py imports; a world of one uses ``single``; a CUDA device uses ``nccl``; otherwise ``gloo``.
An explicit backend always wins; asking for one this machine cannot run raises an error saying
why and what to do.

Example:
    >>> role = Role.from_endpoints(0, ["127.0.0.1:6170"])
    >>> world = create_world(role)            # a world of one: the 'single' backend
    >>> groups = CommGroups(world, role)
"""

from __future__ import annotations

import enum

import torch

from fleetlike.comm.base import Communicator
from fleetlike.comm.dtypes import parse_choice
from fleetlike.comm.gloo import GlooCommunicator
from fleetlike.comm.mpi import MPICommunicator, mpi_available
from fleetlike.comm.nccl import NcclCommunicator
from fleetlike.comm.rendezvous import connect
from fleetlike.comm.single import SingleCommunicator
from fleetlike.comm.torch_group import release_torch_group
from fleetlike.roles.role import Role

__all__ = ["Backend", "resolve_backend", "create_world", "CommGroups", "DEFAULT_TIMEOUT"]

#: Default bound on rendezvous and every collective, in seconds (as torch's 30 minutes).
DEFAULT_TIMEOUT = 1800.0


class Backend(str, enum.Enum):
    """Communication backends. ``AUTO`` picks from the device and the launch environment."""

    AUTO = "auto"
    GLOO = "gloo"
    MPI = "mpi"
    NCCL = "nccl"
    SINGLE = "single"

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        """The member for ``value``; a ValueError listing the backends otherwise."""
        return parse_choice(cls, value, what="backend", noun="backend")


def resolve_backend(requested: Backend | str, role: Role, device: torch.device | None = None) -> Backend:
    """The concrete backend for ``requested`` (see the module docstring for ``auto``)."""
    choice = Backend.parse(requested)
    if choice is not Backend.AUTO:
        return choice
    if role.source == "mpi":
        if mpi_available():
            return Backend.MPI
    if role.world_size == 1:
        return Backend.SINGLE
    if device is not None and device.type == "cuda":
        return Backend.NCCL
    return Backend.GLOO


def create_world(
    role: Role,
    *,
    backend: Backend | str = Backend.AUTO,
    timeout: float = DEFAULT_TIMEOUT,
    device: torch.device | None = None,
) -> Communicator:
    """Meet the other ranks of ``role``'s job and return the world communicator."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    choice = resolve_backend(backend, role, device)
    if choice is Backend.SINGLE:
        if role.world_size != 1:
            raise ValueError(
                f"backend='single' is a world of one, but the role has world_size={role.world_size}; "
                "use 'gloo', 'mpi' or 'nccl'"
            )
        return SingleCommunicator("world", role.rank)
    if choice is Backend.MPI:
        return _mpi_world(role, timeout)
    store = connect(role, timeout)
    if choice is Backend.GLOO:
        return GlooCommunicator(
            store, role.rank, role.world_size, range(role.world_size), "world", role.host, timeout
        )
    return NcclCommunicator.create(store, role, device=device, timeout=timeout)


def _mpi_world(role: Role, timeout: float) -> Communicator:
    if not mpi_available():
        raise RuntimeError(
            "backend='mpi' needs mpi4py and an MPI library; install them with "
            "`pip install 'fleetlike[mpi]'` (the mpich wheel brings mpiexec) and start the job "
            "with mpiexec"
        )
    world = MPICommunicator(timeout=timeout)  # the watchdog aborts a collective past it
    if world.size != role.world_size or world.rank != role.rank:
        raise ValueError(
            f"the MPI world says rank {world.rank} of {world.size}, but the role says rank "
            f"{role.rank} of {role.world_size}; start the job with mpiexec and use MPIRoleMaker"
        )
    return world


class CommGroups:
    """The world communicator and the sub-communicators derived from it, created on demand.

    Creation is collective: every rank must ask for the same groups in the same order, which
    the passes guarantee by building them at ``minimize`` time from the same strategy.
    """

    def __init__(self, world: Communicator, role: Role) -> None:
        self.world = world
        self.role = role
        self._intra: Communicator | None = None
        self._inter: Communicator | None = None
        self._rings: list[Communicator] = [world]
        self._extra: dict[str, Communicator | None] = {}

    @property
    def intra(self) -> Communicator:
        """Ranks on this node, ordered by local rank."""
        if self._intra is None:
            self._intra = self.world.split(
                self.role.node_index, self.role.local_rank, name=f"intra[node {self.role.node_index}]"
            )
        assert self._intra is not None  # color is never None here
        return self._intra

    @property
    def inter(self) -> Communicator:
        """Ranks with this rank's local rank, one per node, ordered by node."""
        if self._inter is None:
            self._inter = self.world.split(
                self.role.local_rank, self.role.node_index, name=f"inter[local {self.role.local_rank}]"
            )
        assert self._inter is not None
        return self._inter

    def rings(self, n: int) -> list[Communicator]:
        """``n`` communicators spanning the world (ring 0 is the world itself)."""
        while len(self._rings) < n:
            i = len(self._rings)
            ring = self.world.split(0, self.world.rank, name=f"ring {i}")
            assert ring is not None
            self._rings.append(ring)
        return self._rings[:n]

    def extra(self, name: str, color: int | None, key: int | None = None) -> Communicator | None:
        """A further split of the world named ``name`` (cached by name; closed with the rest).

        Collective on first use of ``name``: every rank asks for the same names in the same
        order. Strategies use it for communicators of their own (per-ring intra/inter pairs of
        hierarchical allreduce, sync BatchNorm), so their collectives never interleave with the
        gradient buckets' on a shared communicator."""
        if name not in self._extra:
            self._extra[name] = self.world.split(color, key, name=name)
        return self._extra[name]

    def close(self) -> None:
        release_torch_group(self.world)  # torch's group that stages 2 and 3 formed over this world
        for comm in [*self._extra.values(), *self._rings[1:], self._intra, self._inter, self.world]:
            if comm is not None:
                comm.close()

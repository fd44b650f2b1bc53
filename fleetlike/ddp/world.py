"""The communicators of a DDP model: met through the script's own ``torch.distributed`` job.

A DDP script forms its job itself (``init_process_group`` after torchrun, ``mp.spawn`` with
``MASTER_ADDR`` / ``MASTER_PORT``, ``init_method="tcp://..."`` or ``"file://..."``, mpiexec or
Slurm variables read by the script), and every DDP model reduces over its own
``process_group`` (the default group, a subgroup, or dimension 0 of a ``device_mesh``). The
launcher's environment may describe another world, or none. So fleetlike's communicators for a
DDP model are built from that model's group, never from the environment:

* rank and size are the group's own (``pg.rank()``, ``pg.size()``), its members
  ``dist.get_process_group_ranks(pg)``;
* the meeting runs on torch's default store (the one ``init_process_group`` made) under the key
  prefix ``fleetlike/ddp/<members>/<n>/``: no second store is hosted, so no port is bound twice;
* the node layout (what hierarchical allreduce needs) comes from the launcher's role where it
  describes the same world as torch (same rank, same size), else from each member's host name,
  exchanged through the store.

`check_world` refuses communicators whose size differs from the model's group: a process never
averages alone, or with ranks the model's group does not hold.

Example:
    >>> groups = groups_for(ddp_model.process_group)   # every member of the group calls it
"""

from __future__ import annotations

import datetime
import hashlib
import socket
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm import (DEFAULT_TIMEOUT, Backend, CommGroups, Communicator, SingleCommunicator, create_world,
                            resolve_backend)
from fleetlike.comm.gloo import GlooCommunicator
from fleetlike.comm.nccl import NcclCommunicator
from fleetlike.roles import Role, detect_role, parse_endpoint
from fleetlike.roles.settings import env_settings

__all__ = ["WorldMismatchError", "check_world", "groups_for", "model_group"]

_LOCK = threading.Lock()
#: meetings so far per member list in this process (every member meets in the same order)
_MEETINGS: dict[tuple[int, ...], int] = {}
#: communicators already met per process group object (two models on one group share them)
_BY_GROUP: weakref.WeakKeyDictionary[Any, CommGroups] = weakref.WeakKeyDictionary()


class WorldMismatchError(RuntimeError):
    """fleetlike's communicators cannot be matched to the DDP model's process group."""


def model_group(model: torch.nn.Module) -> Any:
    """The process group a DDP ``model`` reduces over (its ``process_group``; with a
    ``device_mesh`` DDP sets it to the mesh's group); None for a model that is not DDP."""
    return getattr(model, "process_group", None)


def check_world(groups: CommGroups, pg: Any, what: str = "this DDP model") -> None:
    """Raise `WorldMismatchError` when ``groups`` spans another number of ranks than ``pg``."""
    if pg is None:
        return
    theirs, mine = pg.size(), groups.world.size
    if theirs != mine:
        raise WorldMismatchError(
            f"{what} reduces over a process group of {theirs} rank(s), but fleetlike's communicators "
            f"span {mine} (role from {groups.role.source!r}: rank {groups.role.rank} of "
            f"{groups.role.world_size}); averaging over them would train "
            f"{'alone' if mine == 1 else 'with other ranks'} and the ranks would diverge. Let "
            "fleetlike meet the model's own group (pass no groups), or pass communicators of "
            "the same ranks"
        )


def groups_for(pg: Any, device: torch.device | None = None, timeout: float = DEFAULT_TIMEOUT) -> CommGroups:
    """fleetlike's communicators over the ranks of ``pg`` (collective over its members, made
    once per group and reused by every model on it). `WorldMismatchError` says why where the
    group cannot be met."""
    if not dist.is_available() or not dist.is_initialized():
        raise WorldMismatchError(
            "torch.distributed is not initialized, so there is no job to meet: call "
            "torch.distributed.init_process_group(...) before building the DDP model"
        )
    if pg is None:
        pg = dist.group.WORLD
    with _LOCK:
        found = _BY_GROUP.get(pg)
    if found is not None:
        return found
    try:
        members = tuple(int(r) for r in dist.get_process_group_ranks(pg))
    except Exception as exc:  # noqa: BLE001 - torch raises ValueError / RuntimeError here
        raise WorldMismatchError(
            f"the DDP model's process_group ({type(pg).__name__}) is not a group torch.distributed "
            f"knows ({exc}); build it with torch.distributed.new_group / a DeviceMesh"
        ) from exc
    rank, size = int(pg.rank()), int(pg.size())
    if len(members) != size or not 0 <= rank < size:
        raise WorldMismatchError(f"the DDP model's process group says rank {rank} of {size} but lists "
                                 f"{len(members)} members {members}")
    groups = _meet(members, rank, device, timeout)
    with _LOCK:
        _BY_GROUP[pg] = groups
    return groups


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - backends without a store (mpi) raise here
        return None


def _meet(members: tuple[int, ...], rank: int, device: torch.device | None, timeout: float) -> CommGroups:
    size = len(members)
    env = _env_role()
    backend = env_settings().backend or "auto"  # FLEETLIKE_BACKEND, as fleet.init reads it
    if size == 1:
        role = Role.from_endpoints(0, ["127.0.0.1:1"], source="torch.distributed")
        return CommGroups(SingleCommunicator("world", 0), role)
    store = _store()
    if store is None:
        # the script's group has no store (backend="mpi"): the launcher's role must be the same world
        if env is None or members != tuple(range(env.world_size)):
            raise WorldMismatchError(
                f"the script's process group (members {members}) has no store to meet on "
                f"(backend {dist.get_backend()!r}) and the launcher's environment "
                f"{'describes no job' if env is None else f'describes rank {env.rank} of {env.world_size}'}; "
                "initialize torch.distributed with gloo or nccl, or start the job with a launcher "
                "whose variables describe the same world"
            )
        return CommGroups(create_world(env, backend=backend, device=device, timeout=timeout), env)
    with _LOCK:
        n = _MEETINGS.get(members, 0)
        _MEETINGS[members] = n + 1
    tag = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:16]
    sub = dist.PrefixStore(f"fleetlike/ddp/{tag}/{n}/", store)
    role = _exchange_role(sub, members, rank, env, timeout)
    choice = resolve_backend(backend, role, device)
    if choice is Backend.GLOO:
        world: Communicator = GlooCommunicator(sub, rank, size, range(size), "ddp world", role.host, timeout)
    elif choice is Backend.NCCL:
        world = NcclCommunicator.create(sub, role, device=device, timeout=timeout, name="ddp world")
    elif choice is Backend.MPI:
        world = create_world(role, backend=Backend.MPI, timeout=timeout)  # checks rank/size against MPI's
    else:
        raise WorldMismatchError(f"FLEETLIKE_BACKEND={backend!r} cannot serve a group of {size} ranks; "
                                 "use gloo, nccl or mpi (or unset it)")
    return CommGroups(world, role)


def _env_role() -> Role | None:
    """The launcher's role where it describes torch's world (same rank and size), else None:
    the one `fleetlike.init_process_group` (`fleetlike.ddp.start`) formed torch's group from, where it did (under
    ``mpirun`` read through MPI), else the environment's."""
    from fleetlike.ddp.start import formed

    group = formed()
    if group is not None and group.role.rank == dist.get_rank() and group.role.world_size == dist.get_world_size():
        return group.role
    try:
        role = detect_role()
    except (ValueError, KeyError, TypeError):  # a partial launcher environment: torch's world rules
        return None
    if role.source == "single" or role.rank != dist.get_rank() or role.world_size != dist.get_world_size():
        return None
    return role


def _exchange_role(store: dist.Store, members: tuple[int, ...], rank: int, env: Role | None,
                   timeout: float) -> Role:
    """A `Role` of the group: every member publishes its host (the launcher's node IP where the
    launcher describes torch's world, else the machine's host name) and reads the others'."""
    host = parse_endpoint(env.current_endpoint)[0] if env is not None else socket.gethostname()
    store.set(f"host/{rank}", host)
    keys = [f"host/{r}" for r in range(len(members))]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    hosts = [store.get(k).decode() for k in keys]
    # ports only tell the members of one host apart: nothing listens on them
    endpoints = [f"[{h}]:{1 + i}" if ":" in h else f"{h}:{1 + i}" for i, h in enumerate(hosts)]
    gpus = env.selected_gpus if env is not None else ()
    return Role.from_endpoints(rank, endpoints, selected_gpus=gpus, source="torch.distributed",
                               job_id=f"ddp-{'-'.join(map(str, members))}"[:64])

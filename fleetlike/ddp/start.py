"""torch's default process group, formed by fleetlike from whichever launcher started the process.

A DDP script forms its job with ``torch.distributed.init_process_group``, which reads torchrun's
variables (``env://``) or an address the script knows. Started by ``mpirun``, ``srun`` or a
launcher whose variables it does not read, it cannot. TI-ACC's and AIACC's users add one line at
the top of such a script, and Light's users delete the call and let ``@light_init`` form the
group. `init_process_group` is that line here:

    import fleetlike; fleetlike.init_process_group()

It reads the role from the launch (``python -m fleetlike.launch``, torchrun, Open MPI or MPICH
``mpirun`` -- through mpi4py where it is installed, so every node's real host is known --, Slurm's
``srun``), meets the other ranks through fleetlike's rendezvous (behind the job's secret: a
process without it is refused, `fleetlike.comm.rendezvous`), and forms torch's default group on
that meeting's store (``gloo``; ``cpu:gloo,cuda:nccl`` on a machine with CUDA), so DDP,
``DistributedSampler`` and ``dist.*`` calls work unchanged. This module forms the group
(`form_group`); `fleetlike.ddp.initialize` adds `fleetlike.auto` on top (every DDP model
averages through fleetlike, with the ``FLEETLIKE_*`` knobs): it sits above the DDP face's
modules, this one below them (`fleetlike.ddp.world` reads the role formed here).

The script's own later ``dist.init_process_group(...)`` call (TI-ACC's and AIACC's scripts keep
theirs) is answered by the group formed here: a call whose ``rank`` / ``world_size`` /
``backend`` agree returns at once (rank 0 says so in one line); one that disagrees raises,
naming both. ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are exported where
unset, as torchrun exports them, for scripts that read them (``torch.cuda.set_device``).

Example:
    >>> group = form_group()          # what fleetlike.init_process_group() does first
    >>> model = torch.nn.parallel.DistributedDataParallel(Net())
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm import DEFAULT_TIMEOUT
from fleetlike.comm.gloo import settle_at_exit
from fleetlike.comm.mpi import mpi_available
from fleetlike.comm.rendezvous import connect
from fleetlike.config import envvars
from fleetlike.roles import Role, detect_role, detect_source
from fleetlike.roles.mpi import MPIRoleMaker

__all__ = ["FormedGroup", "default_backend", "form_group", "formed", "release_group"]

_LOCK = threading.Lock()
_ORIGINAL_INIT: Callable[..., Any] = dist.init_process_group
_ORIGINAL_C10D_INIT: Callable[..., Any] = dist.distributed_c10d.init_process_group


class FormedGroup:
    """What `form_group` formed: the role it read, the backend, whether `fleetlike.auto` was
    installed over it (`fleetlike.ddp.initialize`)."""

    def __init__(self, role: Role, backend: str, accelerated: bool) -> None:
        self.role = role
        self.backend = backend
        self.accelerated = accelerated
        self.answered = 0  # the script's own init_process_group calls answered so far
        #: `fleetlike.auto` was installed for it (not by the script's own import): undone on release
        self.owns_auto = False


_FORMED: FormedGroup | None = None
#: the torchrun variables `_export` set (they were unset before), taken back by `release_group`
_EXPORTED: list[str] = []


def formed() -> FormedGroup | None:
    """The group `form_group` formed and that is still alive, else None."""
    if _FORMED is not None and not dist.is_initialized():
        return None
    return _FORMED


def default_backend() -> str:
    """gloo on CPU; gloo for CPU tensors and NCCL for CUDA ones where CUDA is there (Light's
    default is NCCL, and a CPU tensor in ``dist.*`` still works)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _role() -> Role:
    """The launch's role; under ``mpirun`` through mpi4py when it is there (the hosts of every
    rank are then real, as the Horovod face does), else from the variables."""
    if detect_source() in ("openmpi", "mpich") and mpi_available():
        return MPIRoleMaker().role
    return detect_role()


def form_group(backend: str | None = None, *, timeout: float | None = None) -> FormedGroup:
    """Form torch's default process group from the launch; see the module doc. Collective:
    every rank calls it. A second call returns what the first formed.

    ``backend``: torch's backend string (default `default_backend`); ``timeout``: seconds for
    the meeting and for torch's collectives (default fleetlike's, 300).
    """
    global _FORMED
    with _LOCK:
        alive = formed()
        if alive is not None:
            return alive
        if dist.is_initialized():
            raise RuntimeError(
                "fleetlike.init_process_group: torch.distributed's default group exists already (the "
                "script formed it); call fleetlike.init_process_group() before the script's own "
                "init_process_group, at the top of the script, or drop it and import fleetlike.auto")
        limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        if not limit > 0:
            raise ValueError(f"fleetlike.init_process_group: timeout={timeout!r} must be a positive number of seconds")
        chosen = backend or default_backend()
        role = _role()
        store = connect(role, timeout=limit)
        _ORIGINAL_INIT(chosen, store=dist.PrefixStore("torch.distributed/", store), rank=role.rank,
                       world_size=role.world_size, timeout=datetime.timedelta(seconds=limit))
        settle_at_exit()
        _export(role)
        _FORMED = FormedGroup(role, chosen, False)
        dist.init_process_group = _answer  # type: ignore[assignment]
        dist.distributed_c10d.init_process_group = _answer  # type: ignore[assignment]
        return _FORMED


def release_group() -> None:
    """Destroy the group `form_group` formed (if still alive) and give torch its own
    ``init_process_group`` back."""
    global _FORMED
    with _LOCK:
        if _FORMED is not None and dist.is_initialized():
            dist.destroy_process_group()
        _FORMED = None
        while _EXPORTED:
            os.environ.pop(_EXPORTED.pop(), None)
        dist.init_process_group = _ORIGINAL_INIT  # type: ignore[assignment]
        dist.distributed_c10d.init_process_group = _ORIGINAL_C10D_INIT  # type: ignore[assignment]


def _export(role: Role) -> None:
    """torchrun's variables, where unset, for scripts that read them."""
    local = role.node_ranks()
    for name, value in ((envvars.RANK, role.rank), (envvars.WORLD_SIZE, role.world_size),
                        (envvars.LOCAL_RANK, local.index(role.rank)), (envvars.LOCAL_WORLD_SIZE, len(local))):
        if name not in os.environ:
            os.environ[name] = str(value)
            _EXPORTED.append(name)


def _backends(text: str) -> set[str]:
    """``"cpu:gloo,cuda:nccl"`` -> {"gloo", "nccl"}; ``"gloo"`` -> {"gloo"}."""
    return {part.split(":")[-1].strip().lower() for part in text.split(",") if part.strip()}


@functools.wraps(_ORIGINAL_INIT)
def _answer(backend: str | None = None, init_method: str | None = None, timeout: Any = None,
            world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
            pg_options: Any = None, device_id: Any = None, **kwargs: Any) -> None:
    """torch's ``init_process_group`` while the group fleetlike formed is alive: the script's
    own call is answered by it where they agree, and refused where they do not."""
    group = formed()
    if group is None:
        return _ORIGINAL_INIT(backend, init_method, timeout, world_size, rank, store, group_name, pg_options,
                              device_id, **kwargs)
    role = group.role
    wrong = []
    if world_size not in (-1, None) and int(world_size) != role.world_size:
        wrong.append(f"world_size={world_size} (the launch has {role.world_size})")
    if rank not in (-1, None) and int(rank) != role.rank:
        wrong.append(f"rank={rank} (the launch made this process rank {role.rank})")
    if backend and not _backends(str(backend)) <= _backends(group.backend):
        wrong.append(f"backend={backend!r} (formed with {group.backend!r}; pass "
                     f"fleetlike.init_process_group(backend={backend!r}) to form it so)")
    if wrong:
        raise ValueError(
            "torch.distributed.init_process_group: the default group was formed by "
            "fleetlike.init_process_group from the launch, and this call disagrees with it: "
            + "; ".join(wrong))
    group.answered += 1
    if role.rank == 0 and group.answered == 1:
        given = f"init_method={init_method!r}" if init_method else "env://"
        print(f"fleetlike: init_process_group({given}) answered by the group fleetlike formed "
              f"({role.world_size} ranks from {role.source}, backend {group.backend})",
              file=sys.stderr, flush=True)
    return None

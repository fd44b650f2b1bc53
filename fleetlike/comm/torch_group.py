"""torch.distributed's process group over a fleetlike world: what torch-built strategies run on.

FSDP2 (``torch.distributed.fsdp.fully_shard``), which fleetlike's ZeRO stages 2 and 3 drive,
issues its all-gathers and reduce-scatters through a torch ``ProcessGroup`` of a ``DeviceMesh``;
``torch.distributed.pipelining`` sends a pipeline's activations between stages through one.
fleetlike's gloo communicators are already torch's ``ProcessGroupGloo``, built on the job's
store under a prefix only members holding the job secret can find; this module forms torch's
default group the same way: ``init_process_group`` on a further prefix of that store
(``fleetlike/torch-pg/<n>/``), gloo on the CPU, NCCL on a GPU. So nothing new listens, no port
is chosen, and a process that does not hold the secret cannot join.

Where the script already initialised torch.distributed (a DDP-style script, a test comparing
with FSDP2), its default group is reused when it spans the same ranks, and refused with the
reason when it does not. A group this module made is destroyed when the world closes
(``fleet.shutdown``), with every subgroup made on it; one the script made is left alone.

Example:
    >>> pg = torch_process_group(groups.world, torch.device("cpu"))
    >>> mesh = DeviceMesh.from_group(pg, "cpu")
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm.base import Communicator
from fleetlike.comm.gloo import settle_at_exit

__all__ = ["TorchGroupError", "owned_torch_group", "release_torch_group", "torch_process_group"]

_LOCK = threading.Lock()
#: groups formed so far in this process (each formation uses a fresh key prefix)
_FORMED = [0]
#: the communicator whose default group this module formed (None: none, or the script's own)
_OWNER: list[Communicator | None] = [None]


class TorchGroupError(RuntimeError):
    """torch.distributed's default group cannot serve this fleetlike world."""


def torch_process_group(world: Communicator, device: torch.device, *, purpose: str = "stages 2 and 3",
                        timeout: float | None = None) -> Any:
    """torch's default process group over ``world``'s ranks (collective on first use: every
    rank of ``world`` calls it). Reuses an initialised default group of the same ranks.
    ``purpose`` names what runs on it in errors (ZeRO's stages, a pipeline's activations);
    ``timeout``: seconds for torch's collectives (default the world's)."""
    if dist.is_initialized():
        size, rank = dist.get_world_size(), dist.get_rank()
        if (size, rank) != (world.size, world.rank):
            raise TorchGroupError(
                f"torch.distributed is already initialised as rank {rank} of {size}, but this fleetlike "
                f"world is rank {world.rank} of {world.size}; {purpose} run on torch's default group, "
                "which must span the same ranks: destroy the script's group "
                "(torch.distributed.destroy_process_group()) or initialise it over the same job"
            )
        return dist.group.WORLD
    store = getattr(world, "_store", None)
    if store is None and world.size == 1:  # a world of one has no job store: nothing to meet
        store = dist.HashStore()
    if store is None:
        raise TorchGroupError(
            f"the fleetlike world runs on {world.backend!r}, which has no job store to form torch's process "
            f"group on; {purpose} need a gloo (CPU) or nccl (GPU) world: set FLEETLIKE_BACKEND=gloo or "
            "nccl, or initialise torch.distributed yourself before the first step"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    with _LOCK:
        n = _FORMED[0]
        _FORMED[0] += 1
    prefixed = dist.PrefixStore(f"fleetlike/torch-pg/{n}/", store)
    seconds = timeout if timeout is not None else float(getattr(world, "timeout", 300.0) or 300.0)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, store=prefixed, rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(seconds=seconds), **kwargs)
    settle_at_exit()
    _OWNER[0] = world
    return dist.group.WORLD


def owned_torch_group(world: Communicator) -> bool:
    """Whether this module formed torch's default group for ``world`` (and will destroy it)."""
    return _OWNER[0] is world


def release_torch_group(world: Communicator) -> None:
    """Destroy torch's default group if this module formed it for ``world`` (``world`` is
    closing); a group the script made is left alone."""
    if _OWNER[0] is not world:
        return
    _OWNER[0] = None
    if dist.is_initialized():
        dist.destroy_process_group()

"""The current job as the input layer sees it: rank, size and device from ``fleet``.

`fleetlike.io` defaults ``num_replicas``/``rank`` (and the prefetch device) to the fleet job's,
as torch's ``DistributedSampler`` defaults to the process group's. Without ``fleet.init()`` there
is no job to ask: the error says so rather than silently reading everything on every rank.

Example:
    >>> rank, size = replicas(None, None, "DistributedSampler")
"""

from __future__ import annotations

import torch

from fleetlike.fleet import fleet

__all__ = ["current_device", "io_settings", "replicas"]


def _initialized() -> bool:
    try:
        fleet.role
    except RuntimeError:
        return False
    return True


def replicas(num_replicas: int | None, rank: int | None, what: str) -> tuple[int, int]:
    """``(rank, num_replicas)``, each defaulting to the fleet job's; checked."""
    if num_replicas is None or rank is None:
        if not _initialized():
            raise RuntimeError(
                f"{what}: num_replicas and rank default to the fleet job's, and fleet.init() has not "
                "been called; call fleet.init() first (one process: a job of one) or pass "
                "num_replicas= and rank="
            )
        num_replicas = fleet.worker_num() if num_replicas is None else num_replicas
        rank = fleet.worker_index() if rank is None else rank
    for name, value in (("num_replicas", num_replicas), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__} ({value!r})")
    if num_replicas < 1:
        raise ValueError(f"{what}: num_replicas={num_replicas}; it must be >= 1 (the number of workers)")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"{what}: rank={rank} is outside [0, {num_replicas - 1}] for num_replicas={num_replicas}")
    return rank, num_replicas


def current_device() -> torch.device:
    """The fleet job's device, or the CPU without a job."""
    return fleet.device() if _initialized() else torch.device("cpu")


_IO_DEFAULTS = {"slicing": True, "unbalanced_io_slicing": True, "drop_last_files": False}


def io_settings() -> dict[str, bool]:
    """The job strategy's ``io_configs`` (EPL's ``io.slicing``, ``io.unbalanced_io_slicing``,
    ``io.drop_last_files``); the defaults without a job."""
    if not _initialized():
        return dict(_IO_DEFAULTS)
    return {k: bool(v) for k, v in fleet.effective_strategy(what="fleetlike.io").io_configs.items()}

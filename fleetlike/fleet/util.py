"""``fleet.util``: small host-side collectives and file sharding, as Paddle's ``UtilBase``.

Numbers, numpy arrays and tensors go in; the same kind comes out. Used, for example, to average
the loss over ranks for the adaptive local SGD recipe (seed 003's loss allreduce program).

Example:
    >>> fleet.util.all_reduce(loss_value, mode="sum") / fleet.worker_num()
    >>> fleet.util.get_file_shard(["a", "b", "c", "d", "e"])   # rank 0 of 2 -> ['a', 'b', 'c']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fleetlike.comm import Communicator

__all__ = ["Util", "file_shard"]

_MODES = {"sum": "sum", "max": "max", "min": "min", "avg": "avg", "mean": "avg", "prod": "prod"}


def file_shard(files: Sequence[str], rank: int, world: int) -> list[str]:
    """Paddle's split: contiguous blocks; the first ``len(files) % world`` ranks take one more."""
    if not isinstance(files, (list, tuple)):
        raise TypeError(f"get_file_shard: files must be a list of names, got {type(files).__name__}")
    base, extra = divmod(len(files), world)
    start = rank * base + min(rank, extra)
    return list(files[start : start + base + (1 if rank < extra else 0)])


class Util:
    """Bound to the fleet's world communicator through ``comm_fn`` (resolved at call time)."""

    def __init__(self, comm_fn: Callable[[], tuple[Communicator, int, int, torch.device]]) -> None:
        self._comm_fn = comm_fn

    def _to_tensor(self, x: Any, device: torch.device) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        if isinstance(x, torch.Tensor):
            dev = x.device
            return x.detach().to(device).clone(), lambda t: t.to(dev)
        if isinstance(x, np.ndarray):
            dtype = x.dtype
            return torch.from_numpy(np.ascontiguousarray(x)).to(device).clone(), lambda t: t.cpu().numpy().astype(dtype)
        if isinstance(x, bool) or not isinstance(x, (int, float, np.number)):
            raise TypeError(
                f"fleet.util collectives take numbers, numpy arrays or tensors, got {type(x).__name__}"
            )
        kind = type(x)
        t = torch.tensor(x, dtype=torch.float64 if isinstance(x, (float, np.floating)) else torch.int64)
        return t.to(device), lambda t: kind(t.item())

    def all_reduce(self, x: Any, mode: str = "sum") -> Any:
        """Reduce ``x`` over all workers with ``mode`` in sum / max / min (also avg, prod)."""
        if mode not in _MODES:
            raise ValueError(f"fleet.util.all_reduce: mode={mode!r}; choose one of {sorted(_MODES)}")
        comm, _, _, device = self._comm_fn()
        t, back = self._to_tensor(x, device)
        return back(comm.all_reduce(t, _MODES[mode]))

    def all_gather(self, x: Any) -> list[Any]:
        """Every worker's ``x``, in rank order."""
        comm, _, _, device = self._comm_fn()
        t, back = self._to_tensor(x, device)
        return [back(part) for part in comm.all_gather(t)]

    def barrier(self) -> None:
        self._comm_fn()[0].barrier()

    def get_file_shard(self, files: Sequence[str]) -> list[str]:
        """This worker's share of ``files`` (see `file_shard`)."""
        _, rank, world, _ = self._comm_fn()
        return file_shard(files, rank, world)

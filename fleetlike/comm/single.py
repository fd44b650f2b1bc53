"""The `single` backend: a world of one, so every script also runs as one plain process.

Every collective still goes through the base class (argument checks, out-of-place copies,
statistics), so a script that is wrong for N ranks tends to be wrong for one too.
"""

from __future__ import annotations

import torch

from fleetlike.comm.base import Communicator
from fleetlike.comm.handles import CompletedWork, Work
from fleetlike.comm.ops import ReduceOp

__all__ = ["SingleCommunicator"]


class SingleCommunicator(Communicator):
    """Rank 0 of 1. The base class already short-cuts size-1 groups; these are the rest."""

    backend = "single"

    def __init__(self, name: str = "world", world_rank: int = 0) -> None:
        super().__init__(0, 1, [world_rank], name)

    def _check_device(self, name: str, tensor: torch.Tensor, what: str) -> None:
        """Any device: nothing leaves this process, so a one-GPU job keeps its CUDA tensors.

        (The first GPU run found a single-GPU ResNet job refused here: its world is `single`.)
        """

    def _all_reduce_start(self, buf: torch.Tensor, op: ReduceOp) -> Work:
        return CompletedWork(buf)

    def _broadcast_start(self, buf: torch.Tensor, root: int) -> Work:
        return CompletedWork(buf)

    def _reduce_start(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work:
        return CompletedWork(buf)

    def _all_gather_start(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        if chunk.data_ptr() != out.data_ptr():
            out.copy_(chunk)
        return CompletedWork(out)

    def _reduce_scatter_start(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        if out.data_ptr() != buf.data_ptr():
            out.copy_(buf)
        return CompletedWork(out)

    def _barrier_start(self) -> Work:
        return CompletedWork(None)

    def _split(self, color: int | None, key: int) -> Communicator | None:
        if color is None:
            return None
        return SingleCommunicator(f"{self.name}/split:{color}", self.ranks[0])

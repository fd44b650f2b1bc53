"""``hvd.SyncBatchNorm``: Horovod's name for BatchNorm over the statistics of every rank's batch,
mapped onto fleetlike's `SyncBatchNorm` (one float64 allreduce of sum / sum of squares / count
in forward, one in backward) on the Horovod world.

Example:
    >>> bn = hvd.SyncBatchNorm(64)        # in place of torch.nn.BatchNorm2d(64)
"""

from __future__ import annotations

import torch

from fleetlike.horovod.runtime import is_initialized, runtime
from fleetlike.strategies.sync_bn import SyncBatchNorm as _FleetSyncBatchNorm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_FleetSyncBatchNorm):
    """BatchNorm whose training statistics span all Horovod ranks (any input of 2+ dims)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         comm=runtime("hvd.SyncBatchNorm").comm if is_initialized() else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm is None:  # built before hvd.init(): take the communicator now
            self.comm = runtime("hvd.SyncBatchNorm.forward").comm
        return super().forward(x)

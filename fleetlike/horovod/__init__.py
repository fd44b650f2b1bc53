"""Horovod's PyTorch API on fleetlike: ``import fleetlike.horovod as hvd``.

A PyTorch Horovod script runs with only its import changed, under ``python -m fleetlike.launch``,
``mpiexec``/``mpirun``, ``torchrun`` or Slurm, over gloo, MPI or NCCL, and gets fleetlike's
communicators underneath: the overlapped gradient reducer tuned by a `DistributedStrategy`
(fused buckets, several rings, hierarchical and fp16 allreduce), the desync check that names
each rank's shape, and collective timeouts that name the missing ranks.

Modules: `runtime` (init and topology), `collectives` (tensor collectives, handles, join),
`scatter` (alltoall, reducescatter), `join` (barrier, join), `negotiate` (the agreement before
each collective), `speculate` (a predicted allreduce carries its own agreement), `adasum`, `objects` (objects, parameters,
optimizer state), `optimizer` / `adasum_optimizer` (DistributedOptimizer), `sync_bn`, `ops`.

Example (Horovod's own lines):
    >>> import fleetlike.horovod as hvd
    >>> hvd.init()
    >>> optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

from __future__ import annotations

from typing import Any

import torch

from fleetlike.comm import CollectiveMismatchError, CollectiveTimeoutError
from fleetlike.config import DistributedStrategy as _Strategy
from fleetlike.horovod import env as _hvd_env
from fleetlike import tune as _tune_env
from fleetlike.horovod import elastic
from fleetlike.horovod.adasum import AdasumUnsupportedError, refuse_adasum_on_a_set
from fleetlike.horovod.adasum_optimizer import AdasumOptimizer
from fleetlike.horovod.collectives import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from fleetlike.horovod.gather import (
    allgather,
    allgather_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from fleetlike.horovod.join import barrier, join
from fleetlike.horovod.negotiate import HorovodInternalError
from fleetlike.horovod.objects import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from fleetlike.horovod.ops import (
    Adasum,
    Average,
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    Max,
    Min,
    NoneCompressor,
    Product,
    ReduceOp,
    Sum,
    parse_op,
)
from fleetlike.horovod.optimizer import HorovodOptimizer, OutsideSetOptimizer
from fleetlike.horovod.order import Handle, poll, synchronize
from fleetlike.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    init,
    process_set_included,
    process_set_runtime,
    remove_process_set,
)
from fleetlike.horovod.scatter import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from fleetlike.horovod.runtime import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from fleetlike.horovod.sync_bn import SyncBatchNorm
from fleetlike.horovod.timeline import start_timeline, stop_timeline

__all__ = [
    "elastic",
    "Adasum",
    "AdasumOptimizer",
    "AdasumUnsupportedError",
    "Average",
    "BF16Compressor",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "FP16Compressor",
    "Handle",
    "HorovodInternalError",
    "ProcessSet",
    "HorovodOptimizer",
    "Max",
    "Min",
    "NoneCompressor",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "add_process_set",
    "rank",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: type[Compressor] | Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp | str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    strategy: Any = None,
    agree: bool = True,
) -> HorovodOptimizer | AdasumOptimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Horovod's arguments (see `fleetlike.horovod.optimizer`); ``strategy`` (fleetlike's, keyword
    only) is the `DistributedStrategy` whose data-parallel settings tune the reduction (default:
    the one of ``hvd.init`` / ``fleet.init``, with ``FLEETLIKE_STRATEGY`` applied).

    Example:
        >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
        ...                                named_parameters=model.named_parameters(),
        ...                                compression=hvd.Compression.fp16)
    """
    if num_groups and groups is None:
        groups = num_groups
    red = parse_op(op)
    if process_set is not None and process_set is not global_process_set:
        if red is ReduceOp.ADASUM:
            refuse_adasum_on_a_set()
        if not process_set_included(process_set, "hvd.DistributedOptimizer"):
            return OutsideSetOptimizer(optimizer, named_parameters, process_set)
    rt = process_set_runtime(process_set, "hvd.DistributedOptimizer")
    if red is ReduceOp.ADASUM:
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if groups is not None or strategy is not None:
            raise ValueError("hvd.DistributedOptimizer(op=Adasum) reduces the update in step(): groups and "
                             "strategy (bucket settings) do not apply to it")
        if _hvd_env.read().autotune or _tune_env.requested(rt.strategy or _Strategy()) is not None:
            raise ValueError("hvd.DistributedOptimizer(op=Adasum) with HOROVOD_AUTOTUNE / FLEETLIKE_AUTOTUNE / "
                             "strategy.auto_tune: Adasum reduces the update in step(), it has no gradient buckets "
                             "to tune. Fix: unset the variable for this job, or use op=hvd.Average")
        return AdasumOptimizer(optimizer, named_parameters, compression, backward_passes_per_step)
    return HorovodOptimizer(optimizer, named_parameters, compression, backward_passes_per_step, red,
                            gradient_predivide_factor, groups, sparse_as_dense, strategy=strategy, agree=agree,
                            rt=rt)

"""Pipeline parallelism with Paddle's and EPL's names, on `torch.distributed.pipelining`.

A model larger than one device is cut into stages (`split`), one per rank of a pipeline; the
ranks divide into ``dp_degree`` pipelines of ``pp_degree`` stages (`topology`); each stage's
`PipelineModel` runs torch's 1F1B or GPipe schedule over the micro-batches and averages its
gradients over the pipelines (`model`); a stage that raises stops every rank with its error
(`failure`).

Example:
    >>> fleet.init(strategy=DistributedStrategy(pipeline=True,
    ...     pipeline_configs={"accumulate_steps": 4}, hybrid_configs={"pp_degree": 2}))
    >>> model = fleet.distributed_model(torch.nn.Sequential(*blocks), loss_fn=F.cross_entropy)
    >>> opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    >>> loss = model.train_batch((x, y), opt)
"""

from fleetlike.pipeline.failure import FailureGuard, PipelineStageError
from fleetlike.pipeline.model import PipelineModel, StageModule
from fleetlike.pipeline.split import (StagePlan, agreed_block_seconds, balance, block_seconds, plan_stages,
                                      sequence_blocks, split_points_by_time)
from fleetlike.pipeline.topology import HybridCommunicateGroup, ParallelMode, resolve_degrees

__all__ = [
    "FailureGuard",
    "HybridCommunicateGroup",
    "ParallelMode",
    "PipelineModel",
    "PipelineStageError",
    "StageModule",
    "StagePlan",
    "agreed_block_seconds",
    "balance",
    "block_seconds",
    "plan_stages",
    "resolve_degrees",
    "sequence_blocks",
    "split_points_by_time",
]

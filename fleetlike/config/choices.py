"""The closed sets of string values that `DistributedStrategy` options take.

Why a module of its own: these enums are read well beyond the option registry (the strategies,
the faces, the EPL keys, user code comparing ``s.amp_configs["dtype"] is HalfDtype.BFLOAT16``),
while the registry (`fleetlike.config.options`) is read by the strategy object alone. Each is a
``str`` enum, so a value compares equal to its spelling and a bad spelling is refused with the
valid choices listed (`fleetlike.config.fields.Choice`).

Example:
    >>> HalfDtype("bfloat16") is HalfDtype.BFLOAT16, str(HalfDtype.BFLOAT16)
    (True, 'bfloat16')
"""

from __future__ import annotations

from enum import Enum

from fleetlike.config.fields import Reduction
from fleetlike.config.reductions import ReduceOp

__all__ = [
    "AmpPolicy",
    "CollectiveMode",
    "EplPipelineStrategy",
    "Fp16AllreduceMode",
    "HalfDtype",
    "HierarchicalAlgorithm",
    "Mode",
    "OffloadLevel",
    "OuterOptimizer",
    "PipelineBalance",
    "PipelineP2P",
    "PipelineSchedule",
    "REDUCE_METHOD",
    "ReduceMethod",
    "SyncBatchNormScope",
    "SyncDtype",
    "ZeroLevel",
]


class _StrEnum(str, Enum):
    """A closed set of strings; ``str()`` gives the bare value on every Python version."""

    def __str__(self) -> str:
        return str(self.value)


class HalfDtype(_StrEnum):
    """16-bit float formats, for ``amp_configs.dtype`` and ``fp16_allreduce_configs.dtype``."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class HierarchicalAlgorithm(_StrEnum):
    """How a hierarchical allreduce splits into intra-node and inter-node phases."""

    REDUCE_SCATTER = "reduce_scatter"
    REDUCE_BROADCAST = "reduce_broadcast"


class Fp16AllreduceMode(_StrEnum):
    """Which hops of the allreduce carry compressed gradients."""

    ALL = "all"
    MIXED = "mixed"


class AmpPolicy(_StrEnum):
    """When AMP is on: always, or by TI-ACC's adaptive policies (time, time + lr, loss)."""

    ALWAYS = "always"
    TIME = "time"
    TIME_LR = "time_lr"
    LOSS = "loss"


class OuterOptimizer(_StrEnum):
    """How local SGD turns the averaged change since the last sync into the new parameters.

    ``average`` takes the average as is (Paddle's local SGD); ``sgd`` and ``nesterov`` treat the
    averaged change as a pseudo-gradient for an outer SGD / Nesterov-momentum step (DiLoCo,
    Douillard et al. 2023)."""

    AVERAGE = "average"
    SGD = "sgd"
    NESTEROV = "nesterov"


class SyncDtype(_StrEnum):
    """The wire dtype of local SGD's pseudo-gradients."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class SyncBatchNormScope(_StrEnum):
    """Which ranks a synchronised BatchNorm averages its statistics over."""

    GLOBAL = "global"
    LOCAL = "local"


#: How gradients combine over the ranks: the core's `ReduceOp` (``ReduceMethod.MEAN`` is
#: ``ReduceOp.AVG``, ``ReduceMethod.SUM`` is ``ReduceOp.SUM``), an alias kept for the name
ReduceMethod = ReduceOp
#: ``gradients_reduce_method``'s spellings (EPL's ``communication.gradients_reduce_method``)
REDUCE_METHOD = Reduction((("mean", ReduceOp.AVG), ("sum", ReduceOp.SUM)))


class ZeroLevel(_StrEnum):
    """EPL's ``zero.level``: "" (off) or "v1" (optimizer state and gradients sharded: ZeRO
    stage 2, ``sharding_configs.stage = 2``)."""

    OFF = ""
    V1 = "v1"


class OffloadLevel(_StrEnum):
    """EPL's ``offload.level``: "" (off) or "v0" (every parameter kept in host memory: stage 3
    with the parameter shards, their gradients and the optimizer state offloaded)."""

    OFF = ""
    V0 = "v0"


class PipelineSchedule(_StrEnum):
    """Paddle's ``pipeline_configs.schedule_mode``: one forward then one backward per micro-batch
    in the steady state (1F1B), or every forward before any backward (FThenB, GPipe)."""

    ONE_F_ONE_B = "1F1B"
    F_THEN_B = "FThenB"


class PipelineBalance(_StrEnum):
    """``pipeline_configs.balance``: what the automatic split (no split points) makes equal
    across stages: parameters, or the blocks' forward + backward time measured on an example
    micro-batch."""

    PARAMS = "params"
    TIME = "time"


class PipelineP2P(_StrEnum):
    """``pipeline_configs.p2p``: how a pipeline's neighbouring stages hand over activations and
    gradients: through shared memory where both ranks are on one machine, gloo otherwise
    (auto), or always over gloo."""

    AUTO = "auto"
    GLOO = "gloo"


class EplPipelineStrategy(_StrEnum):
    """EPL's ``pipeline.strategy``: PreferBackward is 1F1B (PipeDream), PreferForward GPipe."""

    PREFER_BACKWARD = "PreferBackward"
    PREFER_FORWARD = "PreferForward"


class Mode(_StrEnum):
    """Fleet 1.x execution mode (ParallelExecutor vs Executor); recorded only in PyTorch."""

    NCCL2 = "nccl2"
    COLLECTIVE = "collective"


class CollectiveMode(_StrEnum):
    """Fleet 1.x ``collective_mode``: a view of whether local SGD replaces gradient allreduce."""

    GRAD_ALLREDUCE = "grad_allreduce"
    LOCAL_SGD = "local_sgd"

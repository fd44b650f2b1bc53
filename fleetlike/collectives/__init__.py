"""Gradient collectives: buckets, the reducer that overlaps them with backward, and the ways a
bucket is averaged (flat, hierarchical, 16-bit compressed, scaled), gradient accumulation's
counter, plus coalesced broadcast.

This layer sits on `fleetlike.comm` only: it knows communicators and tensors, never a
`DistributedStrategy` (choosing a collective from the strategy is the data-parallel pass's job,
`fleetlike.strategies.data_parallel.gradient_collective`), so every class here takes plain
arguments and can be used and tested on its own.

Example:
    >>> coll = FlatAllReduce(groups.rings(1))
    >>> reducer = make_reducer(model, coll, cap_bytes=32 << 20)
    >>> reducer.prepare(loss); loss.backward(); reducer.finalize()   # grads averaged
"""

from fleetlike.collectives.accumulate import Accumulation, count_passes
from fleetlike.collectives.broadcast import broadcast_coalesced
from fleetlike.collectives.buckets import Bucket, plan_buckets
from fleetlike.collectives.codec import HalfCodec
from fleetlike.collectives.compression import CompressedAllReduce
from fleetlike.collectives.flat import BucketCollective, FlatAllReduce, ScaledAllReduce
from fleetlike.collectives.gossip import DownsampledAllReduce, Downsampler, sent_elements
from fleetlike.collectives.hierarchical import (
    HierarchicalAllReduce,
    RingWorkers,
    cross_node_bytes_flat,
    hierarchical_pairs,
)
from fleetlike.collectives.reducer import GradReducer, PassGate, make_reducer, unused_parameters
from fleetlike.collectives.sharded import (
    ParamGather,
    ShardedBucket,
    ShardReduceScatter,
    assign_owners,
    plan_shards,
    two_level_positions,
)
from fleetlike.collectives.transient import IN_FLIGHT, TransientBucket, TransientReducer, transient_buckets
from fleetlike.collectives.segments import SEGMENT_BYTES, agree_max, segmented_all_reduce

__all__ = [
    "IN_FLIGHT",
    "SEGMENT_BYTES",
    "Accumulation",
    "Bucket",
    "BucketCollective",
    "CompressedAllReduce",
    "DownsampledAllReduce",
    "Downsampler",
    "FlatAllReduce",
    "GradReducer",
    "HalfCodec",
    "HierarchicalAllReduce",
    "ParamGather",
    "PassGate",
    "RingWorkers",
    "ScaledAllReduce",
    "ShardReduceScatter",
    "ShardedBucket",
    "TransientBucket",
    "TransientReducer",
    "agree_max",
    "assign_owners",
    "broadcast_coalesced",
    "count_passes",
    "cross_node_bytes_flat",
    "hierarchical_pairs",
    "make_reducer",
    "plan_buckets",
    "plan_shards",
    "segmented_all_reduce",
    "sent_elements",
    "transient_buckets",
    "two_level_positions",
    "unused_parameters",
]

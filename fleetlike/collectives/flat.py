"""The bucket-collective interface and its plain form: one averaging allreduce per bucket.

`BucketCollective` is what `GradReducer` needs from a collective (start a bucket, describe it,
a world communicator for small agreements); the hierarchical and compressed variants implement
the same three members, so the gradient hooks never know which one runs.

Example:
    >>> coll = FlatAllReduce(groups.rings(2))       # bucket i on ring i % 2
    >>> coll.start(bucket).wait()                   # bucket.buffer averaged over the ranks
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fleetlike.collectives.buckets import Bucket
from fleetlike.comm import Communicator, Work, dtype_name
from fleetlike.comm.handles import ChainedWork

__all__ = ["BucketCollective", "FlatAllReduce", "ScaledAllReduce"]


class BucketCollective(Protocol):
    """How a bucket's gradients are combined over the ranks (average by default)."""

    def start(self, bucket: Bucket) -> Work:
        """Start combining ``bucket.buffer`` in place; return the handle to wait on."""
        ...

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        """Facts for the program listing: op name, communicator, wire dtype, ..."""
        ...

    @property
    def world(self) -> Communicator:
        """A communicator spanning all ranks."""
        ...


class FlatAllReduce:
    """Average each bucket with one allreduce; bucket i goes to ring ``i % len(rings)``."""

    def __init__(self, rings: Sequence[Communicator]) -> None:
        if not rings:
            raise ValueError("FlatAllReduce needs at least one communicator")
        self.rings = list(rings)

    @property
    def world(self) -> Communicator:
        """A communicator spanning all ranks (for small agreements such as AMP's finite flag)."""
        return self.rings[0]

    def comm_for(self, bucket: Bucket) -> Communicator:
        return self.rings[bucket.index % len(self.rings)]

    def start(self, bucket: Bucket) -> Work:
        return self.comm_for(bucket).all_reduce_async(bucket.buffer, "avg", agreed=True)

    def start_tensor(self, tensor: torch.Tensor, index: int) -> Work:
        """Average ``tensor`` in place on ring ``index % len(rings)`` (the same call the two-level
        and compressed collectives offer, so a caller need not know which one it holds)."""
        return self.rings[index % len(self.rings)].all_reduce_async(tensor, "avg", agreed=True)

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        return {"comm": self.comm_for(bucket).name, "wire": dtype_name(bucket.dtype)}


class ScaledAllReduce:
    """Another `BucketCollective` with a scale before and after (Horovod's ``prescale_factor`` /
    ``postscale_factor``: 1/f and f for a predivided average, ``size`` after for a Sum, since
    the inner collective averages)."""

    def __init__(self, inner: BucketCollective, pre: float, post: float) -> None:
        self.inner, self.pre, self.post = inner, float(pre), float(post)

    @property
    def world(self) -> Communicator:
        return self.inner.world

    def start(self, bucket: Bucket) -> Work:
        if self.pre != 1.0:
            bucket.buffer.mul_(self.pre)
        work = self.inner.start(bucket)
        post = self.post
        return ChainedWork(work, lambda: bucket.buffer.mul_(post))

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        return {**self.inner.describe(bucket), "prescale": self.pre, "postscale": self.post}

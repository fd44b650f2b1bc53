"""fp16 / bf16 gradient compression around a bucket's allreduce (`CompressedAllReduce`).

Each float32 (or float64) bucket travels as a 16-bit float and comes back in its own dtype:

1. pre-divide by the world size ``N`` (as DDP's ``fp16_compress_hook``), so the sum of ``N``
   values is an average and cannot outgrow the largest gradient;
2. multiply by ``grad_scale`` (AIACC's adjustable gradient scale): raise it to keep small
   gradients from underflowing in float16, lower it if large ones overflow;
3. float16 only, an **overflow guard**: the ranks agree on the bucket's largest magnitude (one
   1-element float64 MAX allreduce on the bucket's own communicators) and, when ``summands x max`` would
   pass 2**15, the factor is lowered by a power of two so no partial sum can reach float16's
   65504. Gradients of magnitude 1e5 on 4 ranks therefore arrive finite. (bfloat16 has float32's
   range and skips the guard and its allreduce.)
4. cast, sum over the ranks in the 16-bit dtype, cast back and divide by the factor.

The codec doing steps 1-4 is `fleetlike.collectives.codec.HalfCodec`.

``mode="all"`` compresses every hop (`CompressedAllReduce` around a flat or hierarchical
collective); ``mode="mixed"`` (AIACC's mode 2) keeps full precision inside a node and
compresses only the inter-node hop (`HierarchicalAllReduce` with ``inter_codec``), which needs
the two-level split even when ``use_hierarchical_allreduce`` is off.

Like the hierarchical chain, a compressed bucket runs on its ring's worker thread (cast,
guard, allreduce, cast back), so backward keeps running meanwhile. Around a hierarchical chain
the casts happen per segment inside its pipeline, overlapping the transfers.

Example:
    >>> coll = CompressedAllReduce(FlatAllReduce(rings), HalfCodec("float16"))
    >>> coll.start(bucket).wait()   # bucket.buffer averaged, float16 on the wire
"""

from __future__ import annotations

from typing import Any

import torch

from fleetlike.collectives.buckets import Bucket
from fleetlike.collectives.codec import HalfCodec
from fleetlike.collectives.flat import FlatAllReduce
from fleetlike.collectives.hierarchical import HierarchicalAllReduce, RingWorkers
from fleetlike.comm import Communicator, Work, dtype_name
from fleetlike.comm.cuda import stream_device

__all__ = ["CompressedAllReduce"]


class CompressedAllReduce:
    """A `BucketCollective` averaging every hop in a 16-bit dtype around ``inner``.

    ``inner`` is a `FlatAllReduce` (the bucket's ring sums the wire tensor) or a
    `HierarchicalAllReduce` (its chain sums it, on the same worker thread as its own buckets)."""

    def __init__(self, inner: FlatAllReduce | HierarchicalAllReduce, codec: HalfCodec) -> None:
        self.inner = inner
        self.codec = codec
        if isinstance(inner, HierarchicalAllReduce):
            self.workers = inner.workers
        else:
            self.workers = RingWorkers(len(inner.rings), "fleetlike-fp16", device=stream_device(inner.world))

    @property
    def world(self) -> Communicator:
        return self.inner.world

    def _run(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        n = self.world.size
        if isinstance(self.inner, HierarchicalAllReduce):  # compressed segment by segment
            return self.inner.run(tensor, index, "avg", codec=self.codec)
        ring = self.inner.rings[index % len(self.inner.rings)]
        return self.codec.all_reduce_(tensor, lambda t: ring.all_reduce(t, "sum", agreed=True), lambda t: ring.all_reduce(t, "max", agreed=True),
                                      summands=n, divide=n)

    def start(self, bucket: Bucket) -> Work:
        if not self.codec.applies_to(bucket.dtype):  # a 16-bit or integer bucket travels as it is
            if isinstance(self.inner, HierarchicalAllReduce):
                return self.inner.start(bucket)  # queued on the same ring workers already
            # issued from the ring's worker like the compressed buckets, so every rank issues the
            # ring's collectives in one order (from the main thread they could interleave)
            return self.workers.submit(bucket.index, lambda: self.inner.start(bucket).wait())
        buf, i = bucket.buffer, bucket.index
        return self.workers.submit(i, lambda: self._run(buf, i))

    def start_tensor(self, tensor: torch.Tensor, index: int) -> Work:
        """Average ``tensor`` (float32/64) in place through the wire dtype (tests, benchmarks)."""
        return self.workers.submit(index, lambda: self._run(tensor, index))

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        d = dict(self.inner.describe(bucket))
        dtype = dtype_name(bucket.dtype)
        if self.codec.applies_to(bucket.dtype):
            d["op"] = "c_fp16_" + d.get("op", "c_allreduce_avg").removeprefix("c_")
            d["wire"] = self.codec.name
            d["returns"] = dtype
            scale = f"1/{self.world.size}" + (f" x {self.codec.grad_scale:g}" if self.codec.grad_scale != 1 else "")
            d["scale"] = scale + (" x overflow guard" if self.codec.guard else "")
        return d

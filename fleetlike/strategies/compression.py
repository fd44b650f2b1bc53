"""fp16 / bf16 gradient compression around a bucket's allreduce, and choosing the collective.

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

import math
from collections.abc import Callable
from typing import Any

import torch

from fleetlike.comm import Communicator, Work
from fleetlike.strategies.buckets import Bucket
from fleetlike.strategies.data_parallel import FlatAllReduce
from fleetlike.strategies.hierarchical import HierarchicalAllReduce, RingWorkers, hierarchical_pairs

__all__ = ["HalfCodec", "CompressedAllReduce", "gradient_collective"]

_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: the guard keeps every partial sum below this (float16's largest finite value is 65504)
_FP16_LIMIT = 2.0**15


class HalfCodec:
    """Casts a float tensor to a 16-bit wire dtype around a sum allreduce (see module doc)."""

    def __init__(self, dtype: str | torch.dtype = "float16", grad_scale: float = 1.0) -> None:
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).replace("torch.", "")
        dtype = str(dtype)
        if dtype not in _HALF:
            raise ValueError(f"dtype={dtype!r} is not a wire dtype; choose one of 'float16', 'bfloat16'")
        if not grad_scale > 0 or not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale={grad_scale!r} must be a positive finite number")
        self.name = dtype
        self.dtype = _HALF[dtype]
        self.grad_scale = float(grad_scale)
        self.guard = self.dtype is torch.float16

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Only wider floats are compressed; 16-bit and integer buckets travel as they are."""
        return dtype in (torch.float32, torch.float64)

    def guard_factor(self, max_abs: float, summands: int) -> float:
        """The power of two putting ``summands * max_abs`` (already scaled) just below 2**15.

        Below 1 it avoids overflow; above 1 it lifts small buckets out of float16's subnormal
        range (below 6e-5 float16 keeps only absolute precision), so both ends keep float16's
        relative precision. Powers of two scale and unscale exactly."""
        bound = max_abs * summands
        if not math.isfinite(bound) or bound == 0.0:
            return 1.0  # non-finite gradients travel as inf/nan: AMP's finite check sees them
        return 2.0 ** min(math.floor(math.log2(_FP16_LIMIT / bound)), 60)

    def scales(
        self, x: torch.Tensor, max_fn: Callable[[torch.Tensor], Any], *, summands: int, divide: int
    ) -> tuple[float, float]:
        """``(pre, factor)`` for ``x``: multiply by ``pre`` before the cast, divide the sum by
        ``factor`` after it. ``pre = factor / divide``; for float16 ``max_fn`` (a MAX allreduce
        over every rank whose values meet in a sum) agrees on the largest magnitude first."""
        factor = self.grad_scale
        if self.guard:  # in float64: a float64 bucket's (scaled) maximum may pass float32's range
            m = _abs_max(x).mul_(factor / divide)
            max_fn(m)
            factor *= self.guard_factor(float(m.item()), summands)
        return factor / divide, factor

    def encode_(self, x: torch.Tensor, pre: float, out: torch.Tensor) -> None:
        """``out <- x * pre`` in the wire dtype; scales ``x`` in place (it is overwritten by the
        result anyway), because an in-place multiply and a same-shape copy are vectorised on CPU
        where the out-of-place mixed-dtype forms are not."""
        if pre != 1.0:
            x.mul_(pre)
        out.copy_(x)

    def decode_(self, wire: torch.Tensor, factor: float, out: torch.Tensor) -> None:
        """``out <- wire / factor`` in ``out``'s dtype (the division in full precision)."""
        out.copy_(wire)
        if factor != 1.0:
            out.div_(factor)

    def all_reduce_(
        self,
        x: torch.Tensor,
        sum_fn: Callable[[torch.Tensor], Any],
        max_fn: Callable[[torch.Tensor], Any],
        *,
        summands: int,
        divide: int,
    ) -> torch.Tensor:
        """``x <- (sum over ranks of x) / divide`` with the wire in ``self.dtype``; blocking."""
        pre, factor = self.scales(x, max_fn, summands=summands, divide=divide)
        wire = torch.empty(x.shape, dtype=self.dtype, device=x.device)
        self.encode_(x, pre, wire)
        sum_fn(wire)
        self.decode_(wire, factor, x)
        return x


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``x`` as a 1-element float64 tensor (NaN if ``x`` holds one).

    ``aminmax`` is one vectorised pass; ``x.abs().max()`` allocates and is ~15x slower on CPU."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float64, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg()).to(torch.float64).reshape(1)


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
            self.workers = RingWorkers(len(inner.rings), "fleetlike-fp16")

    @property
    def world(self) -> Communicator:
        return self.inner.world

    def _run(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        n = self.world.size
        if isinstance(self.inner, HierarchicalAllReduce):  # compressed segment by segment
            return self.inner.run(tensor, index, "avg", codec=self.codec)
        ring = self.inner.rings[index % len(self.inner.rings)]
        return self.codec.all_reduce_(tensor, lambda t: ring.all_reduce(t, "sum"), lambda t: ring.all_reduce(t, "max"),
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
        dtype = str(bucket.dtype).replace("torch.", "")
        if self.codec.applies_to(bucket.dtype):
            d["op"] = "c_fp16_" + d.get("op", "c_allreduce_avg").removeprefix("c_")
            d["wire"] = self.codec.name
            d["returns"] = dtype
            scale = f"1/{self.world.size}" + (f" x {self.codec.grad_scale:g}" if self.codec.grad_scale != 1 else "")
            d["scale"] = scale + (" x overflow guard" if self.codec.guard else "")
        return d


# ---------------------------------------------------------------------- choosing


def gradient_collective(s: Any, groups: Any, role: Any) -> tuple[Any, list[tuple[str, bool, str]]]:
    """The `BucketCollective` for strategy ``s`` and what to record in ``applied_strategy()``.

    Validation follows Fleet: ``hierarchical_allreduce_inter_nranks`` (ranks per inner group,
    0 = the ranks of one node) must be > 1 and divide the world size, else ValueError. Cases
    where the two levels cannot help or cannot be formed fall back to the flat allreduce and
    are recorded as not applied with the reason: one node; one rank per node; nodes of unequal
    sizes (inter_nranks = 0 needs equal nodes: set inter_nranks explicitly to group
    consecutive ranks instead).
    """
    rings = groups.rings(s.nccl_comm_num)
    notes: list[tuple[str, bool, str]] = []
    world = groups.world
    block: int | None = None
    hier_ok = False
    want_hier = bool(s.use_hierarchical_allreduce)
    fp16 = bool(s.fp16_allreduce)
    cfg = s.fp16_allreduce_configs if fp16 else None
    mixed = fp16 and str(cfg["mode"]) == "mixed"
    why_not = ""
    if want_hier or mixed:
        inter_nranks = int(s.hierarchical_allreduce_inter_nranks) if want_hier else 0
        if inter_nranks:
            if inter_nranks <= 1:
                raise ValueError(
                    f"strategy.hierarchical_allreduce_inter_nranks={inter_nranks}: it must be > 1 "
                    "(the ranks of one inner group); use 0 for the ranks of one node"
                )
            if world.size % inter_nranks:
                raise ValueError(
                    f"strategy.hierarchical_allreduce_inter_nranks={inter_nranks} does not divide the "
                    f"world size {world.size}; use a divisor of it, or 0 for the ranks of one node"
                )
            if inter_nranks == world.size:
                why_not = f"inter_nranks={inter_nranks} is the whole world: one group, nothing to split"
            else:
                hier_ok, block = True, inter_nranks
        elif role.node_num == 1:
            why_not = "one node: no allreduce crosses nodes, the flat allreduce is used"
        elif not role.uniform_nodes():
            why_not = ("nodes have unequal numbers of ranks; falling back to the flat allreduce "
                       "(set hierarchical_allreduce_inter_nranks to group consecutive ranks)")
        elif role.local_size == 1:
            why_not = "one rank per node: the two-level allreduce equals the flat one"
        else:
            hier_ok = True
    codec = HalfCodec(str(cfg["dtype"]), float(cfg["grad_scale"])) if fp16 else None
    n = len(rings)
    if hier_ok:
        pairs = hierarchical_pairs(groups, role, n, block)
        algo = str(s.hierarchical_allreduce_configs["algorithm"]) if want_hier else "reduce_scatter"
        label = "node" if block is None else "block"
        coll: Any = HierarchicalAllReduce(pairs, world, algorithm=algo, inter_codec=codec if mixed else None,
                                         node_label=label)
        if want_hier:
            notes.append(("use_hierarchical_allreduce", True,
                          f"{algo}: {pairs[0][0].size} ranks/{label} x {pairs[0][1].size} {label}s, "
                          f"{n} intra/inter pair(s)"))
    else:
        coll = FlatAllReduce(rings)
        if want_hier:
            notes.append(("use_hierarchical_allreduce", False, why_not))
    if fp16:
        assert codec is not None
        if mixed:
            if hier_ok:
                notes.append(("fp16_allreduce", True,
                              f"mixed: {codec.name} across nodes only, full precision inside nodes"))
            else:
                notes.append(("fp16_allreduce", False, f"mixed mode compresses only across nodes, but {why_not}"))
        else:
            coll = CompressedAllReduce(coll, codec)
            notes.append(("fp16_allreduce", True, f"all hops in {codec.name}, pre-divided by {world.size}"
                          + (f", grad_scale {codec.grad_scale:g}" if codec.grad_scale != 1 else "")))
    return coll, notes

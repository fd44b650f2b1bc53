"""Sharded gradient buckets (ZeRO stage 1): reduce-scatter to the owner, all-gather back.

Partitioning. Every parameter has exactly one owner rank, which alone keeps its optimizer state
and updates it; a parameter is never split. The owners are chosen *per gradient bucket*
(`plan_shards`): the bucket's parameters, largest first, each go to the rank with the fewest
bytes in this bucket so far, ties broken by the fewest bytes overall. Balancing inside every
bucket is what makes the reduce-scatter cheap; the tie-break keeps the whole partition within
one largest parameter of ``total / N`` per rank, which bounds each rank's optimizer state.

A bucket that cannot be balanced is **split into one bucket per owner** instead. Every rank
holds every bucket's gradient buffer at stage 1, so a segment's padding is memory on every rank:
one large weight and its small bias in a bucket, split between two ranks, are the weight's
segment and a bias's segment padded to the weight's length, half of the buffer (at one
Linear(2048, 2048) per 25 MB bucket on 2 ranks, peak RSS 16.21 bytes per parameter against
12.31 split; docs/BENCHMARKS.md). When the padding would exceed `PAD_LIMIT` of the bucket's
gradient bytes (and `PAD_MIN_BYTES`), its parameters, largest first, go to the least loaded rank
overall (torch's ZeroRedundancyOptimizer's rule, per parameter), and each owner's are packed
into a bucket of their own, without padding, and allreduced. On gloo, which allreduces the
segmented buffer too, that sends fewer bytes; on backends whose reduce-scatter is used it sends
at most the bytes of the padded reduce-scatter when the padding is at least the gradients, and
up to twice them at `PAD_LIMIT`, the price of the memory. Every rank still stays within one
largest parameter of ``total / N``.

Layout. A `ShardedBucket`'s flat buffer is ``N`` equal segments, one per rank, each holding its
owner's gradients back to back and zero-padded to the longest segment. One reduce-scatter of the
buffer then leaves each rank exactly its own parameters' reduced gradients (``N - 1`` over ``N``
of the bytes of an allreduce, and no parameter cut in two). A bucket whose parameters all belong
to one rank (a parameter larger than the bucket cap) is packed without padding and allreduced
instead: padding it would send ``N`` times its size. Segment order is rank order; for the
two-level form, rank ``(node g, local j)`` sits at position ``j * K + g`` (``K`` nodes), so the
intra-node reduce-scatter hands local rank ``j`` the ``K`` segments of the ranks it shares a
local index with, and the reduce-scatter across nodes hands each its own.

`ShardReduceScatter` is a `BucketCollective` (so `GradReducer`'s hooks launch it during
backward, bucket by bucket, exactly as the allreduce of data parallel); `ParamGather` brings
the updated parameters back to every rank in buckets of ``segment_bytes`` after the update.

On gloo the flat form allreduces the segmented bucket instead and each rank reads its own
segment: gloo's reduce-scatter (torch 2.13, CPU) takes about twice its allreduce of the same
buffer (24 MiB, 2 ranks: 48-53 ms against 25-28 ms; docs/BENCHMARKS.md), so the allreduce,
which moves the bytes data parallel moves, is the cheaper way to the same segment. MPI and NCCL
reduce-scatter (half the bytes of their allreduce).

Example:
    >>> buckets = plan_shards(list(model.parameters()), 32 << 20, world.size)
    >>> coll = ShardReduceScatter(world.rank, [world])
    >>> reducer = make_reducer(model, coll, cap_bytes=None, buckets=buckets)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.collectives.buckets import Bucket, plan_buckets
from fleetlike.collectives.codec import HalfCodec
from fleetlike.collectives.compression import CompressedAllReduce
from fleetlike.collectives.flat import FlatAllReduce
from fleetlike.collectives.hierarchical import HierarchicalAllReduce, RingWorkers
from fleetlike.comm import Communicator, Work, divide_, dtype_name
from fleetlike.comm.cuda import stream_device

__all__ = ["PAD_LIMIT", "PAD_MIN_BYTES", "ParamGather", "ShardReduceScatter", "ShardedBucket", "assign_owners",
           "plan_shards", "two_level_positions"]

#: a bucket whose balanced segments would hold more than this fraction of its gradient bytes
#: again as padding (and at least `PAD_MIN_BYTES`) is split into one bucket per owner instead
PAD_LIMIT = 0.25
#: padding below this is kept: a few KiB per bucket is no memory worth moving the balance for
#: (the size from which `ParamGather` treats a parameter as large, `DIRECT_BYTES`)
PAD_MIN_BYTES = 256 << 10


def assign_owners(sizes: Sequence[int], world: int, load: list[int]) -> list[int]:
    """An owner for each size: largest first, to the rank with the least of this group, then
    the least ``load`` (updated in place), then the lowest rank. Deterministic on every rank."""
    owners = [0] * len(sizes)
    here = [0] * world
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (here[r], load[r], r))
        owners[i] = r
        here[r] += sizes[i]
        load[r] += sizes[i]
    return owners


class ShardedBucket(Bucket):
    """A gradient bucket laid out as one zero-padded segment per rank (see module docstring).

    ``owners[i]`` owns ``params[i]``; ``positions[r]`` is rank ``r``'s segment; ``segment`` the
    elements per segment; ``single`` the one owner of a packed bucket (None when segmented);
    ``why`` says why a bucket has one owner where its parameters shared a bucket with other
    owners' (the padding avoided)."""

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], owners: Sequence[int],
                 positions: Sequence[int], why: str | None = None, *, allocate: bool = True) -> None:
        world = len(positions)
        self.why = why
        self.owners = list(owners)
        self.positions = list(positions)
        self.world = world
        used = sorted(set(owners))
        self.single: int | None = used[0] if len(used) == 1 else None
        offsets: list[int] = []
        if self.single is not None:
            self.segment = 0
            total = 0
            for p in params:
                offsets.append(total)
                total += p.numel()
        else:
            fill = [0] * world
            for p, r in zip(params, owners):
                fill[r] += p.numel()
            self.segment = max(fill)
            total = self.segment * world
            cursor = [positions[r] * self.segment for r in range(world)]
            for p, r in zip(params, owners):
                offsets.append(cursor[r])
                cursor[r] += p.numel()
        super().__init__(index, params, (offsets, total), allocate=allocate)

    def owned(self, rank: int) -> list[int]:
        """Indices into ``params`` of the parameters ``rank`` owns."""
        return [i for i, r in enumerate(self.owners) if r == rank]

    def segment_of(self, rank: int) -> torch.Tensor:
        """``rank``'s segment of the buffer (what the reduce-scatter leaves there)."""
        if self.single is not None:
            return self.buffer
        pos = self.positions[rank]
        return self.buffer[pos * self.segment : (pos + 1) * self.segment]

    @property
    def padding(self) -> int:
        return self.numel - sum(p.numel() for p in self.params)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.single is None:
            d["segment"] = self.segment
            d["padding"] = self.padding
        else:
            d["owner"] = self.single
            if self.why:
                d["why"] = self.why
        return d


def plan_shards(params: Sequence[torch.nn.Parameter], cap_bytes: int | None, world: int,
                positions: Sequence[int] | None = None, *, pad_min_bytes: int | None = None,
                make: Callable[..., ShardedBucket] = ShardedBucket) -> list[ShardedBucket]:
    """The sharded gradient buckets of ``params``: `plan_buckets`' grouping (reverse order, one
    dtype per bucket, ``cap_bytes``), owners balanced inside each bucket (`assign_owners`); a
    bucket whose segments would be more than `PAD_LIMIT` padding (at least ``pad_min_bytes``,
    `PAD_MIN_BYTES`) is split into one bucket per owner, its parameters owned by the least
    loaded ranks (see the module docstring). ``make`` builds each bucket from
    ``(index, params, owners, positions, why)`` (stage 2's transient buckets).

    Example:
        >>> w, b = torch.nn.Parameter(torch.zeros(1 << 20)), torch.nn.Parameter(torch.zeros(1024))
        >>> [(bk.single, bk.numel) for bk in plan_shards([w, b], 32 << 20, 2)]   # not 2 x 4 MiB of segments
        [(1, 1024), (0, 1048576)]
    """
    positions = list(positions) if positions is not None else list(range(world))
    if sorted(positions) != list(range(world)):
        raise ValueError(f"positions={positions} must order the ranks 0..{world - 1}")
    least = PAD_MIN_BYTES if pad_min_bytes is None else pad_min_bytes
    load = [0] * world
    out: list[ShardedBucket] = []
    for group in plan_buckets(params, cap_bytes):
        sizes = [p.numel() * p.element_size() for p in group]
        trial = list(load)
        owners = assign_owners(sizes, world, trial)
        fill = [0] * world
        for size, r in zip(sizes, owners):
            fill[r] += size
        padding = world * max(fill) - sum(sizes)
        if len(set(owners)) == 1 or padding < least or padding <= PAD_LIMIT * sum(sizes):
            load[:] = trial
            out.append(make(len(out), group, owners, positions))
            continue
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):  # ZeroRedundancyOptimizer's rule
            r = min(range(world), key=lambda r: (load[r], r))
            owners[i] = r
            load[r] += sizes[i]
        why = (f"split from a bucket whose balanced segments would add {padding / sum(sizes):.0%} padding "
               f"(> {PAD_LIMIT:.0%}) to every rank's buffer")
        for r in dict.fromkeys(owners):  # in the order of each owner's first parameter: backward order
            part = [p for p, o in zip(group, owners) if o == r]
            out.append(make(len(out), part, [r] * len(part), positions, why))
    return out


def _op_name(op: str) -> str:
    return "avg" if op == "avg" else "sum"


#: backends whose reduce-scatter is slower than their allreduce of the whole buffer (measured:
#: module docstring), where the flat form allreduces and slices
_ALLREDUCE_INSTEAD = frozenset({"gloo"})


class ShardReduceScatter:
    """A `BucketCollective` leaving each rank its own segment's reduced gradients.

    Args:
        rank: this rank in ``rings[0]`` (the world).
        rings: one or more world communicators; bucket ``i`` uses ring ``i % len(rings)``.
        op: "avg" (``gradients_reduce_method = mean``) or "sum".
        pairs: ``(intra, inter)`` communicator pairs for the two-level form (one per ring), or
            None for the flat one. The buckets must use `two_level_positions`.
        codec: 16-bit wire (`HalfCodec`), or None; ``codec_scope`` "all" compresses every hop,
            "inter" only the hop across nodes (needs ``pairs``).
    """

    def __init__(self, rank: int, rings: Sequence[Communicator], *, op: str = "avg",
                 pairs: Sequence[tuple[Communicator, Communicator]] | None = None,
                 codec: HalfCodec | None = None, codec_scope: str = "all") -> None:
        if op not in ("avg", "sum"):
            raise ValueError(f"op={op!r}: gradients are reduced by 'avg' or 'sum'")
        if codec_scope not in ("all", "inter") or (codec_scope == "inter" and not pairs):
            raise ValueError(f"codec_scope={codec_scope!r}: 'all', or 'inter' with (intra, inter) pairs")
        self.rank = rank
        self.rings = list(rings)
        self.op = op
        self.pairs = list(pairs) if pairs else None
        self.codec = codec
        self.codec_scope = codec_scope
        # compressed and two-level chains are several blocking calls: one worker per ring issues
        # them in bucket order (invariant 1), while backward goes on
        lanes = len(self.pairs) if self.pairs else len(self.rings)
        self.workers = RingWorkers(lanes, "fleetlike-shard", device=stream_device(rings[0])) if (pairs or codec) else None
        #: the flat form allreduces the whole bucket and each rank reads its segment
        self.via_allreduce = self.pairs is None and self.world.backend in _ALLREDUCE_INSTEAD

    @classmethod
    def from_allreduce(cls, allreduce: Any, op: str = "avg") -> ShardReduceScatter:
        """The reduce-scatter counterpart of a data-parallel `BucketCollective`: the same rings,
        the same (intra, inter) pairs for a hierarchical one (always the two-level
        reduce-scatter form), the same 16-bit codec and scope for a compressed one. So the
        choice of collective from the strategy and the topology is made in one place."""
        codec, scope = None, "all"
        if isinstance(allreduce, CompressedAllReduce):
            codec, allreduce = allreduce.codec, allreduce.inner
        if isinstance(allreduce, HierarchicalAllReduce):
            if allreduce.inter_codec is not None and codec is None:
                codec, scope = allreduce.inter_codec, "inter"
            world = allreduce.world
            return cls(world.rank, [world], op=op, pairs=allreduce.pairs, codec=codec, codec_scope=scope)
        if isinstance(allreduce, FlatAllReduce):
            return cls(allreduce.world.rank, allreduce.rings, op=op, codec=codec, codec_scope=scope)
        raise TypeError(f"no reduce-scatter form of {type(allreduce).__name__}")

    def positions(self) -> list[int]:
        """Each rank's segment position (collective for the two-level form: call on every rank)."""
        if self.pairs is None:
            return list(range(self.world.size))
        intra, inter = self.pairs[0]
        return two_level_positions(self.world, intra, inter)

    @property
    def world(self) -> Communicator:
        return self.rings[0]

    @property
    def divide(self) -> int:
        return self.world.size if self.op == "avg" else 1

    def ring(self, index: int) -> Communicator:
        return self.rings[index % len(self.rings)]

    def defers_division(self, bucket: Bucket) -> bool:
        """Whether `start` sums ``bucket`` and leaves the average's division to the bucket (a
        transient bucket, which divides only the segment it keeps, as it copies it out: the
        flat allreduce form with ``op`` "avg"; the backend would divide the whole buffer)."""
        return (self.op == "avg" and self.workers is None and hasattr(bucket, "divide_on_release")
                and not getattr(bucket, "resident", True) and isinstance(bucket, ShardedBucket)
                and (bucket.single is not None or self.via_allreduce))

    def start(self, bucket: Bucket) -> Work:
        if not isinstance(bucket, ShardedBucket):
            raise TypeError("ShardReduceScatter reduces ShardedBuckets (plan_shards), got a plain Bucket")
        if self.workers is None:
            ring = self.ring(bucket.index)
            if bucket.single is not None or self.via_allreduce:
                op = "sum" if self.defers_division(bucket) else self.op
                return ring.all_reduce_async(bucket.buffer, op, agreed=True)
            return ring.reduce_scatter_async(bucket.buffer, self.op, out=bucket.segment_of(self.rank), agreed=True)
        return self.workers.submit(bucket.index, lambda: self.run(bucket))

    def run(self, bucket: ShardedBucket) -> None:
        """The blocking chain for ``bucket`` (what a worker runs)."""
        ring = self.ring(bucket.index)
        codec = self.codec if self.codec is not None and self.codec.applies_to(bucket.dtype) else None
        n, divide = self.world.size, self.divide
        if bucket.single is not None and self.pairs is not None:  # packed, two levels: the
            intra, inter = self.pairs[bucket.index % len(self.pairs)]  # bucket's own pair only
            intra.all_reduce(bucket.buffer, "sum", agreed=True)
            inter.all_reduce(bucket.buffer, "sum", agreed=True)
            divide_(bucket.buffer, divide)
            return
        if bucket.single is not None or self.via_allreduce:  # packed (or gloo): one allreduce
            if codec is None:
                ring.all_reduce(bucket.buffer, self.op, agreed=True)
            else:
                codec.all_reduce_(bucket.buffer, lambda t: ring.all_reduce(t, "sum", agreed=True),
                                  lambda t: ring.all_reduce(t, "max", agreed=True), summands=n, divide=divide)
            return
        own = bucket.segment_of(self.rank)
        if self.pairs is None:
            assert codec is not None  # the worker runs only compressed or two-level chains
            pre, factor = codec.scales(bucket.buffer, lambda m: ring.all_reduce(m, "max", agreed=True),
                                       summands=n, divide=divide)
            wire = torch.empty(bucket.numel, dtype=codec.dtype, device=bucket.device)
            codec.encode_(bucket.buffer, pre, wire)
            mine = wire.view(n, -1)[bucket.positions[self.rank]]
            ring.reduce_scatter(wire, "sum", out=mine, agreed=True)
            codec.decode_(mine, factor, own)
            return
        intra, inter = self.pairs[bucket.index % len(self.pairs)]
        buf = bucket.buffer
        if codec is not None and self.codec_scope == "all":
            pre, factor = codec.scales(buf, lambda m: (intra.all_reduce(m, "max", agreed=True),
                                                       inter.all_reduce(m, "max", agreed=True)),
                                       summands=n, divide=divide)
            wire = torch.empty(bucket.numel, dtype=codec.dtype, device=bucket.device)
            codec.encode_(buf, pre, wire)
            chunk = wire.view(intra.size, -1)[intra.rank]
            intra.reduce_scatter(wire, "sum", out=chunk, agreed=True)
            mine = chunk.view(inter.size, -1)[inter.rank]
            inter.reduce_scatter(chunk, "sum", out=mine, agreed=True)
            codec.decode_(mine, factor, own)
            return
        chunk = buf.view(intra.size, -1)[intra.rank]
        intra.reduce_scatter(buf, "sum", out=chunk, agreed=True)
        if codec is not None:  # mixed: only the hop across nodes is 16-bit
            pre, factor = codec.scales(chunk, lambda m: inter.all_reduce(m, "max", agreed=True),
                                       summands=inter.size, divide=divide)
            wire = torch.empty(chunk.numel(), dtype=codec.dtype, device=bucket.device)
            codec.encode_(chunk, pre, wire)
            mine = wire.view(inter.size, -1)[inter.rank]
            inter.reduce_scatter(wire, "sum", out=mine, agreed=True)
            codec.decode_(mine, factor, own)
            return
        inter.reduce_scatter(chunk, "sum", out=own, agreed=True)
        divide_(own, divide)

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        assert isinstance(bucket, ShardedBucket)
        dtype = dtype_name(bucket.dtype)
        codec = self.codec if self.codec is not None and self.codec.applies_to(bucket.dtype) else None
        wire = dtype if codec is None else (f"{dtype} intra, {codec.name} inter" if self.codec_scope == "inter"
                                            else codec.name)
        if bucket.single is not None:
            return {"op": f"c_allreduce_{_op_name(self.op)}", "comm": self.ring(bucket.index).name, "wire": wire,
                    "why": bucket.why or f"one owner (rank {bucket.single}): padding would send {self.world.size}x"}
        if self.via_allreduce:
            return {"op": f"c_allreduce_{_op_name(self.op)}", "comm": self.ring(bucket.index).name, "wire": wire,
                    "why": f"{self.world.backend}'s reduce_scatter is slower than its allreduce: each rank reads its segment"}
        if self.pairs is not None:
            intra, inter = self.pairs[bucket.index % len(self.pairs)]
            return {"op": f"c_reducescatter_{_op_name(self.op)}", "algorithm": "intra reduce_scatter->inter reduce_scatter",
                    "intra": intra.name, "inter": inter.name, "wire": wire}
        return {"op": f"c_reducescatter_{_op_name(self.op)}", "comm": self.ring(bucket.index).name, "wire": wire}


def two_level_positions(world: Communicator, intra: Communicator, inter: Communicator) -> list[int]:
    """Each rank's segment position for the two-level form: ``j * K + g`` for rank ``(inter
    rank g, intra rank j)``, agreed by one small all-gather (node grouping need not be by
    consecutive ranks)."""
    mine = torch.tensor([intra.rank * inter.size + inter.rank], dtype=torch.int64, device=world.device)
    return [int(v) for v in world.all_gather_flat(mine, agreed=True)]



#: parameters of at least this many bytes travel straight from their owner into every rank's
#: parameter (no copies); smaller ones are packed per owner into one small buffer per bucket
DIRECT_BYTES = 256 << 10

#: an interleaved update steps each owner's parameters in chunks of about this many bytes (see
#: `ParamGather.chunk_bytes`): few enough optimizer calls, small enough that the first broadcast
#: starts early and the last one, which nothing overlaps, is short
CHUNK_BYTES = (256 << 10, 4 << 20)


class _Piece:
    """One broadcast of the gather: a parameter straight from its owner (``lo`` None), or one
    owner's packed small parameters, ``buffer[lo:hi]``."""

    __slots__ = ("owner", "params", "lo", "hi", "nbytes")

    def __init__(self, owner: int, params: list[torch.nn.Parameter], lo: int | None = None, hi: int = 0) -> None:
        self.owner, self.params, self.lo, self.hi = owner, params, lo, hi
        self.nbytes = sum(p.numel() * p.element_size() for p in params)


class ParamGather:
    """Brings the updated parameters from their owners to every rank after the update.

    A parameter of at least ``direct_bytes`` is broadcast by its owner straight into every
    rank's parameter (what torch's ZeroRedundancyOptimizer does): no copy in or out, no buffer.
    The smaller ones of a bucket are packed per owner into one buffer of the bucket's small
    parameters (allocated once: their bytes only) and each owner's part is broadcast, so a model
    of many small parameters pays a few collectives per bucket, not one per parameter. Every
    rank issues the same broadcasts in the same order (the layout is a pure function of the
    buckets). At most ``window_bytes`` are in flight (Paddle's ``segment_broadcast_MB``). The
    gradient buckets are zeroed afterwards: gradients read zero after a sharded update (as
    after ``zero_grad``), on every backend alike.

    Interleaved with the update (``run(step)``): each bucket's broadcasts are grouped into
    *chunks*, every owner's pieces cut into runs of about `chunk_bytes`, and the chunks of the
    owners taken in turn. A rank steps its own chunk (``step(params)``) just before issuing that
    chunk's broadcasts, and only posts the others' (asynchronously), so the bytes of one chunk
    travel while the owners step the next: the gather hides behind the update instead of
    following it. The order is the same on every rank; only what each rank steps differs.

    Example:
        >>> gather = ParamGather(reducer.buckets, world.rank, [world], 32 << 20)
        >>> optimizer.step(); gather.run()        # every rank holds every updated parameter
        >>> gather.run(step_only)                 # or: step chunk by chunk, broadcasting as it goes
    """

    def __init__(self, buckets: Sequence[ShardedBucket], rank: int, rings: Sequence[Communicator],
                 window_bytes: int, direct_bytes: int | None = None, chunk_bytes: int | None = None) -> None:
        direct_bytes = DIRECT_BYTES if direct_bytes is None else direct_bytes
        self.rank = rank
        self.rings = list(rings)
        self.window_bytes = max(1, int(window_bytes))
        self.buckets = list(buckets)
        world = self.buckets[0].world if self.buckets else 1
        share = sum(b.nbytes for b in self.buckets) // world
        lo, hi = CHUNK_BYTES
        #: bytes per chunk of an interleaved update: an eighth of a rank's share, within CHUNK_BYTES
        self.chunk_bytes = int(chunk_bytes) if chunk_bytes is not None else min(hi, max(lo, share // 8))
        # per bucket: the buffer of its packed small parameters, and its chunks (lists of pieces)
        self._buffers: list[torch.Tensor | None] = []
        self._chunks: list[list[list[_Piece]]] = []
        for b in self.buckets:
            direct = [p for p in b.params if p.numel() * p.element_size() >= direct_bytes and p.is_contiguous()]
            chosen = {id(p) for p in direct}
            pieces: list[list[_Piece]] = [[] for _ in range(b.world)]
            total = 0
            for r in range(b.world):
                small = [p for p, owner in zip(b.params, b.owners) if owner == r and id(p) not in chosen]
                if small:
                    n = sum(p.numel() for p in small)
                    pieces[r].append(_Piece(r, small, total, total + n))
                    total += n
            for p, r in zip(b.params, b.owners):
                if id(p) in chosen:
                    pieces[r].append(_Piece(r, [p]))
            self._buffers.append(torch.empty(total, dtype=b.dtype, device=b.device) if total else None)
            self._chunks.append(_interleave([_cut(ps, self.chunk_bytes) for ps in pieces]))
        self.collectives_issued = 0
        self.bytes_issued = 0

    def _issue(self, i: int, chunk: list[_Piece], works: list[Work],
               step: Callable[[list[torch.nn.Parameter]], Any] | None) -> None:
        ring = self.rings[i % len(self.rings)]
        buf = self._buffers[i]
        if step is not None and chunk[0].owner == self.rank:
            step([p for piece in chunk for p in piece.params])
        with torch.no_grad():
            for piece in chunk:
                if piece.lo is None:
                    works.append(ring.broadcast_async(piece.params[0].detach(), piece.owner, agreed=True))
                    continue
                assert buf is not None
                if piece.owner == self.rank:
                    off = piece.lo
                    for p in piece.params:
                        buf[off : off + p.numel()].copy_(p.detach().reshape(-1))
                        off += p.numel()
                works.append(ring.broadcast_async(buf[piece.lo : piece.hi], piece.owner, agreed=True))
        self.collectives_issued += len(chunk)

    def _finish(self, i: int, works: list[Work]) -> None:
        for w in works:
            w.wait()
        buf = self._buffers[i]
        with torch.no_grad():
            for chunk in self._chunks[i]:
                for piece in chunk:
                    if piece.lo is not None and piece.owner != self.rank:
                        assert buf is not None
                        off = piece.lo
                        for p in piece.params:
                            p.copy_(buf[off : off + p.numel()].view_as(p))
                            off += p.numel()

    def run(self, step: Callable[[list[torch.nn.Parameter]], Any] | None = None) -> None:
        """Gather every parameter from its owner (blocking). With ``step``, first call it on
        each of this rank's chunks just before that chunk is broadcast (the interleaved update:
        ``step(params)`` must update exactly ``params``)."""
        inflight: list[tuple[int, list[Work]]] = []
        size = 0
        for i, b in enumerate(self.buckets):
            if inflight and size + b.nbytes > self.window_bytes:
                j, w = inflight.pop(0)
                self._finish(j, w)
                size -= self.buckets[j].nbytes
            works: list[Work] = []
            for chunk in self._chunks[i]:
                self._issue(i, chunk, works, step)
            b.zero_()  # its gradients are spent: cleared while the broadcasts travel
            self.bytes_issued += b.nbytes
            inflight.append((i, works))
            size += b.nbytes
        for j, w in inflight:
            self._finish(j, w)

    def layout(self) -> list[tuple[int, list[tuple[int, list[int]]]]]:
        """What `run` issues, in order: per bucket, its bytes (what the window counts) and its
        chunks as ``(owner, [bytes of each broadcast])``. The planner prices the interleaved
        update from it (`fleetlike.plan.cost`)."""
        return [(b.nbytes, [(chunk[0].owner, [piece.nbytes for piece in chunk]) for chunk in chunks])
                for b, chunks in zip(self.buckets, self._chunks)]

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for i, b in enumerate(self.buckets):
            ring = self.rings[i % len(self.rings)].name
            pieces = [piece for chunk in self._chunks[i] for piece in chunk]
            direct = sum(1 for piece in pieces if piece.lo is None)
            out.append({"op": "c_allgather", "bucket": b.index, "params": len(b.params), "size": b.describe()["size"],
                        "comm": ring, "as": f"{direct} direct + {len(pieces) - direct} packed broadcasts",
                        "chunks": len(self._chunks[i])})
        return out


def _cut(pieces: list[_Piece], chunk_bytes: int) -> list[list[_Piece]]:
    """One owner's pieces in runs of at least ``chunk_bytes`` (the last may be shorter)."""
    runs: list[list[_Piece]] = []
    size = chunk_bytes
    for piece in pieces:
        if size >= chunk_bytes:
            runs.append([])
            size = 0
        runs[-1].append(piece)
        size += piece.nbytes
    return runs


def _interleave(runs: list[list[list[_Piece]]]) -> list[list[_Piece]]:
    """The owners' chunks taken in turn: rank 0's first, rank 1's first, ..., rank 0's second."""
    out = []
    for k in range(max((len(r) for r in runs), default=0)):
        out += [r[k] for r in runs if k < len(r)]
    return out

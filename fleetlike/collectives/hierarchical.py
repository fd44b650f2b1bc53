"""Hierarchical (two-level) gradient allreduce: inside nodes, across nodes, inside again.

With ``L`` ranks per node and ``K`` nodes a flat ring allreduce of ``S`` bytes pushes
``2 (N-1)/N * S`` through the one link each node has into the ring (N = K L). The
bandwidth-optimal two-level form sends only ``2 (K-1)/K * S`` out of each node:

1. intra-node **reduce-scatter**: local rank ``j`` ends up with the node's sum of chunk ``j``
   (the buffer is zero-padded to a multiple of ``L``);
2. inter-node **allreduce** of chunk ``j`` among the ranks with local rank ``j`` (one per node):
   the ``L`` inter groups run side by side, each moving ``S / L``;
3. intra-node **allgather** of the chunks: every rank holds the global sum; divide by ``N``.

Fleet's original form (``algorithm="reduce_broadcast"``) is kept as an option: intra **reduce**
to local rank 0, allreduce among the node leaders, intra **broadcast**. It funnels a node's whole
``S`` through one rank and is slower wherever intra-node links are not free.

Execution model: the three phases depend on each other, so each bucket's chain runs on a small
worker thread, one per communicator pair ("ring"), fed in bucket order (on NCCL: the process's
one NCCL issuer, after the kernels that made the gradients; see `fleetlike.comm.cuda`). Backward keeps running
while a bucket's chain is in flight, buckets on different rings overlap each other, and because
every collective of a pair is issued by that pair's one thread, in bucket order, all ranks issue
the same collectives in the same order (invariant 1). ``nccl_comm_num = n`` gives ``n`` pairs
(``CommGroups.extra`` splits), bucket ``i`` goes to pair ``i % n``.

The reduce-scatter form runs each buffer in segments (`fleetlike.collectives.segments`), so
segment ``i`` crosses the nodes while its neighbours are reduce-scattered and all-gathered
inside the node: without that the link idles during the node-local phases.

Mixed compression (AIACC's mode 2, ``fp16_allreduce_configs.mode = "mixed"``) compresses only
phase 2, the hop across nodes: pass ``inter_codec`` (a `HalfCodec`). `CompressedAllReduce`
passes its codec to `run` to compress every hop, segment by segment.

Example:
    >>> pairs = hierarchical_pairs(groups, 1)         # (intra, inter) by node
    >>> coll = HierarchicalAllReduce(pairs, groups.world)
    >>> coll.start_tensor(grads, 0, "avg").wait()    # == world.all_reduce(grads, "avg")
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.collectives.buckets import Bucket
from fleetlike.collectives.codec import HalfCodec
from fleetlike.collectives.segments import INTRA_FORMS, SEGMENT_BYTES, Scratch, agree_max, segmented_all_reduce
from fleetlike.comm import CommGroups, Communicator, Work, divide_, dtype_name
from fleetlike.comm.cuda import ISSUER, stream_device, submit_to

__all__ = ["HierarchicalAllReduce", "RingWorkers", "hierarchical_pairs", "cross_node_bytes_flat"]

_ALGORITHMS = ("reduce_scatter", "reduce_broadcast")


class RingWorkers:
    """One worker thread per ring: jobs of a ring run one after another in submission order.

    ``device`` (the communicators' CUDA device, NCCL): each job runs after the submitting
    thread's kernels and its handle orders the waiting thread's stream after the job's kernels
    (`fleetlike.comm.cuda`); jobs that issue NCCL calls (``issues``) all run on the process's
    one NCCL issuer, so every rank issues its communicators' calls in one order."""

    def __init__(self, n: int, name: str = "fleetlike-ring", *, device: torch.device | None = None,
                 issues: bool = True) -> None:
        self.device = device
        self._shared = device is not None and issues
        self._pools = [] if self._shared else [
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}{i}")
            for i in range(n)
        ]
        self._lock = threading.Lock()

    def submit(self, ring: int, fn: Callable[[], Any]) -> Work:
        if self._shared:
            return ISSUER.submit(fn, self.device)
        with self._lock:
            return submit_to(self._pools[ring % len(self._pools)], fn, self.device)

    def shutdown(self) -> None:
        for p in self._pools:
            p.shutdown(wait=False)


class HierarchicalAllReduce:
    """A `BucketCollective`: two-level average over ``(intra, inter)`` communicator pairs.

    Args:
        pairs: one ``(intra, inter)`` pair per ring; every intra group has the same size ``L``
            and every inter group the same size ``K``, with ``K * L == world.size``.
        world: a communicator over all ranks (for small agreements, e.g. AMP's finite flag).
        algorithm: "reduce_scatter" (default) or "reduce_broadcast".
        inter_codec: compress the inter-node hop only (mixed mode); None keeps the dtype.
        node_label: how the listing names the intra scope (e.g. "node 0").
        segment_bytes: the reduce-scatter form pipelines buffers in segments of this many wire
            bytes (`fleetlike.collectives.segments`).
        intra_form: how that form runs its node-local hops: "broadcast" (default; see
            `fleetlike.collectives.segments`) or "reduce_scatter" (gloo's reduce-scatter and
            allgather). The same sums bit for bit and the same bytes across nodes; "broadcast"
            costs less CPU on gloo.
    """

    def __init__(
        self,
        pairs: Sequence[tuple[Communicator, Communicator]],
        world: Communicator,
        *,
        algorithm: str = "reduce_scatter",
        inter_codec: HalfCodec | None = None,
        node_label: str = "node",
        segment_bytes: int = SEGMENT_BYTES,
        intra_form: str = "broadcast",
    ) -> None:
        if not pairs:
            raise ValueError("HierarchicalAllReduce needs at least one (intra, inter) pair")
        if str(algorithm) not in _ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r} is not one of {', '.join(map(repr, _ALGORITHMS))}")
        for intra, inter in pairs:
            if intra.size * inter.size != world.size:
                raise ValueError(
                    f"intra group {intra.name!r} ({intra.size} ranks) x inter group {inter.name!r} "
                    f"({inter.size} ranks) does not cover the world of {world.size} ranks"
                )
        self.pairs = list(pairs)
        self._world = world
        self.algorithm = str(algorithm)
        self.inter_codec = inter_codec
        self.node_label = node_label
        if int(segment_bytes) < 1:
            raise ValueError(f"segment_bytes={segment_bytes!r} must be a positive number of bytes")
        self.segment_bytes = int(segment_bytes)
        if str(intra_form) not in INTRA_FORMS:
            raise ValueError(f"intra_form={intra_form!r} is not one of {', '.join(map(repr, INTRA_FORMS))}")
        self.intra_form = str(intra_form)
        self._scratch = threading.local()  # a wire-buffer cache per issuing thread (ring workers)
        self.workers = RingWorkers(len(self.pairs), "fleetlike-hier", device=stream_device(world))

    @property
    def world(self) -> Communicator:
        return self._world

    def pair_for(self, index: int) -> tuple[Communicator, Communicator]:
        return self.pairs[index % len(self.pairs)]

    # ------------------------------------------------------------------ BucketCollective

    def start(self, bucket: Bucket) -> Work:
        return self.start_tensor(bucket.buffer, bucket.index, "avg")

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        intra, inter = self.pair_for(bucket.index)
        dtype = dtype_name(bucket.dtype)
        wire = dtype
        if self.inter_codec is not None and self.inter_codec.applies_to(bucket.dtype):
            wire = f"{dtype} intra, {self.inter_codec.name} inter"
        if self.algorithm == "reduce_broadcast":
            steps = "reduce->leaders' allreduce->broadcast"
        elif self.intra_form == "broadcast":
            steps = "exchange+add (2 ranks) or reduce_scatter->allreduce->broadcast per chunk"
        else:
            steps = "reduce_scatter->allreduce->allgather"
        return {
            "op": "c_hierarchical_allreduce_avg",
            "algorithm": steps,
            "intra": intra.name,
            "inter": inter.name,
            "scope": f"{intra.size} ranks/{self.node_label} x {inter.size} {self.node_label}s",
            "wire": wire,
        }

    # ------------------------------------------------------------------ tensors

    def start_tensor(self, tensor: torch.Tensor, index: int, op: str = "avg") -> Work:
        """Start ``op`` ("sum" or "avg") over all ranks on ``tensor`` in place, on pair ``index``."""
        if op not in ("sum", "avg"):
            raise ValueError(f"op={op!r}: hierarchical allreduce does 'sum' or 'avg'")
        return self.workers.submit(index, lambda: self.run(tensor, index, op))

    def run(self, tensor: torch.Tensor, index: int, op: str = "sum", codec: HalfCodec | None = None) -> torch.Tensor:
        """The blocking chain (what the worker thread runs); in place on ``tensor``.

        ``codec`` compresses every hop (`CompressedAllReduce`'s "all" mode); without it,
        ``inter_codec`` compresses the hop across nodes only."""
        intra, inter = self.pair_for(index)
        flat = tensor.view(-1)
        divide = self._world.size if op == "avg" else 1
        scope = "all"
        if codec is None or not codec.applies_to(flat.dtype):
            codec, scope = self.inter_codec, "inter"
            if codec is not None and not codec.applies_to(flat.dtype):
                codec = None
        if self.algorithm == "reduce_scatter":
            scratch = getattr(self._scratch, "buffers", None)
            if scratch is None:
                scratch = self._scratch.buffers = Scratch()
            segmented_all_reduce(flat, intra, inter, divide=divide, codec=codec, scope=scope,
                                 segment_bytes=self.segment_bytes, intra_form=self.intra_form, scratch=scratch)
        elif codec is not None and scope == "all":
            codec.all_reduce_(flat, lambda t: self._reduce_broadcast(t, intra, inter, None, 1),
                              lambda t: agree_max(t, intra, inter), summands=self._world.size, divide=divide)
        else:
            self._reduce_broadcast(flat, intra, inter, codec, divide)
        return tensor

    def _reduce_broadcast(self, flat: torch.Tensor, intra: Communicator, inter: Communicator,
                          codec: HalfCodec | None, divide: int) -> None:
        """Fleet's form: reduce to local rank 0, leaders allreduce (``codec``: compressed), broadcast."""
        if flat.numel() == 0:
            return
        intra.reduce(flat, 0, "sum")
        if intra.rank == 0:
            if codec is None:
                inter.all_reduce(flat, "sum", agreed=True)
            else:  # the division happens before the cast, as DDP's fp16 hook
                codec.all_reduce_(flat, lambda t: inter.all_reduce(t, "sum", agreed=True), lambda t: inter.all_reduce(t, "max", agreed=True),
                                  summands=inter.size, divide=divide)
        intra.broadcast(flat, 0, agreed=True)
        if codec is None:
            divide_(flat, divide)


def hierarchical_pairs(groups: CommGroups, n: int, block: int | None = None) -> list[tuple[Communicator, Communicator]]:
    """``n`` (intra, inter) pairs, created collectively through ``groups.extra``.

    ``block=None`` groups by node (the node index and local rank of ``groups.role``); an int
    groups consecutive ranks ``[b*block, (b+1)*block)`` (Fleet's
    ``hierarchical_allreduce_inter_nranks``)."""
    pairs = []
    rank = groups.world.rank
    for i in range(n):
        suffix = "" if i == 0 else f" ring {i}"
        if block is None:
            g, pos = groups.role.node_index, groups.role.local_rank
            intra_name, inter_name = f"intra[node {g}]{suffix}", f"inter[local {pos}]{suffix}"
        else:
            g, pos = rank // block, rank % block
            intra_name, inter_name = f"intra[block {g}]{suffix}", f"inter[pos {pos}]{suffix}"
        intra = groups.extra(intra_name, g, pos)
        inter = groups.extra(inter_name, pos, g)
        pairs.append((intra, inter))
    return pairs


def cross_node_bytes_flat(wire_bytes: int, rank: int, node_of: Sequence[int]) -> int:
    """Bytes ``rank`` sends to another node in a flat ring allreduce (ring in rank order).

    In the ring model each rank sends all of its ``wire_bytes`` to rank ``rank + 1`` (mod N):
    they cross nodes exactly when that neighbour is on another node, so with nodes of
    consecutive ranks one rank per node (the last) sends ``2 (N-1)/N * S`` across and the others
    send nothing across."""
    nxt = (rank + 1) % len(node_of)
    return wire_bytes if node_of[nxt] != node_of[rank] else 0

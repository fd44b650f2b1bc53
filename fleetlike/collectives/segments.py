"""The two-level allreduce of one flat buffer, pipelined over segments.

`HierarchicalAllReduce`'s bandwidth-optimal chain (intra reduce-scatter -> inter allreduce ->
intra allgather) has phases that depend on each other. Run on a whole bucket one after another,
the slow link between nodes idles while the node-local phases run. Cut into segments, the phases
of different segments overlap: while segment ``i`` crosses the nodes, segment ``i+1`` is being
reduce-scattered and segment ``i-1`` all-gathered, and the casts of a compressed wire happen in
between on this thread. The inter-node allreduce of segment ``i+1`` is queued before that of
segment ``i`` has finished, so the link never waits for this thread.

Safety: the intra and inter groups each have their own connections and worker threads, and
every rank issues the same calls on each of them in the same order (one thread per ring issues
them all), so collectives match across ranks (invariant 1).

Compression (``codec``, a `HalfCodec`) has two scopes. ``"all"`` casts each segment to the wire
dtype before the reduce-scatter and back after the allgather, so every hop carries 16 bits.
``"inter"`` (AIACC's mixed mode) keeps the node-local hops in the bucket's dtype and casts only
the chunk that crosses the nodes. Either way the scale is agreed once per buffer, up front (one
1-element MAX on the intra group and one on the inter group), from the largest magnitude on any
rank: partial sums of ``world`` pre-divided values stay below float16's limit at every hop.

On failure (a collective raising) the buffer's contents are undefined: segments may be left
scaled by the codec's factor, as after any failed in-place allreduce; the caller's
communicators are aborted then, and the step is not applied.

Casts use in-place ``mul_`` and same-shape ``copy_`` only: on CPU these are vectorised, while
``(x * s).to(torch.float16)`` and ``abs().max()`` take slow paths (measured: 64 MiB cast in 6 ms
vs 50 ms; maximum magnitude in 2 ms vs 34 ms).
"""

from __future__ import annotations

import torch

from fleetlike.collectives.codec import HalfCodec
from fleetlike.comm import Communicator, Work, divide_

__all__ = ["SEGMENT_BYTES", "INTRA_FORMS", "Scratch", "agree_max", "segmented_all_reduce"]

#: default segment size. Measured at 1 Gbit between two 2-rank nodes (bench.hierarchical):
#: 1 MiB segments take a 4 MiB buffer from 48 to 41 ms and a 16 MiB float16 one from 97 to
#: 79 ms against 4 MiB segments, and cost nothing at 64 MiB (570 vs 571 ms); 256 KiB segments
#: lose at 1 MiB (16 vs 11 ms) to per-call overhead.
SEGMENT_BYTES = 1 << 20
_SCOPES = ("all", "inter")
#: how the node-local hops run (see `segmented_all_reduce`)
INTRA_FORMS = ("broadcast", "reduce_scatter")


def agree_max(t: torch.Tensor, intra: Communicator, inter: Communicator) -> None:
    """``t <- max over intra x inter`` in place (two small blocking MAX allreduces): how a
    two-level chain agrees on the compression scale."""
    intra.all_reduce(t, "max", agreed=True)
    inter.all_reduce(t, "max", agreed=True)


def segmented_all_reduce(
    flat: torch.Tensor,
    intra: Communicator,
    inter: Communicator,
    *,
    divide: int = 1,
    codec: HalfCodec | None = None,
    scope: str = "all",
    segment_bytes: int = SEGMENT_BYTES,
    intra_form: str = "broadcast",
    scratch: Scratch | None = None,
) -> None:
    """``flat <- (sum over intra x inter) / divide``, in place, blocking.

    Args:
        flat: a contiguous 1-D tensor, the same numel and dtype on every rank.
        intra, inter: the node-local group and the group of this local rank across nodes.
        divide: 1 for a sum, the world size for an average.
        codec: wire compression, or None for the buffer's own dtype.
        scope: "all" (every hop compressed) or "inter" (only the hop across nodes).
        segment_bytes: wire bytes per segment; one segment means no pipelining.
        intra_form: "broadcast" (the node-local hops as broadcasts, see the module doc) or
            "reduce_scatter" (gloo's reduce-scatter and allgather).
        scratch: where the wire buffers live (a `Scratch` kept by the caller across calls);
            None allocates them for this call.
    """
    if scope not in _SCOPES:
        raise ValueError(f"scope={scope!r} is not one of {_SCOPES}")
    if intra_form not in INTRA_FORMS:
        raise ValueError(f"intra_form={intra_form!r} is not one of {INTRA_FORMS}")
    n = flat.numel()
    if n == 0:
        return
    world = intra.size * inter.size
    pre = factor = 1.0
    if codec is not None:
        pre, factor = codec.scales(flat, lambda m: agree_max(m, intra, inter), summands=world, divide=divide)
    all_codec = codec if scope == "all" else None  # compresses every hop
    inter_codec = codec if scope == "inter" else None  # compresses the crossing only
    wire_dtype = all_codec.dtype if all_codec is not None else flat.dtype
    width = intra.size
    elem = wire_dtype.itemsize
    step = max(width, (max(1, segment_bytes) // elem) // width * width)
    segs = [flat[lo : lo + step] for lo in range(0, n, step)]
    padded = n + (-n) % width  # only the last segment can need padding (step is a multiple of width)
    scratch = scratch if scratch is not None else Scratch()
    # one wire buffer for the call (segments are views of it): an encoded bucket, or the
    # crossing's 16-bit chunks in the mixed scope; none when the buffer travels as it is
    wire_all = scratch.get(padded, wire_dtype, flat.device) if all_codec is not None else None
    wire_inter = scratch.get(padded // width, inter_codec.dtype, flat.device, slot="inter") if inter_codec is not None else None
    by_broadcast = intra_form == "broadcast"
    pairwise = by_broadcast and width == 2
    # the peer's half of each segment, received (two ranks per node, "broadcast" form)
    wire_recv = scratch.get(padded // width, wire_dtype, flat.device, slot="recv") if pairwise else None

    def encode(i: int) -> torch.Tensor:
        seg = segs[i]
        lo = i * step
        pad = (-seg.numel()) % width
        if wire_all is not None:
            buf = wire_all[lo : lo + seg.numel() + pad]
            all_codec.encode_(seg, pre, buf[: seg.numel()])  # type: ignore[union-attr]
            if pad:
                buf[seg.numel() :].zero_()
            return buf
        return seg if pad == 0 else torch.cat([seg, seg.new_zeros(pad)])

    def decode(seg: torch.Tensor, buf: torch.Tensor) -> None:
        if all_codec is not None:
            all_codec.decode_(buf[: seg.numel()], factor, seg)
            return
        if buf.data_ptr() != seg.data_ptr():
            seg.copy_(buf[: seg.numel()])
        if inter_codec is None:  # a compressed crossing divided before its cast
            divide_(seg, divide)

    # per segment, dropped once the segment is finished
    bufs: dict[int, torch.Tensor] = {}
    chunks: dict[int, torch.Tensor] = {}
    scatters: dict[int, list[Work]] = {}
    recvs: dict[int, torch.Tensor] = {}
    crossings: dict[int, tuple[Work, torch.Tensor | None]] = {}
    gathers: dict[int, list[Work]] = {}

    def start_scatter(i: int) -> None:
        buf = bufs[i] = encode(i)
        parts = buf.view(width, -1)
        chunk = chunks[i] = parts[intra.rank]
        if pairwise:  # send the peer the half it sums, receive ours; add it after the wait
            peer = 1 - intra.rank
            lo = i * step // width
            got = recvs[i] = wire_recv[lo : lo + chunk.numel()]  # type: ignore[index]
            scatters[i] = [intra.broadcast_async(parts[peer] if root == intra.rank else got, root, agreed=True)
                           for root in range(2)]
        else:
            scatters[i] = [intra.reduce_scatter_async(buf, "sum", out=chunk, agreed=True)]

    def start_crossing(i: int) -> None:
        chunk = chunks[i]
        if wire_inter is not None:
            lo = i * step // width
            w = wire_inter[lo : lo + chunk.numel()]
            inter_codec.encode_(chunk, pre, w)  # type: ignore[union-attr]
            crossings[i] = (inter.all_reduce_async(w, "sum", agreed=True), w)
        else:
            crossings[i] = (inter.all_reduce_async(chunk, "sum", agreed=True), None)

    def start_gather(i: int) -> None:
        work, w = crossings.pop(i)
        work.wait()
        if w is not None:
            inter_codec.decode_(w, factor, chunks[i])  # type: ignore[union-attr]
        chunk = chunks.pop(i)
        if by_broadcast:
            parts = bufs[i].view(width, -1)
            gathers[i] = [intra.broadcast_async(parts[j], j, agreed=True) for j in range(width)]
        else:
            gathers[i] = [intra.all_gather_flat_async(chunk, out=bufs[i], agreed=True)]

    def finish(i: int) -> None:
        for w in gathers.pop(i):
            w.wait()
        decode(segs[i], bufs.pop(i))

    m = len(segs)
    start_scatter(0)
    for i in range(m):
        for w in scatters.pop(i):
            w.wait()
        if pairwise:
            chunks[i].add_(recvs.pop(i))  # the node's sum of chunk i: a + b, as gloo would add it
        start_crossing(i)  # queued behind segment i-1's: the link stays busy
        if i + 1 < m:
            start_scatter(i + 1)
        if i >= 1:
            start_gather(i - 1)
        if i >= 2:
            finish(i - 2)
    start_gather(m - 1)
    for i in range(max(0, m - 2), m):
        finish(i)


class Scratch:
    """Wire buffers kept across calls by one caller thread (a ring's worker): a fresh 32 MiB
    buffer per call costs its page faults again (the allocator returns large blocks to the OS).
    Not thread-safe: one `Scratch` per thread that issues chains."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device, slot: str = "wire") -> torch.Tensor:
        """A tensor of ``numel`` elements (contents undefined) for ``slot``, grown when too small."""
        key = (slot, dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._bufs[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

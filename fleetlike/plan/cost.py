"""Alpha-beta costs of the traced collectives and the timeline of a step.

**Links.** A collective's group is one of three kinds on a cluster of K nodes x L ranks:
``intra`` (ranks of one node; every node's group runs at once), ``inter`` (one rank per node;
the L groups of a two-level allreduce run at once and share the node's link) and ``world``
(several ranks on each of several nodes: a ring that crosses the node links). For each kind and
each op (all_reduce, reduce_scatter, all_gather, broadcast, reduce) `Links` holds ``alpha``
(seconds per call) and ``beta`` (seconds per payload byte): ``t = alpha + beta * bytes``.
`Links.from_rates` derives them from a link's latency and bandwidth with the ring algorithm's
step counts (``2(n-1)`` steps of ``S/n`` for an allreduce, ``n-1`` for reduce-scatter and
all-gather, a binomial tree for broadcast and reduce; a world ring is as slow as its slowest
hop, the crossing between nodes); `fleetlike.plan.probe` measures fleetlike's own collectives
on the real cluster instead, which is what the planner prefers: its ladder of sizes is kept
(``Links.raw``) and read directly (`ladder_cost`: linear between the sizes, the last slope
beyond), since a rate-limited link is not one straight line; the world's broadcast is probed
from every root (``"broadcast@<root>"``).

**Algorithms.** The trace gives each bucket's calls in issue order, so the algorithm is
whatever the program did: one ring allreduce (flat); a max-allreduce and a 16-bit allreduce
(compressed: half the bytes, priced from the 16-bit ladder where probed: gloo sums float16
element by element); per 1 MiB segment on the intra and inter groups, the node-local reduce,
the allreduce across nodes and the node-local gather (hierarchical: broadcasts inside a node of
two ranks, else reduce-scatter and all-gather, `fleetlike.collectives.segments`). Calls on
different group kinds overlap (their own communicators and threads, the segment pipeline), calls
on one kind queue, and a segment's phase waits for its previous phase (`_bucket_cost`'s list
schedule). One segment degenerates to the plain sum. The bucket's local work between its calls
(`BucketTrace.work`: casts, the overflow guard's scan, the segments' sums, scaled like compute)
runs on the bucket's worker thread in that schedule too: the compressed bucket's casts lie
between its calls (on 1gbit they were ~60 ms of a ~600 ms MLP step, missing before).

**Timeline.** Buckets queue on the network in index order; bucket i starts when it is ready
(the measured time its last gradient arrived in backward) and the previous bucket is done. The
step is: the ops' compute (scaled by ``compute_scale``, the slowdown the probe measured when
all ranks compute at once, or by the trace's own from the model's compute on the job,
`Trace.compute_scale`) + the end of backward or of the last bucket, whichever is later +
the blocking collectives of the other ops (AMP's finite flag, local SGD's average). The ops'
compute includes `StepTrace.refault`, the first touch of gradients a program without buckets
allocates afresh every step (`fleetlike.plan.trace`), scaled like the rest. Sharding's
update and parameter gather are priced together (`gather_cost`): the interleaved update
steps each owner's chunk just before broadcasting it, so the gather hides behind the update.
A period of k steps (gradient merge, local SGD) is averaged.

Example:
    >>> links = Links.from_rates(intra=(50e-6, 2e9), inter=(100e-6, 125e6))
    >>> step_time(trace, Cluster(2, 2), links).seconds
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleetlike.comm.stats import ring_send_bytes
from fleetlike.plan.dry import Event
from fleetlike.plan.spec import Cluster
from fleetlike.plan.trace import GatherTrace, StepTrace, Trace

__all__ = ["KINDS", "OPS", "REDUCTIONS", "WIRE_DTYPES", "Links", "StepCost", "event_cost", "gather_cost", "group_kind", "ladder_cost", "step_time"]

KINDS = ("intra", "inter", "world")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
#: ops that sum on the way: on a CPU backend their speed depends on the dtype
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
#: 16-bit wire dtypes probed apart from float32 (gloo sums float16 element by element: an
#: allreduce of the same bytes took ~2x float32's time on loopback, bfloat16's ~1.1x)
WIRE_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass
class Links:
    """``fits[kind][op] = (alpha seconds, beta seconds/byte)`` and the compute slowdown.

    ``source`` says where the figures came from ("probe ...", "rates ...")."""

    fits: dict[str, dict[str, tuple[float, float]]]
    compute_scale: float = 1.0
    source: str = ""
    raw: dict[str, Any] = dataclasses.field(default_factory=dict)

    def cost(self, kind: str, op: str, nbytes: int, root: int | None = None, dtype: str = "float32") -> float:
        """Seconds of ``op`` on ``kind`` for ``nbytes`` of ``dtype``; the first of these that
        was probed: a rooted op's own root's figures (``"broadcast@2"``), a 16-bit reduction's
        own (``"all_reduce:float16"``), the op's, the 16-bit allreduce's, the allreduce's.
        Probed figures are read off the measured ladder (`ladder_cost`), others are ``alpha +
        beta * nbytes``."""
        if kind not in self.fits:
            raise KeyError(f"the link figures have no {kind!r} entry (have {sorted(self.fits)}); "
                           "run --probe on a cluster of this shape")
        ops = self.fits[kind]
        names = [f"{op}@{root}"] if root is not None else []
        if dtype in WIRE_DTYPES and op in REDUCTIONS:
            names += [f"{op}:{dtype}", op, f"all_reduce:{dtype}", "all_reduce"]
        else:
            names += [op, "all_reduce"]
        name = next(n for n in names if n in ops or n == "all_reduce")
        ladder = self.raw.get(kind, {}).get(name) if isinstance(self.raw.get(kind), dict) else None
        if ladder and len(ladder) >= 2:
            return ladder_cost(ladder, nbytes)
        alpha, beta = ops[name]
        return alpha + beta * nbytes

    @classmethod
    def from_rates(cls, *, intra: tuple[float, float], inter: tuple[float, float], cluster: Cluster,
                   compute_scale: float = 1.0) -> Links:
        """Ring-algorithm figures from ``(latency s, bandwidth B/s)`` of each link."""
        fits: dict[str, dict[str, tuple[float, float]]] = {}
        K, L = cluster.nodes, cluster.per_node
        shapes = {"intra": (L, intra, 1.0), "inter": (K, inter, float(L)), "world": (K * L, None, 1.0)}
        for kind, (n, link, share) in shapes.items():
            if link is None:  # a ring over both kinds of hop: each step as slow as the slower
                lat = max(intra[0], inter[0])
                per_byte = max(1 / intra[1], 1 / inter[1])
            else:
                lat, per_byte = link[0], share / link[1]
            n = max(n, 2)
            fits[kind] = {
                "all_reduce": (2 * (n - 1) * lat, 2 * (n - 1) / n * per_byte),
                "reduce_scatter": ((n - 1) * lat, (n - 1) / n * per_byte),
                "all_gather": ((n - 1) * lat, (n - 1) / n * per_byte),
                "broadcast": (math.ceil(math.log2(n)) * lat, per_byte),
                "reduce": (math.ceil(math.log2(n)) * lat, per_byte),
            }
        src = f"rates intra {intra[0] * 1e6:.0f} us {intra[1] / 1e6:.0f} MB/s, inter {inter[0] * 1e6:.0f} us {inter[1] / 1e6:.0f} MB/s"
        return cls(fits, compute_scale, src)

    def to_json(self) -> dict[str, Any]:
        return {"fits": {k: {op: list(v) for op, v in ops.items()} for k, ops in self.fits.items()},
                "compute_scale": self.compute_scale, "source": self.source, "raw": self.raw}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "links") -> Links:
        try:
            fits = {str(k): {str(op): (float(v[0]), float(v[1])) for op, v in ops.items()}
                    for k, ops in data["fits"].items()}
            return cls(fits, float(data.get("compute_scale", 1.0)), str(data.get("source", where)),
                       dict(data.get("raw", {})))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ValueError(f"{where}: not a link-figures file ({type(exc).__name__}: {exc}); write one "
                             "with python -m fleetlike.plan --probe") from exc

    @classmethod
    def load(cls, path: str | Path) -> Links:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError as exc:
            raise ValueError(f"--links {str(p)!r} does not exist; measure it with --probe") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"--links {str(p)!r} is not JSON ({exc})") from exc
        return cls.from_json(data, str(p))


def ladder_cost(points: list[Any], nbytes: int) -> float:
    """Seconds for ``nbytes`` read off a probed ladder ``[(bytes, seconds), ...]``: linear
    between the measured sizes, the smallest size's time below it (latency), and past the
    largest the slope of the last two (the link's sustained rate). Why not the fitted line: a
    rate-limited link (tbf, a switch's buffer) passes small messages at burst speed, so one
    line through every size gets the slope of large messages wrong (the 1 Gbit netns link: 109
    MB/s at 1 MiB, 70 MB/s from 4 to 8 MiB); times are made non-decreasing in size first."""
    pts = sorted((int(x), float(y)) for x, y in points)
    xs = [x for x, _ in pts]
    ys: list[float] = []
    for _, y in pts:
        ys.append(max(y, ys[-1]) if ys else y)
    if nbytes <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if nbytes <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (nbytes - xs[i - 1]) / (xs[i] - xs[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    if slope <= 0:
        slope = ys[-1] / xs[-1]
    return ys[-1] + slope * (nbytes - xs[-1])


def group_kind(ranks: tuple[int, ...], cluster: Cluster) -> str:
    nodes = [r // cluster.per_node for r in ranks]
    distinct = len(set(nodes))
    if distinct == 1:
        return "intra"
    return "inter" if distinct == len(nodes) and cluster.per_node > 1 else "world"


def event_cost(e: Event, cluster: Cluster, links: Links) -> float:
    if e.size <= 1 or e.op == "barrier":
        return 0.0
    return links.cost(group_kind(e.ranks, cluster), e.op, e.nbytes, e.root, e.dtype)


def _bucket_cost(events: list[Event], cluster: Cluster, links: Links, work: tuple[float, ...] = (),
                 scale: float = 1.0) -> float:
    """A list schedule of the bucket's calls and its local work (see the module docstring).

    A call's *stage* is its (op, group kind, dtype) in order of first appearance (a 16-bit
    bucket's float64 maximum is a stage of its own, before the data's), its *segment* how
    many calls of that stage came before it. Calls of one group kind run one after another in
    issue order (one communicator, one thread); a call waits for the previous stage of its own
    segment (its input). Segments of a two-level chain thus overlap across kinds, one segment
    degenerates to the plain sum, and calls of one kind only (flat, compressed) to their sum.

    ``work`` (`BucketTrace.work`, times ``scale``) runs on the bucket's one worker thread, in
    order: the work before a call starts once the call's input is there and the previous work
    is done (a 16-bit bucket's cast waits for the agreed maximum, its division for the sum:
    serial with its calls; a two-level segment's sum overlaps the other segments' calls), and
    the work after the last call ends the bucket."""
    stages: dict[tuple[str, str, str], int] = {}
    seen: dict[tuple[str, str, str], int] = {}
    free: dict[str, float] = {}
    done: dict[tuple[int, int], float] = {}
    cpu = 0.0  # when the worker thread is done with the work so far
    last = 0.0
    for i, e in enumerate(events):
        kind = group_kind(e.ranks, cluster)
        key = (e.op, kind, e.dtype)
        j = stages.setdefault(key, len(stages))
        k = seen[key] = seen.get(key, -1) + 1
        ready = done.get((j - 1, k), 0.0)
        if work:
            cpu = max(cpu, ready) + work[i] * scale
        start = max(free.get(kind, 0.0), ready, cpu)
        end = start + event_cost(e, cluster, links)
        free[kind] = done[(j, k)] = end
        last = max(last, end)
    if work:
        last = max(last, cpu) + work[-1] * scale
    return last


@dataclasses.dataclass
class StepCost:
    """Predicted seconds per step (averaged over the period) and its parts."""

    seconds: float
    compute: float
    exposed_comm: float
    comm: float
    intra_bytes: float
    inter_bytes: float
    per_step: list[float]
    per_bucket: dict[int, float]


def _crossing(e: Event, cluster: Cluster) -> tuple[float, float]:
    """(intra, inter) bytes this rank sends for ``e`` (ring factors; a world ring crosses the
    node links at K of its n hops)."""
    sent = ring_send_bytes(e.op, e.nbytes, e.size)
    kind = group_kind(e.ranks, cluster)
    if kind == "intra":
        return float(sent), 0.0
    if kind == "inter":
        return 0.0, float(sent)
    nodes = len({r // cluster.per_node for r in e.ranks})
    return sent * (1 - nodes / e.size), sent * nodes / e.size


def gather_cost(g: GatherTrace, events: list[Event], cluster: Cluster, links: Links,
                scale: float | None = None) -> tuple[float, float]:
    """``(seconds, network seconds)`` of sharding's update + parameter gather, a list schedule
    of what `ParamGather.run` issues (``g``, the op's broadcasts ``events``).

    Every rank walks the same chunks in the same order: before a chunk's broadcasts, the owner
    steps the chunk (rank 0's steps as traced; another owner's at rank 0's seconds per byte),
    every rank does the traced local work (zeroing, copies); a broadcast starts once every rank
    has posted it and its communicator is free (calls on one communicator queue); before a
    bucket that would exceed the window every rank waits for the oldest bucket in flight. The
    phase ends when the last broadcast and every rank's work are done. Not interleaved, nobody
    steps here (the update ran whole before, in compute) and it is the sum of the broadcasts
    plus the local work. ``scale``: the compute slowdown (default ``links.compute_scale``)."""
    scale = links.compute_scale if scale is None else scale
    own = [(k, nbytes) for owner, k, nbytes in _chunks(g) if owner == 0]
    own_bytes = sum(nbytes for _, nbytes in own)
    rate = sum(g.steps[k] for k, _ in own) / own_bytes if own_bytes else 0.0  # rank 0's seconds per byte
    n = cluster.world_size
    clock = [0.0] * n
    free: dict[str, float] = {}
    inflight: list[tuple[float, int]] = []
    held = 0
    k = 0
    net = 0.0
    for bucket_bytes, chunks in g.buckets:
        while inflight and held + bucket_bytes > g.window:
            done, nbytes = inflight.pop(0)
            held -= nbytes
            clock = [max(c, done) for c in clock]
        end = 0.0
        for owner, pieces in chunks:
            for j, _ in enumerate(pieces):
                e = events[k]
                clock = [c + g.gaps[k] * scale for c in clock]
                if j == 0 and g.interleaved:
                    clock[owner] += (g.steps[k] if owner == 0 else rate * sum(pieces)) * scale
                c = event_cost(e, cluster, links)
                start = max(free.get(e.comm, 0.0), max(clock))
                free[e.comm] = end_e = start + c
                end = max(end, end_e)
                net += c
                k += 1
        inflight.append((end, bucket_bytes))
        held += bucket_bytes
    last = max([d for d, _ in inflight] + [0.0])
    return max(max(clock) + g.tail * scale, last), net


def _chunks(g: GatherTrace) -> list[tuple[int, int, int]]:
    """``(owner, index of its first broadcast, bytes)`` of every chunk, in issue order."""
    out, k = [], 0
    for _, chunks in g.buckets:
        for owner, pieces in chunks:
            out.append((owner, k, sum(pieces)))
            k += len(pieces)
    return out


def _one_step(s: StepTrace, cluster: Cluster, links: Links, scale: float,
              per_bucket: dict[int, float]) -> tuple[float, float, float, float]:
    times = dict(s.times)
    gather = 0.0
    gather_net = 0.0
    gathered: list[Event] = []
    if s.gather is not None:  # sharding's update and gather: one schedule (`gather_cost`)
        gathered = [e for op, es in s.blocking if op == s.gather.op for e in es]
        gather, gather_net = gather_cost(s.gather, gathered, cluster, links, scale)
        times.pop(s.gather.op, None)
    compute = (sum(times.values()) + s.refault) * scale
    backward = s.times.get("backward", 0.0) * scale
    free = 0.0
    comm = 0.0
    for b in s.buckets:
        c = _bucket_cost(b.events, cluster, links, b.work, scale)
        per_bucket[b.index] = c
        comm += c
        free = max(free, b.ready * scale) + c
    exposed = max(0.0, free - backward)
    blocking = sum(event_cost(e, cluster, links) for op, es in s.blocking
                   if s.gather is None or op != s.gather.op for e in es)
    # the gather phase counts as compute for rank 0's own local work, the rest is exposed
    local = s.times.get(s.gather.op, 0.0) * scale if s.gather is not None else 0.0
    gather_exposed = max(0.0, gather - local)
    return (compute + exposed + blocking + gather, compute + gather - gather_exposed,
            exposed + blocking + gather_exposed, comm + blocking + gather_net)


def step_time(t: Trace, links: Links) -> StepCost:
    """Predicted time of one step of ``t`` (see the module docstring): compute scaled by the
    trace's own ``compute_scale`` where it has one, else by the links'."""
    scale = t.compute_scale if t.compute_scale is not None else links.compute_scale
    per: list[float] = []
    comp = exposed = comm = 0.0
    per_bucket: dict[int, float] = {}
    intra = inter = 0.0
    for s in t.steps:
        total, c, x, m = _one_step(s, t.cluster, links, scale, per_bucket)
        per.append(total)
        comp, exposed, comm = comp + c, exposed + x, comm + m
        for e in s.events:
            a, b = _crossing(e, t.cluster)
            intra, inter = intra + a, inter + b
    n = len(t.steps)
    return StepCost(sum(per) / n, comp / n, exposed / n, comm / n, intra / n, inter / n, per, per_bucket)

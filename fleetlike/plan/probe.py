"""``--probe``: measure the cluster's links with fleetlike's own collectives, save the fits.

Run under the launcher on the real cluster, every rank taking part::

    python -m fleetlike.launch --cluster_node_ips=10.0.0.1,10.0.0.2 --nproc_per_node=2 \\
        -m fleetlike.plan --probe --links links.json

Each group kind of `fleetlike.plan.cost` is measured the way a training job uses it: the intra
groups of all nodes at once, the inter groups of all local ranks at once (they share the node's
link, as the two-level allreduce's do), and the world. For each op (all_reduce, reduce_scatter,
all_gather, broadcast; the reductions again in float16 and bfloat16, whose sums a CPU backend
runs at speeds of their own) a ladder of sizes is timed (median of repeats, barrier before each) and
``t = alpha + beta * bytes`` fitted by least squares weighted by 1/t (relative error; small
calls timed several at a time, a call the barriers' jitter hid left out); the world's broadcast is timed from
every root (a binomial tree crosses the node links once or more, by root). The
probe also times a reference kernel (an MLP's forward and backward) on rank 0 alone and on every
rank at once: the ratio is the slowdown of compute when all ranks of a node share its cores
(``Links.compute_scale``), applied to the compute the planner times alone. Rank 0 writes the
JSON (`Links.to_json`).

Example:
    >>> links = Links.load("links.json")
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fleetlike.comm import CommGroups, Communicator
from fleetlike.plan.cost import REDUCTIONS, WIRE_DTYPES, Links

__all__ = ["SIZES", "compute_slowdown", "compute_together", "fit", "kernel_seconds", "probe_worker"]

SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)


def kernel_seconds() -> float:
    """Seconds of one run of a fixed training-like workload (an MLP's forward and backward five
    times: matmuls and memory-bound elementwise ops) on this process's torch threads."""
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    x = torch.randn(128, 512, generator=g)
    t0 = time.perf_counter()
    for _ in range(5):
        net(x).square().mean().backward()
    return time.perf_counter() - t0


#: what `_measure` returns for a call it could not time (the barriers' own jitter took it to
#: zero or below): such a point says nothing and is left out of the fit
UNTIMED_S = 1e-7

#: calls timed back to back between two barriers, by size: a small call is shorter than the
#: barrier's own jitter, so several are averaged (a large one is timed alone)
BATCH_BYTES = 1 << 20


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(alpha, beta)`` of ``t = alpha + beta * bytes``, weighted by 1/t (relative error),
    without the points `_measure` could not time; both kept >= 0."""
    timed = [p for p in points if p[1] > UNTIMED_S]
    if len(timed) >= 2:
        points = timed
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / np.maximum(y, UNTIMED_S)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if beta <= 0:  # a flat or inverted ladder: the slope of the largest point, no latency
        i = int(np.argmax(x))
        return 0.0, max(float(y[i] / x[i]), 0.0)
    if alpha < 0:  # through the origin instead
        return 0.0, max(float(np.sum(w * w * x * y) / np.sum(w * w * x * x)), 0.0)
    return float(alpha), float(beta)


def _run(comm: Communicator, op: str, nbytes: int, root: int = 0, dtype: torch.dtype = torch.float32) -> None:
    n = max(1, nbytes // dtype.itemsize)
    n -= n % comm.size
    n = max(n, comm.size)
    t = torch.ones(n, dtype=dtype)
    if op == "all_reduce":
        comm.all_reduce(t, "sum", agreed=True)
    elif op == "reduce_scatter":
        comm.reduce_scatter(t, agreed=True)
    elif op == "all_gather":
        comm.all_gather_flat(t[: n // comm.size], agreed=True)
    elif op == "broadcast":
        comm.broadcast(t, root, agreed=True)
    else:
        raise ValueError(f"op={op!r} is not probed")


def _measure(world: Communicator, comm: Communicator | None, op: str, nbytes: int, reps: int, root: int = 0,
             dtype: torch.dtype = torch.float32) -> float:
    calls = max(1, min(8, BATCH_BYTES // max(nbytes, 1)))
    times = []
    for _ in range(reps + 1):
        world.barrier()
        t0 = time.perf_counter()
        if comm is not None:
            for _ in range(calls):
                _run(comm, op, nbytes, root, dtype)
        world.barrier()
        times.append(time.perf_counter() - t0)
    base = []
    for _ in range(reps):
        t0 = time.perf_counter()
        world.barrier()
        base.append(time.perf_counter() - t0)
    return max((statistics.median(times[1:]) - statistics.median(base)) / calls, UNTIMED_S)


def compute_slowdown(world: Communicator, work: Callable[[], float], window: float = 1.5) -> tuple[float, float, float]:
    """``(slowdown, seconds alone, seconds all at once)`` of ``work`` (one run, returns its
    seconds): rank 0 alone (median of 5 runs after one) while the others wait in a barrier,
    then `compute_together` for at least ``window`` seconds and 6 runs of rank 0's time.
    Collective over ``world``; every rank gets the figures."""
    world.barrier()
    solo = statistics.median([work() for _ in range(6)][1:]) if world.rank == 0 else 0.0
    span = torch.tensor([max(window, 6 * solo), solo], dtype=torch.float64, device=world.device)
    world.broadcast(span, 0, agreed=True)
    together = compute_together(world, work, float(span[0]))
    alone = float(span[1])
    return max(1.0, together / alone), alone, together


def compute_together(world: Communicator, work: Callable[[], float], window: float = 1.5) -> float:
    """Seconds of one run of ``work`` with every rank running it at once: each rank repeats it
    until one shared deadline ``window`` seconds on (and at least 3 runs), so that every timed
    run competes with all the others (ranks that stop early would leave the rest a quieter
    machine); the median run of each rank (the first left out), averaged over ranks.
    Collective over ``world``."""
    world.barrier()
    deadline = time.monotonic() + window  # one clock for every process of a machine
    runs = [work()]
    while time.monotonic() < deadline or len(runs) < 3:
        runs.append(work())
    mine = torch.tensor([statistics.median(runs[1:]) / world.size], dtype=torch.float64, device=world.device)
    world.all_reduce(mine, "sum", agreed=True)
    return float(mine[0])


def probe_worker(groups: CommGroups, *, sizes: tuple[int, ...] = SIZES, reps: int = 5,
                 ops: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "broadcast"),
                 dtypes: tuple[str, ...] = WIRE_DTYPES) -> Links | None:
    """Collective over every rank of ``groups``; returns the fitted `Links` on rank 0 (else None).

    ``ops`` are timed in float32; their reductions again in each of ``dtypes`` (saved as
    ``"all_reduce:float16"``...): a CPU backend's sum runs at a speed of its own per dtype."""
    role, world = groups.role, groups.world
    kinds: dict[str, Communicator] = {}
    if role.local_size > 1:
        kinds["intra"] = groups.intra
    if role.node_num > 1 and role.local_size > 1:
        kinds["inter"] = groups.inter
    if world.size > 1:
        kinds["world"] = world
    raw: dict[str, Any] = {}
    fits: dict[str, dict[str, tuple[float, float]]] = {}
    for kind, comm in kinds.items():
        fits[kind] = {}
        raw[kind] = {}
        for op in ops:
            pts = [(s, _measure(world, comm, op, s, reps)) for s in sizes]
            raw[kind][op] = pts
            fits[kind][op] = fit(pts)
        for name in dtypes:
            dtype = getattr(torch, name)
            for op in (o for o in ops if o in REDUCTIONS):
                pts = [(s, _measure(world, comm, op, s, reps, dtype=dtype)) for s in sizes]
                raw[kind][f"{op}:{name}"] = pts
                fits[kind][f"{op}:{name}"] = fit(pts)
        if kind == "world" and "broadcast" in ops:  # a tree from each root crosses the node links
            for root in range(1, comm.size):  # differently: sharding's owners are every rank
                pts = [(s, _measure(world, comm, "broadcast", s, reps, root)) for s in sizes]
                raw[kind][f"broadcast@{root}"] = pts
                fits[kind][f"broadcast@{root}"] = fit(pts)
            fits[kind]["broadcast@0"] = fits[kind]["broadcast"]
            raw[kind]["broadcast@0"] = raw[kind]["broadcast"]
    scale, solo, together = compute_slowdown(world, kernel_seconds)
    if world.rank != 0:
        return None
    raw["kernel_seconds_all_ranks"] = together
    raw["kernel_seconds_alone"] = solo
    return Links(fits, scale, f"probe: {role.node_num} nodes x {role.local_size} ranks", raw)


def save(links: Links, path: str | Path) -> None:
    Path(path).write_text(json.dumps(links.to_json(), indent=1))

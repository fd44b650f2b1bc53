"""``--probe``: measure the cluster's links with fleetlike's own collectives, save the fits.

Run under the launcher on the real cluster, every rank taking part::

    python -m fleetlike.launch --cluster_node_ips=10.0.0.1,10.0.0.2 --nproc_per_node=2 \\
        -m fleetlike.plan --probe --links links.json

Each group kind of `fleetlike.plan.cost` is measured the way a training job uses it: the intra
groups of all nodes at once, the inter groups of all local ranks at once (they share the node's
link, as the two-level allreduce's do), and the world. For each op (all_reduce, reduce_scatter,
all_gather, broadcast) a ladder of sizes is timed (median of repeats, barrier before each) and
``t = alpha + beta * bytes`` fitted by least squares weighted by 1/t (relative error). The
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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fleetlike.comm import CommGroups, Communicator
from fleetlike.plan.cost import Links

__all__ = ["SIZES", "fit", "kernel_seconds", "probe_worker"]

SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)


def kernel_seconds(reps: int = 8) -> float:
    """Median seconds of a fixed training-like workload (an MLP's forward and backward: matmuls
    and memory-bound elementwise ops) on this process's torch threads."""
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    x = torch.randn(128, 512, generator=g)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(5):
            net(x).square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(alpha, beta)`` of ``t = alpha + beta * bytes``, weighted by 1/t; both kept >= 0."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def _run(comm: Communicator, op: str, nbytes: int) -> None:
    n = max(1, nbytes // 4)
    n -= n % comm.size
    n = max(n, comm.size)
    t = torch.ones(n)
    if op == "all_reduce":
        comm.all_reduce(t, "sum", agreed=True)
    elif op == "reduce_scatter":
        comm.reduce_scatter(t, agreed=True)
    elif op == "all_gather":
        comm.all_gather_flat(t[: n // comm.size], agreed=True)
    elif op == "broadcast":
        comm.broadcast(t, 0, agreed=True)
    else:
        raise ValueError(f"op={op!r} is not probed")


def _measure(world: Communicator, comm: Communicator | None, op: str, nbytes: int, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        world.barrier()
        t0 = time.perf_counter()
        if comm is not None:
            _run(comm, op, nbytes)
        world.barrier()
        times.append(time.perf_counter() - t0)
    base = []
    for _ in range(reps):
        t0 = time.perf_counter()
        world.barrier()
        base.append(time.perf_counter() - t0)
    return max(statistics.median(times[1:]) - statistics.median(base), 1e-7)


def probe_worker(groups: CommGroups, *, sizes: tuple[int, ...] = SIZES, reps: int = 3,
                 ops: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")) -> Links | None:
    """Collective over every rank of ``groups``; returns the fitted `Links` on rank 0 (else None)."""
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
    world.barrier()
    solo = kernel_seconds() if world.rank == 0 else 0.0  # rank 0 alone, the others wait
    world.barrier()
    kt = torch.tensor([kernel_seconds()], dtype=torch.float64)  # every rank at once
    world.all_reduce(kt, "avg", agreed=True)
    if world.rank != 0:
        return None
    raw["kernel_seconds_all_ranks"] = float(kt.item())
    raw["kernel_seconds_alone"] = solo
    scale = max(1.0, float(kt.item()) / solo)
    return Links(fits, scale, f"probe: {role.node_num} nodes x {role.local_size} ranks", raw)


def save(links: Links, path: str | Path) -> None:
    Path(path).write_text(json.dumps(links.to_json(), indent=1))

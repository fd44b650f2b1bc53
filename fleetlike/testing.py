"""Run a function on N real ranks (processes) and collect what each returns.

Used by the tests and the benchmarks: each rank is a separate process forked from a forkserver
that has torch imported already, so starting a world costs a fraction of a second. A rank's
exception becomes an error in the caller naming the rank and carrying its traceback; a world that
does not finish in ``timeout`` seconds is killed and reported, so nothing can hang or linger.

Example:
    >>> def work(role, x):
    ...     world = make_world(role)
    ...     return world.all_reduce(torch.tensor([x + role.rank])).item()
    >>> run_ranks(work, 2, 10)
    [21, 21]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from fleetlike.roles.role import Role

__all__ = ["RankError", "run_ranks", "free_ports", "endpoints_for", "make_world"]

_CTX: Any = None


class RankError(AssertionError):
    """A rank raised, or the world did not finish in time."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "numpy", "fleetlike.comm"])
        _CTX = ctx
    return _CTX


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` right now (the OS picks them)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def endpoints_for(nodes: int, per_node: int) -> list[str]:
    """Endpoints of a ``nodes x per_node`` job; node i is 127.0.0.(i+1), as two launchers would."""
    ports = free_ports(nodes * per_node)
    return [f"127.0.0.{1 + r // per_node}:{ports[r]}" for r in range(nodes * per_node)]


def make_world(role: Role, backend: str = "auto", timeout: float = 60.0) -> Any:
    """The world communicator for a test rank (gloo unless the world is one rank)."""
    from fleetlike.comm import create_world

    return create_world(role, backend=backend, timeout=timeout)


def _child(fn: Callable[..., Any], role: Role, args: tuple, kwargs: dict, q: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle (bytes), not the queue's pickler: torch would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        result = pickle.dumps(fn(role, *args, **kwargs))
        q.put((role.rank, True, result))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        q.put((role.rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int | None = None,
    *args: Any,
    endpoints: Sequence[str] | None = None,
    nodes: int = 1,
    timeout: float = 60.0,
    job_id: str = "test",
    may_die: Sequence[int] = (),
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(role, *args, **kwargs)`` on every rank; return the results in rank order.

    Give ``world_size`` (ranks spread over ``nodes`` loopback "nodes") or explicit ``endpoints``.
    ``fn`` must be importable by name (a module-level function). Ranks in ``may_die`` may end
    without reporting (a test that kills them); their result is None.
    """
    if endpoints is None:
        if world_size is None or world_size % nodes:
            raise ValueError(f"world_size={world_size} must be a multiple of nodes={nodes}")
        endpoints = endpoints_for(nodes, world_size // nodes)
    eps = list(endpoints)
    ctx = _context()
    q = ctx.Queue()
    procs = []
    for r in range(len(eps)):
        role = Role.from_endpoints(r, eps, job_id=job_id)
        p = ctx.Process(target=_child, args=(fn, role, args, kwargs, q), daemon=True)
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        def finished() -> bool:
            dead = {i for i in may_die if procs[i].exitcode is not None}
            return len(set(results) | dead) >= len(eps)

        while not finished():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(len(eps))) - set(results))
                raise RankError(f"ranks {missing} of {len(eps)} did not finish within {timeout:g}s")
            try:
                rank, ok, value = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [
                    i for i, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and i not in results and i not in may_die
                ]
                if dead:
                    raise RankError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting"
                    ) from None
                continue
            if not ok:
                raise RankError(f"rank {rank} raised:\n{value}")
            results[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 5.0))
    finally:
        _reap(procs)
        q.close()
    return [results.get(r) for r in range(len(eps))]


def _reap(procs: list[Any]) -> None:
    """Kill whatever is still running: a failed test must not leave ranks behind."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(timeout=5)

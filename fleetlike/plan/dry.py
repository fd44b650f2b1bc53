"""A dry communicator grid: every rank of a cluster in one process, collectives recorded, not sent.

The planner must know exactly which collectives a strategy issues, of which sizes, on which
groups, and in which phase of the step. Re-deriving that by hand would drift from the code, so
the planner builds the *real* engine and ``fleet.main_program`` (`fleetlike.strategies`) for
every rank of the cluster, each rank in a thread of this process, over `DryCommunicator` s:

- ``split`` is real: the ranks' threads meet in a `DryFabric` and form the same groups (names,
  members, order) the real job forms, so hierarchical pairs, rings and sync-BN groups are those
  of the cluster being planned;
- while the engines are built, collectives really exchange values between the threads (the
  sharding unit agrees on segment positions with an all-gather); during the traced steps, which
  rank 0 runs alone, they complete at once with local semantics (a reduction leaves the local
  values, an all-gather fills this rank's slot). Either way they go through `Communicator`'s own argument checks, dtype
  conversion and statistics; every ``_record`` (the same call that feeds ``comm.stats``) is also
  appended to the fabric's log with the tag of what the step was doing.

So the list the planner costs is, call for call, what ``comm.stats`` counts on a real job
(``tests/test_plan.py`` checks it for every strategy of the search space).

Example:
    >>> fabric = DryFabric(4)
    >>> world = DryCommunicator(fabric, 0, 4, range(4), "world")   # one per rank thread
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from fleetlike.comm import CompletedWork, Communicator, ReduceOp, Work, dtype_name
from fleetlike.plan.faults import work_faults

__all__ = ["DryCommunicator", "DryFabric", "Event"]


@dataclasses.dataclass(frozen=True)
class Event:
    """One recorded collective call on one rank.

    Attributes:
        op: the statistics' op name ("all_reduce", "broadcast", "reduce", "all_gather",
            "reduce_scatter").
        nbytes: payload bytes as ``comm.stats`` counts them (the wire dtype's size).
        comm: the communicator's name; ``ranks``: its members (world ranks).
        tag: what the step was doing: ``(step, op type)`` or ``(step, "bucket", index)``.
        root: a broadcast's or reduce's root (its index in ``ranks``), else None: where the data
            starts decides which links a tree crosses (`fleetlike.plan.cost`).
        at: seconds since the fabric started when the call was issued (the interleaved sharded
            update's chunks are stepped between their broadcasts: the gaps are the step times).
        dtype: the wire dtype's name: a reduction's cost depends on it where the sum runs on
            the CPU (gloo sums float16 element by element, at about half float32's bytes/s).
    """

    op: str
    nbytes: int
    comm: str
    ranks: tuple[int, ...]
    tag: tuple[Any, ...]
    root: int | None = None
    at: float = 0.0
    dtype: str = "float32"

    @property
    def size(self) -> int:
        return len(self.ranks)


class DryFabric:
    """What the rank threads share: the split exchange and the event log of the traced rank.

    Only the events of ``traced`` (rank 0 by default) are logged; the tag is set by the tracer
    around each op and each bucket. Shared between threads, so guarded by a condition."""

    def __init__(self, world_size: int, *, traced: int = 0, timeout: float = 120.0, backend: str = "gloo") -> None:
        self.world_size = world_size
        #: the backend the planned job runs on: the collectives choose their algorithm by it
        #: (sharding allreduces its buckets on gloo, whose reduce_scatter is slower)
        self.backend = backend
        self.traced = traced
        self.timeout = timeout
        self._cond = threading.Condition()
        self._splits: dict[tuple[Any, ...], dict[int, Any]] = {}
        #: True while the rank threads build their engines (see `DryCommunicator`)
        self.live = True
        self.events: list[Event] = []
        self.tag: tuple[Any, ...] = ("build",)
        #: seconds per minor page fault taken off `now` (0: a plain clock); see `now`
        self.fault_seconds = 0.0
        self._t0 = time.perf_counter()

    def exchange(self, key: tuple[Any, ...], members: Sequence[int], rank: int, value: Any) -> dict[int, Any]:
        """Deposit this rank's ``value`` for exchange ``key``; return every member's when all came."""
        with self._cond:
            entry = self._splits.setdefault(key, {})
            entry[rank] = value
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(entry) == len(members), timeout=self.timeout):
                missing = sorted(set(members) - set(entry))
                raise RuntimeError(
                    f"planner: {key[0]} on {key[1]!r} waited {self.timeout:.0f} s for ranks {missing}; a "
                    "split or collective issued by one rank only cannot be planned")
            return dict(entry)

    def now(self) -> float:
        """Seconds since the fabric started (the clock of `Event.at`), less ``fault_seconds``
        per minor page fault the calling thread's work took (`fleetlike.plan.faults`: its own and
        its intra-op helpers', not other threads'): the planner times on a clock without this
        process's page faults, which come from its own heap's state (`fleetlike.plan.trace`)."""
        t = time.perf_counter() - self._t0
        if self.fault_seconds:
            t -= work_faults() * self.fault_seconds
        return t

    def log(self, rank: int, op: str, nbytes: int, comm: Communicator, root: int | None = None,
            dtype: torch.dtype = torch.float32) -> None:
        if rank != self.traced:
            return
        at = self.now()
        with self._cond:
            self.events.append(Event(op, int(nbytes), comm.name, tuple(comm.ranks), self.tag, root, at,
                                     dtype_name(dtype)))


class DryCommunicator(Communicator):
    """Rank ``rank`` of a group whose collectives complete at once (see the module docstring)."""

    calls_backend_at_size_one = False

    def __init__(self, fabric: DryFabric, rank: int, size: int, ranks: Sequence[int], name: str) -> None:
        super().__init__(rank, size, list(ranks), name)
        self.fabric = fabric
        self.backend = fabric.backend  # the planned job's, so every choice made by backend is its
        self.check_sizes = False  # nothing to agree with: the ranks' sizes agree by construction
        self._nsplits = 0
        self._ncoll = 0
        self._root: int | None = None

    def _record(self, op: str, nbytes: int, dtype: torch.dtype | None = None) -> None:
        super()._record(op, nbytes, dtype)
        self.fabric.log(self.ranks[self.rank], op, nbytes, self, self._root if op in ("broadcast", "reduce") else None,
                        dtype or torch.float32)

    # the root is known to the rooted calls' bodies only: kept for ``_record`` (one rank thread
    # per communicator, so no lock)
    def _broadcast(self, tensor: torch.Tensor, root: int, out: torch.Tensor | None, blocking: bool, agreed: bool) -> Any:
        self._root = root
        return super()._broadcast(tensor, root, out, blocking, agreed)

    def _reduce(self, tensor: torch.Tensor, root: int, op: Any, out: torch.Tensor | None, blocking: bool,
                agreed: bool) -> Any:
        self._root = root
        return super()._reduce(tensor, root, op, out, blocking, agreed)

    # While the engines are built (``fabric.live``) every rank thread is present, and results
    # matter (sharding agrees on segment positions with an all-gather): the values really are
    # exchanged. During the traced steps only rank 0 runs and a call completes with its own data.

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._ncoll += 1
        got = self.fabric.exchange(("coll", self.name, self.ranks, self._ncoll), self.ranks,
                                   self.ranks[self.rank], t.detach().clone())
        return [got[r] for r in self.ranks]

    def _all_reduce_start(self, buf: torch.Tensor, op: ReduceOp) -> Work:
        if self.fabric.live:
            buf.copy_(_reduce(self._gather(buf), op))
        return CompletedWork(buf)

    def _broadcast_start(self, buf: torch.Tensor, root: int) -> Work:
        if self.fabric.live:
            buf.copy_(self._gather(buf)[root])
        return CompletedWork(buf)

    def _reduce_start(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work:
        if self.fabric.live:
            total = _reduce(self._gather(buf), op)
            if self.rank == root:
                buf.copy_(total)
        return CompletedWork(buf)

    def _all_gather_start(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        if self.fabric.live:
            out.view(-1).copy_(torch.cat([c.view(-1) for c in self._gather(chunk)]))
            return CompletedWork(out)
        n = chunk.numel()
        mine = out.view(-1)[self.rank * n : (self.rank + 1) * n]
        if mine.data_ptr() != chunk.data_ptr():
            mine.copy_(chunk.view(-1))
        return CompletedWork(out)

    def _reduce_scatter_start(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        n = out.numel()
        src = _reduce(self._gather(buf), op) if self.fabric.live else buf
        mine = src.view(-1)[self.rank * n : (self.rank + 1) * n]
        if mine.data_ptr() != out.data_ptr():
            out.view(-1).copy_(mine)
        return CompletedWork(out)

    def _barrier_start(self) -> Work:
        if self.fabric.live:
            self._gather(torch.zeros(1))
        return CompletedWork(None)

    def _split(self, color: int | None, key: int) -> Communicator | None:
        self._nsplits += 1
        me = self.ranks[self.rank]
        got = self.fabric.exchange(("split", self.name, self.ranks, self._nsplits), self.ranks, me, (color, key))
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k) in got.items() if c == color)
        ranks = [r for _, r in members]
        return DryCommunicator(self.fabric, ranks.index(me), len(ranks), ranks, f"{self.name}/split:{color}")


def _reduce(values: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    stacked = torch.stack(values)
    if op is ReduceOp.MAX:
        return stacked.max(0).values
    if op is ReduceOp.MIN:
        return stacked.min(0).values
    if op is ReduceOp.PROD:
        return stacked.prod(0)
    total = stacked.sum(0)
    return total / len(values) if op is ReduceOp.AVG else total

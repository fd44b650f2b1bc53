"""Horovod's process sets: collectives among a subset of the Horovod ranks.

A `ProcessSet` names ranks of the Horovod world; ``hvd.add_process_set`` (every rank calls it,
in the same order, with the same ranks) or ``hvd.init(process_sets=[...])`` registers it: the
members split a communicator of their own off the Horovod world and get a runtime on it (its
own agreement, in-flight names and prediction history), the other ranks only record the set.
Every collective, ``DistributedOptimizer``, ``broadcast_parameters`` and the object helpers
take ``process_set=``; roots stay Horovod ranks (``hvd.broadcast(t, root_rank=2,
process_set=odd_set)``), as Horovod documents. ``hvd.remove_process_set`` (collective too)
closes the set's communicators and invalidates the object; the global set cannot be removed.

Deliberate differences: sets may be added whether or not ``HOROVOD_DYNAMIC_PROCESS_SETS`` is
set (``init(process_sets="dynamic")`` is accepted and changes nothing); adding a set with the
ranks of one already registered raises ``ValueError`` on every rank; a collective on a set this
rank is not a member of raises ``ValueError`` naming the set.

Example:
    >>> even = hvd.add_process_set([0, 2])
    >>> if hvd.rank() in even.ranks:
    ...     hvd.allreduce(t, process_set=even)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleetlike.horovod.negotiate import Kind, check, descriptor
from fleetlike.horovod.ops import OP_NAMES
from fleetlike.horovod.order import agree_in_order
from fleetlike.horovod.runtime import Runtime, runtime, split_runtime
from fleetlike.horovod import env as hvd_env
from fleetlike.horovod import runtime as _runtime_module
from fleetlike.horovod.timeline import start_env_timeline

__all__ = [
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "init",
    "process_set_included",
    "process_set_runtime",
    "remove_process_set",
]


class ProcessSet:
    """Ranks of the Horovod world that run collectives together (Horovod's class).

    ``ranks`` (sorted), ``process_set_id`` (set once registered, None after removal),
    ``mpi_comm`` (when built from an mpi4py communicator); ``size()``, ``rank()`` (this
    process's rank within the set) and ``included()``."""

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None
        self.ranks: list[int] | None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator: its COMM_WORLD ranks
            from mpi4py import MPI

            self.mpi_comm = ranks_or_comm
            n = ranks_or_comm.Get_size()
            self.ranks = sorted(MPI.Group.Translate_ranks(ranks_or_comm.Get_group(), list(range(n)),
                                                          MPI.COMM_WORLD.Get_group()))
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             f"object; got {ranks_or_comm!r}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet(ranks={ranks_or_comm!r}): the ranks must be ints")
        self.ranks = ranks

    def _entry(self) -> Runtime | None:
        rt = runtime("ProcessSet")
        if self.process_set_id == 0:
            return rt
        got = rt.process_sets.get(self.process_set_id)
        return None if got is None or got[0] is not self else got[1]

    def size(self) -> int | None:
        """Number of ranks in the set (None while not registered)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return runtime("ProcessSet.size()").comm.size
        return len(self.ranks or [])

    def rank(self) -> int | None:
        """This process's rank within the set (None while not registered or not a member)."""
        if self.process_set_id is None:
            return None
        rt = runtime("ProcessSet.rank()")
        if self.process_set_id == 0:
            return rt.comm.rank
        ranks = self.ranks or []
        return ranks.index(rt.comm.rank) if rt.comm.rank in ranks else None

    def included(self) -> bool | None:
        """Whether this process is a member (None while the set has no ranks)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return runtime("ProcessSet.included()").comm.rank in self.ranks

    def __repr__(self) -> str:
        ranks = "all" if self.process_set_id == 0 else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks}, mpi_comm={self.mpi_comm})"

    __str__ = __repr__


class _GlobalProcessSet(ProcessSet):
    """``hvd.global_process_set``: every Horovod rank (id 0), whatever the world is now."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    @property  # type: ignore[override]
    def ranks(self) -> list[int]:
        rt = _runtime_module._RUNTIME
        return list(range(rt.comm.size)) if rt is not None else []

    @ranks.setter
    def ranks(self, value: Any) -> None:  # the base class assigns it; the global set follows the world
        pass


global_process_set: ProcessSet = _GlobalProcessSet()


def process_set_runtime(process_set: Any, what: str) -> Runtime:
    """The runtime a collective called with ``process_set=`` runs on (the Horovod world's for
    None or the global set); a clear error for a set this rank cannot use."""
    rt = runtime(what)
    if process_set is None or process_set is global_process_set:
        return rt
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be an hvd.ProcessSet (from hvd.add_process_set), "
                        f"got {type(process_set).__name__}")
    if process_set.process_set_id == 0:
        return rt
    if process_set.process_set_id is None:
        raise ValueError(f"{what}: {process_set} is not registered (removed, or never added): add it with "
                         "hvd.add_process_set(...) or pass it to hvd.init(process_sets=[...]) on every rank")
    got = rt.process_sets.get(process_set.process_set_id)
    if got is None or got[0].ranks != process_set.ranks:
        raise ValueError(f"{what}: {process_set} is not registered with this Horovod world (added before the "
                         "last hvd.init?); add it again with hvd.add_process_set(...)")
    if got[1] is None:
        raise ValueError(f"{what}: rank {rt.comm.rank} is not a member of process set {process_set.ranks}; "
                         "call collectives on a set only from its members (see process_set.included())")
    return got[1]


def process_set_included(process_set: Any, what: str) -> bool:
    """Whether this rank is a member of the registered ``process_set`` (errors as
    `process_set_runtime` for a set that is not registered)."""
    try:
        process_set_runtime(process_set, what)
    except ValueError:
        if isinstance(process_set, ProcessSet) and process_set.ranks is not None \
                and process_set.process_set_id is not None and process_set.included() is False:
            return False
        raise
    return True


def _agree_on(rt: Runtime, what: str, ranks: Sequence[int]) -> None:
    """Every rank adds (or removes) the same set at the same point, else every rank raises."""
    row = descriptor(Kind.PROCESS_SET, name=f"{what}{list(ranks)}")
    with rt.lock:
        ag = agree_in_order(rt, row, f"hvd.{what}")
        check(ag, rt.comm, f"hvd.{what}", OP_NAMES)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register ``process_set`` (or a list of ranks) on every rank: collective over the Horovod
    world; returns the registered `ProcessSet`."""
    rt = runtime("hvd.add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ranks = ps.ranks or []
    n = rt.comm.size
    if ps.process_set_id is not None:
        raise ValueError(f"hvd.add_process_set: {ps} is registered already")
    if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < n for r in ranks):
        raise ValueError(f"hvd.add_process_set(ranks={ranks}): give distinct Horovod ranks in 0..{n - 1}")
    _agree_on(rt, "add_process_set", ranks)
    same = [i for i, (other, _) in rt.process_sets.items() if other.ranks == ranks]
    if ranks == list(range(n)) or same:
        raise ValueError(f"hvd.add_process_set: a process set with ranks {ranks} exists already "
                         f"(id {same[0] if same else 0}); use that one")
    sub = split_runtime(rt.comm, rt.role, rt.device, rt.strategy, ranks, "hvd-set", process_set=True)
    set_id = max(rt.process_sets, default=0) + 1
    ps.process_set_id = set_id
    rt.process_sets[set_id] = (ps, sub)
    if sub is not None:
        rt.children.append(sub)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective); False for the global set or a set
    not registered, True once removed (the object is invalidated)."""
    rt = runtime("hvd.remove_process_set")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"hvd.remove_process_set: expected an hvd.ProcessSet, got {type(process_set).__name__}")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    got = rt.process_sets.get(set_id)
    if got is None or got[0] is not process_set:
        return False
    _agree_on(rt, "remove_process_set", process_set.ranks or [])
    del rt.process_sets[set_id]
    sub = got[1]
    if sub is not None:
        rt.children.remove(sub)
        with sub.lock:
            sub.close()
    process_set.process_set_id = None
    return True


def init(comm: Sequence[int] | None = None, process_sets: Sequence[ProcessSet] | str | None = None,
         **kwargs: Any) -> None:
    """``hvd.init``: the Horovod world (`fleetlike.horovod.runtime.init`, whose keyword-only
    arguments are fleetlike's), then Horovod's ``process_sets``: a list of `ProcessSet` to
    register now (duplicates raise), or ``"dynamic"`` (sets may always be added later)."""
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"hvd.init(process_sets={process_sets!r}): give a list of hvd.ProcessSet or 'dynamic'")
        process_sets = None
    sets = list(process_sets or [])
    bad = [ps for ps in sets if not isinstance(ps, ProcessSet)]
    if bad:
        raise TypeError(f"hvd.init(process_sets=...): every entry must be an hvd.ProcessSet, got {bad[0]!r}")
    was = _runtime_module._RUNTIME
    henv = hvd_env.read()  # a refused or malformed HOROVOD_* variable stops here, before any rank connects
    _runtime_module.init(comm, **kwargs)
    rt = _runtime_module._RUNTIME
    if rt is None or rt is was:
        return  # not a member of comm=, or initialised already
    if henv.timeline and rt.comm.rank == 0 and not rt.is_set:
        start_env_timeline(henv.timeline)  # as Horovod: the coordinator writes HOROVOD_TIMELINE
    for i, ps in enumerate(sets):
        if ps.process_set_id is not None and ps.process_set_id in rt.process_sets:
            raise ValueError(f"Horovod could not be initialized because process_sets entry number {i} is a "
                             f"duplicate: {ps}")
        ps.process_set_id = None  # registered with an earlier world, if at all
        try:
            add_process_set(ps)
        except ValueError as exc:
            raise ValueError(f"Horovod could not be initialized because process_sets entry number {i} "
                             f"is a duplicate or invalid: {exc}") from None

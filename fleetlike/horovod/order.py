"""Handles, and collectives matched by name whatever order each rank submitted them in.

Horovod's coordinator starts a collective once every rank has submitted it, by name, so rank 0
may submit ``a`` then ``b`` while rank 1 submits ``b`` then ``a``. fleetlike has no background
thread: a rank negotiates while it is inside an hvd call. Each rank keeps the collectives it
submitted and could not start yet (``Runtime.pending``, oldest first) and, inside a call, starts
them oldest first. Each start agrees with the other ranks (`negotiate`); when their rows name
different collectives (the kind or the name differs), the ranks exchange their pending lists
(the name's crc32, or ``<kind>.noname.<n>`` for an unnamed call: unnamed calls match in
submission order, as Horovod's generated names do) and decide alike from that exchange:

- a collective pending on every active rank: each rank moves it to the front and starts it
  (the first such in the first active rank's order);
- none, and some ranks are inside an ``_async`` submission (or ``poll``): those return, their
  call stays pending (it starts in a later hvd call of theirs), the others negotiate again;
- none, and every rank must wait for its own call: no order can match them, and every rank
  raises `CollectiveMismatchError` with the table of what each rank asked for.

A name cannot be submitted again while it is taken: the second call raises ``ValueError`` at
once, on that rank only, as Horovod. Horovod frees a name when its background thread completes
the collective, a moment each rank sees at a different time: a rank that reuses the name right
after its own copy finished would start a collective that a slower rank refuses. Here the name
is freed by what the caller saw, which is the same on every rank running the same code: by
``synchronize``, by ``poll`` returning True, or by dropping the handle once the collective
completed. In the common case (every rank calls in the same order) the first agreement matches
and nothing else is exchanged.

Example (two ranks, opposite orders; both complete)::

    >>> if hvd.rank() == 0: ha, hb = hvd.allreduce_async(a, name="a"), hvd.allreduce_async(b, name="b")
    >>> else: hb, ha = hvd.allreduce_async(b, name="b"), hvd.allreduce_async(a, name="a")
    >>> hvd.synchronize(ha), hvd.synchronize(hb)
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable
from typing import Any

import torch

from fleetlike.comm import Work
from fleetlike.horovod import timeline
from fleetlike.horovod.negotiate import ACTIVE, Agreement
from fleetlike.horovod.runtime import Runtime

__all__ = ["Handle", "Reorder", "agree_in_order", "claim", "drive", "finish_in_turn", "poll", "resolve", "submit",
           "synchronize"]

#: pending collectives a rank can list in one exchange
MAX_PENDING = 62
_WIDTH = MAX_PENDING + 2  # may_leave, count, keys
#: named handles kept alive for their running collective, past which the completed are let go
_PRUNE_AT = 64


class Reorder(Exception):
    """Raised out of an agreement whose rows name different collectives, after the ranks
    decided what to do instead (see the module docstring); caught by `drive`."""

    def __init__(self, choice: int | None, leave: bool) -> None:
        super().__init__("reorder")
        self.choice, self.leave = choice, leave


class Handle:
    """What an ``_async`` call returns: pass it to `poll` or `synchronize` (Horovod's handle)."""

    __slots__ = ("_rt", "_name", "key", "_label", "_start", "_work", "_finish", "_result", "_done", "_error",
                 "_times", "_seen", "__weakref__")

    def __init__(self, rt: Runtime, name: str | None, key: int, label: str,
                 start: Callable[[], tuple[Work, Callable[[], Any]]]) -> None:
        self._rt, self._name, self.key, self._label, self._start = rt, name, key, label, start
        self._times = [timeline.now(), 0.0]
        self._work: Work | None = None
        self._finish: Callable[[], Any] | None = None
        self._result: Any = None
        self._done = False
        #: the caller saw it complete (``poll`` returned True): its name is free again
        self._seen = False
        self._error: BaseException | None = None

    @property
    def started(self) -> bool:
        return self._work is not None or self._error is not None

    def _launch(self) -> None:
        self._work, self._finish = self._start()
        self._times[1] = timeline.now()

    def _release(self) -> None:
        if self._name is None:
            return
        ref = self._rt.in_flight.get(self._name)
        if ref is not None and ref() is self:
            self._rt.in_flight.pop(self._name)

    def completed(self) -> bool:
        """Started and finished (or failed), whether or not anybody synchronized it yet."""
        return self._error is not None or (self._work is not None and self._work.is_completed())

    def poll(self) -> bool:
        if self._done:
            return True
        if not self.started:
            drive(self._rt, self, may_leave=True)
            if not self.started:
                return False
        self._seen = self.completed()
        return self._seen

    def wait(self) -> Any:
        if not self._done:
            try:
                if not self.started:
                    drive(self._rt, self, may_leave=False)
                if self._error is not None:
                    raise self._error
                assert self._work is not None and self._finish is not None
                self._work.wait()
                self._result = self._finish()
                timeline.record(self._name or self._label, self._label, self._times[0], self._times[1],
                                timeline.now())
            finally:
                self._done = True
                with self._rt.lock:
                    self._release()
                    self._rt.unfinished.discard(self)
        return self._result


def poll(handle: Handle) -> bool:
    """True when the collective behind ``handle`` has completed (``synchronize`` will not block)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"hvd.poll: expected a handle from an _async call, got {type(handle).__name__}")
    return handle.poll()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s collective and return its result (the tensor, or a tuple)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"hvd.synchronize: expected a handle from an _async call, got {type(handle).__name__}")
    return handle.wait()


def claim(rt: Runtime, name: str | None, what: str) -> None:
    """Refuse ``name`` while it is taken (Horovod's duplicate-name error, raised on this rank
    alone before anything is exchanged; see the module docstring for when a name is free)."""
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"{what}: name must be a str, got {type(name).__name__}")
    ref = rt.in_flight.get(name)
    if ref is None:
        return
    # the runtime keeps a handle alive while its collective runs; after that only its caller
    # (or the pending queue) does, so a live handle the caller has not seen complete is taken
    _prune(rt)
    held = ref()
    if held is not None and not held._seen:
        raise ValueError(
            "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
            f"tensor that is currently being processed ({name!r}). If you want to request another "
            "tensor, use a different tensor name (or synchronize the first one's handle)."
        )


def _prune(rt: Runtime) -> None:
    """Let go of the handles whose collective completed (their callers may still hold them)."""
    rt.unfinished = {h for h in rt.unfinished if not h.completed()}


def op_key(rt: Runtime, label: str, name: str | None) -> int:
    """What identifies a submission across ranks: its name, or for an unnamed one its kind and
    submission count (``allreduce.noname.3``)."""
    return zlib.crc32((name if name is not None else rt.auto_name(label)).encode())


def submit(rt: Runtime, name: str | None, label: str, what: str,
           start: Callable[[], tuple[Work, Callable[[], Any]]]) -> Handle:
    """Queue a collective (its ``start`` agrees and starts it) and try to start it now."""
    with rt.lock:
        claim(rt, name, what)
        h = Handle(rt, name, op_key(rt, label, name), label, start)
        if name is not None:
            rt.in_flight[name] = weakref.ref(h)
            if len(rt.unfinished) >= _PRUNE_AT:  # a job whose names never repeat: stay bounded
                _prune(rt)
            rt.unfinished.add(h)
        rt.pending.append(h)
        try:
            drive(rt, h, may_leave=True)
        except BaseException:
            h._release()
            raise
    return h


def drive(rt: Runtime, target: Handle, may_leave: bool) -> None:
    """Start this rank's pending collectives, oldest first, until ``target`` has started (or,
    ``may_leave``, until the ranks decide that it waits for a later call)."""
    with rt.lock:
        saved = rt.driving
        rt.driving = may_leave
        try:
            while not target.started:
                head = rt.pending[0]
                try:
                    head._launch()
                except Reorder as r:
                    if r.leave:
                        return
                    if r.choice is not None:
                        chosen = next(h for h in rt.pending if h.key == r.choice)
                        rt.pending.remove(chosen)
                        rt.pending.insert(0, chosen)
                    continue
                except Exception as exc:  # noqa: BLE001 - it belongs to that handle's caller
                    rt.pending.remove(head)
                    head._error = exc
                    if head is target:
                        raise
                    continue
                rt.pending.remove(head)
        finally:
            rt.driving = saved


def resolve(rt: Runtime, ag: Agreement, own_key: int | None = None) -> None:
    """Called with every agreement table before it is checked: when the active ranks' rows name
    different collectives, exchange pending lists and raise `Reorder` with what every rank
    decided (a pure function of the table and the lists); return when the rows agree on what
    runs, or when no order can match them (the check then raises the mismatch)."""
    active = ag.active
    if len(active) < 2 or len({(ag.rows[i][1], ag.rows[i][6]) for i in active}) == 1:
        return
    me = rt.comm.rank
    keys = [h.key for h in rt.pending] if rt.driving is not None else ([] if own_key is None else [own_key])
    if ag.rows[me][0] != ACTIVE:
        keys = []
    if len(keys) > MAX_PENDING:
        raise RuntimeError(f"hvd: {len(keys)} collectives are pending on rank {rt.ranks[me]} (at most "
                           f"{MAX_PENDING} can be matched by name); synchronize some of them first")
    row = torch.zeros(_WIDTH, dtype=torch.int64)
    row[0] = 1 if rt.driving else 0
    row[1] = len(keys)
    if keys:
        row[2 : 2 + len(keys)] = torch.tensor(keys, dtype=torch.int64)
    out = torch.empty(rt.comm.size * _WIDTH, dtype=torch.int64, device=rt.device)
    rt.comm.all_gather_flat(row.to(rt.device), out=out, agreed=True)
    table = out.view(rt.comm.size, _WIDTH).tolist()
    lists = {i: table[i][2 : 2 + table[i][1]] for i in active}
    common = set(lists[active[0]]).intersection(*(set(lists[i]) for i in active[1:]))
    if common:
        choice = next(k for k in lists[active[0]] if k in common)
        if all(lists[i] and lists[i][0] == choice for i in active):
            # every rank already tries that name first, yet the rows differ: the same name on
            # collectives of different kinds (allgather vs broadcast "n"); no order can match
            # them, so the check raises the mismatch on every rank (reordering would loop forever)
            return
        raise Reorder(choice, False)
    leavers = [i for i in active if table[i][0]]
    if leavers:
        raise Reorder(None, me in leavers)


def agree_in_order(rt: Runtime, row: tuple, what: str) -> Agreement:
    """Agree on ``row`` with the other ranks (the caller holds ``rt.lock``): while other ranks
    start pending named collectives first (`Reorder`), let them go ahead and agree again."""
    while True:
        ag = rt.speculator.agree(row).agreement
        if ag is None:  # pragma: no cover - only a slotted allreduce is ever predicted
            raise RuntimeError(f"{what}: agreed by prediction without data (a fleetlike bug)")
        rt.note_states([r[0] for r in ag.rows])
        try:
            resolve(rt, ag, row[6])
        except Reorder:
            continue
        return ag


def finish_in_turn(started: list[tuple[Work, Callable[[], torch.Tensor]]],
                   home: torch.device) -> Callable[[], list[torch.Tensor]]:
    """The finish of a grouped op: each member's work waited for and its result brought back to
    ``home`` (the caller's device), in the group's order."""
    def finish() -> list[torch.Tensor]:
        out = []
        for work, fin in started:
            work.wait()
            out.append(fin().to(home))
        return out

    return finish


"""Speculative agreement: a predicted allreduce carries its own agreement, no exchange first.

Every hvd collective agrees before it runs (`negotiate`): one small exchange of descriptors,
0.3-0.5 ms on loopback gloo, as long as a 1 MiB allreduce's data. Horovod hides its
negotiation with a response cache; fleetlike predicts instead, and lets the data confirm.

The prediction is a pure function of the agreed history, which every rank saw alike: after an
agreed descriptor D, the descriptor agreed next the last time D came. Training loops repeat, so
after one pass it names each call, on every rank the same. Every allreduce of up to
`SLOT_MAX_BYTES` (single or grouped, any reduction but Adasum, `slotted`) travels with one extra
element per rank, its *slot*, in a pooled buffer (a copy in and out). When
the prediction P is such an allreduce, *every* rank skips the exchange and runs an allreduce of
P's dtype, count (+ slots) and op at once: its own data when its call is P (slot: ``REAL``),
else a buffer of the reduction's identity (slot ``OTHER``, or ``JOINED`` from a rank inside
``hvd.join()``, whose identity is exactly its answer). Every other slot holds the identity, so
the reduced slots are each rank's code, whatever the op. So every rank enters the same backend
collective whatever it was called with (the backend never meets mismatched sizes), and the
slots decide alike everywhere:

- no ``OTHER`` and at least one ``REAL``: a *hit*; the reduced data is the call's result and a
  joined rank has answered;
- otherwise a *miss*: the allreduce is dropped (one wasted collective of P's size, when the
  pattern changes) and the ranks exchange descriptors as without prediction, so a disagreement
  raises `CollectiveMismatchError` with the per-rank table on every rank (a rank whose call was P
  is then in a disagreement), a joined rank answers, a call that is not P runs. The data travel
  in a buffer of their own, so a tensor reduced in place is untouched by a miss.

Larger allreduces would pay a copy in and out of the slotted buffer (more than the exchange, from
a few MiB). On a communicator with point-to-point messages (gloo) they are *coded rings* instead
(`fleetlike.comm.coded`, `carrier` `RING`): the caller's own tensor is reduced in place by a ring
whose reduce-scatter messages carry the codes beside the chunks; every rank knows every code
before any rank writes, and a miss (``hit`` false) writes nothing, so the in-place tensor is
untouched by a miss here too. Elsewhere (MPI, NCCL) they agree first.

First calls, changed calls and other collectives agree first, as before; with the same layout
(slots included; the same ring), so results are bit for bit those of a predicted call (`tests`).
A predicted call completes before it returns (its agreement is in its data): the ``_async``
forms of a predicted allreduce return a completed handle; so does an agreed coded ring (one at a
time per communicator).

Example (two ranks; from the second pass on each call is predicted and needs no exchange)::

    >>> for step in range(3):
    ...     hvd.allreduce_(grad, name="grad"); hvd.allreduce_(loss, name="loss")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.comm import Communicator, Work
from fleetlike.comm.coded import accept_all
from fleetlike.horovod.negotiate import (
    ACTIVE,
    DTYPES,
    JOINED,
    Agreement,
    Kind,
    allreduce_count,
    finish_exchange,
    signature,
    start_exchange,
)
from fleetlike.horovod.ops import OPS, ReduceOp, identity_value

__all__ = ["JOINED_CODE", "OTHER", "REAL", "RING", "SLOTS", "Pending", "Plan", "Round", "SlotBuffer", "Speculator",
           "carrier", "hit", "read_slots", "slotted"]

#: slot codes: this rank's call is not the prediction / it is inside hvd.join() / it is
OTHER, JOINED_CODE, REAL = 0, 1, 2
#: allreduces up to this many bytes of data travel with slots (and may be predicted); larger ones
#: agree first: the exchange (~0.4 ms) is small beside their data, while copying them into a
#: slotted buffer and back costs more than it saves (measured, docs/BENCHMARKS.md)
SLOT_MAX_BYTES = 2 << 20
#: how a predictable allreduce carries its agreement: slots after the data in a buffer of its own
#: (up to `SLOT_MAX_BYTES`), or the codes of a coded ring beside the caller's own data
#: (`fleetlike.comm.coded`: larger ones, on a communicator with point-to-point messages)
SLOTS, RING = "slots", "ring"
#: pooled slotted buffers per (dtype, count, device) at most (reuse skips page faults)
_POOL_PER_KEY = 2
#: predictions kept at most (a new name per step would grow them without end); cleared past it,
#: on every rank at the same agreement
_MAX_PREDICTIONS = 4096


def carrier(row: Sequence[int], ring: bool) -> str | None:
    """How the allreduce of ``row`` carries its agreement (and so may be predicted): `SLOTS` up
    to `SLOT_MAX_BYTES` of data, beyond that `RING` when ``ring`` (the communicator has
    point-to-point messages), else None (it agrees first). Only single or grouped allreduces of
    any op but Adasum, not of a bool tensor nor an integer Average, have one."""
    if row[1] not in (Kind.ALLREDUCE, Kind.GROUPED_ALLREDUCE) or not 0 <= row[3] < len(DTYPES):
        return None
    op, dtype = OPS[row[2]], DTYPES[row[3]]
    if op is ReduceOp.ADASUM or dtype is torch.bool:
        return None
    if not dtype.is_floating_point and op is ReduceOp.AVERAGE:
        return None
    if allreduce_count(row) * dtype.itemsize <= SLOT_MAX_BYTES:
        return SLOTS
    return RING if ring else None


def slotted(row: Sequence[int]) -> bool:
    """Whether the collective of ``row`` is an allreduce that travels with slots."""
    return carrier(row, False) == SLOTS


def hit(codes: Sequence[int]) -> bool:
    """Whether a predicted allreduce's codes confirm it: no rank called something else, and at
    least one called it (the others, if any, are inside ``hvd.join()``)."""
    return OTHER not in codes and REAL in codes


class Plan:
    """A descriptor row and what the agreement derives from it, computed once: its `signature`,
    its `carrier` (and so whether it is `slotted`), and then its op, dtype and element count. A
    repeated call reuses its plan (`Speculator.plan`), so a predicted call compares two
    signatures and nothing else. ``ring``: the communicator runs coded rings."""

    __slots__ = ("row", "sig", "carrier", "slotted", "op", "dtype", "count")

    def __init__(self, row: list[int], ring: bool = False) -> None:
        self.row = row
        self.sig = signature(row)
        self.carrier = carrier(row, ring)
        self.slotted = self.carrier == SLOTS
        known = self.carrier is not None
        self.op = OPS[row[2]] if known else None
        self.dtype = DTYPES[row[3]] if known else None
        self.count = allreduce_count(row) if known else 0


class SlotBuffer:
    """A buffer of ``numel`` data elements + one slot per rank, with both views made once (a
    `RING` plan's buffer has no slots: ``slots`` is empty, the codes travel beside the data)."""

    __slots__ = ("buf", "data", "slots", "numel")

    def __init__(self, buf: torch.Tensor, numel: int) -> None:
        self.buf, self.numel = buf, numel
        self.data, self.slots = buf[:numel], buf[numel:]


def read_slots(slots: torch.Tensor, op: ReduceOp, size: int) -> list[int]:
    """Every rank's code from the reduced slots (Average divided them by the size)."""
    vals = slots.tolist()
    if op is ReduceOp.AVERAGE:
        return [round(v * size) for v in vals]
    return [round(v) for v in vals]


@dataclasses.dataclass
class Round:
    """One agreement: the table (None when predicted) and who has joined."""

    agreement: Agreement | None
    states: list[int]
    #: the predicted allreduce ran this rank's data (``real.buf`` holds the result)
    done: bool = False
    #: a joined rank's identity answered the active ranks' predicted allreduce
    answered: bool = False


@dataclasses.dataclass
class Pending:
    """An agreement under way (`Speculator.begin`): ``work`` completes it (poll it; a coded
    ring's ``wait()`` returns the codes, a slotted allreduce's the buffer)."""

    work: Work
    plan: Plan
    real: SlotBuffer | None
    prediction: Plan | None = None
    buf: SlotBuffer | None = None
    table: torch.Tensor | None = None

    @property
    def row(self) -> list[int]:
        return self.plan.row


class Speculator:
    """The agreement history of one Horovod world. Not thread-safe on its own: every call runs
    under the runtime's lock."""

    def __init__(self, comm: Communicator, device: torch.device | None) -> None:
        self.comm = comm
        self.device = device or torch.device("cpu")
        #: large predictable allreduces run as coded rings (`fleetlike.comm.coded`); not on an
        #: elastic world, whose interrupt must fail a blocked collective at once (a ring's
        #: messages are waited whole)
        self.ring = comm.has_p2p and comm.size > 1 and comm.interrupt is None
        self._last: tuple[int, ...] | None = None
        self._next: dict[tuple[int, ...] | None, Plan | None] = {}
        #: the slotted plan predicted next (None: the next agreement exchanges)
        self._pred: Plan | None = None
        #: False: every collective agrees first (the path tests compare with). Set it on every
        #: rank alike, between collectives.
        self.enabled = True
        self._pool: dict[tuple[torch.dtype, int, torch.device], list[SlotBuffer]] = {}
        self._plans: dict[tuple[Any, ...], Plan] = {}
        #: the slots this rank writes, per (op, dtype, code): the identity, the code in its own
        self._slot_rows: dict[tuple[ReduceOp, torch.dtype, int], torch.Tensor] = {}
        #: predicted agreements confirmed / wasted (tests and benchmarks read them)
        self.hits = 0
        self.misses = 0

    def plan(self, key: tuple[Any, ...], make: Callable[[], list[int]]) -> Plan:
        """The plan of the descriptor ``make()`` builds, cached under ``key`` (every field that
        goes into the row), so that a repeated call builds none."""
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) >= _MAX_PREDICTIONS:
                self._plans.clear()
            got = self._plans[key] = self.make_plan(make())
        return got

    def make_plan(self, row: list[int]) -> Plan:
        """The `Plan` of ``row`` on this world (a coded ring for large allreduces where it can)."""
        return Plan(row, self.ring)

    def take(self, dtype: torch.dtype, count: int, device: torch.device, slots: bool = True) -> SlotBuffer:
        """A buffer of ``count`` elements + the slots (none when not ``slots``; pooled: `give` it
        back when consumed)."""
        total = count + self.comm.size if slots else count
        free = self._pool.get((dtype, total, device))
        if free:
            return free.pop()
        return SlotBuffer(torch.empty(total, dtype=dtype, device=device), count)

    def give(self, sb: SlotBuffer) -> None:
        """Return a buffer from `take` (its data no longer read)."""
        key = (sb.buf.dtype, sb.buf.numel(), sb.buf.device)
        free = self._pool.setdefault(key, [])
        if len(free) < _POOL_PER_KEY:
            free.append(sb)
        if len(self._pool) > 64:  # many sizes: start again rather than hold them all
            self._pool = {key: free}

    def start(self, sb: SlotBuffer, op: ReduceOp, code: int, ring: bool = False,
              accept: Callable[[list[int]], bool] = accept_all) -> Work:
        """Start the allreduce of ``sb`` carrying this rank's ``code``: as a coded ring when
        ``ring`` (written only if ``accept(codes)``; ``wait()`` returns the codes), else with the
        slots after the data filled (the identity, ``code`` in this rank's own: one copy of a row
        made once)."""
        if ring:
            return self.comm.all_reduce_coded_async(sb.buf, op, code, accept)
        key = (op, sb.buf.dtype, code)
        row = self._slot_rows.get(key)
        if row is None:
            row = torch.full((self.comm.size,), identity_value(op, sb.buf.dtype), dtype=sb.buf.dtype,
                             device=sb.buf.device)
            row[self.comm.rank] = code
            self._slot_rows[key] = row
        sb.slots.copy_(row)
        return self.comm.all_reduce_async(sb.buf, op, agreed=True)

    def prediction(self) -> list[int] | None:
        """The row every rank predicts for the next agreement, when it is a slotted allreduce."""
        pred = self._pred if self.enabled else None
        return None if pred is None else pred.row

    def begin(self, row: list[int] | Plan, real: SlotBuffer | None = None) -> Pending:
        """Start this rank's agreement on ``row`` (``real``: its slotted allreduce's data)."""
        plan = row if isinstance(row, Plan) else self.make_plan(row)
        pred = self._pred if self.enabled else None
        if pred is None:
            return self._begin_exchange(plan, real)
        state = plan.row[0]
        ring = pred.carrier == RING
        if real is not None and state == ACTIVE and plan.sig == pred.sig:
            buf, code = real, REAL
        else:
            buf = self.take(pred.dtype, pred.count, self.device, slots=not ring)
            buf.data.fill_(identity_value(pred.op, pred.dtype))
            code = JOINED_CODE if state == JOINED else OTHER
        return Pending(self.start(buf, pred.op, code, ring, hit), plan, real, pred, buf)

    def finish(self, pending: Pending) -> Round | Pending:
        """Wait for ``pending``: its `Round`, or after a missed prediction the exchange that
        follows (a new `Pending`; finish it in turn)."""
        pred = pending.prediction
        if pred is None:
            assert pending.table is not None
            ag = finish_exchange(pending.work, pending.table, self.comm.size)
            active = ag.active
            self._learn(self.make_plan(ag.rows[active[0]]) if active else None)
            return Round(ag, [r[0] for r in ag.rows])
        got = pending.work.wait()
        buf = pending.buf
        assert buf is not None
        codes = got if pred.carrier == RING else read_slots(buf.slots, pred.op, self.comm.size)
        if buf is not pending.real:
            self.give(buf)  # an identity buffer, done with
        if hit(codes):
            self.hits += 1
            self._learn(pred)
            joined = pending.plan.row[0] == JOINED
            if JOINED_CODE not in codes:
                return Round(None, [ACTIVE] * len(codes), done=not joined, answered=joined)
            states = [JOINED if c == JOINED_CODE else ACTIVE for c in codes]
            return Round(None, states, done=not joined, answered=joined)
        self.misses += 1
        return self._begin_exchange(pending.plan, pending.real)

    def agree(self, row: list[int] | Plan, real: SlotBuffer | None = None) -> Round:
        """`begin`, then `finish` until agreed (blocking)."""
        step: Round | Pending = self.begin(row, real)
        while isinstance(step, Pending):
            step = self.finish(step)
        return step

    def _begin_exchange(self, plan: Plan, real: SlotBuffer | None) -> Pending:
        work, table = start_exchange(self.comm, torch.tensor(plan.row, dtype=torch.int64), self.device)
        return Pending(work, plan, real, table=table)

    def _learn(self, plan: Plan | None) -> None:
        """``plan`` (the first active rank's; None: every rank had joined) came after the last
        agreed one; every rank learns the same, from the same table or slots. The prediction
        for the next agreement follows."""
        if len(self._next) >= _MAX_PREDICTIONS:
            self._next.clear()
        self._next[self._last] = plan
        self._last = plan.sig if plan is not None else (Kind.JOIN,)
        nxt = self._next.get(self._last)
        self._pred = nxt if nxt is not None and nxt.carrier is not None else None

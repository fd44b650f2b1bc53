"""``hvd.barrier()`` and ``hvd.join()``: ranks that ran out of data keep answering the others.

A joined rank loops on the agreement (`negotiate`; a predicted allreduce, `speculate`) marked
"joined": while some rank is
active it takes part in the collective the active ranks agreed on (an allreduce with the
identity of its reduction, zeros for Sum / Average / Adasum, or a DistributedOptimizer's buckets
on zeros); once every rank has joined, each returns the rank that joined last (the highest of
those that joined in the final round, as Horovod's coordinator reports it).

A DistributedOptimizer's reduction runs without an agreement until one shows a joined rank (its
first bucket carries a slot per rank, `fleetlike.horovod.optimizer`). So, besides its exchange,
a joined rank keeps one first bucket of zeros posted for each such optimizer, on that
optimizer's own communicators, and polls: when the active ranks start that optimizer's
reduction the posted bucket completes, the joined rank sends the other buckets of zeros, and
every rank reads the flags and agrees before that optimizer's later reductions. A completed
bucket is handled before a completed exchange: an exchange that came before it in the active
ranks' order needed nothing more from this rank (else they could not have gone on). When every
rank has joined, the answers still posted are the same on every rank and complete one another.
Such a posted answer waits for the active ranks' next reduction of that optimizer, or for the
end of the join, for at most the communicator's timeout (gloo; MPI waits without one).

Example:
    >>> for batch in my_uneven_shard: train_step(batch)
    >>> last = hvd.join()
"""

from __future__ import annotations

import time
from typing import Any

from fleetlike.comm import CompletedWork, Work
from fleetlike.horovod.adasum import check_adasum
from fleetlike.horovod.collectives import _agree, _reduce_start
from fleetlike.horovod.negotiate import JOINED, NOT_WITH_JOIN, Agreement, Kind, allreduce_count, check, descriptor
from fleetlike.horovod.ops import OP_NAMES, OPS, ReduceOp, identity
from fleetlike.horovod.order import Reorder, resolve, submit, synchronize
from fleetlike.horovod.process_sets import process_set_runtime
from fleetlike.horovod.runtime import Runtime, runtime
from fleetlike.horovod.speculate import JOINED_CODE, RING, SLOTS, Pending, Round, SlotBuffer, carrier

__all__ = ["barrier", "join"]


def barrier(process_set: Any = None) -> None:
    """Every rank (of ``process_set``) waits here until all have arrived."""
    rt = process_set_runtime(process_set, "hvd.barrier()")

    def start() -> tuple[Work, Any]:
        _agree(rt, Kind.BARRIER, None)
        return CompletedWork(None), lambda: None

    synchronize(submit(rt, None, "barrier", "hvd.barrier()", start))


def join(device: int = -1) -> int:
    """This rank ran out of data: answer the other ranks' allreduces (and DistributedOptimizer
    steps) with zeros until every rank has joined; return the rank that joined last."""
    rt = runtime("hvd.join()")
    with rt.lock:
        posted = [opt for opt in rt.optimizers.values() if opt.answers_from_flags]
        for opt in posted:
            opt.post_join_answer()
        while True:
            step: Round | Pending = rt.speculator.begin(descriptor(Kind.JOIN, state=JOINED))
            while isinstance(step, Pending):  # a predicted allreduce, then maybe the exchange
                posted = _answer_posted_until(step.work, posted)
                step = rt.speculator.finish(step)
            ag = step.agreement
            if ag is None:  # this rank's identity answered the active ranks' predicted allreduce
                rt.note_states(step.states)
                continue
            states = [r[0] for r in ag.rows]
            if all(s == JOINED for s in states):
                for opt in posted:  # every rank posted these: they complete one another
                    opt.settle_join()
                newly = [i for i in range(rt.comm.size) if i not in rt.joined_seen]
                rt.joined_seen = set()
                for opt in rt.optimizers.values():
                    opt.end_join()
                return max(newly) if newly else rt.comm.size - 1
            rt.note_states(states)
            try:
                resolve(rt, ag)
            except Reorder:
                continue  # the active ranks reorder their pending collectives: agree again
            if ag.kind(ag.active[0]) in NOT_WITH_JOIN:
                continue  # the active ranks raise Horovod's error; this rank keeps waiting
            check(ag, rt.comm, "hvd.join", OP_NAMES)
            _answer(rt, ag)


def _answer_posted_until(exchange_work: Work, posted: list[Any]) -> list[Any]:
    """Answer the optimizers' reductions whose posted first bucket completes, until the
    exchange completes; return the optimizers whose answer is still posted. Nothing here waits
    (each rank may see the completions in another order: waiting on one could deadlock)."""
    delay = 1e-5
    while True:
        moved = [opt.join_progress() for opt in posted]
        posted = [opt for opt in posted if opt.join_pending]
        if any(moved):
            delay = 1e-5
            continue
        if exchange_work.is_completed():
            return posted
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)  # an idle rank: poll often at first, then gently


def _answer(rt: Runtime, ag: Agreement) -> None:
    """A joined rank's part in the collective the active ranks agreed on."""
    i = ag.active[0]
    kind = ag.kind(i)
    if kind in (Kind.ALLREDUCE, Kind.GROUPED_ALLREDUCE):
        op = OPS[ag.op(i)]
        numel = allreduce_count(ag.rows[i])
        how = carrier(ag.rows[i], rt.speculator.ring)
        if how == SLOTS:  # the active ranks' buffer has a slot per rank after the data
            buf = identity(op, ag.dtype(i), numel + rt.comm.size, rt.device)
            rt.speculator.start(SlotBuffer(buf, numel), op, JOINED_CODE).wait()
            return
        if how == RING:  # the active ranks run a coded ring (codes beside the data)
            buf = identity(op, ag.dtype(i), numel, rt.device)
            rt.speculator.start(SlotBuffer(buf, numel), op, JOINED_CODE, ring=True).wait()
            return
        counts = [numel] + [0] * (ag.ntensors(i) - 1)
        if op is ReduceOp.ADASUM:
            check_adasum(rt.comm.size, ag.dtype(i))
        work, finish = _reduce_start(rt, identity(op, ag.dtype(i), numel, rt.device), op, 1.0, 1.0, counts)
        work.wait()
        finish()
    elif kind is Kind.OPTIMIZER:
        opt = rt.optimizers.get(ag.root(i))
        if opt is None:
            raise RuntimeError(f"hvd.join: the other ranks reduce the gradients of DistributedOptimizer "
                               f"#{ag.root(i)}, which this rank does not have; create the same optimizers on every rank")
        opt._answer_join()

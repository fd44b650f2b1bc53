"""``hvd.barrier()`` and ``hvd.join()``: ranks that ran out of data keep answering the others.

A joined rank loops on the agreement exchange (`negotiate`) marked "joined": while some rank is
active it takes part in the collective the active ranks agreed on (an allreduce with the
identity of its reduction, zeros for Sum / Average / Adasum, or a DistributedOptimizer's buckets
on zeros); once every rank has joined, each returns the rank that joined last (the highest of
those that joined in the final round, as Horovod's coordinator reports it).

Example:
    >>> for batch in my_uneven_shard: train_step(batch)
    >>> last = hvd.join()
"""

from __future__ import annotations

from typing import Any

from fleetlike.horovod.adasum import check_adasum
from fleetlike.horovod.collectives import OP_NAMES, OPS, _agree, _identity, _no_process_set, _reduce_start
from fleetlike.horovod.negotiate import ACTIVE, JOINED, Agreement, Kind, check, describe, exchange
from fleetlike.horovod.ops import ReduceOp
from fleetlike.horovod.runtime import Runtime, runtime

__all__ = ["barrier", "join"]


def barrier(process_set: Any = None) -> None:
    """Every rank waits here until all have arrived."""
    _no_process_set(process_set, "hvd.barrier")
    rt = runtime("hvd.barrier()")
    with rt.lock:
        _agree(rt, Kind.BARRIER, None)


def join(device: int = -1) -> int:
    """This rank ran out of data: answer the other ranks' allreduces (and DistributedOptimizer
    steps) with zeros until every rank has joined; return the rank that joined last."""
    rt = runtime("hvd.join()")
    with rt.lock:
        while True:
            before = rt.last_states
            ag = exchange(rt.comm, describe(Kind.JOIN, state=JOINED), rt.device)
            states = [r[0] for r in ag.rows]
            if all(s == JOINED for s in states):
                newly = [i for i in range(rt.comm.size) if before is None or before[i] == ACTIVE]
                rt.last_states = None
                return max(newly) if newly else rt.comm.size - 1
            rt.last_states = states
            check(ag, rt.comm, "hvd.join", OP_NAMES)
            _answer(rt, ag)


def _answer(rt: Runtime, ag: Agreement) -> None:
    """A joined rank's part in the collective the active ranks agreed on."""
    i = ag.active[0]
    kind = ag.kind(i)
    if kind in (Kind.ALLREDUCE, Kind.GROUPED_ALLREDUCE):
        op = OPS[ag.op(i)]
        numel = ag.numel(i) if kind is Kind.ALLREDUCE else ag.shape(i)[0]
        counts = [numel] + [0] * (ag.ntensors(i) - 1)
        if op is ReduceOp.ADASUM:
            check_adasum(rt.comm.size, ag.dtype(i))
        work, finish = _reduce_start(rt, _identity(op, ag.dtype(i), numel, rt.device), op, 1.0, 1.0, counts)
        work.wait()
        finish()
    elif kind is Kind.OPTIMIZER:
        opt = rt.optimizers.get(ag.root(i))
        if opt is None:
            raise RuntimeError(f"hvd.join: the other ranks reduce the gradients of DistributedOptimizer "
                               f"#{ag.root(i)}, which this rank does not have; create the same optimizers on every rank")
        opt._answer_join()

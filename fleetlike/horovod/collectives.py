"""Horovod's tensor collectives on fleetlike's communicators: allreduce (and grouped), allgather,
broadcast, alltoall, reducescatter, barrier, join, with Horovod's in-place ``_`` and ``_async``
forms, ``poll`` and ``synchronize``.

Every call first agrees with the other ranks (`negotiate`: shapes, dtypes, ops, names, and who
has joined), then starts the data collective with ``agreed=True``. The async forms return a
`Handle` once the data collective is started; ``synchronize(handle)`` waits and returns the
result, exactly what the blocking form returns (the blocking form is async + synchronize).

Semantics follow ``horovod/torch/mpi_ops.py``: ``op`` (default Average) or the deprecated
``average``; ``prescale_factor`` / ``postscale_factor`` multiply before and after the
reduction; ``compression`` (non-in-place forms) casts on the wire; allgather concatenates along
the first dimension, which may differ between ranks; alltoall sends ``splits[i]`` first-dimension
slices to rank i and, given ``splits``, also returns the received splits; reducescatter splits the
first dimension over ranks (the first ``dim0 % size`` ranks get one row more; Average and Sum
only). A name given to a collective still in flight raises, as in Horovod. Ranks that called
``join()`` answer allreduces with the identity of the reduction (zeros for Sum, Average, Adasum),
and ``join`` returns the last rank to join.

The functions are autograd-aware as Horovod's (allreduce's gradient is the allreduce of the
gradient; allgather's the averaged slice; broadcast's the averaged gradient on the root).

Example:
    >>> h = hvd.allreduce_async(torch.ones(4), name="x", op=hvd.Sum)
    >>> hvd.poll(h)            # True once done
    >>> hvd.synchronize(h)     # tensor([2., 2., 2., 2.]) on two ranks
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.comm import CompletedWork, Work
from fleetlike.horovod.adasum import adasum_allreduce_, adasum_comms, check_adasum
from fleetlike.horovod.negotiate import ACTIVE, JOINED, Agreement, Kind, check, describe, exchange
from fleetlike.horovod.ops import Compression, Compressor, ReduceOp, resolve_op
from fleetlike.horovod.runtime import Runtime, runtime

__all__ = [
    "Handle",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "synchronize",
]

OPS: tuple[ReduceOp, ...] = tuple(ReduceOp)
OP_NAMES = tuple(o.value for o in OPS)
_COMM_OP = {ReduceOp.AVERAGE: "avg", ReduceOp.SUM: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
            ReduceOp.PRODUCT: "prod"}


class Handle:
    """What an ``_async`` call returns: pass it to `poll` or `synchronize` (Horovod's handle)."""

    __slots__ = ("_rt", "_name", "_work", "_finish", "_result", "_done")

    def __init__(self, rt: Runtime, name: str | None, work: Work, finish: Callable[[], Any]) -> None:
        self._rt, self._name, self._work, self._finish = rt, name, work, finish
        self._result: Any = None
        self._done = False

    def poll(self) -> bool:
        return self._done or self._work.is_completed()

    def wait(self) -> Any:
        if not self._done:
            try:
                self._work.wait()
                self._result = self._finish()
            finally:
                self._done = True
                if self._name is not None:
                    with self._rt.lock:
                        self._rt.in_flight.pop(self._name, None)
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


# ------------------------------------------------------------------------------ agreement


def _claim(rt: Runtime, name: str | None, what: str) -> None:
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"{what}: name must be a str, got {type(name).__name__}")
    if name in rt.in_flight:
        raise ValueError(
            "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
            f"tensor that is currently being processed ({name!r}). If you want to request another "
            "tensor, use a different tensor name (or synchronize the first one's handle)."
        )
    rt.in_flight[name] = True


def _agree(rt: Runtime, kind: Kind, name: str | None, **fields: Any) -> Agreement:
    """Exchange descriptors, answer nothing (active rank), raise on disagreement."""
    ag = exchange(rt.comm, describe(kind, name=name or "", **fields))
    rt.last_states = [r[0] for r in ag.rows]
    try:
        check(ag, rt.comm, f"hvd.{kind.label}", OP_NAMES)
    except Exception:
        if name is not None:
            rt.in_flight.pop(name, None)
        raise
    return ag


def _tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _identity(op: ReduceOp, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """What a joined rank contributes: the identity of ``op`` (zeros for Sum/Average/Adasum)."""
    if op is ReduceOp.PRODUCT:
        return torch.ones(numel, dtype=dtype)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        return torch.full((numel,), info.max if op is ReduceOp.MIN else info.min, dtype=dtype)
    return torch.zeros(numel, dtype=dtype)


def _reduce_start(rt: Runtime, buf: torch.Tensor, op: ReduceOp, pre: float, post: float,
                  counts: Sequence[int]) -> tuple[Work, Callable[[], torch.Tensor]]:
    """Start reducing ``buf`` in place over the Horovod world (agreement already done)."""
    if pre != 1.0:
        buf.mul_(pre)
    if op is ReduceOp.ADASUM:
        if rt.adasum_comms is None:
            rt.adasum_comms = adasum_comms(rt.comm)
            rt.own_comms.extend(c for pair in rt.adasum_comms for c in pair if c is not rt.comm)
        flat = buf if buf.is_contiguous() else buf.contiguous()
        adasum_allreduce_(flat.view(-1), counts, rt.comm, rt.adasum_comms)
        if flat is not buf:
            buf.copy_(flat)
        work: Work = CompletedWork(buf)
    else:
        work = rt.comm.all_reduce_async(buf, _COMM_OP[op], agreed=True)

    def finish() -> torch.Tensor:
        if post != 1.0:
            buf.mul_(post)
        return buf

    return work, finish


def _allreduce_in_place(tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float,
                        what: str) -> Handle:
    rt = runtime(what)
    _tensor(tensor, what)
    with rt.lock:
        _claim(rt, name, what)
        _agree(rt, Kind.ALLREDUCE, name, op=OPS.index(op), dtype=tensor.dtype, shape=tuple(tensor.shape))
        if op is ReduceOp.ADASUM:
            check_adasum(rt.comm.size, tensor.dtype)
        work, finish = _reduce_start(rt, tensor, op, pre, post, [tensor.numel()])
    return Handle(rt, name, work, finish)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing ``tensor`` in place over all ranks; returns a handle."""
    _no_process_set(process_set, "hvd.allreduce_async_")
    return _allreduce_in_place(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                               "hvd.allreduce_async_")


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over all ranks and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing a copy of ``tensor``; ``synchronize`` returns the reduced copy."""
    _no_process_set(process_set, "hvd.allreduce_async")
    out = _tensor(tensor, "hvd.allreduce_async").detach().clone()
    return _allreduce_in_place(out, name, resolve_op(op, average), prescale_factor, postscale_factor,
                               "hvd.allreduce_async")


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(allreduce_async(tensor, None, name, op, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post), None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] | Compressor = Compression.none, op: ReduceOp | str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """The reduction of ``tensor`` over all ranks (a new tensor; ``tensor`` is unchanged).

    Example:
        >>> hvd.allreduce(torch.tensor([hvd.rank()], dtype=torch.float32))   # the mean rank
    """
    _no_process_set(process_set, "hvd.allreduce")
    red = resolve_op(op, average)
    compressed, ctx = compression.compress(_tensor(tensor, "hvd.allreduce"))
    out = _AllreduceFn.apply(compressed, name, red, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


# ------------------------------------------------------------------------------ grouped


def _grouped_in_place(tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp, pre: float, post: float,
                      what: str) -> Handle:
    rt = runtime(what)
    tensors = [_tensor(t, what) for t in tensors]
    if not tensors:
        raise ValueError(f"{what}: the list of tensors is empty")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"{what}: the tensors of one group must share a dtype; got {sorted(map(str, dtypes))}. "
                        "Group them by dtype (one call per dtype)")
    counts = [t.numel() for t in tensors]
    shapes_crc = zlib.crc32(repr([tuple(t.shape) for t in tensors]).encode()) & 0x7FFFFFFF
    with rt.lock:
        _claim(rt, name, what)
        _agree(rt, Kind.GROUPED_ALLREDUCE, name, op=OPS.index(op), dtype=tensors[0].dtype,
               ntensors=len(tensors), shape=(sum(counts), shapes_crc))
        if op is ReduceOp.ADASUM:
            check_adasum(rt.comm.size, tensors[0].dtype)
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        work, finish_flat = _reduce_start(rt, flat, op, pre, post, counts)

    def finish() -> list[torch.Tensor]:
        done = finish_flat()
        offset = 0
        with torch.no_grad():
            for t, c in zip(tensors, counts):
                t.copy_(done[offset : offset + c].view_as(t))
                offset += c
        return list(tensors)

    return Handle(rt, name, work, finish)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing every tensor of the list in place, fused into one buffer (one collective)."""
    _no_process_set(process_set, "hvd.grouped_allreduce_async_")
    return _grouped_in_place(tensors, name, resolve_op(op, average), prescale_factor, postscale_factor,
                             "hvd.grouped_allreduce_async_")


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None) -> list[torch.Tensor]:
    """Reduce every tensor of the list in place, in one fused collective."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing copies of the tensors, fused; ``synchronize`` returns the list of results."""
    _no_process_set(process_set, "hvd.grouped_allreduce_async")
    copies = [_tensor(t, "hvd.grouped_allreduce_async").detach().clone() for t in tensors]
    return _grouped_in_place(copies, name, resolve_op(op, average), prescale_factor, postscale_factor,
                             "hvd.grouped_allreduce_async")


class _GroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post)
        return (None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] | Compressor = Compression.none,
                      op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> list[torch.Tensor]:
    """Reductions of every tensor of the list (new tensors), fused into one collective."""
    _no_process_set(process_set, "hvd.grouped_allreduce")
    pairs = [compression.compress(_tensor(t, "hvd.grouped_allreduce")) for t in tensors]
    outs = _GroupedFn.apply(name, resolve_op(op, average), prescale_factor, postscale_factor, *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# ------------------------------------------------------------------------------ allgather


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> Handle:
    """Start gathering every rank's ``tensor`` along the first dimension (sizes may differ)."""
    what = "hvd.allgather_async"
    _no_process_set(process_set, what)
    rt = runtime(what)
    t = _tensor(tensor, what).detach()
    if t.dim() == 0:
        t = t.reshape(1)
    with rt.lock:
        _claim(rt, name, what)
        ag = _agree(rt, Kind.ALLGATHER, name, dtype=t.dtype, shape=tuple(t.shape))
        rows = [ag.shape(i)[0] for i in range(rt.comm.size)]
        trailing = tuple(t.shape[1:])
        per_row = int(torch.Size(trailing).numel())
        width = max(rows) * per_row
        chunk = torch.zeros(width, dtype=t.dtype, device=t.device)
        chunk[: t.numel()] = t.reshape(-1)
        flat = torch.empty(width * rt.comm.size, dtype=t.dtype, device=t.device)
        work = rt.comm.all_gather_flat_async(chunk, out=flat, agreed=True)

    def finish() -> torch.Tensor:
        parts = flat.view(rt.comm.size, width)
        return torch.cat([parts[i, : rows[i] * per_row] for i in range(rt.comm.size)]).view(sum(rows), *trailing)

    return Handle(rt, name, work, finish)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=ReduceOp.AVERAGE)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64))
        offset = int(dims[: rank_of_runtime()].sum())
        return reduced.narrow(0, offset, ctx.dim), None


def rank_of_runtime() -> int:
    return runtime("hvd").comm.rank


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ).

    Example:
        >>> hvd.allgather(torch.arange(hvd.rank() + 1))   # on 2 ranks: tensor([0, 0, 1])
    """
    _no_process_set(process_set, "hvd.allgather")
    return _AllgatherFn.apply(_tensor(tensor, "hvd.allgather"), name)


# ------------------------------------------------------------------------------ broadcast


def _broadcast_in_place(tensor: torch.Tensor, root_rank: int, name: str | None, what: str) -> Handle:
    rt = runtime(what)
    _tensor(tensor, what)
    with rt.lock:
        _claim(rt, name, what)
        _agree(rt, Kind.BROADCAST, name, dtype=tensor.dtype, root=int(root_rank), shape=tuple(tensor.shape))
        if not 0 <= int(root_rank) < rt.comm.size:
            rt.in_flight.pop(name or "", None)
            raise ValueError(f"{what}: root_rank={root_rank} is not a rank of this job (0..{rt.comm.size - 1})")
        buf = tensor.data
        work = rt.comm.broadcast_async(buf, int(root_rank), agreed=True)
    return Handle(rt, name, work, lambda: tensor)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place."""
    _no_process_set(process_set, "hvd.broadcast_async_")
    return _broadcast_in_place(tensor, root_rank, name, "hvd.broadcast_async_")


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Handle:
    """Start broadcasting a copy of ``tensor`` from ``root_rank``."""
    _no_process_set(process_set, "hvd.broadcast_async")
    out = _tensor(tensor, "hvd.broadcast_async").detach().clone()
    return _broadcast_in_place(out, root_rank, name, "hvd.broadcast_async")


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None) -> torch.Tensor:
        ctx.root = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=ReduceOp.AVERAGE)
        if rank_of_runtime() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    _no_process_set(process_set, "hvd.broadcast")
    return _BroadcastFn.apply(_tensor(tensor, "hvd.broadcast"), root_rank, name)


# ------------------------------------------------------------------------------ alltoall


def _splits_list(splits: Any, dim0: int, size: int, what: str) -> list[int]:
    if splits is None:
        if dim0 % size:
            raise ValueError(f"{what}: without splits the first dimension ({dim0}) must divide evenly "
                             f"over {size} ranks; pass splits=[rows for rank 0, rank 1, ...]")
        return [dim0 // size] * size
    values = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != size or any(s < 0 for s in values) or sum(values) != dim0:
        raise ValueError(f"{what}: splits={values} must hold {size} non-negative row counts summing to "
                         f"the first dimension {dim0}")
    return values


def _alltoall_data(rt: Runtime, t: torch.Tensor, out: torch.Tensor, matrix: list[list[int]], per_row: int) -> Work:
    """Move the rows: ``matrix[i][j]`` rows go from rank i to rank j (agreed by every rank)."""
    comm = rt.comm
    n, me = comm.size, comm.rank
    send = [matrix[me][j] * per_row for j in range(n)]
    recv = [matrix[j][me] * per_row for j in range(n)]
    src = t.reshape(-1).contiguous()
    pg = getattr(comm, "process_group", None) if comm.backend == "gloo" else None
    if pg is not None:  # gloo's own all-to-all
        return pg.alltoall_base(out.view(-1), src, recv, send)
    mpi = getattr(comm, "mpi_comm", None) if comm.backend == "mpi" else None
    if mpi is not None and src.dtype not in (torch.bfloat16,):
        # MPI's Alltoallv on raw bytes (every dtype moves; nothing is reduced)
        size = src.element_size()
        sb = [c * size for c in send]
        rb = [c * size for c in recv]
        mpi.Alltoallv([src.view(torch.uint8).numpy(), (sb, _offsets(sb))],
                      [out.view(-1).view(torch.uint8).numpy(), (rb, _offsets(rb))])
        return CompletedWork(out)
    # other backends: every rank gathers every rank's padded rows and keeps what is sent to it
    widest = max(sum(row) for row in matrix) * per_row
    chunk = torch.zeros(widest, dtype=t.dtype, device=t.device)
    chunk[: src.numel()] = src
    everything = comm.all_gather_flat(chunk, agreed=True).view(n, widest)
    flat_out, at = out.view(-1), 0
    for j in range(n):
        start = sum(matrix[j][:me]) * per_row
        flat_out[at : at + recv[j]] = everything[j, start : start + recv[j]]
        at += recv[j]
    return CompletedWork(out)


def _offsets(counts: list[int]) -> list[int]:
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` to rank i; ``synchronize`` returns the rows
    received (in rank order) and, when ``splits`` was given, the received splits."""
    what = "hvd.alltoall_async"
    _no_process_set(process_set, what)
    rt = runtime(what)
    t = _tensor(tensor, what).detach()
    if t.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension to split")
    n = rt.comm.size
    send = _splits_list(splits, t.shape[0], n, what)
    with rt.lock:
        _claim(rt, name, what)
        _agree(rt, Kind.ALLTOALL, name, dtype=t.dtype, shape=tuple(t.shape))
        matrix = rt.comm.all_gather_flat(torch.tensor(send, dtype=torch.int64), agreed=True).view(n, n).tolist()
        recv = [matrix[j][rt.comm.rank] for j in range(n)]
        trailing = tuple(t.shape[1:])
        per_row = int(torch.Size(trailing).numel())
        out = torch.empty((sum(recv), *trailing), dtype=t.dtype, device=t.device)
        work = _alltoall_data(rt, t, out, matrix, per_row)
    if isinstance(splits, torch.Tensor):
        received = torch.tensor(recv, dtype=splits.dtype)
    else:
        received = torch.tensor(recv, dtype=torch.int32)
    return Handle(rt, name, work, lambda: (out, received))


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        back, _ = alltoall(grad, splits=ctx.received)
        return back, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Scatter slices of ``tensor`` to every rank and gather theirs (Horovod's alltoall).

    Returns the received rows; with ``splits`` also the number of rows received from each rank.

    Example:
        >>> out, got = hvd.alltoall(torch.arange(3.0), splits=[1, 2])   # rank 0 of 2 keeps 1 row
    """
    _no_process_set(process_set, "hvd.alltoall")
    out, received = _AlltoallFn.apply(_tensor(tensor, "hvd.alltoall"), splits, name)
    return out if splits is None else (out, received)


# ------------------------------------------------------------------------------ reducescatter


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | str = ReduceOp.AVERAGE,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` over all ranks, keeping this rank's rows of the first dimension."""
    what = "hvd.reducescatter_async"
    _no_process_set(process_set, what)
    red = ReduceOp.parse(op)
    if red not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"{what}: Reducescatter currently only supports AVERAGE and SUM (got op={red.value!r})")
    rt = runtime(what)
    t = _tensor(tensor, what).detach()
    if t.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension to scatter")
    n, me = rt.comm.size, rt.comm.rank
    dim0 = t.shape[0]
    rows = [dim0 // n + (1 if r < dim0 % n else 0) for r in range(n)]
    trailing = tuple(t.shape[1:])
    per_row = int(torch.Size(trailing).numel())
    widest = max(rows) * per_row
    with rt.lock:
        _claim(rt, name, what)
        _agree(rt, Kind.REDUCESCATTER, name, op=OPS.index(red), dtype=t.dtype, shape=tuple(t.shape))
        padded = torch.zeros(n, widest, dtype=t.dtype, device=t.device)
        flat, start = t.reshape(-1), 0
        for r in range(n):
            padded[r, : rows[r] * per_row] = flat[start : start + rows[r] * per_row]
            start += rows[r] * per_row
        if prescale_factor != 1.0:
            padded.mul_(prescale_factor)
        mine = torch.empty(widest, dtype=t.dtype, device=t.device)
        work = rt.comm.reduce_scatter_async(padded.view(-1), _COMM_OP[red], out=mine, agreed=True)

    def finish() -> torch.Tensor:
        out = mine[: rows[me] * per_row].view(rows[me], *trailing)
        if postscale_factor != 1.0:
            out.mul_(postscale_factor)
        return out

    return Handle(rt, name, work, finish)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float) -> torch.Tensor:
        ctx.op, ctx.scale = op, pre * post
        return synchronize(reducescatter_async(tensor, name, op, None, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g = grad * ctx.scale
        if ctx.op is ReduceOp.SUM:
            g = g * runtime("hvd").comm.size
        return allgather(g), None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] | Compressor = Compression.none,
                  op: ReduceOp | str = ReduceOp.AVERAGE, process_set: Any = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of the reduction of ``tensor`` over all ranks (first ``dim0 % size``
    ranks get one row more)."""
    _no_process_set(process_set, "hvd.reducescatter")
    compressed, ctx = compression.compress(_tensor(tensor, "hvd.reducescatter"))
    out = _ReducescatterFn.apply(compressed, name, ReduceOp.parse(op), prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


# ------------------------------------------------------------------------------ barrier, join


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
            ag = exchange(rt.comm, describe(Kind.JOIN, state=JOINED))
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
        work, finish = _reduce_start(rt, _identity(op, ag.dtype(i), numel), op, 1.0, 1.0, counts)
        work.wait()
        finish()
    elif kind is Kind.OPTIMIZER:
        opt = rt.optimizers.get(ag.root(i))
        if opt is None:
            raise RuntimeError(f"hvd.join: the other ranks reduce the gradients of DistributedOptimizer "
                               f"#{ag.root(i)}, which this rank does not have; create the same optimizers on every rank")
        opt._answer_join()


def _no_process_set(process_set: Any, what: str) -> None:
    if process_set is not None:
        raise ValueError(f"{what}: process_set={process_set!r}: fleetlike's Horovod face has only the global "
                         "process set (use hvd.init(comm=[ranks]) for a subset)")

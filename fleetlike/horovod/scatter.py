"""Horovod's alltoall and reducescatter (async forms, autograd) on fleetlike's communicators.

alltoall sends ``splits[i]`` first-dimension rows to rank i (equal shares without ``splits``) and,
given ``splits``, also returns how many rows came from each rank; after the agreement the ranks
all-gather their splits, then the rows move with gloo's own all-to-all, MPI's ``Alltoallv``, or
(other backends) a padded all-gather from which each rank keeps its rows. reducescatter reduces
over all ranks and leaves each rank its rows of the first dimension (the first ``dim0 % size``
ranks one more, as Horovod), Average or Sum.

Example:
    >>> out, got = hvd.alltoall(torch.arange(3.0), splits=[1, 2])   # rank 0 of 2 keeps 1 row
    >>> hvd.reducescatter(torch.ones(4, 2), op=hvd.Sum)             # 2 rows of 2.0 on each of 2
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch


from fleetlike.comm import CompletedWork, Work
from fleetlike.horovod.collectives import _agree, _tensor, comm_device
from fleetlike.horovod.gather import allgather, grouped_allgather
from fleetlike.horovod.negotiate import HorovodInternalError, Kind
from fleetlike.horovod.ops import OPS, Compression, Compressor, ReduceOp, op_name, parse_op
from fleetlike.horovod.order import Handle, finish_in_turn, submit, synchronize
from fleetlike.horovod.process_sets import process_set_runtime
from fleetlike.horovod.runtime import Runtime
from fleetlike.horovod.wire import as_bytes, moves_natively, reduce_dtype, scale_

__all__ = ["ReducescatterOpError", "alltoall", "alltoall_async", "grouped_reducescatter", "grouped_reducescatter_async", "reducescatter",
           "reducescatter_async"]


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
    if not moves_natively(t.dtype):  # the backends' all-to-all lack it: move the bytes
        per_row *= t.element_size()
        t, out = as_bytes(t), as_bytes(out)
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
    received (in rank order) and how many rows came from each rank."""
    what = "hvd.alltoall_async"
    rt = process_set_runtime(process_set, what)
    t = _tensor(tensor, what).detach()
    if t.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension to split")
    n = rt.comm.size
    send = _splits_list(splits, t.shape[0], n, what)
    home, t = t.device, t.to(comm_device(rt, t)).contiguous()
    split_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def start() -> tuple[Work, Callable[[], Any]]:
        _agree(rt, Kind.ALLTOALL, name, dtype=t.dtype, shape=tuple(t.shape))
        mine = torch.tensor(send, dtype=torch.int64, device=t.device)
        matrix = rt.comm.all_gather_flat(mine, agreed=True).view(n, n).tolist()
        recv = [matrix[j][rt.comm.rank] for j in range(n)]
        trailing = tuple(t.shape[1:])
        per_row = int(torch.Size(trailing).numel())
        out = torch.empty((sum(recv), *trailing), dtype=t.dtype, device=t.device)
        work = _alltoall_data(rt, t, out, matrix, per_row)
        return work, lambda: (out.to(home), torch.tensor(recv, dtype=split_dtype))

    return submit(rt, name, "alltoall", what, start)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None) -> Any:
    """Scatter slices of ``tensor`` to every rank and gather theirs (Horovod's alltoall).

    Returns the received rows; with ``splits`` also the number of rows received from each rank.

    Example:
        >>> out, got = hvd.alltoall(torch.arange(3.0), splits=[1, 2])   # rank 0 of 2 keeps 1 row
    """
    out, received = _AlltoallFn.apply(_tensor(tensor, "hvd.alltoall"), splits, name, process_set)
    return out if splits is None else (out, received)


# ------------------------------------------------------------------------------ reducescatter


class ReducescatterOpError(HorovodInternalError, ValueError):
    """A reduction reducescatter does not do: a bad argument (ValueError), raised as Horovod's
    core refuses it when the collective is enqueued (a RuntimeError, HorovodInternalError)."""


def _reducescatter_op(op: ReduceOp | str, what: str) -> ReduceOp:
    red = parse_op(op)
    if red not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ReducescatterOpError(f"{what}: Reducescatter currently only supports AVERAGE and SUM "
                                   f"(got op={op_name(red)!r})")
    return red


def _scatter_one(rt: Runtime, t: torch.Tensor, red: ReduceOp, pre: float,
                 post: float) -> tuple[Work, Callable[[], torch.Tensor]]:
    """Start reduce-scattering ``t`` (agreed already): this rank's rows of the reduction."""
    n, me = rt.comm.size, rt.comm.rank
    dim0 = t.shape[0]
    rows = [dim0 // n + (1 if r < dim0 % n else 0) for r in range(n)]
    trailing = tuple(t.shape[1:])
    per_row = int(torch.Size(trailing).numel())
    widest = max(rows) * per_row
    wire = reduce_dtype(t.dtype)
    padded = torch.zeros(n, widest, dtype=wire, device=t.device)
    flat, start = t.reshape(-1), 0
    for r in range(n):
        padded[r, : rows[r] * per_row] = flat[start : start + rows[r] * per_row]
        start += rows[r] * per_row
    scale_(padded, pre)
    comm_op = red
    if red is ReduceOp.AVERAGE and not wire.is_floating_point:  # Horovod's: sum, 1/size truncated
        comm_op, post = "sum", post / n
    mine = torch.empty(max(widest, 1), dtype=wire, device=t.device)
    work = rt.comm.reduce_scatter_async(padded.view(-1), comm_op, out=mine[:widest], agreed=True)

    def finish() -> torch.Tensor:
        out = scale_(mine[: rows[me] * per_row], post).view(rows[me], *trailing)
        return out if wire == t.dtype else out.to(t.dtype)

    return work, finish


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | str = ReduceOp.AVERAGE,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` over the ranks, keeping this rank's rows of the first dimension."""
    what = "hvd.reducescatter_async"
    red = _reducescatter_op(op, what)
    rt = process_set_runtime(process_set, what)
    t = _tensor(tensor, what).detach()
    if t.dim() == 0:
        raise ValueError(f"{what}: the tensor needs at least one dimension to scatter")
    home, t = t.device, t.to(comm_device(rt, t))

    def start() -> tuple[Work, Callable[[], torch.Tensor]]:
        _agree(rt, Kind.REDUCESCATTER, name, op=OPS.index(red), dtype=t.dtype, shape=tuple(t.shape))
        work, finish = _scatter_one(rt, t, red, prescale_factor, postscale_factor)
        return work, lambda: finish().to(home)

    return submit(rt, name, "reducescatter", what, start)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: Any) -> torch.Tensor:
        ctx.op, ctx.scale, ctx.process_set = op, pre * post, process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g = grad * ctx.scale
        if ctx.op is ReduceOp.SUM:
            g = g * process_set_runtime(ctx.process_set, "hvd.reducescatter").comm.size
        return allgather(g, process_set=ctx.process_set), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] | Compressor = Compression.none,
                  op: ReduceOp | str = ReduceOp.AVERAGE, process_set: Any = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of the reduction of ``tensor`` over the ranks (first ``dim0 % size``
    ranks get one row more)."""
    red = _reducescatter_op(op, "hvd.reducescatter")
    compressed, ctx = compression.compress(_tensor(tensor, "hvd.reducescatter"))
    out = _ReducescatterFn.apply(compressed, name, red, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | str = ReduceOp.AVERAGE, process_set: Any = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start `reducescatter_async` of each tensor of the list, agreed once for the group."""
    what = "hvd.grouped_reducescatter_async"
    red = _reducescatter_op(op, what)
    rt = process_set_runtime(process_set, what)
    ts = [_tensor(t, what).detach() for t in tensors]
    if not ts:
        raise ValueError(f"{what}: the list of tensors is empty")
    if any(t.dim() == 0 for t in ts):
        raise ValueError(f"{what}: every tensor needs at least one dimension to scatter")
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise TypeError(f"{what}: the tensors of one group must share a dtype; got {sorted(map(str, dtypes))}")
    home = ts[0].device
    ts = [t.to(comm_device(rt, t)) for t in ts]
    shapes = [tuple(t.shape) for t in ts]
    crc = zlib.crc32(repr(shapes).encode()) & 0x7FFFFFFF

    def start() -> tuple[Work, Callable[[], list[torch.Tensor]]]:
        _agree(rt, Kind.GROUPED_REDUCESCATTER, name, op=OPS.index(red), dtype=ts[0].dtype, ntensors=len(ts),
               shape=(sum(t.numel() for t in ts), crc))
        started = [_scatter_one(rt, t, red, prescale_factor, postscale_factor) for t in ts]
        return CompletedWork(None), finish_in_turn(started, home)

    return submit(rt, name, "grouped_reducescatter", what, start)


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, process_set: Any,
                *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.scale, ctx.process_set = op, pre * post, process_set
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        scale = ctx.scale
        if ctx.op is ReduceOp.SUM:
            scale *= process_set_runtime(ctx.process_set, "hvd.grouped_reducescatter").comm.size
        gathered = grouped_allgather([g * scale for g in grads], process_set=ctx.process_set)
        return (None, None, None, None, None, *gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] | Compressor = Compression.none,
                          op: ReduceOp | str = ReduceOp.AVERAGE, process_set: Any = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """`reducescatter` of each tensor of the list, agreed once for the group."""
    red = _reducescatter_op(op, "hvd.grouped_reducescatter")
    pairs = [compression.compress(_tensor(t, "hvd.grouped_reducescatter")) for t in tensors]
    outs = _GroupedReducescatterFn.apply(name, red, prescale_factor, postscale_factor, process_set,
                                         *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]

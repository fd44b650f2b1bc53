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

from typing import Any

import torch

from fleetlike.comm import CompletedWork, Work
from fleetlike.horovod.collectives import (
    Handle,
    _agree,
    _claim,
    _no_process_set,
    _tensor,
    comm_device,
    allgather,
    synchronize,
)
from fleetlike.horovod.negotiate import Kind
from fleetlike.horovod.ops import COMM_OP, OPS, Compression, Compressor, ReduceOp
from fleetlike.horovod.runtime import Runtime, runtime

__all__ = ["alltoall", "alltoall_async", "reducescatter", "reducescatter_async"]


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
    home, t = t.device, t.to(comm_device(rt, t))
    with rt.lock:
        _claim(rt, name, what)
        _agree(rt, Kind.ALLTOALL, name, dtype=t.dtype, shape=tuple(t.shape))
        mine = torch.tensor(send, dtype=torch.int64, device=t.device)
        matrix = rt.comm.all_gather_flat(mine, agreed=True).view(n, n).tolist()
        recv = [matrix[j][rt.comm.rank] for j in range(n)]
        trailing = tuple(t.shape[1:])
        per_row = int(torch.Size(trailing).numel())
        out = torch.empty((sum(recv), *trailing), dtype=t.dtype, device=t.device)
        work = _alltoall_data(rt, t, out, matrix, per_row)
    if isinstance(splits, torch.Tensor):
        received = torch.tensor(recv, dtype=splits.dtype)
    else:
        received = torch.tensor(recv, dtype=torch.int32)
    return Handle(rt, name, work, lambda: (out.to(home), received))


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
    home, t = t.device, t.to(comm_device(rt, t))
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
        work = rt.comm.reduce_scatter_async(padded.view(-1), COMM_OP[red], out=mine, agreed=True)

    def finish() -> torch.Tensor:
        out = mine[: rows[me] * per_row].view(rows[me], *trailing)
        if postscale_factor != 1.0:
            out.mul_(postscale_factor)
        return out.to(home)

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

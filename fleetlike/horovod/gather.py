"""Horovod's allgather (and grouped), broadcast, and sparse allreduce on fleetlike's
communicators, with the ``_async`` and in-place forms and autograd.

allgather concatenates every rank's tensor along the first dimension, which may differ between
ranks (every other dimension must match); grouped_allgather does so for each tensor of a list
after one agreement. broadcast overwrites with ``root_rank``'s tensor (a Horovod rank, also on a
process set). Any dtype moves (as its bytes where the backend has no such dtype, `wire`).
``sparse_allreduce_async`` is Horovod's: the indices and the values are all-gathered, so the
result is the uncoalesced sum (divided by the set's size for Average); it returns a function
that waits and returns the sparse tensor.

Example:
    >>> hvd.allgather(torch.arange(hvd.rank() + 1))   # on 2 ranks: tensor([0, 0, 1])
    >>> hvd.broadcast(torch.tensor([hvd.rank()]), root_rank=1)   # tensor([1]) on every rank
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.comm import CompletedWork, Work
from fleetlike.horovod.collectives import _agree, _tensor, allreduce, comm_device, grouped_allreduce
from fleetlike.horovod.negotiate import Kind
from fleetlike.horovod.ops import ReduceOp, op_name, parse_op
from fleetlike.horovod.order import Handle, finish_in_turn, submit, synchronize
from fleetlike.horovod.process_sets import process_set_runtime
from fleetlike.horovod.runtime import Runtime
from fleetlike.horovod.wire import as_bytes, from_bytes

__all__ = [
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "sparse_allreduce_async",
]


def _gather_rows(rt: Runtime, t: torch.Tensor, rows: list[int]) -> tuple[Work, Callable[[], torch.Tensor]]:
    """Start gathering ``t`` (``rows[r]`` first-dimension rows on rank r, the rest equal) as
    bytes in one padded all-gather; the finish returns the concatenation (on the comm device)."""
    n = rt.comm.size
    trailing = tuple(t.shape[1:])
    per_row = int(torch.Size(trailing).numel()) * t.element_size()
    width = max(max(rows) * per_row, 1)
    chunk = torch.zeros(width, dtype=torch.uint8, device=t.device)
    if t.numel():
        chunk[: t.numel() * t.element_size()] = as_bytes(t)
    flat = torch.empty(width * n, dtype=torch.uint8, device=t.device)
    work = rt.comm.all_gather_flat_async(chunk, out=flat, agreed=True)

    def finish() -> torch.Tensor:
        parts = flat.view(n, width)
        data = torch.cat([parts[i, : rows[i] * per_row] for i in range(n)])
        return from_bytes(data, t.dtype).view(sum(rows), *trailing)

    return work, finish


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> Handle:
    """Start gathering every rank's ``tensor`` along the first dimension (sizes may differ)."""
    what = "hvd.allgather_async"
    rt = process_set_runtime(process_set, what)
    t = _tensor(tensor, what).detach()
    if t.dim() == 0:
        t = t.reshape(1)
    home, t = t.device, t.to(comm_device(rt, t))

    def start() -> tuple[Work, Callable[[], torch.Tensor]]:
        ag = _agree(rt, Kind.ALLGATHER, name, dtype=t.dtype, shape=tuple(t.shape))
        work, finish = _gather_rows(rt, t, [ag.shape(i)[0] for i in range(rt.comm.size)])
        return work, lambda: finish().to(home)

    return submit(rt, name, "allgather", what, start)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: Any) -> torch.Tensor:
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=ReduceOp.AVERAGE, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64), process_set=ctx.process_set)
        me = process_set_runtime(ctx.process_set, "hvd.allgather").comm.rank
        return reduced.narrow(0, int(dims[:me].sum()), ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ).

    Example:
        >>> hvd.allgather(torch.arange(hvd.rank() + 1))   # on 2 ranks: tensor([0, 0, 1])
    """
    return _AllgatherFn.apply(_tensor(tensor, "hvd.allgather"), name, process_set)


# ------------------------------------------------------------------------------ grouped allgather


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> Handle:
    """Start gathering each tensor of the list (one agreement for the group); ``synchronize``
    returns the list of gathered tensors."""
    what = "hvd.grouped_allgather_async"
    rt = process_set_runtime(process_set, what)
    ts = [_tensor(t, what).detach() for t in tensors]
    if not ts:
        raise ValueError(f"{what}: the list of tensors is empty")
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise TypeError(f"{what}: the tensors of one group must share a dtype; got {sorted(map(str, dtypes))}")
    ts = [t.reshape(1) if t.dim() == 0 else t for t in ts]
    home = ts[0].device
    ts = [t.to(comm_device(rt, t)) for t in ts]
    trailing_crc = zlib.crc32(repr([tuple(t.shape[1:]) for t in ts]).encode()) & 0x7FFFFFFF

    def start() -> tuple[Work, Callable[[], list[torch.Tensor]]]:
        _agree(rt, Kind.GROUPED_ALLGATHER, name, dtype=ts[0].dtype, ntensors=len(ts),
               shape=(len(ts), trailing_crc))
        mine = torch.tensor([t.shape[0] for t in ts], dtype=torch.int64, device=ts[0].device)
        dims = rt.comm.all_gather_flat(mine, agreed=True).view(rt.comm.size, len(ts)).tolist()
        started = [_gather_rows(rt, t, [dims[r][j] for r in range(rt.comm.size)]) for j, t in enumerate(ts)]
        return CompletedWork(None), finish_in_turn(started, home)

    return submit(rt, name, "grouped_allgather", what, start)


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: Any, *tensors: torch.Tensor) -> Any:
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(list(grads), op=ReduceOp.AVERAGE, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dims], dtype=torch.int64), process_set=ctx.process_set)
        me = process_set_runtime(ctx.process_set, "hvd.grouped_allgather").comm.rank
        offsets = dims[:me].sum(0).tolist() if me else [0] * len(ctx.dims)
        return (None, None, *[g.narrow(0, int(o), d) for g, o, d in zip(reduced, offsets, ctx.dims)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    """`allgather` of each tensor of the list, agreed once for the group."""
    return list(_GroupedAllgatherFn.apply(name, process_set,
                                          *[_tensor(t, "hvd.grouped_allgather") for t in tensors]))


# ------------------------------------------------------------------------------ sparse


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: ReduceOp | str,
                           process_set: Any = None) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by all-gathering its indices and values (Horovod's
    way); returns a function that waits and returns the sparse result (uncoalesced; divided by
    the number of ranks for Average)."""
    what = "hvd.sparse_allreduce_async"
    red = parse_op(op)
    if red not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"{what}: op={op_name(red)!r}; a sparse allreduce sums or averages (hvd.Sum, hvd.Average)")
    t = _tensor(tensor, what)
    if not t.is_sparse:
        raise TypeError(f"{what}: expected a sparse COO tensor (tensor.to_sparse()), got a dense one")
    rt = process_set_runtime(process_set, what)
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)

    def handle() -> torch.Tensor:
        vals = synchronize(values)
        idx = synchronize(indices)
        if red is ReduceOp.AVERAGE:
            vals = vals / rt.comm.size if vals.dtype.is_floating_point else torch.div(vals, rt.comm.size,
                                                                                      rounding_mode="trunc")
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size())

    return handle


# ------------------------------------------------------------------------------ broadcast


def _broadcast_in_place(tensor: torch.Tensor, root_rank: int, name: str | None, what: str,
                        process_set: Any) -> Handle:
    rt = process_set_runtime(process_set, what)
    _tensor(tensor, what)

    def start() -> tuple[Work, Callable[[], torch.Tensor]]:
        _agree(rt, Kind.BROADCAST, name, dtype=tensor.dtype, root=int(root_rank), shape=tuple(tensor.shape))
        root = rt.local_root(root_rank, what)
        data = tensor.data
        direct = data.is_contiguous() and data.device == comm_device(rt, tensor)
        buf = as_bytes(data if direct else data.to(comm_device(rt, tensor)).contiguous())
        work = rt.comm.broadcast_async(buf, root, agreed=True)

        def finish() -> torch.Tensor:
            if not direct:  # staged (`comm_device`, or not contiguous): the result goes back
                tensor.data.copy_(from_bytes(buf, tensor.dtype).view(tensor.shape))
            return tensor

        return work, finish

    return submit(rt, name, "broadcast", what, start)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place."""
    return _broadcast_in_place(tensor, root_rank, name, "hvd.broadcast_async_", process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> Handle:
    """Start broadcasting a copy of ``tensor`` from ``root_rank``."""
    out = _tensor(tensor, "hvd.broadcast_async").detach().clone()
    return _broadcast_in_place(out, root_rank, name, "hvd.broadcast_async", process_set)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any) -> torch.Tensor:
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=ReduceOp.AVERAGE, process_set=ctx.process_set)
        rt = process_set_runtime(ctx.process_set, "hvd.broadcast")
        if rt.ranks[rt.comm.rank] != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    return _BroadcastFn.apply(_tensor(tensor, "hvd.broadcast"), root_rank, name, process_set)

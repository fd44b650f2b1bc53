"""Horovod's allreduce (and grouped allreduce) on fleetlike's communicators, with Horovod's
in-place ``_`` and ``_async`` forms, and the agreement every hvd collective starts with
(allgather and broadcast: `gather`; alltoall and reducescatter: `scatter`; barrier and join:
`join`; handles, ``poll``, ``synchronize`` and matching by name: `order`).

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
from typing import Any, TypeVar

import torch

from fleetlike.comm import CompletedWork, Work
from fleetlike.horovod.adasum import adasum_allreduce_, adasum_comms, check_adasum, refuse_adasum_on_a_set
from fleetlike.horovod.negotiate import Agreement, Kind, check, descriptor
from fleetlike.horovod.ops import OP_NAMES, OPS, Compression, Compressor, ReduceOp, resolve_op
from fleetlike.horovod.order import Handle, poll, resolve, submit, synchronize
from fleetlike.horovod.process_sets import process_set_runtime
from fleetlike.horovod.runtime import Runtime
from fleetlike.horovod.speculate import REAL, RING, Plan, Round, SlotBuffer
from fleetlike.horovod.wire import reduce_dtype, scale_

T = TypeVar("T")

__all__ = [
    "Handle",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "comm_device",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "poll",
    "synchronize",
]



def _agree(rt: Runtime, kind: Kind, name: str | None, **fields: Any) -> Agreement:
    """Exchange descriptors, answer nothing (active rank), raise on disagreement."""
    ag = _round(rt, rt.speculator.make_plan(descriptor(kind, name=name or "", **fields)), name, None).agreement
    if ag is None:  # pragma: no cover - only a slotted allreduce is ever predicted
        raise RuntimeError(f"hvd.{kind.label}: agreed by prediction without data (a fleetlike bug)")
    return ag


def _round(rt: Runtime, plan: Plan, name: str | None, real: SlotBuffer | None) -> Round:
    """Agree on ``plan`` (`speculate`: predicted, or exchanged and checked). Rows naming other
    collectives first go through `order.resolve` (which may raise `Reorder`)."""
    rnd = rt.speculator.agree(plan, real)
    rt.note_states(rnd.states)
    if rnd.agreement is not None:
        resolve(rt, rnd.agreement, plan.row[6])
        check(rnd.agreement, rt.comm, f"hvd.{Kind(plan.row[1]).label}", OP_NAMES)
    return rnd


def _tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def comm_device(rt: Runtime, t: torch.Tensor) -> torch.device:
    """Where ``t``'s data must be to travel: its own device, or the communicator's.

    Horovod takes CPU and GPU tensors in one job (``hvd.allreduce(torch.tensor(loss))`` beside
    CUDA gradients). NCCL moves CUDA tensors only and gloo/MPI CPU tensors only, so a tensor on
    the other kind of device is staged: copied to the communicator's device, moved, and the
    result copied back (as Horovod's own CPU ops do for GPU tensors). The `single` world of one
    moves nothing and takes any device.
    """
    if t.device == rt.device or rt.comm.backend == "single":
        return t.device
    return rt.device


def _reduce_start(rt: Runtime, buf: torch.Tensor, op: ReduceOp, pre: float, post: float,
                  counts: Sequence[int]) -> tuple[Work, Callable[[], torch.Tensor]]:
    """Start reducing ``buf`` in place over the Horovod world (agreement already done)."""
    scale_(buf, pre)
    if op is ReduceOp.ADASUM:
        if rt.adasum_comms is None:
            rt.adasum_comms = adasum_comms(rt.comm)
            rt.own_comms.extend(c for pair in rt.adasum_comms for c in pair if c is not rt.comm)
        flat = buf if buf.is_contiguous() else buf.contiguous()
        adasum_allreduce_(flat.view(-1), counts, rt.comm, rt.adasum_comms)
        if flat is not buf:
            buf.copy_(flat)
        work: Work = CompletedWork(buf)
    elif op is ReduceOp.AVERAGE and not buf.dtype.is_floating_point:
        # Horovod's integer average: the sum, scaled by 1/size in float64 and truncated
        work = rt.comm.all_reduce_async(buf, "sum", agreed=True)
        post = post / rt.comm.size
    else:
        work = rt.comm.all_reduce_async(buf, op, agreed=True)

    def finish() -> torch.Tensor:
        return scale_(buf, post)

    return work, finish


def _reduce(rt: Runtime, kind: Kind, name: str | None, fill: Callable[[torch.Tensor], Any], counts: Sequence[int],
            dtype: torch.dtype, device: torch.device, op: ReduceOp, pre: float, post: float,
            direct: torch.Tensor | None = None, ntensors: int = 1,
            shape: tuple[int, ...] = ()) -> tuple[Work, Callable[[Callable[[torch.Tensor, bool], T]], T]]:
    """Agree on an allreduce of ``sum(counts)`` elements that ``fill`` writes into a flat buffer
    and start it; ``finish(consume)`` returns ``consume(reduced flat data, pooled)`` (pooled: the
    data go back to the pool after ``consume``, so keep a copy). A small allreduce
    (any op but Adasum) travels with one slot per rank after the data (`speculate`), the same
    whether predicted or agreed first, in a pooled buffer; a large one reduces ``direct`` (a flat
    contiguous view of the caller's tensor) in place when given. The descriptor and what the
    agreement derives from it are built once per distinct call (`Speculator.plan`)."""
    numel = sum(counts)
    spec = rt.speculator
    plan = spec.plan((kind, name, op, dtype, shape, ntensors),
                     lambda: descriptor(kind, name=name or "", op=OPS.index(op), dtype=dtype, ntensors=ntensors,
                                        shape=shape))
    if plan.carrier is None:
        _round(rt, plan, name, None)
        if op is ReduceOp.ADASUM:
            check_adasum(rt.comm.size, dtype)
        flat = direct
        if flat is None:
            flat = torch.empty(numel, dtype=dtype, device=device)
            fill(flat)
        work, finish_flat = _reduce_start(rt, flat, op, pre, post, counts)
        return work, lambda consume: consume(finish_flat(), False)
    ring = plan.carrier == RING
    if ring:  # the codes travel beside the data: reduce the caller's tensor itself when we may
        if direct is not None and pre == 1.0:
            sb = SlotBuffer(direct, numel)
        else:  # out of place, or prescaled (a refused ring must leave the tensor as it was)
            sb = SlotBuffer(torch.empty(numel, dtype=dtype, device=device), numel)
            fill(sb.data)
    else:
        sb = spec.take(dtype, numel, device)
        fill(sb.data)
    data = sb.data
    scale_(data, pre)
    try:
        rnd = _round(rt, plan, name, sb)
    except Exception:
        if not ring:
            spec.give(sb)
        raise
    if rnd.done:
        work: Work = CompletedWork(sb.buf)
    elif ring:  # agreed first: the same ring (the same sums, bit for bit), done before returning
        spec.start(sb, op, REAL, ring=True).wait()
        work = CompletedWork(sb.buf)
    else:
        work = spec.start(sb, op, REAL)

    def finish(consume: Callable[[torch.Tensor, bool], T]) -> T:
        try:
            scale_(data, post)
            return consume(data, not ring)
        finally:
            if not ring:
                with rt.lock:
                    spec.give(sb)

    return work, finish


def _allreduce(tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float, what: str,
               in_place: bool, process_set: Any) -> Handle:
    rt = process_set_runtime(process_set, what)
    _tensor(tensor, what)
    if op is ReduceOp.ADASUM and rt.is_set:
        refuse_adasum_on_a_set()
    src = tensor.detach().reshape(-1)
    device = comm_device(rt, tensor)
    wire = reduce_dtype(tensor.dtype)
    staged = device != tensor.device or wire != tensor.dtype
    direct = src if in_place and tensor.is_contiguous() and not staged else None

    def consume(flat: torch.Tensor, pooled: bool) -> torch.Tensor:
        if not in_place:
            if staged:
                return flat.view(tensor.shape).to(tensor.device, tensor.dtype)
            return flat.view(tensor.shape).clone() if pooled else flat.view(tensor.shape)
        if flat is not direct:  # pooled: back into the tensor (through its flat view if it has one)
            if direct is not None:
                direct.copy_(flat)
            else:
                tensor.detach().copy_(flat.view(tensor.shape))
        return tensor

    def start() -> tuple[Work, Callable[[], torch.Tensor]]:
        work, finish_flat = _reduce(rt, Kind.ALLREDUCE, name, lambda d: d.copy_(src), [tensor.numel()],
                                    wire, device, op, pre, post, direct, shape=tuple(tensor.shape))
        return work, lambda: finish_flat(consume)

    return submit(rt, name, "allreduce", what, start)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing ``tensor`` in place over the ranks (of ``process_set``); returns a handle."""
    return _allreduce(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                      "hvd.allreduce_async_", True, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place over the ranks and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing a copy of ``tensor``; ``synchronize`` returns the reduced copy."""
    return _allreduce(_tensor(tensor, "hvd.allreduce_async"), name, resolve_op(op, average), prescale_factor,
                      postscale_factor, "hvd.allreduce_async", False, process_set)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: Any) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post,
                          process_set=ctx.process_set), None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] | Compressor = Compression.none, op: ReduceOp | str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """The reduction of ``tensor`` over the ranks (a new tensor; ``tensor`` is unchanged).

    Example:
        >>> hvd.allreduce(torch.tensor([hvd.rank()], dtype=torch.float32))   # the mean rank
    """
    red = resolve_op(op, average)
    compressed, ctx = compression.compress(_tensor(tensor, "hvd.allreduce"))
    out = _AllreduceFn.apply(compressed, name, red, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


# ------------------------------------------------------------------------------ grouped


def _grouped_in_place(tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp, pre: float, post: float,
                      what: str, process_set: Any) -> Handle:
    rt = process_set_runtime(process_set, what)
    tensors = [_tensor(t, what) for t in tensors]
    if not tensors:
        raise ValueError(f"{what}: the list of tensors is empty")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"{what}: the tensors of one group must share a dtype; got {sorted(map(str, dtypes))}. "
                        "Group them by dtype (one call per dtype)")
    if op is ReduceOp.ADASUM and rt.is_set:
        refuse_adasum_on_a_set()
    counts = [t.numel() for t in tensors]
    shapes_crc = zlib.crc32(repr([tuple(t.shape) for t in tensors]).encode()) & 0x7FFFFFFF
    device = comm_device(rt, tensors[0])
    wire = reduce_dtype(tensors[0].dtype)

    def fill(d: torch.Tensor) -> None:
        torch.cat([t.detach().reshape(-1).to(device, wire) for t in tensors], out=d)

    def consume(done: torch.Tensor, pooled: bool) -> list[torch.Tensor]:
        offset = 0
        with torch.no_grad():
            for t, c in zip(tensors, counts):
                t.copy_(done[offset : offset + c].view_as(t))
                offset += c
        return list(tensors)

    def start() -> tuple[Work, Callable[[], list[torch.Tensor]]]:
        work, finish_flat = _reduce(rt, Kind.GROUPED_ALLREDUCE, name, fill, counts, wire, device, op, pre, post,
                                    ntensors=len(tensors), shape=(sum(counts), shapes_crc))
        return work, lambda: finish_flat(consume)

    return submit(rt, name, "grouped_allreduce", what, start)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing every tensor of the list in place, fused into one buffer (one collective)."""
    return _grouped_in_place(tensors, name, resolve_op(op, average), prescale_factor, postscale_factor,
                             "hvd.grouped_allreduce_async_", process_set)


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
    copies = [_tensor(t, "hvd.grouped_allreduce_async").detach().clone() for t in tensors]
    return _grouped_in_place(copies, name, resolve_op(op, average), prescale_factor, postscale_factor,
                             "hvd.grouped_allreduce_async", process_set)


class _GroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, process_set: Any,
                *tensors: torch.Tensor) -> Any:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(list(grads), op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post,
                                    process_set=ctx.process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] | Compressor = Compression.none,
                      op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> list[torch.Tensor]:
    """Reductions of every tensor of the list (new tensors), fused into one collective."""
    pairs = [compression.compress(_tensor(t, "hvd.grouped_allreduce")) for t in tensors]
    outs = _GroupedFn.apply(name, resolve_op(op, average), prescale_factor, postscale_factor, process_set,
                            *[p[0] for p in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]

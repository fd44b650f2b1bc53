"""Horovod's tensor collectives on fleetlike's communicators: allreduce (and grouped), allgather,
broadcast, with Horovod's in-place ``_`` and ``_async`` forms, ``poll`` and ``synchronize``
(alltoall and reducescatter: `scatter`; barrier and join: `join`).

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
from fleetlike.horovod.adasum import adasum_allreduce_, adasum_comms, check_adasum
from fleetlike.horovod.negotiate import Agreement, Kind, check, descriptor
from fleetlike.horovod.ops import COMM_OP, OP_NAMES, OPS, Compression, Compressor, ReduceOp, identity, resolve_op
from fleetlike.horovod.runtime import Runtime, runtime
from fleetlike.horovod.speculate import REAL, RING, Plan, Round, SlotBuffer

T = TypeVar("T")

__all__ = [
    "Handle",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "poll",
    "synchronize",
]



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
    ag = _round(rt, rt.speculator.make_plan(descriptor(kind, name=name or "", **fields)), name, None).agreement
    if ag is None:  # pragma: no cover - only a slotted allreduce is ever predicted
        raise RuntimeError(f"hvd.{kind.label}: agreed by prediction without data (a fleetlike bug)")
    return ag


def _round(rt: Runtime, plan: Plan, name: str | None, real: SlotBuffer | None) -> Round:
    """Agree on ``plan`` (`speculate`: predicted, or exchanged and checked)."""
    rnd = rt.speculator.agree(plan, real)
    rt.note_states(rnd.states)
    if rnd.agreement is not None:
        try:
            check(rnd.agreement, rt.comm, f"hvd.{Kind(plan.row[1]).label}", OP_NAMES)
        except Exception:
            if name is not None:
                rt.in_flight.pop(name, None)
            raise
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
        work = rt.comm.all_reduce_async(buf, COMM_OP[op], agreed=True)

    def finish() -> torch.Tensor:
        if post != 1.0:
            buf.mul_(post)
        return buf

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
    if pre != 1.0:
        data.mul_(pre)
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
            if post != 1.0:
                data.mul_(post)
            return consume(data, not ring)
        finally:
            if not ring:
                with rt.lock:
                    spec.give(sb)

    return work, finish


def _allreduce(tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float, what: str,
               in_place: bool) -> Handle:
    rt = runtime(what)
    _tensor(tensor, what)
    with rt.lock:
        _claim(rt, name, what)
        src = tensor.detach().reshape(-1)
        device = comm_device(rt, tensor)
        staged = device != tensor.device
        direct = src if in_place and tensor.is_contiguous() and not staged else None
        work, finish_flat = _reduce(rt, Kind.ALLREDUCE, name, lambda d: d.copy_(src), [tensor.numel()],
                                    tensor.dtype, device, op, pre, post, direct, shape=tuple(tensor.shape))

    def consume(flat: torch.Tensor, pooled: bool) -> torch.Tensor:
        if not in_place:
            if staged:
                return flat.view(tensor.shape).to(tensor.device)
            return flat.view(tensor.shape).clone() if pooled else flat.view(tensor.shape)
        if flat is not direct:  # pooled: back into the tensor (through its flat view if it has one)
            if direct is not None:
                direct.copy_(flat)
            else:
                tensor.detach().copy_(flat.view(tensor.shape))
        return tensor

    def finish() -> torch.Tensor:
        return finish_flat(consume)

    return Handle(rt, name, work, finish)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
    """Start reducing ``tensor`` in place over all ranks; returns a handle."""
    _no_process_set(process_set, "hvd.allreduce_async_")
    return _allreduce(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                      "hvd.allreduce_async_", True)


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
    return _allreduce(_tensor(tensor, "hvd.allreduce_async"), name, resolve_op(op, average), prescale_factor,
                      postscale_factor, "hvd.allreduce_async", False)


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
    device = comm_device(rt, tensors[0])

    def fill(d: torch.Tensor) -> None:
        torch.cat([t.detach().reshape(-1).to(device) for t in tensors], out=d)

    with rt.lock:
        _claim(rt, name, what)
        work, finish_flat = _reduce(
            rt, Kind.GROUPED_ALLREDUCE, name, fill,
            counts, tensors[0].dtype, device, op, pre, post, ntensors=len(tensors),
            shape=(sum(counts), shapes_crc))

    def consume(done: torch.Tensor, pooled: bool) -> list[torch.Tensor]:
        offset = 0
        with torch.no_grad():
            for t, c in zip(tensors, counts):
                t.copy_(done[offset : offset + c].view_as(t))
                offset += c
        return list(tensors)

    def finish() -> list[torch.Tensor]:
        return finish_flat(consume)

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
    home, t = t.device, t.to(comm_device(rt, t))
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
        out = torch.cat([parts[i, : rows[i] * per_row] for i in range(rt.comm.size)]).view(sum(rows), *trailing)
        return out.to(home)

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
        buf = tensor.data.to(comm_device(rt, tensor))
        work = rt.comm.broadcast_async(buf, int(root_rank), agreed=True)

    def finish() -> torch.Tensor:
        if buf.device != tensor.device:  # staged (see `comm_device`): the result goes back
            tensor.data.copy_(buf)
        return tensor

    return Handle(rt, name, work, finish)


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


def _no_process_set(process_set: Any, what: str) -> None:
    if process_set is not None:
        raise ValueError(f"{what}: process_set={process_set!r}: fleetlike's Horovod face has only the global "
                         "process set (use hvd.init(comm=[ranks]) for a subset)")

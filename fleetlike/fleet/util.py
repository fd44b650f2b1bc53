"""``fleet.util``: small host-side collectives and file sharding, as Paddle's ``UtilBase``.

Numbers, numpy arrays and tensors go in; the same kind comes out. Used, for example, to average
the loss over ranks for the adaptive local SGD recipe (seed 003's loss allreduce program).

Dtypes: `Util.all_reduce` takes every integer (int8 ... int64, uint8 ... uint64) and float
(float16, bfloat16, float32, float64) dtype. Where the backends lack one, it travels widened
(integers as int64, reinterpreted bits for uint64) and the result comes back in the input's
dtype, wrapping around on overflow as the dtype's own arithmetic (numpy's ``a + b``) does.
``mode="avg"`` (alias ``"mean"``, an addition to Paddle's sum / max / min) of integers is the
true mean as float64, numpy's rule for ``np.mean`` of integers, never a rounded-down integer.

`Util.all_gather` takes ragged data: each rank's array or tensor may have its own shape (any
dtype, the same on every rank), as Paddle's gather of objects allows.

Example:
    >>> fleet.util.all_reduce(loss_value, mode="sum") / fleet.worker_num()
    >>> fleet.util.all_reduce(np.array([1, 2], dtype=np.int8), mode="avg")   # float64 mean
    >>> fleet.util.all_gather(np.arange(fleet.worker_index() + 1))           # ragged
    >>> fleet.util.get_file_shard(["a", "b", "c", "d", "e"])   # rank 0 of 2 -> ['a', 'b', 'c']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fleetlike.comm import Communicator, ReduceOp, all_gather_ragged, dtype_name

__all__ = ["Util", "file_shard", "REDUCE_DTYPES"]

_MODES = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "avg": ReduceOp.AVG,
          "mean": ReduceOp.AVG, "prod": ReduceOp.PROD}

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: What `Util.all_reduce` accepts.
REDUCE_DTYPES: tuple[torch.dtype, ...] = _INTS + _FLOATS
_SIGN = -(2**63)  # flips uint64's order into int64's: max/min of the flipped bits agree


def file_shard(files: Sequence[str], rank: int, world: int) -> list[str]:
    """Paddle's split: contiguous blocks; the first ``len(files) % world`` ranks take one more."""
    if not isinstance(files, (list, tuple)):
        raise TypeError(f"get_file_shard: files must be a list of names, got {type(files).__name__}")
    base, extra = divmod(len(files), world)
    start = rank * base + min(rank, extra)
    return list(files[start : start + base + (1 if rank < extra else 0)])


def _to_tensor(x: Any, device: torch.device, name: str) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """``x`` as a private tensor on ``device``, and the function that turns a result tensor back
    into ``x``'s kind (tensor on its device, numpy array, numpy scalar, Python number)."""
    if isinstance(x, torch.Tensor):
        dev = x.device
        return x.detach().to(device).clone(), lambda t: t.to(dev)
    if isinstance(x, np.generic) and not isinstance(x, np.bool_):
        x = np.asarray(x)
        return torch.from_numpy(x.copy()).to(device), lambda t: t.cpu().numpy()[()]
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x, copy=True, order="C")).to(device), lambda t: t.cpu().numpy()
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float)):
        raise TypeError(
            f"fleet.util.{name} takes numbers, numpy arrays or tensors, got {type(x).__name__} "
            f"({x!r:.40}); convert it, e.g. with np.asarray(x)"
        )
    kind: type = float if isinstance(x, float) else int
    t = torch.tensor(x, dtype=torch.float64 if kind is float else torch.int64, device=device)
    return t, lambda t: (float if t.is_floating_point() else kind)(t.item())


def _reduce(comm: Communicator, t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Reduce ``t`` in a dtype the backends take; the result in ``t``'s dtype, except that the
    mean of integers is float64."""
    dtype = t.dtype
    if dtype in _FLOATS:
        return comm.all_reduce(t, op)
    if op is ReduceOp.AVG:  # np.mean of integers: float64 values, summed, divided
        total = comm.all_reduce(t.to(torch.float64), ReduceOp.SUM)
        return total.div_(comm.size)
    if dtype == torch.uint64:  # the same 64 bits as int64: sum and prod wrap identically
        bits = t.view(torch.int64)
        flip = op in (ReduceOp.MAX, ReduceOp.MIN)
        if flip:
            bits = bits.bitwise_xor(_SIGN)
        out = comm.all_reduce(bits, op)
        return (out.bitwise_xor_(_SIGN) if flip else out).view(torch.uint64)
    # int64 holds every narrower integer; casting back wraps as the dtype's arithmetic does
    return comm.all_reduce(t.to(torch.int64), op).to(dtype)


class Util:
    """Bound to the fleet's world communicator through ``comm_fn`` (resolved at call time)."""

    def __init__(self, comm_fn: Callable[[], tuple[Communicator, int, int, torch.device]]) -> None:
        self._comm_fn = comm_fn

    def all_reduce(self, x: Any, mode: str = "sum") -> Any:
        """Reduce ``x`` over all workers with ``mode`` in sum / max / min (also avg, prod).

        Every integer and float dtype; the result has ``x``'s kind and dtype, except
        ``mode="avg"`` of integers, which is the float64 mean (see the module docstring)."""
        if not isinstance(mode, str) or mode.lower() not in _MODES:
            raise ValueError(f"fleet.util.all_reduce: mode={mode!r}; choose one of {sorted(_MODES)}")
        comm, _, _, device = self._comm_fn()
        t, back = _to_tensor(x, device, "all_reduce")
        if t.dtype not in REDUCE_DTYPES:
            raise TypeError(
                f"fleet.util.all_reduce: {type(x).__name__} of dtype {dtype_name(t.dtype)} cannot be "
                f"reduced; supported dtypes: {', '.join(dtype_name(d) for d in REDUCE_DTYPES)}. "
                "Convert it first (booleans: .astype(np.int32) for counts)"
            )
        return back(_reduce(comm, t, _MODES[mode.lower()]))

    def all_gather(self, x: Any) -> list[Any]:
        """Every worker's ``x``, in rank order. Arrays and tensors may differ in shape between
        workers (not in dtype): sizes are exchanged first, as Horovod's allgather does."""
        comm, _, _, device = self._comm_fn()
        t, back = _to_tensor(x, device, "all_gather")
        return [back(part) for part in all_gather_ragged(comm, t)]

    def barrier(self) -> None:
        self._comm_fn()[0].barrier()

    def get_file_shard(self, files: Sequence[str]) -> list[str]:
        """This worker's share of ``files`` (see `file_shard`)."""
        _, rank, world, _ = self._comm_fn()
        return file_shard(files, rank, world)

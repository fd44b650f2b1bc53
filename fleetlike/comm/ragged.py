"""Gathering tensors whose shapes differ between ranks (Horovod's allgather, Paddle's
``all_gather_object`` for tensors).

A plain all-gather needs the same size on every rank: the backends size their receive buffers
from the local tensor, and gloo aborts the process when a peer sends more. Here the ranks first
all-gather a fixed-size descriptor (dtype, ndim, shape), then every rank pads its data to the
largest byte count, all-gathers the padded bytes, and cuts each rank's part back to its shape.
Both exchanges have sizes equal by construction, so they skip the size check (``agreed=True``).

The data travel as raw bytes, so every dtype moves (int8, bool, uint16, complex...), also those
the reductions do not support. Ranks must agree on the dtype: a difference raises
`CollectiveMismatchError` on every rank, naming each rank's dtype and shape.

Example:
    >>> parts = all_gather_ragged(world, torch.arange(world.rank + 1))
    >>> [p.tolist() for p in parts]            # on 3 ranks
    [[0], [0, 1], [0, 1, 2]]
"""

from __future__ import annotations

import torch

from fleetlike.comm.base import Communicator
from fleetlike.comm.dtypes import dtype_name
from fleetlike.comm.errors import CollectiveMismatchError
from fleetlike.comm.guard import mismatch_table

__all__ = ["all_gather_ragged", "MAX_DIMS"]

#: Most dimensions a gathered tensor may have (the descriptor has a fixed width).
MAX_DIMS = 16

#: Every dtype with a stable code in the descriptor (the code is its position).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex64, torch.complex128,
)


def all_gather_ragged(comm: Communicator, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order, whatever each one's shape.

    Collective: every rank of ``comm`` calls it. Costs two all-gathers (a descriptor of
    ``MAX_DIMS + 3`` ints, then the data padded to the largest rank's byte count)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_gather_ragged: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    ndim = tensor.dim() if tensor.dim() <= MAX_DIMS else -2
    desc = torch.full((MAX_DIMS + 3,), -1, dtype=torch.int64)
    desc[0], desc[1], desc[2] = code, ndim, tensor.numel() * tensor.element_size()
    if ndim >= 0:
        desc[3 : 3 + ndim] = torch.tensor(tensor.shape, dtype=torch.int64)
    on = tensor.device
    rows = comm.all_gather(desc.to(on), agreed=True)
    table = [r.tolist() for r in rows]
    codes = {r[0] for r in table}
    if len(codes) > 1 or -1 in codes or any(r[1] == -2 for r in table):
        _raise(comm, table, tensor)
    sizes = [r[2] for r in table]
    longest = max(sizes)
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() < longest:
        raw = torch.cat([raw, raw.new_zeros(longest - raw.numel())])
    gathered = comm.all_gather_flat(raw, agreed=True).view(comm.size, longest)
    return [
        gathered[i, : sizes[i]].view(tensor.dtype).reshape(tuple(r[3 : 3 + r[1]]))
        for i, r in enumerate(table)
    ]


def _raise(comm: Communicator, table: list[list[int]], tensor: torch.Tensor) -> None:
    def name(code: int) -> str:
        return dtype_name(_DTYPES[code]) if code >= 0 else "unsupported"

    rows = [
        {
            "rank": str(comm.ranks[i]),
            "dtype": name(r[0]),
            "shape": str(tuple(r[3 : 3 + r[1]])) if r[1] >= 0 else f"over {MAX_DIMS} dims",
        }
        for i, r in enumerate(table)
    ]
    raise CollectiveMismatchError(
        f"all_gather_ragged on communicator {comm.name!r}: the ranks' tensors cannot be gathered "
        f"together (this rank has {dtype_name(tensor.dtype)} {tuple(tensor.shape)}):\n"
        f"{mismatch_table(rows)}\nShapes may differ; the dtype must be the same on every rank "
        f"(one of {', '.join(dtype_name(d) for d in _DTYPES)}) and a tensor may have at most "
        f"{MAX_DIMS} dims. Convert with .to(dtype) before gathering.",
        rows,
    )

"""Broadcast many tensors from one rank with few collectives and bounded extra memory.

Used to start every rank from rank 0's parameters and buffers (the startup program and the
eager ``fleet.distributed_model``): one collective per tensor would pay the latency of hundreds
of small messages, one flat copy of the whole model would double its memory.

Example:
    >>> broadcast_coalesced(world, [p.data for p in model.parameters()] + list(model.buffers()))
"""

from __future__ import annotations

import torch

from fleetlike.comm import Communicator

__all__ = ["broadcast_coalesced"]


def broadcast_coalesced(comm: Communicator, tensors: list[torch.Tensor], root: int = 0, cap_bytes: int = 16 << 20) -> None:
    """Broadcast ``tensors`` from ``root``: few collectives, bounded extra memory.

    Tensors of one dtype are packed into flat buffers of at most ``cap_bytes`` (a larger tensor
    goes alone, in place), so a big model costs a few collectives and no full second copy."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if nbytes >= cap_bytes and t.is_contiguous():
                comm.broadcast(t.detach(), root)
                continue
            if chunk and size + nbytes > cap_bytes:
                _broadcast_packed(comm, chunk, root)
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        if chunk:
            _broadcast_packed(comm, chunk, root)


def _broadcast_packed(comm: Communicator, group: list[torch.Tensor], root: int) -> None:
    flat = torch.cat([t.detach().reshape(-1) for t in group])
    comm.broadcast(flat, root)
    offset = 0
    with torch.no_grad():
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

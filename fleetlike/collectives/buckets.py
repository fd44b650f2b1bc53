"""Gradient buckets: flat buffers whose slices *are* the parameters' ``.grad`` tensors.

Fusion costs no copy and no extra memory: each parameter's gradient is a view into its bucket's
flat buffer, so autograd accumulates straight into the buffer that the collective sends. Buckets
follow the reverse order of the parameters, as DDP does, because backward produces gradients
roughly in that order: the first bucket to fill is the first to start communicating.

Example:
    >>> layout = plan_buckets(list(model.parameters()), cap_bytes=32 << 20)
    >>> buckets = [Bucket(i, ps) for i, ps in enumerate(layout)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from fleetlike.comm import dtype_name

__all__ = ["Bucket", "non_finite", "plan_buckets"]

T = TypeVar("T")


def plan_buckets(params: Sequence[torch.nn.Parameter], cap_bytes: int | None) -> list[list[torch.nn.Parameter]]:
    """Group trainable ``params`` (reverse order) into buckets of at most ``cap_bytes``.

    A bucket holds one dtype on one device. ``cap_bytes=None`` gives one bucket per parameter
    (``fuse_all_reduce_ops=False``). A parameter larger than the cap gets a bucket of its own.
    """
    buckets: list[list[torch.nn.Parameter]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[torch.nn.Parameter], int]] = {}
    for p in reversed([p for p in params if p.requires_grad]):
        if cap_bytes is None:
            buckets.append([p])
            continue
        key = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        current = open_.get(key)
        if current is not None and current[1] + size > cap_bytes and current[0]:
            current = None
        if current is None:
            group: list[torch.nn.Parameter] = []
            buckets.append(group)
            current = (group, 0)
        current[0].append(p)
        open_[key] = (current[0], current[1] + size)
    return buckets


class Bucket:
    """One flat gradient buffer and the parameters whose ``.grad`` are views into it."""

    def __init__(
        self, index: int, params: Sequence[torch.nn.Parameter], layout: tuple[Sequence[int], int] | None = None,
        *, allocate: bool = True,
    ) -> None:
        """``layout`` = (offset of each parameter, buffer numel) places the gradients elsewhere
        than back to back (the sharded buckets leave a segment per rank, zero-padded).
        ``allocate=False`` leaves the buffer empty (no views): a bucket that exists only while it
        communicates allocates it then (`fleetlike.collectives.transient`)."""
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.params = list(params)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        if layout is not None:
            self.offsets, total = list(layout[0]), int(layout[1])
        self.numel = total
        self.buffer = torch.zeros(total if allocate else 0, dtype=self.dtype, device=self.device)
        self.views = [
            self.buffer[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)
        ] if allocate else []

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    def attach(self) -> None:
        """Make every parameter's ``.grad`` the view into this bucket (again, if a user's
        ``zero_grad(set_to_none=True)`` or a load replaced it), keeping accumulated values."""
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is view:  # accumulated in place (the per-step case)
                continue
            if g is None:
                p.grad = view
            elif g.is_sparse:  # a sparse gradient handed back sparse: dense in the bucket again
                view.copy_(g.to_dense())
                p.grad = view
            elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
                view.copy_(g)
                p.grad = view

    def zero_(self) -> None:
        self.buffer.zero_()

    def describe(self) -> dict[str, Any]:
        """Facts for the program listing."""
        kb = self.nbytes / 1024
        size = f"{kb:.1f}KiB" if kb < 1024 else f"{kb / 1024:.2f}MiB"
        return {
            "bucket": self.index,
            "grads": len(self.params),
            "numel": self.numel,
            "size": size,
            "dtype": dtype_name(self.dtype),
        }


def non_finite(flat: torch.Tensor, views: Sequence[torch.Tensor], name_of: Callable[[int], T]) -> list[T]:
    """The names (``name_of(i)`` for view i: a name, or an index) of the ``views`` (slices of
    the gradient buffer ``flat``) holding NaN or Inf:
    the NaN check of every face (the reducer's buckets before their allreduce, DDP's buckets
    before and after). One pass over ``flat`` when it is finite, the common case."""
    if bool(torch.isfinite(flat).all()):
        return []
    return [name_of(i) for i, view in enumerate(views) if not bool(torch.isfinite(view).all())]

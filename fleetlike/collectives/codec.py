"""The half-precision wire codec: how a float bucket travels as float16 / bfloat16 and comes back.

Kept apart from the collectives that use it (`CompressedAllReduce`, `HierarchicalAllReduce`'s
mixed mode, `segmented_all_reduce`) because all three need it and none of them needs the others:
as its own module it sits below them, so no import circle is needed to share it.

Each float32 (or float64) tensor is pre-divided by the number of ranks (as DDP's
``fp16_compress_hook``), multiplied by ``grad_scale`` and, for float16, guarded against overflow
by an agreed maximum (see `HalfCodec.scales`), then cast to the 16-bit dtype; after the sum it is
cast back and divided by the factor.

Example:
    >>> codec = HalfCodec("float16")
    >>> codec.all_reduce_(x, lambda t: comm.all_reduce(t, "sum"), lambda t: comm.all_reduce(t, "max"),
    ...                   summands=comm.size, divide=comm.size)     # x averaged, float16 on the wire
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fleetlike.comm import dtype_name

__all__ = ["HalfCodec"]

_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: the guard keeps every partial sum below this (float16's largest finite value is 65504)
_FP16_LIMIT = 2.0**15


class HalfCodec:
    """Casts a float tensor to a 16-bit wire dtype around a sum allreduce (see module doc)."""

    def __init__(self, dtype: str | torch.dtype = "float16", grad_scale: float = 1.0) -> None:
        if isinstance(dtype, torch.dtype):
            dtype = dtype_name(dtype)
        dtype = str(dtype)
        if dtype not in _HALF:
            raise ValueError(f"dtype={dtype!r} is not a wire dtype; choose one of 'float16', 'bfloat16'")
        if not grad_scale > 0 or not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale={grad_scale!r} must be a positive finite number")
        self.name = dtype
        self.dtype = _HALF[dtype]
        self.grad_scale = float(grad_scale)
        self.guard = self.dtype is torch.float16

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Only wider floats are compressed; 16-bit and integer buckets travel as they are."""
        return dtype in (torch.float32, torch.float64)

    def guard_factor(self, max_abs: float, summands: int) -> float:
        """The power of two putting ``summands * max_abs`` (already scaled) just below 2**15.

        Below 1 it avoids overflow; above 1 it lifts small buckets out of float16's subnormal
        range (below 6e-5 float16 keeps only absolute precision), so both ends keep float16's
        relative precision. Powers of two scale and unscale exactly."""
        bound = max_abs * summands
        if not math.isfinite(bound) or bound == 0.0:
            return 1.0  # non-finite gradients travel as inf/nan: AMP's finite check sees them
        return 2.0 ** min(math.floor(math.log2(_FP16_LIMIT / bound)), 60)

    def scales(
        self, x: torch.Tensor, max_fn: Callable[[torch.Tensor], Any], *, summands: int, divide: int
    ) -> tuple[float, float]:
        """``(pre, factor)`` for ``x``: multiply by ``pre`` before the cast, divide the sum by
        ``factor`` after it. ``pre = factor / divide``; for float16 ``max_fn`` (a MAX allreduce
        over every rank whose values meet in a sum) agrees on the largest magnitude first."""
        factor = self.grad_scale
        if self.guard:  # in float64: a float64 bucket's (scaled) maximum may pass float32's range
            m = _abs_max(x).mul_(factor / divide)
            max_fn(m)
            factor *= self.guard_factor(float(m.item()), summands)
        return factor / divide, factor

    def encode_(self, x: torch.Tensor, pre: float, out: torch.Tensor) -> None:
        """``out <- x * pre`` in the wire dtype; scales ``x`` in place (it is overwritten by the
        result anyway), because an in-place multiply and a same-shape copy are vectorised on CPU
        where the out-of-place mixed-dtype forms are not."""
        if pre != 1.0:
            x.mul_(pre)
        out.copy_(x)

    def decode_(self, wire: torch.Tensor, factor: float, out: torch.Tensor) -> None:
        """``out <- wire / factor`` in ``out``'s dtype (the division in full precision)."""
        out.copy_(wire)
        if factor != 1.0:
            out.div_(factor)

    def all_reduce_(
        self,
        x: torch.Tensor,
        sum_fn: Callable[[torch.Tensor], Any],
        max_fn: Callable[[torch.Tensor], Any],
        *,
        summands: int,
        divide: int,
    ) -> torch.Tensor:
        """``x <- (sum over ranks of x) / divide`` with the wire in ``self.dtype``; blocking."""
        pre, factor = self.scales(x, max_fn, summands=summands, divide=divide)
        wire = torch.empty(x.shape, dtype=self.dtype, device=x.device)
        self.encode_(x, pre, wire)
        sum_fn(wire)
        self.decode_(wire, factor, x)
        return x


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``x`` as a 1-element float64 tensor (NaN if ``x`` holds one).

    ``aminmax`` is one vectorised pass; ``x.abs().max()`` allocates and is ~15x slower on CPU."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float64, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg()).to(torch.float64).reshape(1)

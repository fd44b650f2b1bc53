"""How each dtype Horovod moves travels on fleetlike's communicators, and Horovod's scaling.

The communicators move float32/64, float16, bfloat16, int32/64 and uint8. Horovod's collectives
also take int8, int16 and bool: collectives that only move data (allgather, broadcast, alltoall)
move any dtype as its bytes (`as_bytes`, a view: no copy); reductions run int8, int16 and bool
in int32 (`reduce_dtype`) and cast back, which keeps the wrap-around of the narrow integer sum.

Horovod scales (``prescale_factor`` / ``postscale_factor``, the 1/size of an integer Average)
in float64 for integer tensors and float32 for 16-bit floats, then casts back (an integer is
truncated toward zero): `scale_` does the same in place.

Example:
    >>> scale_(torch.tensor([-75], dtype=torch.int32), 0.5)   # tensor([-37], dtype=torch.int32)
"""

from __future__ import annotations

import torch

from fleetlike.comm.dtypes import SUPPORTED_DTYPES

__all__ = ["as_bytes", "from_bytes", "moves_natively", "reduce_dtype", "scale_"]

#: moved by every backend's own collectives (gloo's all-to-all included)
_NATIVE = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8})


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` runs in on the wire."""
    return dtype if dtype in SUPPORTED_DTYPES else torch.int32


def moves_natively(dtype: torch.dtype) -> bool:
    """Whether a data-moving collective sends ``dtype`` as it is (else as bytes)."""
    return dtype in _NATIVE


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s data as a flat uint8 tensor (a view of ``t`` when it is contiguous)."""
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Flat uint8 data read back as ``dtype`` (flat)."""
    return b if dtype == torch.uint8 else b.view(dtype)


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``t`` in place by ``factor`` as Horovod does (integers in float64, truncated
    toward zero; 16-bit floats in float32)."""
    if factor == 1.0:
        return t
    if t.dtype.is_floating_point and t.dtype not in (torch.float16, torch.bfloat16):
        return t.mul_(factor)
    if t.dtype == torch.bool:
        raise TypeError(f"hvd: prescale_factor / postscale_factor {factor} cannot scale a bool tensor")
    wide = torch.float32 if t.dtype.is_floating_point else torch.float64
    return t.copy_(t.to(wide).mul_(factor).to(t.dtype) if t.dtype.is_floating_point
                   else torch.trunc(t.to(wide).mul_(factor)).to(t.dtype))

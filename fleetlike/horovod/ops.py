"""Horovod's reduction names and gradient compressors (``hvd.Average``, ``hvd.Compression.fp16``).

`ReduceOp` is the core's one enum of reductions (`fleetlike.config.reductions`, the same object
as ``fleetlike.comm.ReduceOp``); the module-level names ``Average``, ``Sum``, ``Adasum``,
``Min``, ``Max``, ``Product`` are its members, and `NAMES` is Horovod's spelling of them, so
``op=hvd.Sum`` and ``op="sum"`` both work and ``op="average"`` is `Average`. A `Compressor` has Horovod's interface
(``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx) -> tensor``), so a user's own
compressor plugs into `allreduce` as it does in Horovod.

Example:
    >>> import fleetlike.horovod as hvd
    >>> hvd.allreduce(torch.ones(3), op=hvd.Sum, compression=hvd.Compression.fp16)
"""

from __future__ import annotations

from typing import Any

import torch

from fleetlike.comm import ReduceOp

__all__ = [
    "NAMES",
    "OPS",
    "OP_NAMES",
    "Adasum",
    "Average",
    "BF16Compressor",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "Max",
    "Min",
    "NoneCompressor",
    "Product",
    "ReduceOp",
    "Sum",
    "identity",
    "identity_value",
    "op_name",
    "parse_op",
    "resolve_op",
]


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

#: Horovod's names of its reductions, in descriptor order (a descriptor carries the position,
#: `negotiate`; Horovod's own constants count 0..5 in this order)
NAMES: dict[str, ReduceOp] = {"average": Average, "sum": Sum, "adasum": Adasum, "min": Min, "max": Max,
                              "product": Product}
OPS: tuple[ReduceOp, ...] = tuple(NAMES.values())
OP_NAMES = tuple(NAMES)


def parse_op(op: ReduceOp | str) -> ReduceOp:
    """``op`` as a reduction of this face: a member of `OPS` or a Horovod name in any case."""
    return ReduceOp.parse(op, NAMES)


def op_name(op: ReduceOp) -> str:
    """Horovod's name of ``op`` (``"average"`` for `Average`), for messages."""
    return OP_NAMES[OPS.index(op)]


def identity(op: ReduceOp, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    """What a joined rank contributes: the identity of ``op`` (zeros for Sum/Average/Adasum)."""
    return torch.full((numel,), identity_value(op, dtype), dtype=dtype, device=device)


def identity_value(op: ReduceOp, dtype: torch.dtype) -> float | int:
    """The identity of ``op`` in ``dtype`` (0 for Sum/Average/Adasum, 1 for Product, the
    dtype's largest / smallest value for Min / Max)."""
    if op is ReduceOp.PRODUCT:
        return 1
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        return info.max if op is ReduceOp.MIN else info.min
    return 0


def resolve_op(op: ReduceOp | str | None, average: bool | None, default: ReduceOp = Average) -> ReduceOp:
    """Horovod's rule for the deprecated ``average=`` flag: ``op`` wins, giving both is an error."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    return default if op is None else parse_op(op)


class Compressor:
    """Horovod's compressor interface: what travels instead of the tensor, and how to undo it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError("a Compressor subclass defines compress(tensor) -> (tensor, ctx)")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError("a Compressor subclass defines decompress(tensor, ctx) -> tensor")


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    #: the wire dtype of floating-point tensors (None: their own)
    wire_dtype: torch.dtype | None = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel in ``wire_dtype`` and come back in their own dtype."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        if tensor.dtype.is_floating_point:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx else tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (half the bytes; ~3 significant digits)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, ~2 significant digits)."""

    wire_dtype = torch.bfloat16


class Compression:
    """Horovod's namespace of compressors: ``Compression.none``, ``.fp16`` (and ``.bf16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

"""Light's gradient fusion options: which tensors are reduced together, in one collective.

``light.cc.get_distributed_optimizer`` and ``light.cc.fusion_allreduce`` take Light's fusion
arguments; `fusion_segments` turns them into segments (lists of positions in the given order),
each reduced as one fused allreduce:

* ``allreduce_type="normal"``: every tensor alone (Light's ``ltallreduce``);
* ``allreduce_type="fusion"`` (default) with ``fusion_type``:

  - ``"auto_fusion"`` (default): consecutive tensors while their bytes stay within
    ``auto_fusion_threshold`` (default 67108864, 64 MiB); a tensor larger than it is alone;
  - ``"piecewise_fusion"``: ``piecewise_fusion_schedule`` lists boundaries, ``"2;6"`` is three
    segments: positions 0-1, 2-5 and 6 onwards; ``"0"`` (default) one segment of everything;
  - ``"scopewise_fusion"``: ``scopewise_fusion_schedule`` lists name prefixes (PyTorch's module
    paths stand for TensorFlow's variable scopes), ``"encoder;decoder"``: the tensors whose name
    starts with each prefix form one segment, the rest one more; it needs the names
    (``named_parameters``, or ``(grad, name)`` pairs);
  - ``"xlascope_fusion"`` is refused: it groups by XLA ``jit_scope``, which PyTorch has not.

Fusion changes how many collectives run, never the values: an average is an average.

Example:
    >>> fusion_segments([4, 4, 4, 4, 4, 4, 4], fusion_type="piecewise_fusion", piecewise_fusion_schedule="2;6")
    [[0, 1], [2, 3, 4, 5], [6]]
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

__all__ = ["AllreduceType", "DEFAULT_AUTO_FUSION_THRESHOLD", "FusionType", "fusion_segments"]

#: Light's default ``auto_fusion_threshold``, in bytes
DEFAULT_AUTO_FUSION_THRESHOLD = 67108864


class AllreduceType(str, enum.Enum):
    """Light's ``allreduce_type``."""

    NORMAL = "normal"
    FUSION = "fusion"


class FusionType(str, enum.Enum):
    """Light's ``fusion_type``."""

    AUTO = "auto_fusion"
    PIECEWISE = "piecewise_fusion"
    SCOPEWISE = "scopewise_fusion"
    XLASCOPE = "xlascope_fusion"


def _choice(enum_type: type[enum.Enum], name: str, value: object) -> enum.Enum:
    try:
        return enum_type(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}; choose one of {[m.value for m in enum_type]}") from None


def _schedule(text: str) -> list[int]:
    """``"2;6"`` -> [2, 6], checked: non-negative integers in increasing order."""
    if not isinstance(text, str):
        raise TypeError(f"piecewise_fusion_schedule={text!r} must be a string such as '2;6'")
    parts = [p.strip() for p in text.split(";") if p.strip()]
    try:
        bounds = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"piecewise_fusion_schedule={text!r}: give ';'-separated layer indices, e.g. '2;6'") from None
    if any(b < 0 for b in bounds) or any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"piecewise_fusion_schedule={text!r}: the boundaries must be >= 0 and increasing, e.g. '2;6'")
    return bounds


def fusion_segments(nbytes: Sequence[int], *, allreduce_type: str = "fusion", fusion_type: str = "auto_fusion",
                    auto_fusion_threshold: int = DEFAULT_AUTO_FUSION_THRESHOLD,
                    piecewise_fusion_schedule: str = "0", scopewise_fusion_schedule: str = "",
                    names: Sequence[str | None] | None = None) -> list[list[int]]:
    """The segments (positions into ``nbytes``, in order; none empty) Light's options describe
    for tensors of ``nbytes`` bytes each; ValueError naming the option for a bad one."""
    kind = _choice(AllreduceType, "allreduce_type", allreduce_type)
    fusion = _choice(FusionType, "fusion_type", fusion_type)
    n = len(nbytes)
    if kind is AllreduceType.NORMAL:
        return [[i] for i in range(n)]
    if fusion is FusionType.XLASCOPE:
        raise ValueError("fusion_type='xlascope_fusion' groups gradients by TensorFlow XLA jit_scope, which "
                         "PyTorch models do not have; use 'auto_fusion', 'piecewise_fusion' or 'scopewise_fusion'")
    if fusion is FusionType.AUTO:
        if isinstance(auto_fusion_threshold, bool) or not isinstance(auto_fusion_threshold, int) \
                or auto_fusion_threshold < 1:
            raise ValueError(f"auto_fusion_threshold={auto_fusion_threshold!r} must be a positive number of bytes "
                             f"(default {DEFAULT_AUTO_FUSION_THRESHOLD})")
        out: list[list[int]] = []
        size = 0
        for i, b in enumerate(nbytes):
            if out and size + b <= auto_fusion_threshold:
                out[-1].append(i)
                size += b
            else:
                out.append([i])
                size = b
        return out
    if fusion is FusionType.PIECEWISE:
        bounds = [b for b in _schedule(piecewise_fusion_schedule) if 0 < b < n]
        edges = [0, *bounds, n]
        return [list(range(a, b)) for a, b in zip(edges, edges[1:]) if b > a]
    scopes = [s.strip() for s in str(scopewise_fusion_schedule).split(";") if s.strip()]
    if names is None or any(name is None for name in names):
        raise ValueError("fusion_type='scopewise_fusion' groups tensors by name: pass named_parameters="
                         "model.named_parameters() (or (grad, name) pairs to fusion_allreduce)")
    segments: list[list[int]] = [[] for _ in scopes] + [[]]
    for i, name in enumerate(names):
        hit = next((k for k, scope in enumerate(scopes) if str(name).startswith(scope)), len(scopes))
        segments[hit].append(i)
    return [s for s in segments if s]

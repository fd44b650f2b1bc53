"""Dtypes the communicators move, their names, and parsing a closed set given as a str enum.

Why a module of its own: the same snippets (``str(dtype).replace("torch.", "")``, an enum
``parse`` whose error lists the valid choices, the dtype list) were written out in many places;
one copy keeps the spelling of messages, program attributes and tables identical everywhere.
It imports nothing of fleetlike, so every module can use it.

Example:
    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    >>> parse_choice(Backend, "GLOO", what="backend", noun="backend")
    <Backend.GLOO: 'gloo'>
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TypeVar

import torch

__all__ = ["SUPPORTED_DTYPES", "dtype_name", "dtype_names", "parse_choice"]

#: What every backend moves (the base class converts where one cannot reduce a dtype natively).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
)

E = TypeVar("E", bound=enum.Enum)

#: value -> member, per enum class, built on first use (a dict lookup is ~0.1 us, ``cls(v)`` ~0.5)
_TABLES: dict[type[enum.Enum], dict[str, enum.Enum]] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the name used in messages, programs and tables."""
    return str(dtype).replace("torch.", "")


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    """Comma-separated `dtype_name`s, for "supported dtypes: ..." messages."""
    return ", ".join(dtype_name(d) for d in dtypes)


def parse_choice(cls: type[E], value: E | str, *, what: str, noun: str) -> E:
    """``value`` as a member of the str enum ``cls``: the member itself, its value, or its value
    in another case. Anything else raises ValueError naming the value and every valid choice.

    ``what`` is the argument's name and ``noun`` what it should be, for the message:
    ``backend='ucx' is not a backend; choose one of 'auto', 'gloo', ...``.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        table = _TABLES.get(cls)
        if table is None:
            table = _TABLES[cls] = {str(m.value): m for m in cls}
        found = table.get(value)
        if found is None:
            found = table.get(value.lower())
        if found is not None:
            return found  # type: ignore[return-value]
    choices = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"{what}={value!r} is not a {noun}; choose one of {choices}")

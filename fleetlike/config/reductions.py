"""`ReduceOp`: the one set of reductions that every layer and face of fleetlike names.

The communicators reduce with it (``world.all_reduce(t, ReduceOp.AVG)``), the Horovod face's
``hvd.Average``, ``hvd.Sum``, ``hvd.Adasum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product`` are its
members, and the strategy's ``sharding_configs.gradients_reduce_method`` names two of them. Each
API keeps its own spelling of the same member: the collective grid's ``"avg"`` / ``"prod"`` (the
values, `GRID`), Horovod's ``"average"`` / ``"product"``, EPL's ``"mean"``. `ReduceOp.parse`
takes the table of spellings an API accepts and, for anything else, names exactly those.

It sits in the bottom layer (no torch, nothing else of fleetlike) so that the options table can
use it as well as the communicators above.

Example:
    >>> ReduceOp.parse("avg")
    <ReduceOp.AVG: 'avg'>
    >>> ReduceOp.AVERAGE is ReduceOp.AVG          # Horovod's name of the same member
    True
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = ["GRID", "ReduceOp"]


class ReduceOp(str, enum.Enum):
    """A reduction. ``ADASUM`` is the adaptive summation of Maleki et al., which the Horovod face
    runs (`fleetlike.horovod.adasum`); the communicators do the other five (`GRID`)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    ADASUM = "adasum"
    # other APIs' names of the same members (enum aliases: ReduceOp.AVERAGE is ReduceOp.AVG)
    AVERAGE = "avg"
    MEAN = "avg"
    PRODUCT = "prod"

    @classmethod
    def parse(cls, value: ReduceOp | str, names: Mapping[str, ReduceOp] | None = None, *,
              what: str = "op") -> ReduceOp:
        """The member ``value`` names among ``names`` (an API's spellings -> members; None:
        every member, by its value or any of its names): a member, or a spelling in any case.
        Anything else raises ValueError naming the value and every spelling of ``names``.

        ``what`` is the argument's name, for the message: ``op='mean' is not a reduction; choose
        one of 'average', 'sum', ...``.
        """
        table = _ALL if names is None else names
        if isinstance(value, cls):
            if names is None or value in names.values():
                return value
        elif isinstance(value, str):
            found = table.get(value)
            if found is None:
                found = table.get(value.lower())
            if found is not None:
                return found
        shown = value.value if isinstance(value, cls) else value
        choices = ", ".join(repr(k) for k in table)
        hint = ""
        if cls.ADASUM not in table.values() and (value is cls.ADASUM or shown == "adasum"):
            hint = " (Adasum is the Horovod face's: hvd.allreduce(t, op=hvd.Adasum))"
        raise ValueError(f"{what}={shown!r} is not a reduction; choose one of {choices}{hint}")


#: the communicators' reductions, by their values
GRID: dict[str, ReduceOp] = {m.value: m for m in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD)}
#: every spelling the enum knows: each member's value and each of its names, lower case
_ALL: dict[str, ReduceOp] = {**{m.value: m for m in ReduceOp}, **{n.lower(): m for n, m in ReduceOp.__members__.items()}}

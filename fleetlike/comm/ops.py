"""`ReduceOp`: the reductions of the collective grid, as a str enum.

Its own module so the guard and the backends import it without the communicator.

Example:
    >>> ReduceOp.parse("avg")
    <ReduceOp.AVG: 'avg'>
"""

from __future__ import annotations

import enum

from fleetlike.comm.dtypes import parse_choice

__all__ = ["ReduceOp"]


class ReduceOp(str, enum.Enum):
    """Reduction of a collective. Accepts the enum or its name in any case."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @classmethod
    def parse(cls, value: ReduceOp | str) -> ReduceOp:
        """The member for ``value``; a ValueError listing the reductions otherwise."""
        return parse_choice(cls, value, what="op", noun="reduction")

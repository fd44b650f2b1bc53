"""`ReduceOp`: the reductions of the collective grid, the core's one enum (`fleetlike.config.reductions`).

Its own module so the guard and the backends import it without the communicator. A
communicator reduces with the members of `GRID` (sum, avg, max, min, prod) and accepts them by
value in any case; Adasum is the Horovod face's own algorithm.

Example:
    >>> ReduceOp.parse("avg", GRID)
    <ReduceOp.AVG: 'avg'>
"""

from __future__ import annotations

from fleetlike.config.reductions import GRID, ReduceOp

__all__ = ["GRID", "ReduceOp"]

"""The errors of `fleetlike.comm`, in one module every other comm module can import.

Kept apart from the communicator (``base``) and the guard so neither has to import the other
for its exception types: ``base`` raises them, ``guard`` builds them, callers catch them.

Example:
    >>> try:
    ...     world.all_reduce(t)
    ... except CollectiveMismatchError as exc:   # ranks passed different shapes
    ...     print(exc)                            # a table: each rank's op, dtype and shape
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveFailedError",
    "CollectiveMismatchError",
]


class CommError(RuntimeError):
    """A collective could not be carried out (peer missing, backend failure, bad setup)."""


class CollectiveError(CommError):
    """A collective could not complete; the message names the op, its number and the ranks."""

    def __init__(self, message: str, *, op: str, seq: int, missing: list[int] | None) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.missing = missing


class CollectiveTimeoutError(CollectiveError):
    """The collective did not complete within the timeout given to ``fleet.init``."""


class CollectiveFailedError(CollectiveError):
    """The backend failed (typically: a peer died and its connections closed)."""


class CollectiveMismatchError(CommError):
    """Ranks called different collectives at the same point (op, size, shape, dtype, root...).

    Raised on every rank of the group, before any data moves, with one row per rank. ``rows``
    holds the same table as data: one dict per rank (``rank``, ``op``, ``dtype``, ``shape``...).
    """

    def __init__(self, message: str, rows: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.rows = rows or []

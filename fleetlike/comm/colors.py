"""The colour exchange of a `split` through a store, shared by the store-based backends.

gloo and NCCL form sub-groups the same way: each rank writes ``color:key`` under the split's
number, waits for every member's entry, and the ranks of its colour ordered by (key, rank) are
the new group. MPI has ``MPI_Comm_split`` and does not need it.

Example:
    >>> order = split_order(store, seq=0, rank=1, size=4, color=0, key=1, timeout=60, name="world")
    >>> order            # group ranks of the new communicator's members, in its rank order
    [0, 1]
"""

from __future__ import annotations

import datetime
from typing import Any

from fleetlike.comm.errors import CommError

__all__ = ["split_order"]


def split_order(
    store: Any, *, seq: int, rank: int, size: int, color: int | None, key: int, timeout: float, name: str
) -> list[int] | None:
    """Collective over ``store``: the members of ``color`` (group ranks, ordered by key then
    rank), or None when ``color`` is None (this rank takes no part, as MPI_UNDEFINED)."""
    store.set(f"split{seq}/{rank}", f"{-1 if color is None else color}:{key}")
    keys = [f"split{seq}/{r}" for r in range(size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - torch's stores raise several types
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise CommError(
            f"split #{seq} of {name!r}: ranks {missing} did not call split within {timeout:g}s; "
            "every rank of the group must call split, in the same order"
        ) from exc
    entries = [tuple(int(x) for x in store.get(k).decode().split(":")) for k in keys]
    if color is None:
        return None
    return [r for _, r in sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)]

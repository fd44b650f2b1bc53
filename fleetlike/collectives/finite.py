"""``check_nan_inf`` over the ranks: whose gradients were non-finite, agreed by every rank.

A rank that finds NaN or Inf in its own gradients and raises on its own leaves its peers inside
the step's collectives: they wait for it until their timeout, or fail later on an unrelated
collective. Paddle's ``check_nan_inf`` and torch's ``GradScaler`` under FSDP all-reduce a
found-inf flag for that reason; here each rank's two slots of one small all-reduce say which of
its gradients were bad (the first one's index in an order every rank shares, and how many), so
every rank raises the same `FloatingPointError` at the same step, naming the rank and the
parameter, before anything is applied.

Example:
    >>> bad = [i for i, g in enumerate(grads) if not bool(torch.isfinite(g).all())]
    >>> agree_finite(world, bad, names.__getitem__, "before their allreduce")  # raises on every rank, or none
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fleetlike.comm import Communicator

__all__ = ["agree_finite", "describe_non_finite"]


def agree_finite(world: Communicator, bad: Sequence[int], name_of: Callable[[int], str], when: str,
                 what: str = "the gradients") -> None:
    """Raise the same `FloatingPointError` on every rank of ``world`` when any rank's ``bad``
    (indices of gradients in an order every rank shares; ``name_of`` names one) is not empty;
    otherwise return. ``what`` and ``when`` say what was checked (the error reads "{what} of
    rank 1 (fc.weight) held NaN or Inf {when}"). One all-reduce of ``2 * world.size``
    integers, which every rank of ``world`` must call."""
    slots = torch.zeros(2 * world.size, dtype=torch.int64)
    if bad:
        slots[2 * world.rank] = min(bad) + 1
        slots[2 * world.rank + 1] = len(bad)
    if world.size > 1:
        slots = world.all_reduce(slots.to(world.device), "sum", agreed=True).cpu()
    found = {int(world.ranks[r]): (int(slots[2 * r]) - 1, int(slots[2 * r + 1]))
             for r in range(world.size) if int(slots[2 * r + 1])}
    if found:
        raise FloatingPointError(describe_non_finite(found, name_of, when, what))


def describe_non_finite(found: dict[int, tuple[int, int]], name_of: Callable[[int], str], when: str,
                        what: str = "the gradients") -> str:
    """The error for ``found`` ({rank: (index of its first non-finite gradient, how many)})."""
    def one(rank: int) -> str:
        first, count = found[rank]
        name = name_of(first)
        return f"rank {rank} ({name}" + (f" and {count - 1} more" if count > 1 else "") + ")"

    ranks = sorted(found)
    who = f"{what} of " + ", ".join(one(r) for r in ranks)
    whose = f"rank {ranks[0]}'s" if len(ranks) == 1 else "those ranks'"
    return (f"{who} held NaN or Inf {when}; every rank stops at this step, before the update "
            f"(strategy.check_nan_inf found it). Look at {whose} data and loss, or lower the learning rate")

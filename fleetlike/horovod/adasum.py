"""Adasum: the adaptive summation of Maleki et al., as Horovod computes it on CPU.

Two gradients ``a`` and ``b`` combine as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 when its vector's squared norm is below sqrt(DBL_MIN)): orthogonal
gradients add, parallel ones average, so a learning rate tuned for one rank keeps working on
many. Ranks combine pairwise in a binary tree: level 1 pairs ranks (0, 1), (2, 3), ...; level 2
combines the results of {0, 1} and {2, 3}; and so on, the lower group always being ``a``. Each
tensor of a fused call has its own coefficients (Horovod's per-layer ``tensor_counts``).

The data move as in Horovod's ``AdasumMPI`` (vector halving, distance doubling): at each level
a rank swaps half of its current slice with its partner (``rank ^ level``), so each rank
combines ``1/2^level`` of the vector, and the dot products and norms of every tensor are summed
over the ranks that hold its pieces (a small float64 allreduce per level). A final all-gather
puts the slices back together. Dot products and coefficients are computed in float64.

Like Horovod, only a power-of-two number of ranks is supported (`AdasumUnsupportedError`
otherwise) and only float16, float32 and float64 tensors.

Example:
    >>> adasum_allreduce_(flat, counts=[w.numel(), b.numel()], comm=world, pairs=adasum_comms(world))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fleetlike.comm import Communicator

__all__ = ["ADASUM_DTYPES", "AdasumUnsupportedError", "adasum_comms", "adasum_allreduce_", "check_adasum", "slices"]

ADASUM_DTYPES = (torch.float16, torch.float32, torch.float64)
_TINY = math.sqrt(2.2250738585072014e-308)  # sqrt(DBL_MIN), Horovod's threshold


class AdasumUnsupportedError(NotImplementedError):
    """A case Horovod's Adasum does not support either (non-power-of-two ranks, integer dtypes)."""


def check_adasum(size: int, dtype: torch.dtype) -> None:
    """Raise `AdasumUnsupportedError` for what the algorithm cannot do, before any data moves."""
    if size & (size - 1):
        raise AdasumUnsupportedError(
            f"Running Adasum with non-power of 2 ranks is not supported yet (this job has {size} ranks): "
            "Adasum's vector-halving tree pairs ranks level by level. Use 1, 2, 4, 8, ... ranks, or "
            "op=hvd.Average"
        )
    if dtype not in ADASUM_DTYPES:
        raise AdasumUnsupportedError(
            f"Adasum reduces float16, float32 and float64 tensors; got {dtype}. Use op=hvd.Sum for integers"
        )


def refuse_adasum_on_a_set() -> None:
    """Horovod's refusal (its message and type) of Adasum on a process set other than the global
    one: the vector-halving tree is built over the whole world."""
    raise NotImplementedError("Adasum does not support non-global process sets yet.")


def adasum_comms(comm: Communicator) -> list[tuple[Communicator, Communicator]]:
    """``(pair, group)`` communicators for each level: the partner pair, and the ``2 * level``
    ranks whose pieces make up the vectors combined at that level. Collective (splits)."""
    out = []
    level = 1
    while level < comm.size:
        r = comm.rank
        pair = comm.split(r & ~level, r, name=f"{comm.name}.adasum.pair{level}")
        group = comm if 2 * level == comm.size else comm.split(r // (2 * level), r, name=f"{comm.name}.adasum.group{level}")
        assert pair is not None and group is not None
        out.append((pair, group))
        level *= 2
    return out


def slices(count: int, size: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` range of the vector each rank holds after every halving level."""
    out = []
    for r in range(size):
        lo, hi, level = 0, count, 1
        while level < size:
            first = (hi - lo) >> 1
            if r & level:
                lo += first
            else:
                hi = lo + first
            level *= 2
        out.append((lo, hi))
    return out


def adasum_allreduce_(
    buf: torch.Tensor, counts: Sequence[int], comm: Communicator, comms: list[tuple[Communicator, Communicator]]
) -> torch.Tensor:
    """Replace the flat ``buf`` (every rank's, same size) by the Adasum of all ranks' ``buf``.

    ``counts``: the sizes of the tensors fused in ``buf`` (each gets its own coefficients)."""
    check_adasum(comm.size, buf.dtype)
    if comm.size == 1:
        return buf
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    if bounds[-1] != buf.numel():
        raise ValueError(f"adasum: counts sum to {bounds[-1]}, the buffer has {buf.numel()} elements")
    work = buf.double()
    lo, hi, level = 0, buf.numel(), 1
    for pair, group in comms:
        first = (hi - lo) >> 1
        second = (hi - lo) - first
        left = not comm.rank & level
        send = work[lo + first : hi] if left else work[lo : lo + first]
        keep_lo, keep_hi = (lo, lo + first) if left else (lo + first, hi)
        width = max(first, second)
        chunk = torch.zeros(width, dtype=torch.float64, device=buf.device)
        chunk[: send.numel()] = send
        both = pair.all_gather_flat(chunk, agreed=True).view(2, width)
        got = both[1 - pair.rank][: keep_hi - keep_lo]
        mine = work[keep_lo:keep_hi]
        stats = torch.zeros(3 * len(counts), dtype=torch.float64, device=buf.device)
        for t in range(len(counts)):
            s, e = max(bounds[t], keep_lo), min(bounds[t + 1], keep_hi)
            if s >= e:
                continue
            a, b = mine[s - keep_lo : e - keep_lo], got[s - keep_lo : e - keep_lo]
            own, other = float(a.dot(a)), float(b.dot(b))
            stats[3 * t] = float(a.dot(b))
            # slot 1: the left (lower) group's squared norm, slot 2: the right one's
            stats[3 * t + 1], stats[3 * t + 2] = (own, other) if left else (other, own)
        group.all_reduce(stats, "sum", agreed=True)
        sums = stats.tolist()
        for t in range(len(counts)):
            s, e = max(bounds[t], keep_lo), min(bounds[t + 1], keep_hi)
            if s >= e:
                continue
            dot, lnorm, rnorm = sums[3 * t : 3 * t + 3]
            own, other = (lnorm, rnorm) if left else (rnorm, lnorm)
            acoeff = 1.0 - dot / own * 0.5 if own >= _TINY else 1.0
            bcoeff = 1.0 - dot / other * 0.5 if other >= _TINY else 1.0
            a, b = mine[s - keep_lo : e - keep_lo], got[s - keep_lo : e - keep_lo]
            a.mul_(acoeff).add_(b, alpha=bcoeff)
        lo, hi = keep_lo, keep_hi
        level *= 2
    # every rank holds one slice of the result: gather them back into place
    ranges = slices(buf.numel(), comm.size)
    width = max(h - l for l, h in ranges)
    chunk = torch.zeros(width, dtype=torch.float64, device=buf.device)
    chunk[: hi - lo] = work[lo:hi]
    gathered = comm.all_gather_flat(chunk, agreed=True).view(comm.size, width)
    for r, (l, h) in enumerate(ranges):
        work[l:h] = gathered[r, : h - l]
    buf.copy_(work.view(buf.shape))
    return buf

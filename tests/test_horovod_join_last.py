"""The Horovod face's ``hvd.join()`` returns the rank that joined last, and a name shared by two
collectives of different kinds raises on every rank instead of negotiating forever.

Horovod documents ``join`` as returning "the rank that joined last" (its own test asserts the
return is never the first rank to join). Each rank runs a different number of allreduces before
joining, in every order at 2 and 3 ranks; the allreduces repeat one shape (predicted: their data
carry the agreement, `fleetlike.horovod.speculate`) or change shape at every call (agreed by
exchange). The rank with the most allreduces joins last; every rank must return it, and the sums
are checked against the joined ranks' zeros.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

from fleetlike.testing import run_ranks

pytestmark = [pytest.mark.timeout(240)]


def _join_orders(role: Any, orders: list[list[int]], speculated: bool) -> list[dict[str, Any]]:
    import fleetlike.horovod as hvd

    hvd.init(role_maker=role)
    out = []
    for counts in orders:
        sums = []
        for step in range(counts[role.rank]):
            n = 3 if speculated else 3 + step
            got = hvd.allreduce(torch.full((n,), float(role.rank + 1)), op=hvd.Sum, name=None)
            sums.append(got[0].item())
        out.append({"last": hvd.join(), "sums": sums})
    hvd.shutdown()
    return out


def _expected_sums(counts: list[int], rank: int) -> list[float]:
    return [float(sum(r + 1 for r, c in enumerate(counts) if c > step)) for step in range(counts[rank])]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("speculated", [True, False], ids=["predicted", "exchanged"])
def test_join_returns_the_rank_that_joined_last_in_every_order(world: int, speculated: bool) -> None:
    # counts[r]: allreduces rank r runs before joining; the rank with the most joins last
    orders = [[c + 1 for c in perm] for perm in itertools.permutations(range(world))]
    orders += [[1] * world]  # every rank joins in the same round: the highest rank, as before
    results = run_ranks(_join_orders, world, orders, speculated, timeout=180)
    for k, counts in enumerate(orders):
        last = max(range(world), key=lambda r: (counts[r], r))
        for rank in range(world):
            got = results[rank][k]
            assert got["last"] == last, (counts, rank, got)
            assert got["sums"] == _expected_sums(counts, rank), (counts, rank, got)


def _clash(role: Any, case: str) -> dict[str, Any]:
    import fleetlike.horovod as hvd

    hvd.init(role_maker=role)
    x = torch.arange(4.0)
    started = time.monotonic()
    try:
        if case == "tensor":
            hvd.allgather(x, name="n") if role.rank == 0 else hvd.broadcast(x, 0, name="n")
        else:
            hvd.allgather_object({"r": role.rank}) if role.rank == 0 else hvd.broadcast_object({"r": 1}, 0)
        said = "no error"
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        said = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    hvd.shutdown()
    return {"error": said, "took": took}


@pytest.mark.parametrize("case", ["tensor", "object"])
def test_one_name_on_two_kinds_of_collective_raises_on_every_rank(case: str) -> None:
    """``allgather(x, name="n")`` against ``broadcast(x, 0, name="n")``, and ``allgather_object``
    against ``broadcast_object`` (which share their internal names): the mismatch error, with
    both kinds in its table, on both ranks within 10 s."""
    results = run_ranks(_clash, 2, case, timeout=60)
    for res in results:
        assert res["error"].startswith("CollectiveMismatchError"), res
        assert "allgather" in res["error"] and "broadcast" in res["error"], res
        assert res["took"] < 10, res

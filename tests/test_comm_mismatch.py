"""Ranks that pass different sizes get a Python error on every rank, never a process abort.

Before the size check, two gloo ranks calling ``all_reduce`` with 4 and 6 elements died with
SIGABRT inside gloo (``enforce fail at gloo/transport/tcp/pair.cc``, exit 134): nothing to catch.
With default settings each rank must now raise `CollectiveMismatchError` naming every rank's
shape, and go on working; ragged data goes through `all_gather_ragged`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetlike.comm import CollectiveMismatchError, SingleCommunicator, all_gather_ragged
from fleetlike.testing import make_world, run_ranks

KINDS = ("all_reduce", "all_gather", "all_gather_flat", "broadcast", "reduce", "reduce_scatter")


def _shape(kind: str, rank: int) -> tuple[int, ...]:
    """Rank 0 has 4 elements, rank 1 has 6 (reduce_scatter: divisible by the group size)."""
    return (2 * (rank + 2),) if kind == "reduce_scatter" else (rank + 2, 2) if rank else (4,)


def _mismatch(role, kind: str, use_async: bool, check_collectives: bool):
    world = make_world(role)
    world.check_collectives = check_collectives
    try:
        x = torch.ones(_shape(kind, role.rank))
        fn = getattr(world, f"{kind}_async" if use_async else kind)
        try:
            res = fn(x)
            if use_async:
                res.wait()
        except CollectiveMismatchError as exc:
            error = str(exc), exc.rows
        else:
            error = None
        # the communicator still works: the check ran before any data moved
        after = world.all_reduce(torch.tensor([1.0 + role.rank])).item()
        return error, after
    finally:
        world.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_async", [False, True])
def test_different_sizes_raise_on_every_rank_naming_each_shape(kind, use_async):
    results = run_ranks(_mismatch, 2, kind, use_async, False, timeout=60)
    for rank, (error, after) in enumerate(results):
        assert error is not None, f"rank {rank}: no error for {kind} with sizes 4 and 6"
        text, rows = error
        assert "found by the size check" in text, text
        assert [r["shape"] for r in rows] == [str(_shape(kind, 0)), str(_shape(kind, 1))], text
        assert str(_shape(kind, 0)) in text and str(_shape(kind, 1)) in text, text
        assert after == 3.0


@pytest.mark.timeout(60)
def test_full_check_still_names_the_shapes():
    for error, _ in run_ranks(_mismatch, 2, "all_reduce", False, True, timeout=45):
        text, rows = error
        assert "check_collectives is on" in text and [r["shape"] for r in rows] == ["(4,)", "(3, 2)"]


def _agreed_skips_the_check(role):
    world = make_world(role)
    try:
        world.stats.reset()
        x = torch.ones(4)
        world.all_reduce(x, agreed=True)
        world.all_reduce(x)
        return world._seq
    finally:
        world.close()


def test_agreed_calls_skip_the_size_exchange_and_numbering_stays_in_step():
    assert run_ranks(_agreed_skips_the_check, 2, timeout=30) == [2, 2]


def _ragged(role, shapes, dtype):
    world = make_world(role)
    try:
        rng = np.random.default_rng(role.rank)
        x = torch.from_numpy(rng.integers(-100, 100, size=shapes[role.rank])).to(getattr(torch, dtype))
        # plain data back: torch cannot unpickle some dtypes' storages (uint16)
        return [(tuple(p.shape), str(p.dtype), p.to(torch.float64).tolist()) for p in all_gather_ragged(world, x)]
    finally:
        world.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", ["float32", "int8", "int16", "bool", "float16", "uint16"])
def test_ragged_gather_returns_every_rank_shape(dtype):
    shapes = [(3,), (2, 5), ()]
    results = run_ranks(_ragged, 3, shapes, dtype, timeout=60)
    for parts in results:
        for rank, ((got_shape, got_dtype, values), shape) in enumerate(zip(parts, shapes)):
            want = np.random.default_rng(rank).integers(-100, 100, size=shape)
            assert got_shape == shape and got_dtype == f"torch.{dtype}"
            expect = torch.from_numpy(want).to(getattr(torch, dtype)).to(torch.float64)
            assert values == expect.tolist()


def _ragged_dtypes(role):
    world = make_world(role)
    try:
        all_gather_ragged(world, torch.ones(2, dtype=torch.float32 if role.rank else torch.int64))
    except CollectiveMismatchError as exc:
        return str(exc)
    finally:
        world.close()
    return None


@pytest.mark.timeout(60)
def test_ragged_gather_with_different_dtypes_raises_on_every_rank():
    for text in run_ranks(_ragged_dtypes, 2, timeout=45):
        assert text is not None and "int64" in text and "float32" in text


def test_world_of_one_needs_no_check():
    world = SingleCommunicator()
    assert [t.tolist() for t in all_gather_ragged(world, torch.arange(3))] == [[0, 1, 2]]

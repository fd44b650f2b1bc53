"""``fleet.util.all_reduce`` / ``all_gather`` over two real gloo ranks against numpy.

Before the fix int8 / int16 (and the unsigned types) raised TypeError, and ``mode="avg"`` of
integers was floor-divided; now every integer and float dtype reduces, results keep the input's
kind and dtype (wrapping as the dtype's own arithmetic), and the integer mean is numpy's float64.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlike.fleet.util import Util
from fleetlike.testing import make_world, run_ranks

NP_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64")
MODES = ("sum", "max", "min", "avg", "prod")
KINDS = ("ndarray", "tensor", "npscalar")


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    shape: tuple[int, ...]
    mode: str
    kind: str
    seed: int


def _value(case: Case, rank: int) -> np.ndarray:
    rng = np.random.default_rng(case.seed * 7 + rank)
    dt = np.dtype(case.dtype)
    if dt.kind == "f":
        return rng.uniform(-3, 3, size=case.shape).astype(dt)
    info = np.iinfo(dt)
    # the full range: sums and products overflow and must wrap as numpy's do
    return rng.integers(info.min, info.max, size=case.shape, dtype=dt, endpoint=True)


def _input(case: Case, rank: int):
    a = _value(case, rank)
    if case.kind == "tensor":
        return torch.from_numpy(a)
    if case.kind == "npscalar":
        return a.reshape(-1)[0] if a.size else a.dtype.type(0)
    return a


def _expected(case: Case, world: int):
    xs = [np.asarray(_input(case, r) if case.kind != "tensor" else _value(case, r)) for r in range(world)]
    if case.mode == "avg":
        if np.issubdtype(xs[0].dtype, np.integer):
            return np.mean(np.stack(xs), axis=0)  # float64: numpy's rule
        return np.mean(np.stack(xs), axis=0, dtype=np.float64).astype(xs[0].dtype)
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[case.mode]
    with np.errstate(over="ignore"):
        return functools.reduce(ufunc, xs)


def _ranks(role, cases):
    world = make_world(role)
    util = Util(lambda: (world, world.rank, world.size, torch.device("cpu")))
    try:
        out = []
        for case in cases:
            got = util.all_reduce(_input(case, role.rank), case.mode)
            if isinstance(got, torch.Tensor):
                got = ("tensor", str(got.dtype), got.to(torch.float64).numpy() if got.dtype.is_floating_point
                       else got.numpy())
            else:
                got = (type(got).__name__, str(np.asarray(got).dtype), np.asarray(got))
            out.append(got)
        return out
    finally:
        world.close()


def _check(case: Case, got, want: np.ndarray) -> None:
    kind, dtype, values = got
    if case.kind == "tensor":
        assert kind == "tensor" and dtype == f"torch.{want.dtype}", (case, got)
    elif case.kind == "npscalar":
        assert np.asarray(values).shape == (), (case, got)
        assert dtype == str(want.dtype), (case, got)
    else:
        assert dtype == str(want.dtype), (case, got)
    values = np.asarray(values)
    assert values.shape == want.shape, (case, values.shape, want.shape)
    if want.dtype.kind == "f":
        tol = {"float16": 2e-3, "float32": 1e-6}.get(str(want.dtype), 1e-12)
        np.testing.assert_allclose(values.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=str(case))
    else:
        assert np.array_equal(values, want), (case, values, want)


case_st = st.builds(
    Case,
    dtype=st.sampled_from(NP_DTYPES),
    shape=st.sampled_from([(), (1,), (5,), (2, 3)]),
    mode=st.sampled_from(MODES),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
).filter(lambda c: not (c.kind == "npscalar" and c.shape != ()))


@pytest.mark.timeout(300)
@settings(max_examples=6, deadline=None)
@given(st.lists(case_st, min_size=4, max_size=16))
def test_all_reduce_every_dtype_matches_numpy(cases):
    results = run_ranks(_ranks, 2, cases, timeout=90)
    for rank_results in results:
        for case, got in zip(cases, rank_results):
            _check(case, got, _expected(case, 2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["int8", "int16", "uint16", "uint64", "int64"])
def test_integer_dtypes_once_refused_and_their_mean(dtype):
    """The cases of the issue: int8/int16 raised TypeError, the integer mean rounded down."""
    cases = [Case(dtype, (3,), "sum", "ndarray", 1), Case(dtype, (3,), "avg", "ndarray", 2),
             Case(dtype, (3,), "avg", "tensor", 3), Case(dtype, (), "max", "npscalar", 4)]
    for rank_results in run_ranks(_ranks, 2, cases, timeout=90):
        for case, got in zip(cases, rank_results):
            _check(case, got, _expected(case, 2))


def _python_numbers(role):
    world = make_world(role)
    util = Util(lambda: (world, world.rank, world.size, torch.device("cpu")))
    try:
        return (util.all_reduce(role.rank + 2, "avg"), util.all_reduce(role.rank + 2, "sum"),
                util.all_reduce(0.5, "max"), util.all_reduce(torch.tensor([1.0], dtype=torch.bfloat16), "sum").item(),
                [a.tolist() for a in util.all_gather(np.arange(role.rank + 2).reshape(1, -1))],
                util.all_gather(role.rank))
    finally:
        world.close()


def test_python_numbers_bfloat16_and_ragged_gather():
    for res in run_ranks(_python_numbers, 2, timeout=45):
        mean, total, biggest, bf16, ragged, ranks = res
        assert mean == 2.5 and isinstance(mean, float)  # (2 + 3) / 2, not 2
        assert total == 5 and isinstance(total, int)
        assert biggest == 0.5 and bf16 == 2.0
        assert ragged == [[[0, 1]], [[0, 1, 2]]]
        assert ranks == [0, 1]


def test_unsupported_values_say_what_and_how():
    from fleetlike.comm import SingleCommunicator

    world = SingleCommunicator()
    util = Util(lambda: (world, 0, 1, torch.device("cpu")))
    with pytest.raises(TypeError, match="bool.*supported dtypes: int8"):
        util.all_reduce(np.array([True]))
    with pytest.raises(TypeError, match="numbers, numpy arrays or tensors, got str"):
        util.all_reduce("3")
    with pytest.raises(ValueError, match="mode='median'"):
        util.all_reduce(1, "median")
    assert util.all_reduce(np.array([3], dtype=np.int8), "avg").dtype == np.float64

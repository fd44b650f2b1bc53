"""Speculative agreement (`fleetlike.horovod.speculate`) on real gloo ranks, 2 and 3.

One multi-rank run per world size checks, against the sequential path (speculation off, same
ranks, same inputs: bit for bit) and against numpy sums:

- a repeating pattern of allreduces (single and grouped, several ops and dtypes, prescale and
  postscale, async and in place) is predicted after one pass (the hits are counted) and gives
  the sequential path's results;
- ``join`` while the active ranks' allreduce is predicted: the joined rank's identity answers
  the predicted allreduce, every step's sum is right and ``join`` returns the last rank;
- a mismatch on a predicted call (shape with another byte count, op, dtype on one rank) raises
  `CollectiveMismatchError` naming each rank's value on every rank, leaves the in-place tensor
  as it was, and the next calls run;
- every rank changing the call together (a miss) still gives the right result;
- a repeated call builds no descriptor (its `Plan` is reused, the fast path of a hit).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fleetlike.horovod as hvd
from fleetlike.horovod.runtime import runtime
from fleetlike.horovod.speculate import SLOT_MAX_BYTES
from fleetlike.testing import run_ranks

PASSES = 3
BIG = SLOT_MAX_BYTES // 4 + 1000


@pytest.fixture(autouse=True)
def _no_hvd():  # type: ignore[no-untyped-def]
    hvd.shutdown()
    yield
    hvd.shutdown()


def _x(rank: int, step: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    t = torch.randn(n, generator=g)
    return (t * 100).to(dtype) if not dtype.is_floating_point else t.to(dtype)


def _pattern(r: int, step: int) -> dict[str, Any]:
    """One pass of a training-like loop of hvd allreduces; results as numpy arrays."""
    out: dict[str, Any] = {}
    out["sum"] = hvd.allreduce(_x(r, step, 1000), op=hvd.Sum, name="sum").numpy()
    t = _x(r, step, 333, torch.float64)
    hvd.allreduce_(t, name="avg", prescale_factor=0.5, postscale_factor=3.0)
    out["avg"] = t.numpy()
    out["max"] = hvd.synchronize(hvd.allreduce_async(_x(r, step, 77, torch.int32), op=hvd.Max)).numpy()
    g = [_x(r, step, 10), _x(r, step + 50, 4 * 5).view(4, 5)]
    out["grouped"] = [a.numpy() for a in hvd.grouped_allreduce(g, op=hvd.Sum, name="grouped")]
    h = hvd.allreduce_async_(_x(r, step, 4096), op=hvd.Min, name="min")
    out["min"] = hvd.synchronize(h).numpy()
    big = _x(r, step, BIG)  # over SLOT_MAX_BYTES: a coded ring on the tensor itself (no slots, no copy)
    hvd.allreduce_(big, op=hvd.Sum, name="big")
    out["big"] = big.numpy()
    out["big_avg"] = hvd.allreduce(_x(r, step + 70, BIG, torch.float64), name="big_avg", postscale_factor=2.0).numpy()
    out["big_max"] = hvd.allreduce(_x(r, step, BIG + 1, torch.int32), op=hvd.Max, name="big_max").numpy()
    return out


def _rank(role: Any) -> dict[str, Any]:
    hvd.init(role_maker=role, timeout=60)
    try:
        r, n = hvd.rank(), hvd.size()
        spec = runtime().speculator
        res: dict[str, Any] = {}
        # 1. the pattern with speculation, then again without (the sequential path)
        res["spec"] = [_pattern(r, 0)]
        plans = dict(spec._plans)
        built = _count_descriptors()
        res["spec"] += [_pattern(r, s) for s in range(1, PASSES)]
        # a repeated call reuses its plan: no descriptor built, the same plan objects
        res["built_again"] = built()
        res["same_plans"] = spec._plans.keys() == plans.keys() and all(spec._plans[k] is v for k, v in plans.items())
        res["hits"], res["misses"] = spec.hits, spec.misses
        spec.enabled = False
        res["seq"] = [_pattern(r, s) for s in range(PASSES)]
        res["hits_off"] = spec.hits - res["hits"]
        spec.enabled = True
        # 2. join while the active ranks' allreduce is predicted (rank i has 3 + i steps), with
        # slots and as a coded ring (the joined rank polls its ring while answering)
        for size in (512, BIG):
            hits = spec.hits
            got = [hvd.allreduce(_x(r, s, size), op=hvd.Sum, name=f"uneven{size}").numpy() for s in range(3 + r)]
            res[f"join{size}"] = (got, hvd.join(), spec.hits - hits)
        # 3. a mismatch on a predicted call, on one rank: another byte count, op, dtype; with
        # slots (256) and as a coded ring (BIG, reduced in place: a refused ring writes nothing)
        for size in (256, BIG):
            for case in ("numel", "op", "dtype"):
                for s in range(2):
                    hvd.allreduce_(_x(r, s, size), op=hvd.Sum, name="m")
                t, op = _x(r, 9, size), hvd.Sum
                if r == n - 1:
                    t, op = {"numel": (_x(r, 9, size + 44), op), "op": (t, hvd.Max),
                             "dtype": (t.to(torch.int32), op)}[case]
                before = t.clone()
                try:
                    hvd.allreduce_(t, op=op, name="m")
                    res[f"mismatch.{case}.{size}"] = "no error"
                except hvd.CollectiveMismatchError as e:
                    res[f"mismatch.{case}.{size}"] = str(e)
                res[f"untouched.{case}.{size}"] = torch.equal(t, before)
                res[f"after.{case}.{size}"] = hvd.allreduce(_x(r, 5, 64), op=hvd.Sum, name="after").numpy()
        # 4. every rank moves to a new size at once: a miss, then the sequential path
        for s in range(2):
            hvd.allreduce(_x(r, s, 128), op=hvd.Sum, name="grow")
        misses = spec.misses
        res["grow"] = (hvd.allreduce(_x(r, 7, 200), op=hvd.Sum, name="grow").numpy(), spec.misses - misses)
        return res
    finally:
        hvd.shutdown()


def _count_descriptors() -> Any:
    """Count the descriptors `collectives` builds from now on; the reader returns the count and
    puts the real function back."""
    import fleetlike.horovod.collectives as coll

    real, calls = coll.descriptor, [0]

    def counting(*args: Any, **kwargs: Any) -> list[int]:
        calls[0] += 1
        return real(*args, **kwargs)

    def read() -> int:
        coll.descriptor = real
        return calls[0]

    coll.descriptor = counting
    return read


def _sum(arrays: list[np.ndarray]) -> np.ndarray:
    return np.sum(np.stack(arrays), axis=0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_speculative_agreement(world: int) -> None:
    results = run_ranks(_rank, world, timeout=120)
    calls = 8  # allreduces per pass, predicted from the second pass on (the first of the
    # second pass not yet: what follows the last call of a pass is learnt there)
    for r, res in enumerate(results):
        assert res["hits"] >= calls * (PASSES - 1) - 1, (res["hits"], res["misses"])
        assert res["hits_off"] == 0
        assert res["built_again"] == 0 and res["same_plans"], (res["built_again"], res["same_plans"])
        # speculative == sequential, bit for bit, on every call of every pass
        for spec, seq in zip(res["spec"], res["seq"]):
            for k in spec:
                for a, b in zip(*(v if isinstance(v, list) else [v] for v in (spec[k], seq[k]))):
                    np.testing.assert_array_equal(a, b, err_msg=k)
        # and both are the reduction of every rank's input
        for s, got in enumerate(res["spec"]):
            np.testing.assert_allclose(got["sum"], _sum([_x(i, s, 1000).numpy() for i in range(world)]), rtol=1e-5,
                                       atol=1e-5)
            want = np.mean([_x(i, s, 333, torch.float64).numpy() * 0.5 for i in range(world)], axis=0) * 3.0
            np.testing.assert_allclose(got["avg"], want, rtol=1e-12)
            np.testing.assert_array_equal(got["max"], np.max([_x(i, s, 77, torch.int32).numpy()
                                                              for i in range(world)], axis=0))
            np.testing.assert_allclose(got["grouped"][1], _sum([_x(i, s + 50, 20).view(4, 5).numpy()
                                                                for i in range(world)]), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got["min"], np.min([_x(i, s, 4096).numpy() for i in range(world)], axis=0))
            np.testing.assert_allclose(got["big"], _sum([_x(i, s, BIG).numpy() for i in range(world)]), rtol=1e-5,
                                       atol=1e-5)
            want = np.mean([_x(i, s + 70, BIG, torch.float64).numpy() for i in range(world)], axis=0) * 2.0
            np.testing.assert_allclose(got["big_avg"], want, rtol=1e-12)
            np.testing.assert_array_equal(got["big_max"], np.max([_x(i, s, BIG + 1, torch.int32).numpy()
                                                                  for i in range(world)], axis=0))
        # join: at step s the ranks still active are those with 3 + i > s
        for size in (512, BIG):
            got, last, join_hits = res[f"join{size}"]
            assert last == world - 1
            for s, g in enumerate(got):
                want = _sum([_x(i, s, size).numpy() for i in range(world) if s < 3 + i])
                np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5, err_msg=f"join step {s} ({size})")
        for size in (256, BIG):
            for case in ("numel", "op", "dtype"):
                msg = res[f"mismatch.{case}.{size}"]
                assert "disagree" in msg and str(world - 1) in msg, msg
                np.testing.assert_allclose(res[f"after.{case}.{size}"],
                                           _sum([_x(i, 5, 64).numpy() for i in range(world)]), rtol=1e-5, atol=1e-5)
                assert res[f"untouched.{case}.{size}"], (case, size)
            assert f"({size},)" in res[f"mismatch.numel.{size}"] and f"({size + 44},)" in res[f"mismatch.numel.{size}"]
            assert "sum" in res[f"mismatch.op.{size}"] and "max" in res[f"mismatch.op.{size}"]
            assert "int32" in res[f"mismatch.dtype.{size}"] and "float32" in res[f"mismatch.dtype.{size}"]
        grown, misses = res["grow"]
        assert misses == 1
        np.testing.assert_allclose(grown, _sum([_x(i, 7, 200).numpy() for i in range(world)]), rtol=1e-5, atol=1e-5)
    # the joined ranks answered predicted allreduces with their identity (rank 0 joins first)
    assert results[0]["join512"][2] >= 1 and results[0]["join" + str(BIG)][2] >= 1

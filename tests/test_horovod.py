"""``import fleetlike.horovod as hvd`` on real gloo ranks (2, 3, and 4 on two loopback nodes with
hierarchical allreduce), every call against a numpy or single-process torch reference.

One multi-rank run per world size executes the whole suite of `horovod_common.rank_suite`
(collectives in every form, objects, state broadcast, errors, join, DistributedOptimizer
training, SyncBatchNorm); `check_suite` compares each result. The MPI twin is
``test_horovod_mpi.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from horovod_common import (
    DTYPES,
    OPS,
    TRAIN_CASES,
    _np_reduce,
    a2a_input,
    adasum_optimizer_reference,
    adasum_reference,
    inputs,
    key,
    reducescatter_rows,
    splits_for,
    train_join_reference,
    train_reference,
)

import fleetlike.horovod as hvd
from fleetlike.testing import run_ranks


@pytest.fixture(autouse=True)
def _no_hvd():  # type: ignore[no-untyped-def]
    hvd.shutdown()
    yield
    hvd.shutdown()


def check_suite(results: list[dict[str, Any]], world: int, nodes: int = 1) -> None:
    """Every result of `rank_suite` against its reference (shared with the MPI test)."""
    xs = [inputs(r) for r in range(world)]
    per_node = world // nodes
    for r, res in enumerate(results):
        lr = r % per_node
        assert res["topo"][:7] == (r, world, lr, per_node, r // per_node, nodes, True)
        assert res["topo"][9:] == (True, True, True)
    for r, res in enumerate(results):
        for op in OPS:
            for dt in DTYPES:
                if op == "average" and dt is torch.int32:
                    continue
                want = _np_reduce(op, [x[key(dt)].numpy() for x in xs])
                sync, inplace, asy, asy_, dtype = res[f"ar.{op}.{key(dt)}"]
                assert dtype == str(dt)
                if dt is torch.int32:
                    np.testing.assert_array_equal(sync, want)
                else:
                    np.testing.assert_allclose(sync, want, rtol=1e-5, atol=1e-6)
                # async == sync == in place, bit for bit
                for other in (inplace, asy, asy_):
                    np.testing.assert_array_equal(other, sync)
        f32 = [x["f32"].numpy() for x in xs]
        np.testing.assert_allclose(res["ar.scaled"], np.sum([a * 0.5 for a in f32], 0) * 3.0, rtol=1e-5)
        np.testing.assert_allclose(res["ar.average_flag"], np.sum(f32, 0), rtol=1e-5, atol=1e-6)
        fp16, dtype = res["ar.fp16"]
        assert dtype == "torch.float32"
        np.testing.assert_allclose(fp16, np.mean(f32, 0), atol=3e-3 * world)
        np.testing.assert_allclose(res["ar.bf16"], np.mean(f32, 0), atol=3e-2 * world)
        np.testing.assert_allclose(res["ar.grad"], np.full((3, 4), sum(range(1, world + 1))), rtol=1e-6)
        grouped, g_in, g_async = res["grouped"]
        for i, k in enumerate(("g0", "g1")):
            parts = [x[k].numpy() for x in xs]
            np.testing.assert_allclose(grouped[i], np.sum(parts, 0), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(g_in[i], np.mean(parts, 0), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(g_async[i], grouped[i])
        gathered = np.concatenate([x["gather"].numpy() for x in xs])
        np.testing.assert_array_equal(res["gather"][0], gathered)
        np.testing.assert_array_equal(res["gather"][1], gathered)
        # d/dg of sum(2 * allgather(g)): 2, averaged over ranks (Horovod's allgather gradient)
        np.testing.assert_allclose(res["gather.grad"], np.full((r + 1, 3), 2.0))
        for got in res["bcast"]:
            np.testing.assert_array_equal(got, xs[world - 1]["bcast"].numpy())
        a2a, got_splits, splits_dtype, even, splits_dtype_t = res["a2a"]
        want_rows = []
        for j in range(world):
            src = a2a_input(j, world).numpy()
            start = sum(splits_for(j, world)[:r])
            want_rows.append(src[start : start + splits_for(j, world)[r]])
        np.testing.assert_array_equal(a2a, np.concatenate(want_rows))
        assert got_splits == [splits_for(j, world)[r] for j in range(world)]
        assert (splits_dtype, splits_dtype_t) == ("torch.int32", "torch.int64")
        want_even = np.concatenate([
            (np.arange(2 * world * 3, dtype=np.float64).reshape(2 * world, 3) + 100 * j)[2 * r : 2 * r + 2]
            for j in range(world)
        ])
        np.testing.assert_array_equal(even, want_even)
        rows = reducescatter_rows(7, world)
        lo = sum(rows[:r])
        total = np.sum([x["rs"].numpy() for x in xs], 0)
        avg, summed, summed_async = res["rs"]
        np.testing.assert_allclose(summed, total[lo : lo + rows[r]], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(avg, total[lo : lo + rows[r]] / world, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(summed_async, summed)
        if world & (world - 1) == 0:
            one, group, f32_ada = res["adasum"]
            np.testing.assert_allclose(one, adasum_reference([x["ada0"].numpy() for x in xs]), rtol=1e-10)
            np.testing.assert_allclose(group[0], adasum_reference([x["ada0"].numpy() for x in xs]), rtol=1e-10)
            np.testing.assert_allclose(group[1].ravel(), adasum_reference([x["ada1"].numpy() for x in xs]),
                                       rtol=1e-10)
            np.testing.assert_allclose(f32_ada, adasum_reference([x["ada0"].float().numpy() for x in xs]),
                                       rtol=1e-5)
        else:
            assert "non-power of 2 ranks is not supported" in res["adasum"]
            assert f"{world} ranks" in res["adasum"]
        if world & (world - 1) == 0:
            assert "Adasum reduces float16, float32 and float64" in res["adasum.int"]
        else:  # the ranks are checked first
            assert "non-power of 2 ranks" in res["adasum.int"]
        sent, gathered_objs = res["obj"]
        assert sent == {"from": world - 1, "list": list(range(world + 1))}
        assert gathered_objs == [("rank", j, "x" * j) for j in range(world)]
        sd, named, lr, betas, empty, state_keys, step, exp_avg, n_states = res["params"]
        from horovod_common import Net

        base = [p.detach().numpy() for p in Net().parameters()]
        for got, ref in zip(sd, base):
            np.testing.assert_allclose(got, ref + (world - 1), rtol=1e-6)
        for got, ref in zip(named, base):
            np.testing.assert_allclose(got, ref, rtol=1e-6)  # rank 0's (times 1)
        assert lr == pytest.approx(0.001 * world) and betas == pytest.approx((0.9, 0.99 - 0.01 * (world - 1)))
        assert empty == 0  # the root had not stepped: no state anywhere, hyper-parameters only
        assert state_keys == ["exp_avg", "exp_avg_sq", "step"] and step == 1.0 and n_states == 4
        np.testing.assert_allclose(exp_avg, np.full((8, 6), 0.1), rtol=1e-6)  # root's first moment
        for k in ("err.shape", "err.op", "err.dtype", "err.root"):
            assert res[k].startswith("CollectiveMismatchError"), (k, res[k])
        assert "grad.w" in res["err.shape"] and "(3,)" in res["err.shape"] and f"({3 + world - 1},)" in res["err.shape"]
        assert "disagree on the shape" in res["err.shape"]
        assert "disagree on the op" in res["err.op"] and "sum" in res["err.op"] and "average" in res["err.op"]
        assert "disagree on the dtype" in res["err.dtype"] and "float64" in res["err.dtype"]
        assert "disagree on the root" in res["err.root"]
        assert "same name as another tensor that is currently being processed" in res["err.dup"]
        assert "same name as another tensor that is currently being processed" in res["err.dup.done"]
        np.testing.assert_array_equal(res["dup.reused"], np.ones(2))  # Average of ones
        assert "only supports AVERAGE and SUM" in res["err.rs_op"]
        assert res["err.model"].startswith("CollectiveMismatchError") and "optimizer_setup" in res["err.model"]
        assert "disagree on the numel" in res["err.model"] and "the same model" in res["err.model"]
        got, last = res["join"]
        assert last == world - 1
        for k, value in enumerate(got):
            active = [j + 1 for j in range(world) if j >= k]
            want = sum(active) if k % 2 == 0 else sum(active) / world
            np.testing.assert_allclose(value, [want, want], rtol=1e-6)
        seen, last_after = res["join.allgather"]
        assert seen == "joined" if r == 0 else "Allgather is not supported with Join" in seen
        assert last_after == results[0]["join.allgather"][1] and last_after != 0
        for case in TRAIN_CASES:
            ref = train_reference(case, world)
            tol = 2e-3 if case[3] == "fp16" else 1e-6
            for got, want in zip(res["train"][case[0]], ref):
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=case[0])
        params, last, calls, sums = res["train.join"]
        assert last == world - 1
        assert (calls == 0) == (nodes == 1), calls  # hierarchical buckets agree before each step
        assert sums == [float(sum(range(k, world + 1))) for k in range(2, 2 + r)]  # joined ranks add 0
        for got, want in zip(params, train_join_reference(world)[1 + r]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        zero, again, warned, notes, buckets = res["opt.errors"]
        assert buckets > 1  # strategy.fuse_grad_size_in_MB reached the reducer
        assert (("use_hierarchical_allreduce", True) in [n[:2] for n in notes]) == (nodes > 1)
        assert "zero_grad() was called after loss.backward() but before optimizer.step()" in zero
        assert "more than backward_passes_per_step times" in again
        assert any("skip_synchronize" in w for w in warned)
        if world & (world - 1) == 0:
            assert "Skipping synchronization is not supported when using Adasum" in res["opt.adasum_skip"]
            for got, want in zip(res["opt.adasum"], adasum_optimizer_reference(world)):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _check_bn(results, world)
    # every rank ends with the same trained parameters
    for case in TRAIN_CASES:
        for r in range(1, world):
            for a, b in zip(results[0]["train"][case[0]], results[r]["train"][case[0]]):
                np.testing.assert_array_equal(a, b)


def _check_bn(results: list[dict[str, Any]], world: int) -> None:
    xs = [torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    x = torch.cat(xs).requires_grad_(True)
    bn = torch.nn.BatchNorm1d(3)
    y = bn(x)
    weight = torch.cat([torch.full((4, 3, 5), float(r + 1)) for r in range(world)])
    (y * weight).sum().backward()
    for r, res in enumerate(results):
        out, grad, rm, rv = res["bn"]
        np.testing.assert_allclose(out, y.detach()[4 * r : 4 * r + 4].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(grad, x.grad[4 * r : 4 * r + 4].numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rm, bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rv, bn.running_var.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_call_on_gloo(world: int) -> None:
    spec = {"rings": 2, "timeout_case": world == 2}
    results = run_ranks(_gloo, world, spec, timeout=150)
    check_suite(results, world)
    if world == 2:
        assert "CollectiveTimeoutError" in results[0]["timeout"] and "[1]" in results[0]["timeout"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_call_on_two_nodes_hierarchical() -> None:
    """4 ranks on two loopback nodes: topology (cross ranks), Adasum over 4 ranks, and the
    DistributedOptimizer cases on the hierarchical allreduce of the strategy."""
    results = run_ranks(_gloo, 4, {"hierarchical": True}, nodes=2, timeout=150)
    check_suite(results, 4, nodes=2)


def _gloo(role: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from horovod_common import gloo_rank

    return gloo_rank(role, spec)

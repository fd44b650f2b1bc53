"""Horovod's semantics on ``import fleetlike.horovod as hvd`` beyond the basic suite, on real
ranks: 2 and 3 gloo ranks, 2 and 3 MPI ranks (``mpiexec``), one job each running every check of
`horovod_face_common.face_rank`, each compared with a reference computed here from the inputs
(numpy / single-process torch) and Horovod's documented rules. Also ``-np 2 -H localhost:2
--mpi`` under the launcher (hydra's PMI descriptor reaches the ranks through mpiguard). The
3-rank jobs are in the slow tier; the fast tier runs the 2-rank ones.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import run_job
from horovod_face_common import DTYPES, data, emb_input, face_rank, reference, sparse_input
from mpi_runner import mpi_unavailable_reason, run_mpi

from fleetlike.testing import run_ranks

_MPI = mpi_unavailable_reason()


def _gloo(role: Any, spec: dict[str, Any]) -> dict[str, Any]:
    import fleetlike.horovod as hvd

    hvd.init(role_maker=role, timeout=60.0)
    try:
        return face_rank(hvd, {**spec, "init": {"role_maker": role}})
    finally:
        hvd.shutdown()


def mpi_face(spec: dict[str, Any]) -> dict[str, Any]:
    import fleetlike.horovod as hvd

    hvd.init()
    try:
        return face_rank(hvd, spec)
    finally:
        hvd.shutdown()


def _sparse_adam(n: int, as_dense: bool) -> list[list[float]]:
    """SparseAdam on the embedding with the gradients averaged over ranks (one process)."""
    torch.manual_seed(3)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    grads = []
    for q in range(n):
        emb.zero_grad()
        emb(emb_input(q)).sum().backward()
        grads.append(emb.weight.grad.to_dense())
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    emb.weight.grad = (sum(grads) / n).to_sparse()
    opt.step()
    return emb.weight.detach().tolist()


def check(results: list[dict[str, Any]]) -> None:
    n = len(results)
    ref = reference(n)
    for r, res in enumerate(results):
        assert res["built"] == (False, False, True)
        for dt in DTYPES:
            k = str(dt)
            for key in ("gather", "ggather", "bcast", "sum"):
                if f"{key}.{k}" in ref:
                    assert res[f"{key}.{k}"] == ref[f"{key}.{k}"], (key, k, r)
            if f"rs.{k}" in ref:
                assert res[f"rs.{k}"] == ref[f"rs.{k}"][r], (k, r)
            got, received = res[f"a2a.{k}"]
            want, counts = [], []
            for q in range(n):
                splits = [(q + j) % 3 for j in range(n)]
                rows = data(q, dt, sum(splits))[sum(splits[:r]) : sum(splits[: r + 1])]
                want += rows.tolist()
                counts.append(splits[r])
            assert got == want and received == counts, (k, r)
        xs = [data(q, torch.int32, 4).double() for q in range(n)]
        # Horovod scales integers in float64 and truncates toward zero
        assert res["int.pre"] == sum(torch.trunc(x * 0.37) for x in xs).int().tolist()
        assert res["int.post"] == torch.trunc(sum(xs) * 0.37).int().tolist()
        assert res["int.avg"] == torch.trunc(sum(xs) / n).int().tolist()
        rs = torch.trunc(sum(data(q, torch.int64, 4).double() for q in range(n)) / n).long()
        rows = [4 // n + (1 if q < 4 % n else 0) for q in range(n)]
        assert res["int.rs_avg"] == rs[sum(rows[:r]) : sum(rows[: r + 1])].tolist()
        for j, d0 in enumerate((4, 3)):
            total = sum(data(q, torch.float32, d0) for q in range(n)) * 0.5
            rows = [d0 // n + (1 if q < d0 % n else 0) for q in range(n)]
            np.testing.assert_allclose(res["grs"][j], total[sum(rows[:r]) : sum(rows[: r + 1])].numpy(), rtol=1e-6)
        if r == 0:
            assert res["dup"].startswith("ValueError") and "same name" in res["dup"]
        assert res["dup.sum"] == [1.0, 1.0]  # the average of ones
        assert res["dup.freed"] == [(n - 1) / 2] * 2
        assert res["groups.differ"].startswith("CollectiveMismatchError"), res["groups.differ"]
        for nm in "abc":
            assert res["order"][nm] == [float(sum(ord(nm) + q for q in range(n)))] * 3
        assert res["order.never"].startswith("CollectiveMismatchError"), res["order.never"]
        # process sets: ids in the order added, roots as Horovod ranks
        even, odd = list(range(0, n, 2)), list(range(1, n, 2))
        mine = even if r in even else odd
        assert res["ps.ids"] == (1, 2, len(mine), mine.index(r), True, False)
        assert res["ps.sum"] == [float(sum(q + 1 for q in mine))]
        assert res["ps.gather"] == mine and res["ps.bcast"] == [mine[-1]] and res["ps.obj"] == f"from {mine[0]}"
        assert res["ps.foreign"].startswith("ValueError") and "not a member" in res["ps.foreign"]
        assert res["ps.dupe"].startswith("ValueError") and "exists already" in res["ps.dupe"]
        assert res["ps.remove"] == (True, False, True, False)
        # the optimizer on the even set averages over its members; odd ranks step alone
        torch.manual_seed(5)
        model = torch.nn.Linear(3, 2)
        members = even if r in even else [r]
        grads = []
        for q in members:
            model.zero_grad()
            model(data(q, torch.float32, 2)).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        want = [p.detach() - 0.5 * sum(g[i] for g in grads) / len(members) for i, p in enumerate(model.parameters())]
        for got, w in zip(res["ps.opt"], want):
            np.testing.assert_allclose(got, w.numpy(), rtol=1e-6, atol=1e-7)
        dense = sum(sparse_input(q).to_dense() for q in range(n)) / n
        np.testing.assert_allclose(res["sparse"], dense.numpy(), rtol=1e-6)
        for as_dense in (False, True):
            np.testing.assert_allclose(res[f"emb.{as_dense}"], _sparse_adam(n, as_dense), rtol=1e-5, atol=1e-6)
        assert res["names"] == ["allreduce.noname.0.0"]
        # rank r did r allreduces before joining: the last to join is n - 1, on every rank
        assert res["join.last"] == n - 1
        seen, last = res["join.gather"]
        assert seen == "waited" if r == 0 else "Allgather is not supported with Join" in seen
        assert last == results[0]["join.gather"][1] and last != 0
        if n == 2:
            assert res["join.int"] == (1, None if r == 0 else [-37])  # -75 / 2 truncated, as Horovod
        if "fail" in res:
            assert "lonely" in res["fail"] or "Timeout" in res["fail"], res["fail"]
        if "after" in res:
            assert res["after"] == [float(n)]
        ps = list(range(n))[::-1][: max(1, n - 1)]
        assert res["init.ps"] == (1, r in ps, [float(len(ps))] if r in ps else None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_horovod_semantics_on_gloo(world: int) -> None:
    check(run_ranks(_gloo, world, {"recover": world == 2}, timeout=240))


@pytest.mark.mpi
@pytest.mark.skipif(_MPI is not None, reason=_MPI or "")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_horovod_semantics_on_mpi(world: int) -> None:
    check(run_mpi(world, "call", {"target": "test_horovod_face:mpi_face", "data": {}}, timeout=240))


@pytest.mark.mpi
@pytest.mark.skipif(_MPI is not None, reason=_MPI or "")
@pytest.mark.timeout(120)
def test_np_hosts_mpi_mode_keeps_hydras_descriptors(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import fleetlike.horovod as hvd
        hvd.init()
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
        print(f"rank {hvd.rank()} of {hvd.size()} mpi={hvd.mpi_enabled()} sum={total.item()}", flush=True)
    """))
    from test_launch_run import clean_env

    # the launcher forked from the session's preload server (stdout and stderr in one pipe); the
    # ranks mpiexec starts are plain interpreters either way
    proc = run_job([sys.executable, "-m", "fleetlike.launch", "-np", "2", "-H", "localhost:2", "--mpi",
                    "--", sys.executable, str(script)], cwd=tmp_path, env=clean_env(), timeout=100)
    assert proc.returncode == 0, proc.stdout
    for r in range(2):
        assert f"rank {r} of 2 mpi=True sum=3.0" in proc.stdout

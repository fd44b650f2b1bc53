"""The coded allreduce (`fleetlike.comm.coded`) on real gloo ranks, 2, 3 and 4, against numpy.

Every rank draws the same random cases (a seeded property test: element counts from 0 to several
pieces per chunk, every reduction, six dtypes, codes that are accepted or refused); for each:

- accepted: every rank holds the numpy reduction of all ranks' inputs, bit for bit the same on
  every rank, and every rank returned every rank's code in rank order;
- refused: every buffer is exactly what it was (nothing written before the codes were known);
- chunks travel in several pieces (the piece size is made tiny), and fewer elements than ranks;
- polled (`is_completed` until true) gives what a plain wait gives;
- a second one while one is in flight, a non-contiguous tensor, a non-int code: clear errors;
- a rank that never comes: the others get `CollectiveTimeoutError` naming it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from fleetlike.comm import CollectiveTimeoutError, CommError, ReduceOp
from fleetlike.testing import run_ranks

OPS = ["sum", "avg", "min", "max", "prod"]
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16]
CASES = 40


def _cases(size: int) -> list[dict[str, Any]]:
    """The same cases on every rank (and in the test process)."""
    rng = np.random.RandomState(1234 + size)
    out = []
    for i in range(CASES):
        dtype = DTYPES[rng.randint(len(DTYPES))]
        op = OPS[rng.randint(len(OPS))]
        if op == "avg" and not dtype.is_floating_point:
            op = "sum"
        numel = int(rng.choice([0, 1, size - 1, size, size + 1, rng.randint(2, 200), rng.randint(200, 5000)]))
        out.append({"numel": numel, "op": op, "dtype": dtype, "refuse": bool(rng.rand() < 0.3),
                    "piece_bytes": int(rng.choice([8, 64, 1 << 20])), "poll": bool(rng.rand() < 0.2)})
    return out


def _data(rank: int, i: int, case: dict[str, Any]) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * i + rank)
    if case["op"] == "prod":  # stay finite: near 1 for floats, 1..2 for integers
        base = torch.rand(case["numel"], generator=g, dtype=torch.float64) * 0.5 + 0.75
        if not case["dtype"].is_floating_point:
            base = torch.randint(1, 3, (case["numel"],), generator=g).double()
    else:
        base = torch.randn(case["numel"], generator=g, dtype=torch.float64) * 10
    return base.to(case["dtype"])


def _code(rank: int, i: int) -> int:
    return 10 * i + rank


def _cases_rank(role: Any) -> dict[str, Any]:
    import fleetlike.comm.coded as coded
    from fleetlike.comm import create_world

    world = create_world(role, timeout=60)
    try:
        out: dict[str, Any] = {"results": []}
        for i, case in enumerate(_cases(world.size)):
            coded.SEGMENT_BYTES = case["piece_bytes"]
            t = _data(world.rank, i, case)
            refuse = case["refuse"]
            work = world.all_reduce_coded_async(t, case["op"], _code(world.rank, i),
                                                accept=lambda codes, refuse=refuse: not refuse)
            if case["poll"]:
                deadline = time.monotonic() + 30
                while not work.is_completed() and time.monotonic() < deadline:
                    time.sleep(0.001)
            codes = work.wait()
            out["results"].append((codes, t.double().numpy().copy(), t.view(-1).clone()))
        coded.SEGMENT_BYTES = 1 << 20
        # one in flight at a time per communicator
        first = world.all_reduce_coded_async(torch.ones(8), "sum", 1)
        try:
            world.all_reduce_coded_async(torch.ones(8), "sum", 1)
            out["busy"] = "no error"
        except CommError as exc:
            out["busy"] = str(exc)
        first.wait()
        for what, call in {
            "strided": lambda: world.all_reduce_coded_async(torch.ones(4, 4).t(), "sum", 1),
            "code": lambda: world.all_reduce_coded_async(torch.ones(4), "sum", True),
            "op": lambda: world.all_reduce_coded_async(torch.ones(4), "median", 1),
        }.items():
            try:
                call()
                out[what] = "no error"
            except (TypeError, ValueError) as exc:
                out[what] = f"{type(exc).__name__}: {exc}"
        # the communicator still works after refused rings and bad calls
        t = torch.full((5,), float(world.rank))
        out["after"] = (world.all_reduce_coded_async(t, ReduceOp.SUM, 0).wait(), t.tolist())
        return out
    finally:
        world.close()


def _reference(arrays: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(arrays)
    return {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0), "max": stack.max(0),
            "prod": stack.prod(0)}[op]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4))])
def test_coded_allreduce_against_numpy(world: int) -> None:
    results = run_ranks(_cases_rank, world, timeout=150)
    for i, case in enumerate(_cases(world)):
        inputs = [_data(r, i, case).double().numpy() for r in range(world)]
        want_codes = [_code(r, i) for r in range(world)]
        got = [res["results"][i] for res in results]
        for r, (codes, value, _) in enumerate(got):
            assert codes == want_codes, (i, case, r, codes)
            if case["refuse"]:  # nothing written: each rank still holds its own input
                np.testing.assert_array_equal(value, inputs[r], err_msg=f"case {i} {case} rank {r}")
                continue
            want = _reference(inputs, case["op"])
            dtype = case["dtype"]
            if not dtype.is_floating_point:
                np.testing.assert_array_equal(value, want, err_msg=f"case {i} {case}")
            else:
                tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 3e-2)
                np.testing.assert_allclose(value, want, rtol=tol, atol=tol * 10, err_msg=f"case {i} {case}")
        if not case["refuse"]:  # one result, the same bits on every rank
            for _, _, raw in got[1:]:
                assert torch.equal(raw, got[0][2]), (i, case)
    for res in results:
        assert "in flight" in res["busy"], res["busy"]
        assert res["strided"].startswith("ValueError") and "contiguous" in res["strided"], res["strided"]
        assert res["code"].startswith("TypeError") and "code must be an int" in res["code"], res["code"]
        assert res["op"].startswith("ValueError") and "median" in res["op"], res["op"]
        codes, value = res["after"]
        assert codes == [0] * world and value == [float(sum(range(world)))] * 5


def _absent_rank(role: Any, gave_up: str) -> tuple[str, str]:
    """Rank 1 stays away from the coded all-reduce until the others have given up on it (each
    writes a file in ``gave_up``), however long their 2 s timeout takes to fire."""
    from fleetlike.comm import create_world

    world = create_world(role, timeout=2.0)
    world.all_reduce(torch.ones(2))  # everyone is here
    if world.rank == 1:
        while not all(os.path.exists(os.path.join(gave_up, str(r))) for r in (0, 2)):
            time.sleep(0.02)
        return "stayed away", ""
    try:
        world.all_reduce_coded_async(torch.ones(1000), "sum", 2).wait()
        return "ok", ""
    except CollectiveTimeoutError as exc:
        return type(exc).__name__, str(exc)
    finally:
        open(os.path.join(gave_up, str(world.rank)), "w").close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_that_never_comes_is_named(tmp_path) -> None:
    results = run_ranks(_absent_rank, 3, str(tmp_path), timeout=45)
    for rank in (0, 2):
        kind, msg = results[rank]
        assert kind == "CollectiveTimeoutError", (kind, msg)
        assert "ranks [1] did not arrive" in msg and "2s timeout" in msg, msg

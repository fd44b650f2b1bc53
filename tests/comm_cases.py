"""Collective test cases shared by the gloo and MPI property tests: inputs, execution, reference.

A case is plain data, so hypothesis draws it in the test process, every rank runs it, and the
test process checks each rank's result against numpy on the same (re-generated) inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_flat", "reduce_scatter")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")
OPS = ("sum", "avg", "max", "min", "prod")


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    dtype: str
    shape: tuple[int, ...]
    op: str
    root: int
    seed: int
    inplace: bool
    use_async: bool


def case_strategy(world: int) -> st.SearchStrategy[Case]:
    def build(kind: str, rows: int, cols: int, **kw: Any) -> Case:
        if kind == "reduce_scatter":
            shape: tuple[int, ...] = (world * rows, cols)
        elif cols == 0 and rows == 0:
            shape = ()
        else:
            shape = (rows, cols) if cols else (rows,)
        return Case(kind=kind, shape=shape, **kw)

    return st.builds(
        build,
        kind=st.sampled_from(KINDS),
        rows=st.integers(0, 5),
        cols=st.integers(0, 7),
        dtype=st.sampled_from(DTYPES),
        op=st.sampled_from(OPS),
        root=st.integers(0, world - 1),
        seed=st.integers(0, 2**16),
        inplace=st.booleans(),
        use_async=st.booleans(),
    )


def make_input(case: Case, rank: int) -> torch.Tensor:
    rng = np.random.default_rng(case.seed * 131 + rank)
    dtype = getattr(torch, case.dtype)
    if dtype.is_floating_point:
        data = torch.from_numpy(rng.uniform(-2.0, 2.0, size=case.shape)).to(dtype)
    else:
        low = 0 if dtype == torch.uint8 else -3
        data = torch.from_numpy(rng.integers(low, 4, size=case.shape)).to(dtype)
    return data


def run_case(comm: Any, case: Case, device: torch.device | str | None = None) -> dict[str, Any]:
    """Run ``case`` twice on this rank: as flagged (async / in place) and plain; return both.

    With ``device`` the inputs live there (CUDA for nccl); the results come back on the CPU."""
    x = make_input(case, comm.rank)
    if device is not None:
        x = x.to(device)
    return {"flagged": _cpu(_run(comm, case, x.clone(), case.inplace, case.use_async)),
            "plain": _cpu(_run(comm, case, x.clone(), False, False))}


def _cpu(result: Any) -> Any:
    if isinstance(result, list):
        return [t.cpu() for t in result]
    return result.cpu()


def _run(comm: Any, case: Case, x: torch.Tensor, inplace: bool, use_async: bool) -> Any:
    name = case.kind
    fn = getattr(comm, f"{name}_async" if use_async else name)
    finish = (lambda w: w.wait()) if use_async else (lambda r: r)
    n, r = comm.size, comm.rank
    if name == "all_reduce":
        return finish(fn(x, case.op) if inplace else fn(x, case.op, out=torch.empty_like(x))).clone()
    if name == "broadcast":
        return finish(fn(x, case.root) if inplace else fn(x, case.root, out=torch.empty_like(x))).clone()
    if name == "reduce":
        out = x.clone()
        return finish(fn(x, case.root, case.op) if inplace else fn(x, case.root, case.op, out=out)).clone()
    if name == "all_gather":
        return [t.clone() for t in finish(fn(x))]
    if name == "all_gather_flat":
        if inplace:
            buf = torch.zeros(n * x.numel(), dtype=x.dtype, device=x.device)
            k = x.numel()
            buf[r * k : (r + 1) * k].copy_(x.reshape(-1))
            return finish(fn(buf[r * k : (r + 1) * k], out=buf)).clone()
        return finish(fn(x)).clone()
    if name == "reduce_scatter":
        if inplace:
            flat = x.reshape(-1)
            k = flat.numel() // n
            return finish(fn(flat, case.op, out=flat[r * k : (r + 1) * k])).clone()
        return finish(fn(x, case.op)).clone()
    raise ValueError(name)


def _reduce(stack: np.ndarray, op: str, is_float: bool) -> np.ndarray:
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        s = stack.sum(0)
        return s / stack.shape[0] if is_float else np.floor_divide(s, stack.shape[0])
    if op == "max":
        return stack.max(0)
    if op == "min":
        return stack.min(0)
    return stack.prod(0)


def expected(case: Case, world: int, rank: int) -> Any:
    xs = [make_input(case, i) for i in range(world)]
    is_float = xs[0].is_floating_point()
    stack = np.stack([x.double().numpy() if is_float else x.long().numpy() for x in xs])
    dtype = getattr(torch, case.dtype)
    back = lambda a: torch.from_numpy(np.asarray(a)).to(dtype)  # noqa: E731
    if case.kind == "all_reduce":
        return back(_reduce(stack, case.op, is_float))
    if case.kind == "broadcast":
        return xs[case.root]
    if case.kind == "reduce":
        return back(_reduce(stack, case.op, is_float)) if rank == case.root else xs[rank]
    if case.kind == "all_gather":
        return xs
    if case.kind == "all_gather_flat":
        return torch.cat([x.reshape(-1) for x in xs])
    if case.kind == "reduce_scatter":
        full = back(_reduce(stack, case.op, is_float)).reshape(-1)
        k = full.numel() // world
        return full[rank * k : (rank + 1) * k]
    raise ValueError(case.kind)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return {torch.float16: (1e-2, 2e-2), torch.bfloat16: (2e-2, 8e-2),
            torch.float32: (1e-5, 1e-5)}.get(dtype, (1e-12, 1e-12))


def assert_close(got: Any, want: Any, case: Case, rank: int) -> None:
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (case, rank)
        for g, w in zip(got, want):
            assert_close(g, w, case, rank)
        return
    assert got.dtype == want.dtype, (case, rank, got.dtype)
    assert got.numel() == want.numel(), (case, rank, got.shape, want.shape)
    g, w = got.reshape(-1), want.reshape(-1)
    if got.is_floating_point():
        rtol, atol = tolerance(got.dtype)
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=atol, msg=lambda m: f"{case} rank {rank}: {m}")
    else:
        assert torch.equal(g, w), f"{case} rank {rank}: {g} != {w}"


def run_cases(comm: Any, cases: list[Case], device: torch.device | str | None = None) -> list[dict[str, Any]]:
    return [run_case(comm, c, device) for c in cases]


def run_by_world(draws: list[tuple[int, list[Case]]], world_of: Callable[[int], Any], keep: Any = None) -> list[Any]:
    """For each ``(n, cases)`` in turn, the cases on ``world_of(n)`` (a communicator of the job's
    first ``n`` ranks; None on the ranks outside it, whose result is None). Each communicator is
    closed after its cases, except ``keep`` (the job's world, used for its own size)."""
    results = []
    for n, cases in draws:
        comm = world_of(n)
        if comm is None:
            results.append(None)
            continue
        try:
            results.append(run_cases(comm, cases))
        finally:
            if comm is not keep:
                comm.close()
    return results


def check_by_world(draws: list[tuple[int, list[Case]]], per_rank: list[list[Any]]) -> None:
    """`check_all` for each draw of `run_by_world`, and None from the ranks outside its world."""
    for i, (world, cases) in enumerate(draws):
        check_all(cases, [per_rank[r][i] for r in range(world)])
        assert all(per_rank[r][i] is None for r in range(world, len(per_rank))), i


def check_all(cases: list[Case], results: list[list[dict[str, Any]]]) -> None:
    world = len(results)
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            assert_close(res["flagged"], expected(case, world, rank), case, rank)
            # async and in-place give bit-identical results to the plain blocking call
            f, p = res["flagged"], res["plain"]
            for a, b in zip(f if isinstance(f, list) else [f], p if isinstance(p, list) else [p]):
                assert torch.equal(a, b), f"{case} rank {rank}: flagged {a} != plain {b}"

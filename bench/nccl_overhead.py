"""Host cost of one NCCL ``all_reduce`` call through fleetlike, on the CPU, against a no-op NCCL.

What a GPU run measures as "fleetlike's per-call overhead" (docs/gpu.md) is Python: argument
checks, numbering, the size check, ordering the comm stream after the caller's, the handle and
its event, the watchdog's bookkeeping. This times exactly that path with CuPy's NCCL binding
and torch.cuda's stream and event calls replaced by no-op stand-ins, so it runs without a GPU
and compares two trees of fleetlike side by side: ``--base REV`` (a git revision, extracted to a
temporary folder) against the working tree. Each tree runs in its own process; the rows
interleave nothing across processes, so each row is the median of ``--reps`` repetitions of
``--calls`` calls.

Rows (8-byte float32 tensor, world of one unless said; a world of one still calls NCCL):

- ``raw``: the stand-in binding's ``allReduce`` alone (the floor: a Python call);
- ``all_reduce``: ``world.all_reduce(x)`` in place (blocking form: launch, then ``wait``);
- ``all_reduce_async+wait``: ``world.all_reduce_async(x).wait()``;
- ``2 ranks, agreed``: a two-rank world (the stand-in mirrors a peer), ``agreed=True``;
- ``2 ranks, size check``: the same without ``agreed``: the default size check included.

Usage (from the repository root)::

    python -m bench.nccl_overhead --base 2f9e186      # before (REV) / after (this tree)

Prints the table and writes ``docs/benchmarks/nccl_overhead_cpu.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, run_info, save_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "nccl_overhead_cpu.json"


class _Stream:
    cuda_stream = 1234

    def __init__(self, *a: Any, **kw: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Event:
    def __init__(self, *a: Any, **kw: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _fake_nccl() -> types.ModuleType:
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    (nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN, nccl.NCCL_AVG) = range(5)
    (nccl.NCCL_INT8, nccl.NCCL_UINT8, nccl.NCCL_INT32, nccl.NCCL_UINT32, nccl.NCCL_INT64, nccl.NCCL_UINT64,
     nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT64, nccl.NCCL_BFLOAT16) = range(10)

    class NcclError(RuntimeError):
        pass

    class NcclCommunicator:
        def __init__(self, ndev: int, uid: Any, rank: int) -> None:
            self.ndev = ndev

        def allReduce(self, s: int, r: int, n: int, t: int, op: int, stream: int) -> None:
            pass

        def allGather(self, s: int, r: int, n: int, t: int, stream: int) -> None:
            if self.ndev > 1:  # a mirrored peer: the same row twice (the size check agrees)
                import ctypes
                nbytes = n * 8
                ctypes.memmove(r, s, nbytes)
                ctypes.memmove(r + nbytes, s, nbytes)

        def check_async_error(self) -> None:
            pass

        def destroy(self) -> None:
            pass

        def abort(self) -> None:
            pass

    nccl.NcclError = NcclError
    nccl.NcclCommunicator = NcclCommunicator
    nccl.get_version = lambda: 22703
    nccl.get_unique_id = lambda: bytes(128)
    nccl.groupStart = nccl.groupEnd = lambda: None
    return nccl


def _worker(calls: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import fleetlike.comm.nccl as nccl_mod

    current = _Stream()
    torch.cuda.Stream = _Stream  # type: ignore[misc]
    torch.cuda.Event = _Event  # type: ignore[misc]
    torch.cuda.current_stream = lambda device=None: current  # type: ignore[assignment]
    torch.cuda.device = lambda d: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.stream = lambda s: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.set_device = lambda d: None  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, s: None  # type: ignore[method-assign]
    try:  # the fast stream query lives beside the NCCL handle; in older trees, in nccl.py itself
        import fleetlike.comm.nccl_work as stream_mod
    except ImportError:
        stream_mod = nccl_mod
    stream_mod._GET_CURRENT_STREAM = None
    try:
        import fleetlike.comm.cuda as cuda_mod
        cuda_mod.dedicated_stream = lambda device: (_Stream(), None)
    except ImportError:  # a tree from before the module
        pass
    nccl = _fake_nccl()

    def world(size: int) -> Any:
        store = dist.PrefixStore("nccl/world/", dist.HashStore())
        return nccl_mod.NcclCommunicator._connect(nccl, store, 0, size, range(size), "world", torch.device("cpu"), 600)

    one, two = world(1), world(2)
    x = torch.ones(2, dtype=torch.float32)
    raw, p = one.nccl_comm, x.data_ptr()
    cases = {
        "raw": lambda: raw.allReduce(p, p, 2, 7, 0, 1234),
        "all_reduce": lambda: one.all_reduce(x),
        "all_reduce_async+wait": lambda: one.all_reduce_async(x).wait(),
        "2 ranks, agreed": lambda: two.all_reduce(x, agreed=True),
        "2 ranks, size check": lambda: two.all_reduce(x),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for name, fn in list(cases.items()):
        try:
            for _ in range(200):
                fn()
        except Exception as exc:  # noqa: BLE001 - a tree this stand-in cannot drive: say so, go on
            print(f"{name}: not timed ({type(exc).__name__}: {exc})", file=sys.stderr)
            del cases[name], times[name]
    for _ in range(reps):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def _tree_of(rev: str, into: Path) -> Path:
    """``fleetlike/`` of git revision ``rev``, extracted under ``into``."""
    archive = into / "tree.tar"
    subprocess.run(["git", "archive", "-o", str(archive), rev, "fleetlike", "bench"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    # this script and its helpers, as they are here (the revision may predate them)
    for name in ("nccl_overhead.py", "_common.py", "__init__.py"):
        (into / "bench" / name).write_text((ROOT / "bench" / name).read_text())
    return into


def _run_tree(path: Path, calls: int, reps: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(path))
    done = subprocess.run([sys.executable, "-m", "bench.nccl_overhead", "--worker", "--calls", str(calls),
                           "--reps", str(reps)], cwd=path, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the worker in {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git revision to compare against (before); omitted: this tree only")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.calls, args.reps)))
        return
    after = _run_tree(ROOT, args.calls, args.reps)
    before = None
    if args.base:
        with tempfile.TemporaryDirectory() as tmp:
            before = _run_tree(_tree_of(args.base, Path(tmp)), args.calls, args.reps)
    rows = [{"path": k, "before": (before or {}).get(k), "after": v,
             "ratio": v / before[k] if before and k in before else None} for k, v in after.items()]
    cols = [Column("path", "call (8 B float32, fake NCCL)"), Column("before", "before us/call", "{:.2f}"),
            Column("after", "after us/call", "{:.2f}"), Column("ratio", "after/before", "{:.2f}")]
    print(format_table(cols, rows))
    save_json(OUT, {"run": run_info("bench.nccl_overhead", argv), "base": args.base, "calls": args.calls,
                    "reps": args.reps, "rows": rows})
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

"""Collectives, nccl-tests style: fleetlike's communicators against the raw backend, side by side.

For each backend, op and message size it times the fleetlike call and the raw backend's call on
the *same* transport and buffers:

=========  =========================================  ===========================================
backend    fleetlike                                  raw
=========  =========================================  ===========================================
gloo       ``GlooCommunicator.all_reduce(t)`` ...     its ``process_group.allreduce([t]).wait()``
mpi        ``MPICommunicator.all_reduce(t)`` ...      ``mpi_comm.Allreduce(IN_PLACE, a)``, ``a`` a
                                                      numpy view of ``t`` made once
=========  =========================================  ===========================================

so the ratio isolates fleetlike's wrapper. Every call is timed alone, the implementations
interleaved in rotating order (A B, B A, ...; A B C, B C A, ... with the control), with no
barrier between (consecutive collectives keep the ranks in step), so machine noise hits all
alike; a call's time is the slowest rank's, and a row reports
the median over calls. Columns follow nccl-tests: ``size`` is the largest buffer (all_gather's
output, reduce_scatter's input), algbw = size / time, busbw = algbw x factor (all_reduce
2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1). ``ratio`` is fleetlike busbw /
raw busbw (= raw time / fleetlike time); ``paired`` the median of per-call ratios of neighbouring
fleetlike and raw calls; ``+us`` the per-call overhead (difference of the medians) and
``best +us`` the difference of the fastest calls, which load on the machine disturbs least.
``raw/raw`` times the raw call against itself as a third interleaved implementation: how far
from 1.0 a ratio strays on this machine with no difference at all (``--no-control`` skips it).

Usage (from the repository root)::

    python -m bench.collectives                      # gloo and mpi, 2 ranks, 8 B .. 256 MiB
    python -m bench.collectives --backend gloo --max-bytes 16M --ops all_reduce

Writes ``docs/benchmarks/collectives_<backend>.json`` and ``.png``. Gloo ranks are processes
from `fleetlike.testing.run_ranks`; MPI ranks are this module re-run under ``mpiexec --worker``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench._common import (
    Column,
    format_table,
    human_bytes,
    interleaved_timings,
    median,
    parse_bytes,
    plot_panels,
    run_info,
    run_mpiexec,
    save_json,
    size_ladder,
)

__all__ = ["OPS", "bus_factor", "Config", "main"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BACKENDS = ("gloo", "mpi")
ROOT = Path(__file__).resolve().parents[1]

#: Targets from the issue: busbw ratio for messages >= 1 MiB, overhead on 8-byte messages.
TARGET_RATIO = 0.95
TARGET_RATIO_FROM = 1 << 20
TARGET_OVERHEAD_US = 30.0


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"op={op!r} is not benchmarked; choose one of {', '.join(OPS)}")


@dataclasses.dataclass(frozen=True)
class Config:
    world: int
    sizes: tuple[int, ...]
    ops: tuple[str, ...]
    iters: int
    min_iters: int
    size_budget: int
    control: bool = False

    def calls(self, nbytes: int) -> int:
        """Timed calls per implementation: ``size_budget`` bytes' worth, within the bounds."""
        return max(self.min_iters, min(self.iters, self.size_budget // max(nbytes, 1)))


# --------------------------------------------------------------------------- calls


def _count(op: str, nbytes: int, world: int) -> int:
    """float32 elements of the largest buffer: a multiple of the world for the chunked ops."""
    count = max(nbytes // 4, 1)
    if op in ("all_gather", "reduce_scatter"):
        count = max(count - count % world, world)
    return count


def _gloo_calls(comm: Any, op: str, count: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions, ReduceScatterOptions

    pg, n = comm.process_group, comm.size
    if op == "all_reduce":
        t = torch.zeros(count)
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return (lambda: comm.all_reduce(t)), (lambda: pg.allreduce([t], opts).wait())
    if op == "broadcast":
        t = torch.zeros(count)
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return (lambda: comm.broadcast(t, 0)), (lambda: pg.broadcast([t], opts).wait())
    if op == "all_gather":
        out, chunk = torch.zeros(count), torch.zeros(count // n)
        return (lambda: comm.all_gather_flat(chunk, out=out)), (lambda: pg._allgather_base(out, chunk).wait())
    if op == "reduce_scatter":
        buf, out = torch.zeros(count), torch.zeros(count // n)
        opts = ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return (
            (lambda: comm.reduce_scatter(buf, out=out)),
            (lambda: pg._reduce_scatter_base(out, buf, opts).wait()),
        )
    raise ValueError(op)


def _mpi_calls(comm: Any, op: str, count: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    import torch
    from mpi4py import MPI

    mc, n = comm.mpi_comm, comm.size
    if op == "all_reduce":
        t = torch.zeros(count)
        a = t.numpy()
        return (lambda: comm.all_reduce(t)), (lambda: mc.Allreduce(MPI.IN_PLACE, a, MPI.SUM))
    if op == "broadcast":
        t = torch.zeros(count)
        a = t.numpy()
        return (lambda: comm.broadcast(t, 0)), (lambda: mc.Bcast(a, 0))
    if op == "all_gather":
        out, chunk = torch.zeros(count), torch.zeros(count // n)
        o, c = out.numpy(), chunk.numpy()
        return (lambda: comm.all_gather_flat(chunk, out=out)), (lambda: mc.Allgather(c, o))
    if op == "reduce_scatter":
        buf, out = torch.zeros(count), torch.zeros(count // n)
        b, o = buf.numpy(), out.numpy()
        return (
            (lambda: comm.reduce_scatter(buf, out=out)),
            (lambda: mc.Reduce_scatter_block(b, o, MPI.SUM)),
        )
    raise ValueError(op)


def measure(comm: Any, cfg: Config) -> list[dict[str, Any]]:
    """This rank's samples (seconds per call) for every op and size; collective over ``comm``."""
    if comm.backend == "gloo":
        make, sync = _gloo_calls, (lambda: comm.process_group.barrier().wait())
    else:
        make, sync = _mpi_calls, comm.mpi_comm.Barrier
    samples = []
    for op in cfg.ops:
        for size in cfg.sizes:
            count = _count(op, size, comm.size)
            calls = cfg.calls(count * 4)
            fleet, raw = make(comm, op, count)
            sync()
            # Each call timed alone, in rotating order (A B, B A, ...): all see the same noise, and
            # consecutive collectives keep the ranks in step without a barrier per sample.
            impls = {"fleetlike": fleet, "raw": raw}
            if cfg.control:  # raw against itself: the noise floor of a ratio on this machine
                impls["raw_again"] = raw
            times = interleaved_timings(impls, reps=calls, warmup=2)
            samples.append({"op": op, "bytes": count * 4, "count": count, "calls": calls, **times})
            del fleet, raw
    return samples


def _gloo_rank(role: Any, cfg: Config) -> list[dict[str, Any]]:
    from fleetlike.testing import make_world

    comm = make_world(role, backend="gloo", timeout=600)
    try:
        return measure(comm, cfg)
    finally:
        comm.close()


def _mpi_worker(cfg: Config, result_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    from fleetlike.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    samples = measure(comm, cfg)
    gathered = comm.mpi_comm.gather(samples, root=0)
    if comm.rank == 0:
        Path(result_file).write_text(json.dumps(gathered))
    comm.close()


# --------------------------------------------------------------------------- results


def summarize(per_rank: Sequence[list[dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """One row per (op, size): a call's time is the slowest rank's; the row takes the median."""
    rows = []
    for entries in zip(*per_rank):
        e0 = entries[0]
        row: dict[str, Any] = {k: e0[k] for k in ("op", "bytes", "count", "calls")}
        per_call = {}
        for impl in ("fleetlike", "raw", "raw_again"):
            if impl not in e0:
                continue
            per_call[impl] = [max(s) for s in zip(*(e[impl] for e in entries))]
            t = median(per_call[impl])
            row[f"{impl}_min_us"] = min(per_call[impl]) * 1e6
            algbw = e0["bytes"] / t / 1e9
            row[f"{impl}_us"] = t * 1e6
            row[f"{impl}_algbw"] = algbw
            row[f"{impl}_busbw"] = algbw * bus_factor(e0["op"], world)
        row["ratio"] = row["raw_us"] / row["fleetlike_us"]
        # the same comparison call by call: neighbours in time share the machine's state
        row["paired_ratio"] = median([r / f for r, f in zip(per_call["raw"], per_call["fleetlike"])])
        if "raw_again" in per_call:
            row["control_ratio"] = row["raw_us"] / row["raw_again_us"]
        row["overhead_us"] = row["fleetlike_us"] - row["raw_us"]
        # best case: the fastest call of each, a load-insensitive view of the added cost
        row["best_overhead_us"] = row["fleetlike_min_us"] - row["raw_min_us"]
        rows.append(row)
    return rows


COLUMNS = [
    Column("bytes", "size", human_bytes),
    Column("count", "count"),
    Column("calls", "calls"),
    Column("fleetlike_us", "time(us)", "{:.1f}"),
    Column("fleetlike_algbw", "algbw", "{:.3f}"),
    Column("fleetlike_busbw", "busbw", "{:.3f}"),
    Column("raw_us", "raw time", "{:.1f}"),
    Column("raw_algbw", "raw algbw", "{:.3f}"),
    Column("raw_busbw", "raw busbw", "{:.3f}"),
    Column("ratio", "ratio", "{:.3f}"),
    Column("paired_ratio", "paired", "{:.3f}"),
    Column("overhead_us", "+us", "{:+.1f}"),
    Column("best_overhead_us", "best +us", "{:+.1f}"),
]
CONTROL = Column("control_ratio", "raw/raw", "{:.3f}")

SUMMARY_SIZES = (8, 1 << 20, 16 << 20, 256 << 20)


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, checked per op: min busbw ratio >= 1 MiB, overhead at the smallest size."""
    out: dict[str, Any] = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        big = [r["ratio"] for r in mine if r["bytes"] >= TARGET_RATIO_FROM]
        noise = [abs(1 - r["control_ratio"]) for r in mine
                 if r["bytes"] >= TARGET_RATIO_FROM and "control_ratio" in r]
        small = min(mine, key=lambda r: r["bytes"])
        out[op] = {
            "min_ratio_from_1MiB": min(big) if big else None,
            "ratio_ok": (min(big) >= TARGET_RATIO) if big else None,
            "control_spread_from_1MiB": max(noise) if noise else None,
            "smallest_bytes": small["bytes"],
            "smallest_overhead_us": small["overhead_us"],
            # the target is stated for 8-byte messages; larger smallest sizes are not judged
            "overhead_ok": small["overhead_us"] <= TARGET_OVERHEAD_US if small["bytes"] <= 8 else None,
            "ratios": {str(r["bytes"]): round(r["ratio"], 3) for r in mine if r["bytes"] in SUMMARY_SIZES},
        }
    return out


def report(backend: str, world: int, rows: list[dict[str, Any]], info: dict[str, Any], out_dir: Path) -> None:
    print(f"\n# {backend}: {world} ranks, float32, sum. time: median over calls of the slowest "
          "rank; GB/s = 1e9 B/s;\n# +us: fleetlike minus raw median; best +us: fastest call minus "
          "fastest call")
    for op in dict.fromkeys(r["op"] for r in rows):
        print(f"\n## {op}  (busbw factor {bus_factor(op, world):g})")
        mine = [r for r in rows if r["op"] == op]
        print(format_table(COLUMNS + ([CONTROL] if "control_ratio" in mine[0] else []), mine))
    checks = verdict(rows)
    print(f"\n## {backend} vs targets (busbw ratio >= {TARGET_RATIO} from 1 MiB; "
          f"<= {TARGET_OVERHEAD_US:g} us extra at the smallest size)")
    for op, v in checks.items():
        ratio = "n/a" if v["min_ratio_from_1MiB"] is None else f"{v['min_ratio_from_1MiB']:.3f}"
        spread = v["control_spread_from_1MiB"]
        noise = "" if spread is None else f" (raw/raw within +-{spread:.3f})"
        print(f"  {op:15s} min ratio >= 1 MiB: {ratio:>6s} {_ok(v['ratio_ok']):6s}{noise}   "
              f"overhead at {human_bytes(v['smallest_bytes'])}: {v['smallest_overhead_us']:+.1f} us "
              f"{_ok(v['overhead_ok'])}")
    payload = {"benchmark": "collectives", "backend": backend, "world": world, "dtype": "float32",
               **info, "targets": {"busbw_ratio": TARGET_RATIO, "from_bytes": TARGET_RATIO_FROM,
                                   "overhead_us": TARGET_OVERHEAD_US},
               "verdict": checks, "results": rows}
    json_path = save_json(out_dir / f"collectives_{backend}.json", payload)
    panels = []
    for op in checks:
        mine = [r for r in rows if r["op"] == op]
        panels.append({"title": op, "x": [r["bytes"] for r in mine],
                       "series": {"fleetlike": [r["fleetlike_busbw"] for r in mine],
                                  f"raw {backend}": [r["raw_busbw"] for r in mine]},
                       "ratio": {"fleetlike / raw": [r["ratio"] for r in mine],
                                 **({"raw / raw (noise)": [r["control_ratio"] for r in mine]}
                                    if "control_ratio" in mine[0] else {})}})
    png = plot_panels(out_dir / f"collectives_{backend}.png",
                      f"{backend}, {world} ranks: busbw, fleetlike vs raw ({info['date']})", panels,
                      ratio_label="fleetlike / raw", ratio_target=TARGET_RATIO)
    print(f"\nwrote {json_path} and {png}")


def _ok(flag: bool | None) -> str:
    return "" if flag is None else ("ok" if flag else "MISSED")


def markdown_summary(rows_by_backend: dict[str, list[dict[str, Any]]]) -> str:
    """Ratios at 8 B, 1 MiB, 16 MiB and 256 MiB, and the 8-byte overhead, one line per op."""
    sizes = sorted({s for rows in rows_by_backend.values() for r in rows for s in [r["bytes"]]
                    if s in SUMMARY_SIZES})
    cols = [Column("backend", "backend"), Column("op", "op")]
    cols += [Column(str(s), f"ratio @ {human_bytes(s)}", "{:.3f}") for s in sizes]
    cols += [Column("overhead", "+us @ smallest", "{:+.1f}")]
    table = []
    for backend, rows in rows_by_backend.items():
        for op in dict.fromkeys(r["op"] for r in rows):
            mine = [r for r in rows if r["op"] == op]
            line: dict[str, Any] = {"backend": backend, "op": op,
                                    "overhead": min(mine, key=lambda r: r["bytes"])["overhead_us"]}
            line.update({str(r["bytes"]): r["ratio"] for r in mine})
            table.append(line)
    return format_table(cols, table, markdown=True)


# --------------------------------------------------------------------------- entry point


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="all", choices=[*BACKENDS, "all"])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--min-bytes", default="8", help="smallest message (default 8)")
    p.add_argument("--max-bytes", default="256M", help="largest message (default 256M)")
    p.add_argument("--step-factor", type=int, default=4, help="size ladder factor, from the top (default 4)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--iters", type=int, default=400, help="most timed calls per size and implementation")
    p.add_argument("--min-iters", type=int, default=16, help="fewest timed calls (the biggest sizes)")
    p.add_argument("--size-budget", default="1G",
                   help="bytes per size and implementation; sets the calls between the bounds")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                   help="also time raw against itself, an A/A ratio showing the noise floor "
                        "(default on; --no-control runs 1.5x faster)")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="folder for JSON and PNG")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per backend run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        p.error(f"--ops {args.ops!r}: unknown {bad}; choose from {', '.join(OPS)}")
    if args.world < 2:
        p.error(f"--world {args.world}: collectives need at least 2 ranks")
    if not 1 <= args.min_iters <= args.iters:
        p.error(f"need 1 <= --min-iters ({args.min_iters}) <= --iters ({args.iters})")
    try:
        sizes = size_ladder(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.step_factor)
    except ValueError as exc:
        p.error(str(exc))
    args.config = Config(world=args.world, sizes=tuple(sizes), ops=ops, iters=args.iters,
                         min_iters=args.min_iters, size_budget=parse_bytes(args.size_budget),
                         control=args.control)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg: Config = args.config
    if args.worker:
        _mpi_worker(cfg, args.result_file)
        return 0
    info = run_info("bench.collectives", argv)
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    rows_by_backend = {}
    for backend in backends:
        per_rank = _run_gloo(cfg, args.timeout) if backend == "gloo" else _run_mpi(cfg, argv, args.timeout)
        rows = summarize(per_rank, cfg.world)
        report(backend, cfg.world, rows, info, Path(args.out))
        rows_by_backend[backend] = rows
    print("\n## summary (fleetlike busbw / raw busbw; Markdown)\n")
    print(markdown_summary(rows_by_backend))
    return 0


def _run_gloo(cfg: Config, timeout: float) -> list[list[dict[str, Any]]]:
    # by module name, also when this file runs as __main__, so the ranks can import it
    from bench.collectives import _gloo_rank
    from fleetlike.testing import run_ranks

    return run_ranks(_gloo_rank, cfg.world, cfg, timeout=timeout, job_id="bench-collectives")


def _run_mpi(cfg: Config, argv: Sequence[str], timeout: float) -> list[list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory(prefix="fleetlike-bench-") as tmp:
        result = os.path.join(tmp, "samples.json")
        run_mpiexec(cfg.world, [sys.executable, "-m", "bench.collectives", *argv, "--worker",
                                "--result-file", result], timeout=timeout, cwd=ROOT)
        return json.loads(Path(result).read_text())


if __name__ == "__main__":
    sys.exit(main())

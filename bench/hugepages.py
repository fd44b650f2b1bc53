"""Filling a buffer made fresh every step: 4 KiB pages, huge pages, memory kept mapped.

What a stage 2 gradient bucket costs to fill (`fleetlike.collectives.hugepages`): for each size,
the median time to make a buffer and copy a gradient's worth of values into it, then drop it,
three ways in one process, interleaved:

- ``torch.empty``: what a fresh allocation gets; with glibc's mmap threshold fixed at 128 KiB
  (``mallopt``, as the memory benchmarks run) a large block is mapped on allocation and unmapped
  on free, so every page faults in at 4 KiB;
- ``empty_transient``: the same lifetime in a mapping advised for transparent huge pages;
- ``kept``: one buffer allocated before the loop and reused, the floor (stage 1's buckets).

Usage (from the repository root)::

    python -m bench.hugepages                     # 8, 32 and 128 MiB, 30 rounds each
    python -m bench.hugepages --no-docs --out /tmp/hugepages

Writes ``docs/benchmarks/hugepages.json`` and ``.png`` and (re)writes the "## Fresh buffers in
huge pages" section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench._common import (Column, format_table, human_bytes, median, parse_bytes, plot_panels, replace_section,
                           run_info, save_json)

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("torch.empty", "empty_transient", "kept")


def _timings(nbytes: int, rounds: int) -> dict[str, float]:
    import torch

    from fleetlike.collectives.hugepages import empty_transient

    numel = nbytes // 4
    src = torch.randn(numel)
    kept = torch.empty(numel)
    cpu = torch.device("cpu")
    makers: dict[str, Callable[[], torch.Tensor]] = {
        "torch.empty": lambda: torch.empty(numel),
        "empty_transient": lambda: empty_transient(numel, torch.float32, cpu),
        "kept": lambda: kept,
    }
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[: r % len(WAYS)]:  # rotated: no way always first
            started = time.perf_counter()
            buf = makers[way]()
            buf.copy_(src)
            times[way].append(time.perf_counter() - started)
            del buf
    return {w: median(ts) * 1e3 for w, ts in times.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8MiB,32MiB,128MiB", help="comma-separated buffer sizes")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: torch's default)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "hugepages"))
    ap.add_argument("--no-docs", action="store_true", help="leave docs/BENCHMARKS.md alone")
    args = ap.parse_args(argv)

    import torch

    from fleetlike.collectives.hugepages import huge_pages_granted

    if args.threads:
        torch.set_num_threads(args.threads)

    ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD: large blocks mapped and unmapped
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rows = []
    for nbytes in sizes:
        t = _timings(nbytes, args.rounds)
        rows.append({"size": nbytes, **t, "speedup": t["torch.empty"] / t["empty_transient"]})
    granted = huge_pages_granted()
    cols = [Column("size", "size", human_bytes), *(Column(w, f"{w} ms", "{:.2f}") for w in WAYS),
            Column("speedup", "torch.empty / empty_transient", "{:.2f}x")]
    table = format_table(cols, rows)
    print(table)
    head = (f"transparent huge pages granted on request: {granted}; median of {args.rounds} rounds, "
            f"{torch.get_num_threads()} torch thread(s), glibc's mmap threshold at 128 KiB")
    print(head)
    payload = {**run_info("bench.hugepages", argv), "huge_pages_granted": granted, "rounds": args.rounds,
               "threads": torch.get_num_threads(), "rows": rows}
    save_json(f"{args.out}.json", payload)
    plot_panels(f"{args.out}.png", "fill a fresh buffer", [{
        "title": "make + copy in + drop", "x": sizes, "series": {w: [r[w] for r in rows] for w in WAYS},
        "ratio": {"torch.empty / empty_transient": [r["speedup"] for r in rows]}}],
        ylabel="ms", ratio_label="speed-up")
    if not args.no_docs:
        title = "## Fresh buffers in huge pages"
        section = (f"{title}\n\n`{payload['command']}` ({head})\n\n{format_table(cols, rows, markdown=True)}\n\n"
                   f"![hugepages](benchmarks/{Path(args.out).name}.png)\n")
        replace_section(ROOT / "docs" / "BENCHMARKS.md", title, section)
    return payload


if __name__ == "__main__":
    main()

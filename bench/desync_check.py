"""Cost of the agreement checks before each collective, three settings side by side.

Two gloo ranks; each size is timed with every setting, interleaved in one run, so the ratios
isolate the checks:

- ``off``: no check (``comm.check_sizes = False``, or callers passing ``agreed=True``, as the
  gradient buckets do; what every collective cost before the size check existed);
- ``sizes``: the default size check (an all-gather of a 16-int descriptor per rank before the
  collective, comparing what decides the bytes on the wire; a mismatch raises
  `CollectiveMismatchError` instead of aborting the process inside gloo);
- ``full``: ``check_collectives=True`` (the same exchange, every field compared, shapes too).

Usage (from the repository root)::

    python -m bench.desync_check            # ~30 s; writes docs/benchmarks/desync_check.{json,png}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench._common import (
    Column,
    format_table,
    human_bytes,
    interleaved_timings,
    median,
    plot_panels,
    run_info,
    save_json,
)
from fleetlike.testing import make_world, run_ranks

SIZES = (8, 1 << 20)
SETTINGS = ("off", "sizes", "full")


def _rank(role, reps: int, sizes: tuple[int, ...]):
    world = make_world(role)
    try:
        out = {}
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            inner = 200 if nbytes <= 1 << 16 else 20

            def run(check_sizes: bool, check_collectives: bool):
                def call() -> None:
                    world.check_sizes = check_sizes
                    world.check_collectives = check_collectives
                    world.all_reduce(t)

                return call

            fns = {"off": run(False, False), "sizes": run(True, False), "full": run(False, True)}
            times = interleaved_timings(fns, reps=reps, inner=inner, sync=world.barrier)
            out[nbytes] = {k: median(v) for k, v in times.items()}
            world.check_sizes, world.check_collectives = True, False
        return out
    finally:
        world.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="all_reduce payloads in bytes")
    parser.add_argument("--out", default="docs/benchmarks/desync_check.json")
    args = parser.parse_args(argv)
    sizes = tuple(args.sizes)
    results = run_ranks(_rank, 2, args.reps, sizes, timeout=600)
    rows = []
    for nbytes in sizes:
        # the slower rank's median: a collective is as slow as its slowest member
        us = {s: max(r[nbytes][s] for r in results) * 1e6 for s in SETTINGS}
        for s in SETTINGS:
            rows.append({"size": human_bytes(nbytes), "nbytes": nbytes, "setting": s, "us": us[s],
                         "added_us": us[s] - us["off"], "ratio": us[s] / us["off"]})
    columns = [Column("size", "all_reduce"), Column("setting", "setting"), Column("us", "us/call", "{:.1f}"),
               Column("added_us", "added (us)", "{:.1f}"), Column("ratio", "x off", "{:.2f}")]
    print(format_table(columns, rows))
    path = save_json(args.out, {**run_info("bench.desync_check", argv), "rows": rows})
    xs = list(sizes)
    plot_panels(
        Path(path).with_suffix(".png"),
        "agreement checks before all_reduce (2 gloo ranks)",
        [{"title": "time per call",
          "x": xs,
          "series": {s: [r["us"] for r in rows if r["setting"] == s] for s in SETTINGS},
          "ratio": {f"{s} / off": [r["ratio"] for r in rows if r["setting"] == s] for s in ("sizes", "full")}}],
        ylabel="us per all_reduce",
        ratio_label="x off",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

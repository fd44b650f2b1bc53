"""Cost of the collective desync check (``fleet.init(check_collectives=True)``), side by side.

Two gloo ranks; each size is timed with the check off and on, interleaved in one run, so the
ratio isolates the check (one small all-gather of a 16-int descriptor before each collective).

Usage (from the repository root)::

    python -m bench.desync_check            # ~20 s; writes docs/benchmarks/desync_check.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench._common import Column, format_table, human_bytes, interleaved_timings, median, run_info, save_json
from fleetlike.testing import make_world, run_ranks

SIZES = (8, 1 << 10, 1 << 20, 16 << 20)


def _rank(role, reps: int):
    world = make_world(role)
    try:
        out = {}
        for nbytes in SIZES:
            t = torch.ones(max(1, nbytes // 4))
            inner = 50 if nbytes <= 1 << 20 else 4

            def off() -> None:
                world.check_collectives = False
                world.all_reduce(t)

            def on() -> None:
                world.check_collectives = True
                world.all_reduce(t)

            times = interleaved_timings({"off": off, "on": on}, reps=reps, inner=inner, sync=world.barrier)
            out[nbytes] = {k: median(v) for k, v in times.items()}
            world.check_collectives = False
        return out
    finally:
        world.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="docs/benchmarks/desync_check.json")
    args = parser.parse_args(argv)
    results = run_ranks(_rank, 2, args.reps, timeout=300)
    rows = []
    for nbytes in SIZES:
        off = max(r[nbytes]["off"] for r in results)
        on = max(r[nbytes]["on"] for r in results)
        rows.append({"size": human_bytes(nbytes), "off_us": off * 1e6, "on_us": on * 1e6,
                     "added_us": (on - off) * 1e6, "ratio": on / off})
    columns = [Column("size", "size"), Column("off_us", "check off (us)", "{:.1f}"),
               Column("on_us", "check on (us)", "{:.1f}"), Column("added_us", "added (us)", "{:.1f}"),
               Column("ratio", "on/off", "{:.2f}")]
    print(format_table(columns, rows))
    save_json(args.out, {**run_info("bench.desync_check", argv), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

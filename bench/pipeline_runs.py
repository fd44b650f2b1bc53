"""Several runs of `bench.pipeline` side by side: per schedule and micro-batch count, the slower
stage's idle (the median step's time in the schedule's waits, `bench.pipeline_report.idle_of`)
over the bubble (p-1)/(m+p-1) in each run, their median, how many runs are within 20 %; the
same over the idle the run's own stage times imply (`bench.pipeline_report.add_expected`: the
stages' median forward and backward and their update, unequal stages and all); the per-step
spread; and fleetlike's steps/s over torch's schedule (stage 0: the pipeline's step).

One run is one machine moment; the idle moves with the load, so the docs quote repeated runs,
leaving out (and counting) a run's configuration in which a stage waited for a core more than
``--max-core-wait`` of its steps: another job held its core. Each run takes the CPU lock by itself (the loop is the caller's)::

    for i in 1 2 3 4 5; do
        flock /tmp/fleetlike-cpu.lock python -m bench.pipeline --no-docs --out /tmp/pipe_$i.json
    done
    python -m bench.pipeline_runs /tmp/pipe_*.json

Writes ``docs/benchmarks/pipeline_runs.json``, which ``bench.pipeline`` puts in its docs
section, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench._common import format_table, run_info, save_json
from bench.pipeline_report import RUN_COLUMNS, add_expected, expected_of, idle_of, slower

__all__ = ["core_wait", "main", "summarise"]

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "pipeline_runs.json"

def core_wait(run: dict[str, Any], key: tuple[str, int] | None = None) -> float:
    """The largest fraction of its steps any stage of ``run`` (of its configuration ``key`` =
    (schedule, m), default any) spent runnable but not running (the kernel's schedstat): other
    processes on its core. Where that is large the run measured the machine's other jobs, not
    the pipeline."""
    return max(float(r["runnable"]) for r in run["rows"] if key is None or (r["schedule"], r["m"]) == key)


def summarise(runs: list[dict[str, Any]], max_core_wait: float = float("inf")) -> list[dict[str, Any]]:
    """One row per (schedule, m) over ``runs`` (each a `bench.pipeline` JSON); the
    expectations are computed afresh from each run's measured stage times (`add_expected`); a
    run's configuration in which a stage waited for a core more than ``max_core_wait`` of its
    steps is left out of that row (counted in ``left_out``)."""
    for run in runs:
        if all("forward_s" in r for r in run["rows"]):
            add_expected(run["rows"])
    keys = sorted({(r["schedule"], r["m"]) for run in runs for r in run["rows"]})
    nan = float("nan")
    out = []
    for mode, m in keys:
        ran = [run for run in runs if any((r["schedule"], r["m"]) == (mode, m) for r in run["rows"])]
        have = [run for run in ran if core_wait(run, (mode, m)) <= max_core_wait]
        if not have:
            continue
        slow = [slower(run["rows"], mode, m) for run in have]
        ratios = [idle_of(r) * (m + 1) for r in slow]
        vs_expected = [idle_of(r) / expected_of(r) for r in slow]
        spread = [(r.get("idle_p10", nan) * (m + 1), r.get("idle_p90", nan) * (m + 1)) for r in slow]
        firsts = [next(r for r in run["rows"] if (r["schedule"], r["m"], r["stage"]) == (mode, m, 0)) for run in have]
        out.append({"schedule": mode, "m": m, "bubble": 1 / (m + 1), "left_out": len(ran) - len(have),
                    "per_run": ratios,
                    "median": statistics.median(ratios), "within": f"{sum(0.8 <= x <= 1.2 for x in ratios)} of {len(ratios)}",
                    "expected": statistics.median(expected_of(r) for r in slow), "per_run_expected": vs_expected,
                    "expected_latency": statistics.median(r.get("expected_latency", nan) for r in slow),
                    "median_expected": statistics.median(vs_expected),
                    "within_expected": f"{sum(0.8 <= x <= 1.2 for x in vs_expected)} of {len(vs_expected)}",
                    "spread": (statistics.median(a for a, _ in spread), statistics.median(b for _, b in spread)),
                    "ratio": [r["ratio"] for r in firsts],
                    "ratio_gloo": [r["ratio_gloo"] for r in firsts if "ratio_gloo" in r]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench.pipeline JSON files")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--max-core-wait", type=float, default=0.05,
                    help="leave out a run's configuration in which a stage waited for a core (runnable, not "
                         "running: other processes on its core) more than this fraction of its steps")
    args = ap.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    for r in runs:
        if core_wait(r) > args.max_core_wait:
            print(f"{r['info']['command']} ({r['info']['date']}): a stage waited for a core up to "
                  f"{core_wait(r):.2f} of its steps (load average {r['load_end']:.1f} at the end); "
                  "those configurations are left out")
    rows = summarise(runs, args.max_core_wait)
    print(format_table(RUN_COLUMNS, rows))

    def brief(r: dict[str, Any]) -> dict[str, Any]:
        return {"date": r["info"]["date"], "command": r["info"]["command"], "pinned": r["pinned"],
                "load_end": r["load_end"], "core_wait": core_wait(r)}
    save_json(Path(args.out), {"info": run_info("bench.pipeline_runs", argv), "rows": rows,
                               "max_core_wait": args.max_core_wait, "runs": [brief(r) for r in runs]})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The online tuner's whole grid in one table and one plot, from the runs of `bench.autotune`.

A cell of the grid (model x link) costs from seconds (loopback mlp) to a quarter of an hour
(100 Mbit resnet) of a machine's CPU, so the grid is measured in several runs of
`bench.autotune`, each saving its JSON with every model's raw rounds and the tuner's trials.
This script reads those files, recomputes each row from its raw rounds with the same
`bench.autotune.summarise` (so every cell has the same columns, whatever version of the script
wrote it), keeps the latest run of each cell, checks the two goals, and writes the grid's
table, JSON and plot. It measures nothing itself: each row names the file (and so the command
and date) it comes from.

Goals per cell: "goal 1": the tuned job's steady steps/s >= 0.95x the best fixed setting's;
"goal 2", only where the best fixed setting is >= 1.2x the default: tuned >= 1.15x the default.

Example:
    python -m bench.autotune_grid docs/benchmarks/autotune.json docs/benchmarks/autotune-mlp50m.json \\
        --out docs/benchmarks/autotune-grid
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.autotune import summarise

__all__ = ["GOAL_BEST", "GOAL_DEFAULT", "GOAL_DEFAULT_WHERE", "goals", "grid_rows", "main", "markdown", "plot"]

#: tuned / best fixed, in every cell
GOAL_BEST = 0.95
#: tuned / default, in the cells where best fixed / default >= GOAL_DEFAULT_WHERE
GOAL_DEFAULT = 1.15
GOAL_DEFAULT_WHERE = 1.2
_LINKS = ("loopback", "1gbit", "100mbit")
_MODELS = ("mlp", "convnet", "mlp50m", "resnet")


def goals(row: dict[str, Any]) -> tuple[str, str]:
    """("met" / "not met", "met" / "not met" / "n/a") for one summarised row."""
    g1 = "met" if row["tuned_vs_best"] >= GOAL_BEST else "not met"
    if row["best_vs_default"] < GOAL_DEFAULT_WHERE:
        return g1, "n/a"
    return g1, "met" if row["tuned_vs_default"] >= GOAL_DEFAULT else "not met"


def grid_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The latest run of each (link, model) cell over ``paths``, recomputed from its raw rounds,
    in the grid's order (link, then model)."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        for r in doc["rows"]:
            if "raw" not in r:
                raise ValueError(f"{p}: row {r.get('link')} {r.get('model')} has no 'raw' rounds to recompute "
                                 "it from; rerun that cell with python -m bench.autotune")
            row = {**summarise(r["link"], r["model"], r["raw"]), "source": Path(p).name, "date": doc["date"],
                   "command": doc["command"]}
            row["goal_best"], row["goal_default"] = goals(row)
            key = (r["link"], r["model"])
            if key not in latest or row["date"] >= latest[key]["date"]:
                latest[key] = row
    order = {(lk, m): (i, j) for i, lk in enumerate(_LINKS) for j, m in enumerate(_MODELS)}
    return sorted(latest.values(), key=lambda r: order.get((r["link"], r["model"]), (99, 99)))


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The grid table as BENCHMARKS.md prints it."""
    head = ("link", "model", "ranks", "tuned steps/s", "chosen", "best fixed", "best steps/s", "default steps/s",
            "tuned / best", "tuned / default", "best / default", "goal 1", "goal 2", "tuned / same fixed",
            "round spread", "tuning steps", "tuning s", "cost s", "CPU share", "run")
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if h in ("link", "model", "chosen", "best fixed", "goal 1", "goal 2", "run")
                            else "--:" for h in head) + "|"]
    for r in rows:
        chosen = r["chosen"].removesuffix(" native")
        cells = [r["link"], r["model"], str(r["ranks"]), f"{r['tuned_steps_per_s']:.2f}", chosen, r["best_fixed"],
                 f"{r['best_fixed_steps_per_s']:.2f}", f"{r['default_steps_per_s']:.2f}", f"{r['tuned_vs_best']:.2f}",
                 f"{r['tuned_vs_default']:.2f}", f"{r['best_vs_default']:.2f}", r["goal_best"], r["goal_default"],
                 _same(r["tuned_vs_same_fixed"]), f"{r['round_spread']:.2f}", str(r["tuning_steps"]),
                 f"{r['tuning_seconds']:.1f}", f"{r['tuning_cost_seconds']:.1f}", f"{r['cpu_share']:.2f}",
                 r["source"].removesuffix(".json")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _same(ratio: float) -> str:
    """The chosen setting against its fixed twin; "-" where the chosen bucket size is not one of
    the fixed grid's (the tuner tries every size that gives other buckets: 0.64 MB, 2.56 MB, ...)."""
    return "-" if math.isnan(ratio) else f"{ratio:.2f}"


def plot(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Each cell's settings as a fraction of its best fixed one (so cells 1000x apart in steps/s
    share one axis), with goal 1's line at 0.95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.2))
    for i, r in enumerate(rows):
        best = r["best_fixed_steps_per_s"]
        xs = [v / best for v in r["fixed_steps_per_s"].values()]
        ax.scatter([i] * len(xs), xs, color="grey", s=14, label="fixed settings" if i == 0 else None)
        ax.scatter([i], [r["default_steps_per_s"] / best], color="tab:blue", marker="s",
                   label="default" if i == 0 else None)
        ax.scatter([i], [r["tuned_vs_best"]], color="tab:red", marker="*", s=140, label="tuned" if i == 0 else None)
    ax.axhline(GOAL_BEST, color="tab:red", lw=0.8, ls="--", label=f"goal: {GOAL_BEST}x the best")
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['link']}" for r in rows])
    ax.set_ylabel("steady steps/s / best fixed setting's")
    ax.set_title("auto_tune against every fixed setting of its grid (median of rounds)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from bench._common import run_info, save_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="JSON files written by python -m bench.autotune")
    ap.add_argument("--out", default="docs/benchmarks/autotune-grid", help="writes OUT.json and OUT.png")
    args = ap.parse_args(argv)
    rows = grid_rows(args.runs)
    missing = [f"{lk} {m}" for lk in _LINKS for m in _MODELS
               if not any(r["link"] == lk and r["model"] == m for r in rows)]
    out = Path(args.out)
    save_json(out.with_suffix(".json"), {**run_info("bench.autotune_grid", argv), "missing": missing, "rows": rows})
    plot(out.with_suffix(".png"), rows)
    print(markdown(rows))
    met1 = sum(r["goal_best"] == "met" for r in rows)
    applies = [r for r in rows if r["goal_default"] != "n/a"]
    print(f"\ncells: {len(rows)} of {len(_LINKS) * len(_MODELS)}; missing: {', '.join(missing) or 'none'}; "
          f"goal 1 met in {met1} of {len(rows)}; goal 2 applies to {len(applies)}, met in "
          f"{sum(r['goal_default'] == 'met' for r in applies)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

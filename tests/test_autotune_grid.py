"""The tuner's benchmark grid (`bench.autotune_grid`): rows recomputed from raw rounds, the latest
run of a cell kept, the two goals judged on the recomputed ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.autotune_grid import goals, grid_rows, markdown


def _raw(tuned: float, best: float, default: float, chosen: str = "two_level 1MB x2 native") -> dict:
    """Raw rounds as `bench.autotune`'s worker saves them: seconds per step per round."""
    return {"times": {"flat 32MB x1": [1 / default] * 3, "two_level 1MB x2": [1 / best] * 3, "tuned": [1 / tuned] * 3},
            "tuning": {"steps": 10, "seconds": 10 / tuned + 1.0, "chosen": chosen, "done": True, "trials": []},
            "cpu_seconds_all_ranks": 4.0, "wall_seconds": 2.0, "ranks": 4, "grad_bytes": 1, "two_level_possible": True}


def _run(path: Path, date: str, rows: list[tuple[str, str, dict]]) -> Path:
    path.write_text(json.dumps({"command": "python -m bench.autotune", "date": date,
                                "rows": [{"link": lk, "model": m, "raw": raw} for lk, m, raw in rows]}))
    return path


def test_the_latest_run_of_a_cell_wins_and_rows_are_recomputed(tmp_path: Path) -> None:
    old = _run(tmp_path / "a.json", "2026-01-01 10:00 UTC", [("1gbit", "mlp", _raw(1.0, 2.0, 1.0)),
                                                             ("loopback", "mlp", _raw(3.0, 3.0, 3.0))])
    new = _run(tmp_path / "b.json", "2026-01-02 10:00 UTC", [("1gbit", "mlp", _raw(1.9, 2.0, 1.0))])
    rows = grid_rows([new, old])
    assert [(r["link"], r["model"], r["source"]) for r in rows] == [("loopback", "mlp", "a.json"),
                                                                    ("1gbit", "mlp", "b.json")]
    g = rows[1]
    assert g["tuned_vs_best"] == pytest.approx(0.95) and g["tuned_vs_default"] == pytest.approx(1.9)
    assert g["tuned_vs_same_fixed"] == pytest.approx(0.95)  # the chosen setting's fixed twin
    assert g["tuning_cost_seconds"] == pytest.approx(1.0)
    assert (g["goal_best"], g["goal_default"]) == ("met", "met")
    assert "| 1gbit | mlp | 4 | 1.90 | two_level 1MB x2 |" in markdown(rows)


@pytest.mark.parametrize(("tuned", "best", "default", "want"), [
    (0.94, 1.0, 1.0, ("not met", "n/a")),       # best within 1.2x of the default: goal 2 does not apply
    (1.10, 1.25, 1.0, ("not met", "not met")),  # 0.88x the best, 1.10x the default
    (1.15, 1.2, 1.0, ("met", "met")),
])
def test_goals(tuned: float, best: float, default: float, want: tuple[str, str]) -> None:
    row = {"tuned_vs_best": tuned / best, "tuned_vs_default": tuned / default, "best_vs_default": best / default}
    assert goals(row) == want


def test_a_row_without_raw_rounds_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"command": "x", "date": "d", "rows": [{"link": "1gbit", "model": "mlp"}]}))
    with pytest.raises(ValueError, match="no 'raw' rounds"):
        grid_rows([p])

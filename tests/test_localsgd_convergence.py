"""Convergence on a real dataset that a package ships (scikit-learn's digits), 4 gloo ranks:
synchronous SGD, local SGD k=4 and adaptive local SGD reach test accuracy within 1 percentage
point of each other while averaging at least 4x less often.

Communication rounds: synchronous data parallel allreduces the gradients once per step (one
round, whatever the number of buckets); local SGD's rounds are the parameter averages its stats
report (``localsgd_averages`` after the last step). Same seeds, shards, model and learning-rate
schedule in every mode (``tests/localsgd_digits.py``, also used by ``bench/localsgd.py``).
"""

from __future__ import annotations

import pytest

from fleetlike.testing import run_ranks
from localsgd_digits import MODES, STEPS, digits_run


def _every_mode(role) -> dict:
    """Each mode in turn in the same ranks: one job, not three (each run its own session)."""
    return {mode: digits_run(role, mode) for mode in MODES}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_local_sgd_matches_sync_accuracy_with_4x_fewer_averages():
    by_rank = run_ranks(_every_mode, 4, timeout=170)
    runs = {mode: [ranks[mode] for ranks in by_rank] for mode in MODES}
    acc, rounds = {}, {}
    for mode, ranks in runs.items():
        accs = {r["acc"] for r in ranks}
        assert len(accs) == 1, f"{mode}: ranks end with different models (test accuracies {sorted(accs)})"
        acc[mode] = accs.pop()
        trace = ranks[0]["trace"]
        assert len(trace) == STEPS
        rounds[mode] = STEPS if mode == "sync" else trace[-1]["averages"]
        if mode != "sync":
            assert rounds[mode] == sum(t["averaged"] for t in trace)
    summary = f"test accuracy {acc}, communication rounds {rounds} over {STEPS} steps"
    print(summary)
    assert acc["sync"] > 0.93, summary  # it did learn
    assert max(acc.values()) - min(acc.values()) <= 0.01, summary
    for mode in ("localsgd_k4", "adaptive"):
        assert rounds["sync"] >= 4 * rounds[mode], summary
    ks = {t["k"] for t in runs["adaptive"][0]["trace"]}
    assert len(ks) > 2, f"adaptive k never moved: {sorted(ks)}; {summary}"

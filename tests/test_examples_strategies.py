"""examples/quick_start/train_eager.py (a plain PyTorch loop) under the launcher with every
strategy, each given as FLEETLIKE_STRATEGY JSON without editing the script.

For each (one launcher job runs the unmodified script once per strategy, in turn): the job
succeeds on 2 workers, rank 0's loss falls over 8 steps, and rank 0's
``fleet.applied_strategy()`` lines (printed after the first step) show the strategy acting.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from examples_common import PY, ROOT, clean_env, costs, launcher
from helpers import IN_TURN, case_logs, in_turn_cases, run_job, run_jobs

#: tests/test_eager.py runs every strategy on real ranks in the fast tier
pytestmark = pytest.mark.slow

SCRIPT = str(ROOT / "examples" / "quick_start" / "train_eager.py")
STEPS = 8

#: id -> (FLEETLIKE_STRATEGY, lines rank 0's applied_strategy() must print)
CASES = {
    "default": ({}, ["data_parallel: applied (1 buckets"]),
    "localsgd": ({"localsgd": True, "localsgd_configs": {"k_steps": 2}},
                 ["localsgd: applied (replaces data_parallel", "k_steps=2", "data_parallel: NOT applied"]),
    "adaptive_localsgd": ({"adaptive_localsgd": True, "adaptive_localsgd_configs": {"init_k_steps": 2}},
                          ["adaptive_localsgd: applied (replaces data_parallel", "k from loss and lr (init 2"]),
    "gradient_merge": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
                       ["gradient_merge: applied (update every 2 micro-steps", "data_parallel: applied"]),
    "amp_bfloat16": ({"amp": True, "amp_configs": {"dtype": "bfloat16"}},
                     ["amp: applied (autocast bfloat16", "data_parallel: applied"]),
    "amp_float16": ({"amp": True, "amp_configs": {"dtype": "float16"}},
                    ["amp: applied (autocast float16, dynamic loss scaling", "data_parallel: applied"]),
    "recompute": ({"recompute": True, "recompute_configs": {"checkpoints": ["block"]}},
                  ["recompute: applied (checkpoints: block)", "data_parallel: applied"]),
    "sync_batch_norm": ({"sync_batch_norm": True},
                        ["sync_batch_norm: applied (1 BatchNorm layer(s)", "over all 2 ranks"]),
    "fp16_allreduce": ({"fp16_allreduce": True}, ["fp16_allreduce: applied (", "float16"]),
    # one node: nothing crosses nodes, so the flat allreduce is kept, and the log says why
    # (test_hierarchical_on_two_loopback_nodes below runs it where it applies)
    "use_hierarchical_allreduce": ({"use_hierarchical_allreduce": True},
                                   ["use_hierarchical_allreduce: NOT applied (one node"]),
}


def applied_lines(log: str) -> list[str]:
    return [line.split("applied_strategy: ", 1)[1] for line in log.splitlines() if "applied_strategy: " in line]


def check_log(log: str, expected: list[str], strategy: dict) -> None:
    lines = applied_lines(log)
    assert lines, f"no applied_strategy lines in rank 0's log:\n{log[-2000:]}"
    text = "\n".join(lines)
    for want in expected:
        assert want in text, f"{want!r} not in applied_strategy() of {json.dumps(strategy)}:\n{text}"
    loss = costs(log)
    assert len(loss) == STEPS and all(c == c for c in loss), loss  # every step, no nan
    assert statistics.mean(loss[-3:]) < statistics.mean(loss[:3]) - 0.02, f"loss did not fall: {loss}"


@pytest.mark.timeout(150)
def test_train_eager_with_each_strategy(tmp_path: Path) -> None:
    """One launcher job: each worker runs the script once per strategy, in turn (each run its own
    ``fleet.init`` with the strategy from FLEETLIKE_STRATEGY, as separate jobs would)."""
    cases = []
    for name, (strategy, _) in CASES.items():
        (tmp_path / name).mkdir()
        cases.append((name, SCRIPT, {"STEPS": str(STEPS), "MODEL_PATH": str(tmp_path / name),
                                     "FLEETLIKE_STRATEGY": json.dumps(strategy)}))
    plan = in_turn_cases(tmp_path / "cases.json", cases)
    proc = run_job(launcher(str(IN_TURN), str(plan), log_dir=tmp_path / "log"), cwd=tmp_path, env=clean_env(),
                   timeout=140)
    logs = [case_logs((tmp_path / "log" / f"workerlog.{r}").read_text()) for r in range(2)]
    assert proc.returncode == 0 and all(list(log) == list(CASES) for log in logs), proc.stdout[-3000:]
    for name, (strategy, expected) in CASES.items():
        check_log(logs[0][name], expected, strategy)
        assert len(costs(logs[1][name], rank=1)) == STEPS, name
        assert applied_lines(logs[1][name]) == [], name  # rank 0 only
        assert (tmp_path / name / "model.pt").exists(), name  # saved on rank 0, loads into the plain module


@pytest.mark.timeout(120)
def test_hierarchical_on_two_loopback_nodes(tmp_path: Path) -> None:
    """Two launchers, one per "node" (127.0.0.1 and 127.0.0.2), 2 workers each: the hierarchical
    allreduce applies (intra-node reduce-scatter, cross-node allreduce, intra-node gather).
    Each launcher chooses and holds its own ports (``--started_port=auto``); they meet through a
    rendezvous file, as the launchers of real nodes would on a shared filesystem."""
    ips = ("127.0.0.1", "127.0.0.2")
    strategy = {"use_hierarchical_allreduce": True}
    env = clean_env(STEPS=str(STEPS), MODEL_PATH=str(tmp_path), FLEETLIKE_STRATEGY=json.dumps(strategy))

    procs = run_jobs([[PY, "-m", "fleetlike.launch", f"--cluster_node_ips={','.join(ips)}", f"--node_ip={ip}",
                       "--started_port=auto", f"--rendezvous_file={tmp_path / 'rdzv'}", "--nproc_per_node=2",
                       f"--log_dir={tmp_path / f'log{node}'}", SCRIPT] for node, ip in enumerate(ips)],
                     cwd=tmp_path, envs=[env, env], timeout=100)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(p.stdout[-2000:] for p in procs)
    check_log((tmp_path / "log0" / "workerlog.0").read_text(),
              ["use_hierarchical_allreduce: applied (reduce_scatter: 2 ranks/node x 2 nodes"], strategy)
    assert len(costs((tmp_path / "log1" / "workerlog.1").read_text(), rank=3)) == STEPS

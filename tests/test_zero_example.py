"""examples/large_model/train.py runs as documented: under the launcher, 2 CPU workers, stage 3:
the loss falls, each rank holds about half of the weights, a checkpoint of two shards is written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from examples_common import clean_env
from helpers import run_job

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_large_model_example_trains_with_stage_3(tmp_path):
    proc = run_job([sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=2", "--started_port=auto",
                    "--log_dir", str(tmp_path / "log"), str(ROOT / "examples/large_model/train.py")],
                   cwd=ROOT, env=clean_env(STEPS="30", BLOCKS="2", CKPT=str(tmp_path / "ckpt")), timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:]
    log = proc.stdout + (tmp_path / "log" / "workerlog.1").read_text()
    losses = [float(v) for v in re.findall(r"\[rank 0\] step \d+ loss ([0-9.]+)", log)]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    held = {int(r): (int(a), int(b)) for r, a, b in re.findall(r"\[rank (\d)\] holds (\d+) of (\d+) weights", log)}
    assert set(held) == {0, 1} and sum(a for a, _ in held.values()) == held[0][1]
    assert "sharding: applied (stage 3 on torch's FSDP2 over 2 ranks" in log
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("shard-*.pt")) == ["shard-00000.pt", "shard-00001.pt"]

"""The examples run as documented: under the launcher, 2 CPU workers, a few steps each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [
    "examples/quick_start/train_fleet.py",
    "examples/quick_start/train_eager.py",
    "examples/local_sgd/fixed_k.py",
    "examples/local_sgd/warmup_recipe.py",
    "examples/local_sgd/adaptive.py",
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs_under_the_launcher(script, tmp_path):
    (tmp_path / "model").mkdir()
    env = {**os.environ, "STEPS": "6", "MODEL_PATH": str(tmp_path / "model")}
    proc = subprocess.run(
        [sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=2",
         "--started_port=auto", "--log_dir", str(tmp_path / "log"), str(ROOT / script)],
        capture_output=True, text=True, timeout=80, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[rank 0]" in proc.stdout
    assert (tmp_path / "log" / "workerlog.1").exists()


@pytest.mark.timeout(60)
def test_plain_script_runs_as_one_process(tmp_path):
    for script, saved in (("examples/quick_start/train.py", "model.pt"), ("examples/quick_start/train_fleet.py", "COMPLETE")):
        model_dir = tmp_path / Path(script).stem
        model_dir.mkdir()
        env = {**os.environ, "STEPS": "3", "MODEL_PATH": str(model_dir)}
        proc = subprocess.run([sys.executable, str(ROOT / script)], capture_output=True, text=True,
                              timeout=50, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "worker_index: 0, step2 cost" in proc.stdout
        assert (model_dir / saved).exists()  # step 4: the model was saved

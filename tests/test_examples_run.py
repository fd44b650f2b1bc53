"""The examples run as documented: under the launcher, 2 CPU workers, a few steps each."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from examples_common import clean_env, costs

ROOT = Path(__file__).resolve().parent.parent
#: the program-style quick start runs in the fast tier; the others are the same launcher path
EXAMPLES = [
    "examples/quick_start/train_fleet.py",
    *(pytest.param(p, marks=pytest.mark.slow) for p in (
        "examples/quick_start/train_eager.py",
        "examples/quick_start/train_eager_clip.py",
        "examples/local_sgd/fixed_k.py",
        "examples/local_sgd/warmup_recipe.py",
        "examples/local_sgd/adaptive.py",
    )),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs_under_the_launcher(script, tmp_path):
    (tmp_path / "model").mkdir()
    env = clean_env(STEPS="6", MODEL_PATH=str(tmp_path / "model"))
    proc = subprocess.run(
        [sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=2",
         "--started_port=auto", "--log_dir", str(tmp_path / "log"), str(ROOT / script)],
        capture_output=True, text=True, timeout=80, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[rank 0]" in proc.stdout
    assert (tmp_path / "log" / "workerlog.1").exists()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_plain_script_runs_as_one_process(tmp_path):
    for script, saved in (("examples/quick_start/train.py", "model.pt"), ("examples/quick_start/train_fleet.py", "COMPLETE")):
        model_dir = tmp_path / Path(script).stem
        model_dir.mkdir()
        env = clean_env(STEPS="3", MODEL_PATH=str(model_dir))
        proc = subprocess.run([sys.executable, str(ROOT / script)], capture_output=True, text=True,
                              timeout=50, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "worker_index: 0, step2 cost" in proc.stdout
        assert (model_dir / saved).exists()  # step 4: the model was saved


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_clipping_sees_the_averaged_gradients(tmp_path):
    """train_eager_clip.py clips after opt.synchronize(): both workers measure the same (averaged)
    gradient norm at every step although their batches differ."""
    env = clean_env(STEPS="4")
    proc = subprocess.run(
        [sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=2", "--started_port=auto",
         "--log_dir", str(tmp_path / "log"), str(ROOT / "examples/quick_start/train_eager_clip.py")],
        capture_output=True, text=True, timeout=80, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    logs = [(tmp_path / "log" / f"workerlog.{r}").read_text() for r in range(2)]
    norms = [re.findall(r"grad_norm = ([0-9.]+)", log) for log in logs]
    assert len(norms[0]) == 4 and norms[0] == norms[1], norms
    assert costs(logs[0], 0) != costs(logs[1], 1)  # different data on the two workers

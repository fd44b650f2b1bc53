"""The examples run as documented: under the launcher, 2 CPU workers, a few steps each."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from examples_common import clean_env, costs
from helpers import IN_TURN, case_logs, in_turn_cases, run_job, run_jobs

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
#: run in one slow launcher job, in turn; examples/quick_start/train_eager.py runs under the
#: launcher with every strategy in tests/test_examples_strategies.py
IN_ONE_JOB = ("examples/quick_start/train_eager_clip.py", "examples/local_sgd/fixed_k.py",
              "examples/local_sgd/warmup_recipe.py", "examples/local_sgd/adaptive.py")


def _launch(tmp_path: Path, *script: str, **env: str):
    return run_job([sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=2", "--started_port=auto",
                    "--log_dir", str(tmp_path / "log"), *script], cwd=ROOT, env=clean_env(**env), timeout=80)


@pytest.mark.timeout(90)
def test_program_style_quick_start_runs_under_the_launcher(tmp_path):
    (tmp_path / "model").mkdir()
    proc = _launch(tmp_path, str(ROOT / "examples/quick_start/train_fleet.py"), STEPS=str(STEPS),
                   MODEL_PATH=str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "[rank 0]" in proc.stdout
    assert len(costs((tmp_path / "log" / "workerlog.1").read_text(), rank=1)) == STEPS
    assert (tmp_path / "model" / "COMPLETE").exists()  # saved by rank 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_examples_run_under_the_launcher(tmp_path):
    """One launcher job runs each example in turn (tests/launch_workers/in_turn.py). Among them,
    train_eager_clip.py clips after opt.synchronize(): both workers measure the same (averaged)
    gradient norm at every step although their batches differ."""
    cases = []
    for script in IN_ONE_JOB:
        (tmp_path / Path(script).stem).mkdir()
        cases.append((Path(script).stem, ROOT / script, {"STEPS": str(STEPS), "MODEL_PATH": str(tmp_path / Path(script).stem)}))
    proc = _launch(tmp_path, str(IN_TURN), str(in_turn_cases(tmp_path / "cases.json", cases)))
    logs = [case_logs((tmp_path / "log" / f"workerlog.{r}").read_text()) for r in range(2)]
    names = [Path(s).stem for s in IN_ONE_JOB]
    assert proc.returncode == 0 and all(list(log) == names for log in logs), proc.stdout[-3000:]
    assert "[rank 0]" in proc.stdout
    clip = [logs[r]["train_eager_clip"] for r in range(2)]
    norms = [re.findall(r"grad_norm = ([0-9.]+)", log) for log in clip]
    assert len(norms[0]) == STEPS and norms[0] == norms[1], norms
    assert costs(clip[0], 0) != costs(clip[1], 1)  # different data on the two workers
    assert len(re.findall(r"^worker 1 step \d+ loss", logs[1]["fixed_k"], flags=re.M)) == STEPS
    assert len(re.findall(r"^step \d+ loss", logs[0]["adaptive"], flags=re.M)) == STEPS
    assert re.findall(r"^worker 1 pass (\d+) k", logs[1]["warmup_recipe"], flags=re.M) == ["0", "1", "2", "3", "4"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_plain_script_runs_as_one_process(tmp_path):
    scripts = (("examples/quick_start/train.py", "model.pt"), ("examples/quick_start/train_fleet.py", "COMPLETE"))
    dirs = [tmp_path / Path(script).stem for script, _ in scripts]
    for model_dir in dirs:
        model_dir.mkdir()
    # the two one-process jobs at once (each computes on one thread)
    procs = run_jobs([[sys.executable, str(ROOT / script)] for script, _ in scripts], cwd=tmp_path,
                     envs=[clean_env(STEPS="3", MODEL_PATH=str(d)) for d in dirs], timeout=50)
    for proc, model_dir, (_, saved) in zip(procs, dirs, scripts):
        assert proc.returncode == 0, proc.stdout[-2000:]
        assert "worker_index: 0, step2 cost" in proc.stdout
        assert (model_dir / saved).exists()  # step 4: the model was saved

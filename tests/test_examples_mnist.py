"""examples/pytorch_mnist: PyTorch's MNIST example (synthetic data) and its fleetlike conversion.

`main_fleet.py` runs under each starter a user has — the fleetlike launcher, torchrun, mpiexec —
on 2 workers and learns: the test accuracy after 2 short epochs is far above chance (10%).
The diff between the two scripts is checked in test_examples_diff.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from examples_common import PY, ROOT, clean_env, launcher, mpi_missing, mpiexec, run
from helpers import run_job, torchrun_module

MNIST = ROOT / "examples" / "pytorch_mnist"
#: 2 epochs of 1280 images (10 steps of 64 per worker each): seconds on a CPU. The lowest final
#: accuracy over seeds 1-5 at this size was 0.76 for 2 workers' batches, 0.998 for one (bound 0.5)
SMALL = ["--epochs", "2", "--train-size", "1280", "--test-size", "500", "--log-interval", "5"]


def accuracies(text: str) -> list[float]:
    """Every "Test set: ... Accuracy: c/n (p%)" line's c/n, in order."""
    return [int(c) / int(n) for c, n in re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: (\d+)/(\d+)", text)]


def check_learned(text: str, workers: int) -> None:
    acc = accuracies(text)
    print("final test accuracies", acc[-workers:], "(bound 0.5)")
    assert len(acc) == 2 * workers, text[-3000:]  # every worker tests after each epoch
    assert min(acc[-workers:]) > 0.5, f"final test accuracy {acc[-workers:]} (chance: 0.1)\n{text[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_single_process_original_learns(tmp_path: Path) -> None:
    proc = run_job([PY, str(MNIST / "main.py"), *SMALL, "--save-model"], cwd=tmp_path, env=clean_env(), timeout=50)
    assert proc.returncode == 0, proc.stdout[-3000:]
    check_learned(proc.stdout, workers=1)
    assert (tmp_path / "mnist_cnn.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fleet_version_under_the_launcher(tmp_path: Path) -> None:
    proc = run_job(launcher(str(MNIST / "main_fleet.py"), *SMALL, "--save-model", log_dir=tmp_path / "log"),
                   cwd=tmp_path, env=clean_env(), timeout=80)
    assert proc.returncode == 0, proc.stdout[-4000:]
    logs = [(tmp_path / "log" / f"workerlog.{r}").read_text() for r in range(2)]
    for log in logs:  # each worker's own log: its two tests, the last one's accuracy
        check_learned(log, workers=1)
    # each worker trained on its own half: 10 batches per epoch, logged every 5
    assert "".join(logs).count("Train Epoch: 1 [") == 2 * 2, logs[-1][-3000:]
    assert (tmp_path / "mnist_cnn.pt").exists()  # saved by rank 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fleet_version_under_torchrun(tmp_path: Path) -> None:
    proc = run_job(torchrun_module(str(MNIST / "main_fleet.py"), *SMALL), cwd=tmp_path, env=clean_env(), timeout=80)
    assert proc.returncode == 0, proc.stdout[-4000:]
    check_learned(proc.stdout, workers=2)


@pytest.mark.slow
@pytest.mark.default_port
@pytest.mark.timeout(90)
def test_fleet_version_under_mpiexec(tmp_path: Path) -> None:
    missing = mpi_missing()
    if missing:
        pytest.skip(missing)
    proc = run(mpiexec(str(MNIST / "main_fleet.py"), *SMALL), cwd=tmp_path,
               env=clean_env(HYDRA_IFACE="lo"), timeout=80)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    check_learned(proc.stdout, workers=2)

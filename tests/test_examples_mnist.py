"""The MNIST examples (synthetic data) as their users start them: PyTorch's example
(examples/pytorch_mnist/main.py) and its fleetlike conversion (main_fleet.py), and Horovod's
example with one import changed (examples/horovod/pytorch_mnist.py).

The original runs as one process; the two distributed scripts run under each starter a user
has: the fleetlike launcher, torchrun, mpiexec, on 2 workers. Each starter runs one job whose
workers run main_fleet.py and then Horovod's script (tests/launch_workers/in_turn.py: each its
own ``fleet.init`` / ``hvd.init``, as separate jobs would), and both learn: the test accuracy
after 2 short epochs is far above chance (10%). The diff between the two PyTorch scripts is
checked in test_examples_diff.py, Horovod's script against Horovod's in test_horovod_example.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from examples_common import PY, ROOT, clean_env, launcher, mpi_missing, mpiexec, run
from helpers import IN_TURN, case_logs, in_turn_cases, run_job, torchrun_module

MNIST = ROOT / "examples" / "pytorch_mnist"
HOROVOD = ROOT / "examples" / "horovod" / "pytorch_mnist.py"
#: 2 epochs of 1280 images (10 steps of 64 per worker each): seconds on a CPU. The lowest final
#: accuracy over seeds 1-5 at this size was 0.76 for 2 workers' batches, 0.998 for one (bound 0.5)
SMALL = ["--epochs", "2", "--train-size", "1280", "--test-size", "500", "--log-interval", "5"]
#: the same for Horovod's script (logged every 2 steps)
HOROVOD_SMALL = ["--epochs", "2", "--train-size", "1280", "--test-size", "500", "--lr", "0.05", "--log-interval", "2"]
CASES = ("fleet", "horovod")


def accuracies(text: str) -> list[float]:
    """Every "Test set: ... Accuracy: c/n (p%)" line's c/n (PyTorch's example), in order."""
    return [int(c) / int(n) for c, n in re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: (\d+)/(\d+)", text)]


def horovod_accuracies(text: str) -> list[float]:
    """Every "Test set: ... Accuracy: p%" line's p (Horovod's example: rank 0 prints), in order."""
    return [float(p) for p in re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", text)]


def check_learned(text: str, workers: int) -> None:
    acc = accuracies(text)
    print("final test accuracies", acc[-workers:], "(bound 0.5)")
    assert len(acc) == 2 * workers, text[-3000:]  # every worker tests after each epoch
    assert min(acc[-workers:]) > 0.5, f"final test accuracy {acc[-workers:]} (chance: 0.1)\n{text[-3000:]}"


def check_horovod_learned(text: str) -> None:
    acc = horovod_accuracies(text)
    print("horovod final test accuracy", acc[-1:], "(bound 50%)")
    assert len(acc) == 2 and acc[-1] > 50.0, text[-3000:]


def both_scripts(tmp_path: Path, *fleet_extra: str) -> list[str]:
    """tests/launch_workers/in_turn.py and its cases: main_fleet.py, then Horovod's script."""
    plan = in_turn_cases(tmp_path / "cases.json", [("fleet", MNIST / "main_fleet.py", {}, [*SMALL, *fleet_extra]),
                                                   ("horovod", HOROVOD, {}, HOROVOD_SMALL)])
    return [str(IN_TURN), str(plan)]


def check_both_ended(text: str, workers: int) -> None:
    for case in CASES:
        assert text.count(f"=== end {case}\n") == workers, f"{case} did not end on every worker\n{text[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_single_process_original_learns(tmp_path: Path) -> None:
    proc = run_job([PY, str(MNIST / "main.py"), *SMALL, "--save-model"], cwd=tmp_path, env=clean_env(), timeout=50)
    assert proc.returncode == 0, proc.stdout[-3000:]
    check_learned(proc.stdout, workers=1)
    assert (tmp_path / "mnist_cnn.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fleet_and_horovod_versions_under_the_launcher(tmp_path: Path) -> None:
    proc = run_job(launcher(*both_scripts(tmp_path, "--save-model"), log_dir=tmp_path / "log"),
                   cwd=tmp_path, env=clean_env(), timeout=110)
    logs = [case_logs((tmp_path / "log" / f"workerlog.{r}").read_text()) for r in range(2)]
    assert proc.returncode == 0 and all(list(log) == list(CASES) for log in logs), proc.stdout[-4000:]
    fleet_logs = "".join(log["fleet"] for log in logs)
    check_learned(fleet_logs, workers=2)
    # each worker trained on its own half: 10 batches per epoch, logged every 5
    assert fleet_logs.count("Train Epoch: 1 [") == 2 * 2, fleet_logs[-3000:]
    assert (tmp_path / "mnist_cnn.pt").exists()  # saved by rank 0
    check_horovod_learned(logs[0]["horovod"])
    # each worker trains on its half (DistributedSampler over hvd.size()): 640 images, logged every 2 steps
    assert "Train Epoch: 1 [128/640 (20%)]" in logs[0]["horovod"], logs[0]["horovod"][-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fleet_and_horovod_versions_under_torchrun(tmp_path: Path) -> None:
    proc = run_job(torchrun_module(*both_scripts(tmp_path)), cwd=tmp_path, env=clean_env(), timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:]
    check_both_ended(proc.stdout, workers=2)
    check_learned(proc.stdout, workers=2)
    check_horovod_learned(proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fleet_and_horovod_versions_under_mpiexec(tmp_path: Path) -> None:
    missing = mpi_missing()
    if missing:
        pytest.skip(missing)
    proc = run(mpiexec(*both_scripts(tmp_path)), cwd=tmp_path, env=clean_env(HYDRA_IFACE="lo"), timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    check_both_ended(proc.stdout, workers=2)
    check_learned(proc.stdout, workers=2)
    check_horovod_learned(proc.stdout)

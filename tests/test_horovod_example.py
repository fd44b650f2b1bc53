"""examples/horovod/pytorch_mnist.py: Horovod's PyTorch MNIST example with one import changed.

The structure test reads the script with `ast` and compares it with Horovod's
``examples/pytorch/pytorch_mnist.py``: the same sequence of ``hvd.*`` names, the same functions
and command-line flags (plus ``--train-size`` / ``--test-size`` for the synthetic data), and
function bodies identical to Horovod's. The fingerprints below are sha256 prefixes of
``ast.dump`` of Horovod's own definitions (horovod/horovod master, 2026), so any edit to those
bodies fails here. The run tests start it as a Horovod user would, with the fleetlike launcher,
``mpiexec -n 2`` and torchrun, and check that it learns (test accuracy far above the 10% of chance).
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import pytest
from examples_common import ROOT, clean_env, launcher, mpi_missing, mpiexec, run, torchrun

EXAMPLE = ROOT / "examples" / "horovod" / "pytorch_mnist.py"
SMALL = ["--epochs", "2", "--train-size", "2560", "--test-size", "500", "--lr", "0.05"]

#: every ``hvd.<name>`` in Horovod's script, in source order
HOROVOD_NAMES = [
    "allreduce", "rank", "init", "local_rank", "size", "rank", "size", "rank", "size", "nccl_built",
    "local_size", "broadcast_parameters", "broadcast_optimizer_state", "Compression", "Compression",
    "DistributedOptimizer", "Adasum", "Average",
]
HOROVOD_FLAGS = [
    "--batch-size", "--test-batch-size", "--epochs", "--lr", "--momentum", "--no-cuda", "--seed",
    "--log-interval", "--fp16-allreduce", "--use-mixed-precision", "--use-adasum",
    "--gradient-predivide-factor", "--data-dir", "--num-proc", "--hosts", "--communication",
]
#: sha256(ast.dump(definition))[:16] of Horovod's unchanged definitions
HOROVOD_BODIES = {
    "Net": "51aa439d5c592de7",
    "train_mixed_precision": "ab4a871e1877891d",
    "train_epoch": "b4dd1d495e7b9389",
    "metric_average": "31d75d240eb122df",
    "test": "861a8135d5fab00c",
}
#: main() without its two dataset statements (Horovod's `with FileLock: datasets.MNIST(...)`)
HOROVOD_MAIN_REST = ("f858e55a4d84e524", 26)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def structure(source: str) -> dict[str, object]:
    tree = ast.parse(source)
    names = sorted((n for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "hvd"),
                   key=lambda n: (n.lineno, n.col_offset))
    imports = [(a.name, a.asname) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imports += [(f"{n.module}.{a.name}", a.asname) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names]
    flags = [n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"]
    bodies = {n.name: _digest(ast.dump(n)) for n in ast.walk(tree)
              if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in HOROVOD_BODIES}
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    rest = [ast.dump(st) for st in main.body if not isinstance(st, ast.With) and not (
        isinstance(st, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id in ("train_dataset", "test_dataset") for t in st.targets))]
    return {"names": [n.attr for n in names], "imports": imports, "flags": flags, "bodies": bodies,
            "main_rest": (_digest("\n".join(rest)), len(rest))}


def test_example_is_horovods_with_the_import_changed() -> None:
    got = structure(EXAMPLE.read_text())
    assert got["names"] == HOROVOD_NAMES
    assert ("fleetlike.horovod", "hvd") in got["imports"]
    assert not [m for m, _ in got["imports"] if m.split(".")[0] in ("horovod", "torchvision")]
    assert got["flags"] == HOROVOD_FLAGS[:13] + ["--train-size", "--test-size"] + HOROVOD_FLAGS[13:]
    assert got["bodies"] == HOROVOD_BODIES
    assert got["main_rest"] == HOROVOD_MAIN_REST


def test_structure_check_sees_a_change() -> None:
    source = EXAMPLE.read_text().replace("optimizer.zero_grad()\n            output = model(data)",
                                         "output = model(data)", 1)
    assert structure(source)["bodies"] != HOROVOD_BODIES


def accuracy(text: str) -> list[float]:
    return [float(p) for p in re.findall(r"Test set: Average loss: [0-9.]+, Accuracy: ([0-9.]+)%", text)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_example_learns_under_the_launcher(tmp_path: Path) -> None:
    proc = run(launcher(str(EXAMPLE), *SMALL, log_dir=tmp_path / "log"), cwd=tmp_path, env=clean_env(), timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (tmp_path / "log" / "workerlog.0").read_text()
    acc = accuracy(log)
    assert len(acc) == 2 and acc[-1] > 50.0, log[-3000:]
    # each worker trains on its half (DistributedSampler over hvd.size()): 1280 images, logged every 10
    assert "Train Epoch: 1 [640/1280 (50%)]" in log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_example_learns_under_mpiexec(tmp_path: Path) -> None:
    missing = mpi_missing()
    if missing:
        pytest.skip(missing)
    proc = run(mpiexec(str(EXAMPLE), *SMALL), cwd=tmp_path, env=clean_env(HYDRA_IFACE="lo"), timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    acc = accuracy(proc.stdout)
    assert len(acc) == 2 and acc[-1] > 50.0, proc.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_example_learns_under_torchrun(tmp_path: Path) -> None:
    proc = run(torchrun(str(EXAMPLE), *SMALL), cwd=tmp_path, env=clean_env(), timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    acc = accuracy(proc.stdout)
    assert len(acc) == 2 and acc[-1] > 50.0, proc.stdout[-3000:]

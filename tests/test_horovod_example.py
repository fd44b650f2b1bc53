"""examples/horovod/pytorch_mnist.py and pytorch_mnist_elastic.py: Horovod's PyTorch MNIST examples
(plain and elastic) with one import changed.

The structure test reads the script with `ast` and compares it with Horovod's
``examples/pytorch/pytorch_mnist.py``: the same sequence of ``hvd.*`` names, the same functions
and command-line flags (plus ``--train-size`` / ``--test-size`` for the synthetic data), and
function bodies identical to Horovod's. The fingerprints below are sha256 prefixes of
``ast.dump`` of Horovod's own definitions (horovod/horovod master, 2026), so any edit to those
bodies fails here. The run tests start it as a Horovod user would, with the fleetlike launcher,
``mpiexec -n 2`` and torchrun, and check that it learns (test accuracy far above the 10% of chance).
The elastic example gets the same structure check against Horovod's
``examples/elastic/pytorch/pytorch_mnist_elastic.py``, and one elastic run with a worker SIGKILLed
compared with a run of the same rollback in which nobody dies.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import pytest
import torch
from examples_common import PY, ROOT, clean_env, launcher, mpi_missing, mpiexec, run
from helpers import run_job, run_jobs, torchrun_module
from test_elastic_nodes import free_port

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
    proc = run_job(launcher(str(EXAMPLE), *SMALL, log_dir=tmp_path / "log"), cwd=tmp_path, env=clean_env(),
                   timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:]
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
    proc = run_job(torchrun_module(str(EXAMPLE), *SMALL), cwd=tmp_path, env=clean_env(), timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:]
    acc = accuracy(proc.stdout)
    assert len(acc) == 2 and acc[-1] > 50.0, proc.stdout[-3000:]


ELASTIC = ROOT / "examples" / "horovod" / "pytorch_mnist_elastic.py"
#: every ``hvd.<name>`` in Horovod's elastic script, in source order
ELASTIC_NAMES = [
    "init", "local_rank", "size", "rank", "size", "rank", "size", "nccl_built", "local_size", "Compression",
    "Compression", "allreduce", "elastic", "rank", "DistributedOptimizer", "Adasum", "Average", "size", "elastic",
]
#: sha256(ast.dump(definition))[:16] of Horovod's definitions, and of its other module-level
#: statements (imports, the dataset statements and the download lock left out) with their count
ELASTIC_BODIES = {
    "Net": "51aa439d5c592de7", "metric_average": "31d75d240eb122df", "train": "58f56a05ee19787c",
    "test": "861a8135d5fab00c", "on_state_reset": "a2c2e3b96129eb6b",
}
ELASTIC_REST = ("814080f29589540d", 34)


def _data_statement(st: ast.stmt) -> bool:
    """The statements the data source replaced, or added: imports, the docstring, the download
    lock, the dataset assignments and the ``--train-size`` / ``--test-size`` flags."""
    if isinstance(st, (ast.Import, ast.ImportFrom, ast.With)):
        return True
    if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
        return True
    if isinstance(st, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id in ("train_dataset", "test_dataset") for t in st.targets)
    call = getattr(st, "value", None)
    return (isinstance(st, ast.Expr) and isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument"
            and call.args[0].value in ("--train-size", "--test-size"))


def module_structure(source: str) -> dict[str, object]:
    tree = ast.parse(source)
    names = sorted((n for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "hvd"),
                   key=lambda n: (n.lineno, n.col_offset))
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in ELASTIC_BODIES}
    rest = [ast.dump(st) for st in tree.body if not _data_statement(st) and st not in defs.values()]
    imports = [(a.name, a.asname) for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    imports += [(f"{n.module}.{a.name}", a.asname) for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names]
    return {"names": [n.attr for n in names], "imports": imports,
            "bodies": {k: _digest(ast.dump(v)) for k, v in defs.items()}, "rest": (_digest("\n".join(rest)), len(rest))}


def test_elastic_example_is_horovods_with_the_import_changed() -> None:
    got = module_structure(ELASTIC.read_text())
    assert got["names"] == ELASTIC_NAMES
    assert ("fleetlike.horovod", "hvd") in got["imports"]
    assert not [m for m, _ in got["imports"] if m.split(".")[0] in ("horovod", "torchvision", "filelock")]
    assert got["bodies"] == ELASTIC_BODIES
    assert got["rest"] == ELASTIC_REST
    changed = ELASTIC.read_text().replace("state.commit()", "pass", 1)
    assert module_structure(changed)["bodies"] != ELASTIC_BODIES


#: runs a script as ``python script.py`` would (runpy, its folder first on sys.path), with one
#: failure after the AT-th commit: ``kill`` (rank 1 SIGKILLs itself once, half a second later,
#: when rank 0 waits in the next step's allreduce) or ``fail`` (every rank raises the error a
#: lost peer raises, and nobody dies); then every rank saves its parameters, the learning rate,
#: the commit it rolled back to and whether every rank holds the same parameters
CHECKED_RUN = """
import os, runpy, signal, sys, time
import torch
import fleetlike.elastic
import fleetlike.horovod as hvd
from fleetlike.comm import CommError
out, mode, at, script = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
open(os.path.join(out, "pid.%d" % os.getpid()), "w").close()
state, commit, n = hvd.elastic.TorchState, hvd.elastic.TorchState.commit, []
def failing(self):
    commit(self)
    n.append(1)
    if len(n) != at:
        return
    if mode == "fail":
        raise CommError("a peer failed (injected after commit %d)" % at)
    if hvd.rank() == 1 and not os.path.exists(os.path.join(out, "killed")):
        open(os.path.join(out, "killed"), "w").close()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
state.commit = failing
sys.argv, sys.path[0] = sys.argv[4:], os.path.dirname(script)
names = runpy.run_path(script, run_name="__main__")
mine = torch.cat([p.detach().reshape(-1) for p in names["model"].parameters()])
every = hvd.allgather(mine.view(1, -1))
torch.save({"rank": hvd.rank(), "size": hvd.size(), "params": mine, "identical": bool((every == every[0]).all()),
            "lr": [g["lr"] for g in names["optimizer"].param_groups], "commits": names["state"].commits,
            "rolled_back_to": [r["commit"] for r in fleetlike.elastic.RESET_LOG]},
           os.path.join(out, "params.%d.pt" % os.getpid()))
"""


def _elastic_example(out: Path, mode: str, at: int) -> list[str]:
    """The launcher command of one run (``out`` made, with the checked wrapper in it)."""
    out.mkdir()
    wrapper = out / "checked_run.py"
    wrapper.write_text(CHECKED_RUN)
    return [PY, "-m", "fleetlike.launch", "--nnodes=1:2", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            "--node_ip=127.0.0.1", "--rdzv_last_call=1", "--nproc_per_node=2", "--max_restarts=1",
            "--started_port=auto", f"--log_dir={out / 'log'}", str(wrapper), str(out), mode, str(at), str(ELASTIC),
            "--epochs", "2", "--batch-size", "16", "--lr", "0.1", "--train-size", "320", "--test-size", "100"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_elastic_example_survives_a_killed_worker(tmp_path: Path) -> None:
    """Under ``--nnodes 1:2 --max_restarts 1`` a worker SIGKILLed mid-epoch is started again, the
    survivor rolls back to the last commit, the restarted worker takes it (with the random
    generators its rank had then: the dropout masks), and both end with exactly the parameters of
    a run where the same rollback happens and nobody dies (run beside it: the same fp32 operations
    in the same order, so equal to the bit). Not those of a run
    without any rollback: after a reset the script trains the first ``len(train_loader) -
    state.batch`` batches of the epoch again, as under horovodrun. The reset callback's learning
    rate (``lr * hvd.size()``) reaches every rank, the restarted one included, as Horovod's sync
    hands it out."""
    at = 7  # of the 20 commits of epoch 1
    modes = ("kill", "fail")
    # the two launchers at once, forked from the session's preload server (as their workers are)
    ends = run_jobs([_elastic_example(tmp_path / mode, mode, at) for mode in modes], cwd=tmp_path,
                    envs=[clean_env()] * len(modes), timeout=200)
    procs = dict(zip(modes, ends))
    for mode, proc in procs.items():
        assert proc.returncode == 0, (mode, proc.stdout[-5000:])
    got = {mode: {int(p.name.split(".")[1]): torch.load(p) for p in (tmp_path / mode).glob("params.*.pt")}
           for mode in procs}
    started = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "kill").glob("pid.*"))
    # the killed worker was started again; the survivor rolled back, its new partner joined afresh
    assert len(started) == 3 and len(got["kill"]) == 2, (started, list(got["kill"]))
    assert sorted(len(r["rolled_back_to"]) for r in got["kill"].values()) == [0, 1], got["kill"]
    for mode, ranks in got.items():
        assert sorted(r["rank"] for r in ranks.values()) == [0, 1] and all(r["size"] == 2 for r in ranks.values())
        assert all(r["identical"] for r in ranks.values()), mode
        assert all(r["lr"] == [0.2] for r in ranks.values()), (mode, [r["lr"] for r in ranks.values()])
        assert [r["rolled_back_to"] for r in ranks.values() if r["rolled_back_to"]] != [], mode
        assert all(r["rolled_back_to"] in ([], [at]) for r in ranks.values()), mode
    want = got["fail"][min(got["fail"])]["params"]
    for r in got["kill"].values():
        torch.testing.assert_close(r["params"], want, rtol=0, atol=0)
    # the script's test() ran on the re-formed world (its averages are allreduces); that this
    # model and data learn is the plain example's test (40 steps here are too few to)
    logs = "".join(_read(p) for p in sorted((tmp_path / "kill" / "log").rglob("workerlog.*")))
    assert len(accuracy(logs)) == 1, logs[-3000:]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""

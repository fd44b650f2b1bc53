"""One rank of an MPI test job: ``mpiexec -n N python tests/mpi_runner.py SPEC OUTDIR``.

The test process pickles a job spec (a task name and its data) to ``SPEC``; every rank runs the
task on the MPI world and pickles its result to ``OUTDIR/rank{r}.pkl``. A rank that raises
writes its traceback to ``OUTDIR/rank{r}.err`` and aborts the whole job, so peers blocked in a
collective do not hang until the test's timeout. `run_mpi` is the test-side half: it starts
the job in its own process group, bounds it with a timeout, and turns failures into errors that
name the rank.

Tasks:
    cases          run a list of `comm_cases.Case` on ``MPICommunicator()`` (COMM_WORLD)
    cases_by_world several (world size, cases) draws, each on a world of the job's first ranks
    split          for each colouring: ``world.split(colors[rank], key=-rank)``, then an allreduce
                   of the ranks
    split_by_world several such draws, each on a world of the job's first ranks
    create_world   build the world with ``fleetlike.comm.create_world`` from an MPI role, and
                   its `CommGroups` (intra, inter, rings)
    stall          rank 0 issues an allreduce rank 1 never joins (the watchdog's case)
    mismatch       each rank calls one collective with its own size; returns the error text
    call           ``module:function`` of a test helper module, called with the data (the
                   Horovod-face suite: ``horovod_common:mpi_rank``)
    several        a list of (task, data), run in turn on the same ranks
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

__all__ = ["mpiexec_path", "mpi_unavailable_reason", "run_mpi"]

RUNNER = Path(__file__).resolve()


# --------------------------------------------------------------------------- test side


def mpiexec_path() -> Path:
    """The mpich wheel's ``mpiexec``, installed next to the running interpreter."""
    return Path(sys.executable).parent / "mpiexec"


def mpi_unavailable_reason() -> str | None:
    """Why MPI tests cannot run here, or None when they can."""
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError or a missing libmpi
        return f"mpi4py does not import ({exc}); pip install mpi4py mpich"
    exe = mpiexec_path()
    if not os.access(exe, os.X_OK):
        return f"no mpiexec next to the interpreter at {exe}; pip install mpich"
    return None


def mpiexec_command(n: int, *args: str) -> list[str]:
    """``mpiexec`` for ``n`` local ranks: fork launcher (no ssh), no core binding, loopback."""
    return [str(mpiexec_path()), "-launcher", "fork", "-bind-to", "none", "-n", str(n), *args]


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HYDRA_IFACE", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_mpi(n: int, task: str, data: Any, *, timeout: float = 60.0) -> list[Any]:
    """Run ``task`` on ``n`` MPI ranks; return each rank's result in rank order.

    Raises AssertionError with the failing rank's traceback (or mpiexec's output) when a rank
    fails, and kills the job's whole process group when it outlives ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="fleetlike-mpi-") as tmp:
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(pickle.dumps({"task": task, "data": data}))
        proc = subprocess.Popen(
            mpiexec_command(n, sys.executable, str(RUNNER), str(spec), tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=mpi_env(),
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, _ = proc.communicate()
            raise AssertionError(
                f"mpiexec -n {n} ({task}) did not finish within {timeout:g}s; killed. Output:\n"
                + out.decode(errors="replace")[-4000:]
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        errors = sorted(Path(tmp).glob("rank*.err"))
        if errors:
            raise AssertionError(
                "\n".join(f"{e.stem} raised:\n{e.read_text()}" for e in errors)
            )
        if proc.returncode != 0:
            raise AssertionError(
                f"mpiexec -n {n} ({task}) exited with {proc.returncode}:\n"
                + out.decode(errors="replace")[-4000:]
            )
        results = []
        for r in range(n):
            path = Path(tmp) / f"rank{r}.pkl"
            if not path.exists():
                raise AssertionError(f"rank {r} of {n} ({task}) wrote no result")
            results.append(pickle.loads(path.read_bytes()))
        return results


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


# --------------------------------------------------------------------------- rank side


def _task_cases(cases: list[Any]) -> Any:
    from comm_cases import run_cases

    from fleetlike.comm.mpi import MPICommunicator

    world = MPICommunicator()
    try:
        return run_cases(world, cases)
    finally:
        world.close()


def _sub_world(n: int) -> Any:
    """A communicator of the job's first ``n`` ranks (COMM_WORLD itself when ``n`` is the job's
    size; None on the ranks outside it), so that one job covers worlds of every size up to its
    own: MPI's collectives on a split communicator of ``n`` ranks are those of an ``n``-rank job."""
    from mpi4py import MPI

    from fleetlike.comm.mpi import MPICommunicator

    comm = MPI.COMM_WORLD
    if n == comm.Get_size():
        return MPICommunicator()
    sub = comm.Split(0 if comm.Get_rank() < n else MPI.UNDEFINED, key=comm.Get_rank())
    return None if sub == MPI.COMM_NULL else MPICommunicator(sub)


def _task_cases_by_world(draws: list[tuple[int, list[Any]]]) -> Any:
    """`comm_cases.run_by_world` on worlds of the job's first ranks (`_sub_world`)."""
    from comm_cases import run_by_world

    return run_by_world(draws, _sub_world)


def _task_split_by_world(draws: list[list[list[int | None]]]) -> Any:
    """For each list of colourings (one colour per rank of a world of that many ranks): the
    splits of `_task_split` on a world of the first ``len(colours)`` ranks; None outside it."""
    results = []
    for colorings in draws:
        world = _sub_world(len(colorings[0]))
        results.append(None if world is None else _splits(world, colorings))
    return results


def _task_split(colorings: list[list[int | None]]) -> Any:
    """One split per colouring, in order, on the same world (one job covers several draws)."""
    from fleetlike.comm.mpi import MPICommunicator

    return _splits(MPICommunicator(), colorings)


def _splits(world: Any, colorings: list[list[int | None]]) -> Any:
    """``world.split`` by each colouring in turn, an allreduce on each part; closes ``world``."""
    import torch

    results = []
    try:
        for colors in colorings:
            sub = world.split(colors[world.rank], key=-world.rank)
            if sub is None:
                results.append(None)
                continue
            try:
                total = sub.all_reduce(torch.tensor([world.rank])).item()
                results.append((sub.ranks, sub.rank, sub.size, total))
            finally:
                sub.close()
        return results
    finally:
        world.close()


def _task_create_world(_: Any) -> Any:
    import torch
    from mpi4py import MPI

    from fleetlike.comm import CommGroups, create_world, resolve_backend
    from fleetlike.roles import MPIRoleMaker, Role

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    endpoints = [f"127.0.0.1:{7000 + r}" for r in range(size)]
    role = Role.from_endpoints(rank, endpoints, source="mpi")
    maker_role = MPIRoleMaker().role
    out: dict[str, Any] = {
        "auto": resolve_backend("auto", role).value,
        "maker": (maker_role.rank, maker_role.world_size, maker_role.source),
    }
    for label, r in (("explicit", role), ("maker", maker_role)):
        world = create_world(r, backend="mpi" if label == "explicit" else "auto")
        out[f"{label}_world"] = (
            world.backend,
            world.rank,
            world.size,
            world.all_reduce(torch.tensor([float(rank + 1)])).item(),
        )
        if label == "maker":  # sub-communicators by MPI splits: one node, so intra = world
            groups = CommGroups(world, r)
            out["intra"] = groups.intra.all_gather_flat(torch.tensor([rank])).tolist()
            out["inter"] = groups.inter.all_gather_flat(torch.tensor([rank])).tolist()
            out["rings"] = [ring.all_reduce(torch.tensor([1])).item() for ring in groups.rings(3)]
            groups.close()
        else:
            world.close()
    if size > 1:  # a role that disagrees with MPI about the rank is refused
        wrong = Role.from_endpoints((rank + 1) % size, endpoints, source="mpi")
        try:
            create_world(wrong, backend="mpi")
        except ValueError as exc:
            out["mismatch"] = str(exc)
        else:
            out["mismatch"] = None
    return out


def _task_stall(spec: dict[str, Any]) -> Any:
    """Rank 0 issues a collective that rank 1 never joins; the watchdog must end the job."""
    import time

    import torch

    from fleetlike.comm.mpi import MPICommunicator

    world = MPICommunicator(timeout=spec["timeout"])
    world.barrier()  # collective #1: both ranks are up
    if world.rank == 0:
        x = torch.ones(4)
        if spec["mode"] == "async":
            world.all_reduce_async(x).wait()
        else:
            world.all_reduce(x)
    else:
        time.sleep(spec["sleep"])  # stuck in its data loader, say
    return "finished"


def _task_mismatch(spec: dict[str, Any]) -> Any:
    """Rank r passes ``spec["shapes"][r]`` to ``spec["kind"]``; returns (error text, rows) or
    None, then an allreduce showing the communicator still works."""
    import torch

    from fleetlike.comm import CollectiveMismatchError
    from fleetlike.comm.mpi import MPICommunicator

    world = MPICommunicator(timeout=spec.get("timeout", 30.0))
    world.check_sizes = spec.get("check_sizes", True)
    try:
        x = torch.ones(spec["shapes"][world.rank])
        try:
            getattr(world, spec["kind"])(x)
        except CollectiveMismatchError as exc:
            error: Any = (str(exc), exc.rows)
        except Exception as exc:  # noqa: BLE001 - what MPI itself does, for the record
            error = ("other", f"{type(exc).__name__}: {exc}")
        else:
            error = None
        return error, world.all_reduce(torch.tensor([1.0 + world.rank])).item()
    finally:
        world.close()


def _task_mismatches(specs: list[dict[str, Any]]) -> Any:
    """`_task_mismatch` of each spec in turn, each on its own communicator (one job covers
    several; a job's start costs seconds, a collective does not)."""
    return [_task_mismatch(spec) for spec in specs]


def _task_several(tasks: list[tuple[str, Any]]) -> Any:
    """Each ``(task, data)`` in turn on the same ranks: their results, in order (one job covers
    several tasks; a job's start costs every rank a torch import, a task does not)."""
    return [TASKS[name](data) for name, data in tasks]


def _task_call(spec: dict[str, Any]) -> Any:
    """``spec["target"]`` ("module:function", importable from tests/) called with ``spec["data"]``."""
    import importlib

    sys.path.insert(0, str(RUNNER.parent))
    module, _, name = spec["target"].partition(":")
    return getattr(importlib.import_module(module), name)(spec["data"])


TASKS = {"call": _task_call, "mismatch": _task_mismatch, "mismatches": _task_mismatches,
         "cases": _task_cases, "split": _task_split, "cases_by_world": _task_cases_by_world,
         "split_by_world": _task_split_by_world, "create_world": _task_create_world,
         "stall": _task_stall, "several": _task_several}


def main(spec_path: str, outdir: str) -> None:
    import torch

    torch.set_num_threads(1)
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    try:
        spec = pickle.loads(Path(spec_path).read_bytes())
        result = TASKS[spec["task"]](spec["data"])
        tmp = Path(outdir) / f"rank{rank}.pkl.tmp"
        tmp.write_bytes(pickle.dumps(result))
        shutil.move(tmp, Path(outdir) / f"rank{rank}.pkl")
    except BaseException:  # noqa: BLE001 - report, then take the whole job down
        (Path(outdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Small pieces many test files need, written once: comparing parameter lists, seeded batches,
the two losses the tests train with. Rank functions import them by module name (tests/ is on
sys.path in the workers too), so they stay plain module-level functions."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["PRELOAD_VARIABLES", "cross_entropy", "labelled_batch", "max_diff", "mse", "params", "preload_env",
           "regression_batch", "run_job", "run_jobs", "start_job", "popen_job", "torchrun_module", "in_turn_cases",
           "case_logs", "IN_TURN", "side_by_side"]

T = TypeVar("T")

#: the session's preload server (tests/conftest.py), kept by the helpers that otherwise clear
#: every FLEETLIKE_ variable from a launcher's environment
PRELOAD_VARIABLES = ("FLEETLIKE_PRELOAD", "FLEETLIKE_PRELOAD_SOCKET")


def preload_env() -> dict[str, str]:
    """The preload variables of this process's environment (the launchers' workers fork from the
    session's server; the test says so where it needs a plain start)."""
    return {k: os.environ[k] for k in PRELOAD_VARIABLES if k in os.environ}


def proc_status(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of this process, in bytes."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest absolute difference between two lists of same-shaped arrays."""
    assert len(a) == len(b), (len(a), len(b))
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def params(model: torch.nn.Module) -> list[np.ndarray]:
    """The model's parameters as numpy copies."""
    return [p.detach().clone().numpy() for p in model.parameters()]


def labelled_batch(seed: int, rows: int, features: int, classes: int) -> dict[str, torch.Tensor]:
    """``x`` standard normal (float32) and ``y`` class labels, both from one seeded generator."""
    rng = np.random.default_rng(seed)
    return {"x": torch.from_numpy(rng.standard_normal((rows, features)).astype("float32")),
            "y": torch.from_numpy(rng.integers(0, classes, rows))}


def regression_batch(seed: int, rows: int, features: int, outputs: int, scale: float,
                     squash: bool = False) -> dict[str, torch.Tensor]:
    """``x`` standard normal and the target ``y = scale * x[:, :outputs]`` (through tanh with
    ``squash``): each rank's ``scale`` gives it a different optimum, so averaging matters."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype("float32")
    head = np.tanh(x[:, :outputs]) if squash else x[:, :outputs]
    return {"x": torch.from_numpy(x), "y": torch.from_numpy((head * scale).copy())}


def cross_entropy(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The classification loss (in float32 even when the model's output is 16-bit under AMP)."""
    return F.cross_entropy(model(feed["x"]).float(), feed["y"])


def mse(model: torch.nn.Module, feed: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(feed["x"]), feed["y"])


# ---------------------------------------------------------------- jobs side by side
# (a test file's multi-process jobs that mostly wait, for a peer, a heartbeat or a timeout, run
# at once; each test then checks its own job's result)

@contextlib.contextmanager
def side_by_side(*waves: Mapping[str, Callable[[], T]]) -> Iterator[dict[str, Future[T]]]:
    """Run each wave's jobs at once, each in a thread of its own (a job is a function that starts
    processes and waits for them, bounded by its own timeouts), the waves one after the other
    (so that no more run at once than the machine keeps up with); yield every job's future by
    name. On exit, waits for every job: none outlives the block."""
    futures: dict[str, Future[T]] = {name: Future() for wave in waves for name in wave}

    def run(name: str, job: Callable[[], T]) -> None:
        futures[name].set_running_or_notify_cancel()
        try:
            futures[name].set_result(job())
        except BaseException as exc:  # noqa: BLE001 - the test that reads the result raises it
            futures[name].set_exception(exc)

    def drive() -> None:
        for wave in waves:
            threads = [threading.Thread(target=run, args=item, daemon=True) for item in wave.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    driver = threading.Thread(target=drive, name="side-by-side", daemon=True)
    driver.start()
    try:
        yield futures
    finally:
        driver.join()

# ---------------------------------------------------------------- jobs forked from the preload server

#: the interpreter flags of the session's preload server (tests/conftest.py): a command forked from
#: it runs with them
PRELOAD_FLAGS = ("-u",)
#: runs several scripts in turn in each worker of one job (its docstring says how)
IN_TURN = Path(__file__).resolve().parent / "launch_workers" / "in_turn.py"


def torchrun_module(*args: str, nproc: int = 2) -> list[str]:
    """torchrun on one node as ``python -m torch.distributed.run`` (the code of the ``torchrun``
    console script; as a module, `run_job` forks its agent from the preload server; the workers
    it starts are plain interpreters either way)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


# Plain torch DDP (no fleetlike in the script) runs as plain interpreters, never forked from the
# preload server: torch 2.13's ProcessGroupGloo can deadlock when a DDP model is freed right after
# its last step. The Reducer's destructor destroys the group with the GIL held and waits for the
# gloo worker's lock; the worker, holding it, frees the last allreduce's copy of the thread-local
# state, which holds the Python context backward stashes there, and that needs the GIL. Forked
# from the server the pair of ranks hung in 2 of 12 runs; as plain interpreters in none of 16.
# Ranks forked by `run_ranks` build their DDP references in `dp_common.torch_group`, which lets
# gloo's workers go idle before the model frees the group.
# The same free, when the worker asks for the GIL after the interpreter began finalising, aborts
# the process instead ("terminate called without an active exception", 1 of 40 runs of two
# plain DDP ranks, under torchrun too): plain scripts in tests/launch_workers sleep a moment
# before they exit; fleetlike does the same at exit wherever it made a gloo group
# (`fleetlike.comm.gloo.settle_at_exit`).


def run_job(cmd: Sequence[str], *, cwd: Path | str, env: Mapping[str, str], timeout: float,
            preload: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``python ... script|-m module args`` to its end, in its own session, killing the whole
    session after ``timeout`` seconds. Forked from the session's preload server where ``env``
    names one (``FLEETLIKE_PRELOAD_SOCKET``) and the command qualifies, else started plainly: the
    launcher or script then skips its own torch import. The child writes stdout and stderr to one
    pipe: ``stdout`` holds both, in order, and ``stderr`` is empty."""
    return run_jobs([cmd], cwd=cwd, envs=[env], timeout=timeout, preload=preload)[0]


def run_jobs(cmds: Sequence[Sequence[str]], *, cwd: Path | str, envs: Sequence[Mapping[str, str]],
             timeout: float, preload: bool = True) -> list[subprocess.CompletedProcess[str]]:
    """`run_job` for processes that run at once (one per node or rank), each with its env; all
    are killed when one outlives ``timeout``."""
    started = [_start(c, cwd=cwd, env=e, preload=preload) for c, e in zip(cmds, envs)]
    chunks: list[list[bytes]] = [[] for _ in started]
    drains = [threading.Thread(target=lambda r=r, out=out: out.extend(iter(lambda: r.read(65536), b"")),
                               daemon=True) for (_, r), out in zip(started, chunks)]
    for t in drains:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p, _ in started]
    except subprocess.TimeoutExpired:
        for p, _ in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p, _ in started:
            p.wait(timeout=30)
        for t in drains:
            t.join(timeout=5)
        text = "\n".join(b"".join(c).decode(errors="replace")[-4000:] for c in chunks)
        raise AssertionError(f"{' '.join(map(str, cmds[0]))} did not finish in {timeout:g}s; killed.\n{text}") from None
    for t in drains:
        t.join(timeout=30)
    for _, r in started:
        r.close()
    return [subprocess.CompletedProcess([str(x) for x in c], code, b"".join(out).decode(errors="replace"), "")
            for c, code, out in zip(cmds, codes, chunks)]


def start_job(cmd: Sequence[str], *, cwd: Path | str, env: Mapping[str, str],
              preload: bool = True) -> tuple[Any, Any]:
    """`run_job`'s start alone: ``(process, reader of its stdout and stderr)``; the process has
    ``pid``, ``poll``, ``wait`` and ``returncode`` as a `subprocess.Popen` (the caller reads the
    reader to its end and ends the session ``pid``)."""
    return _start(cmd, cwd=cwd, env=env, preload=preload)


class _ForkedPopen:
    """A process forked from the session's preload server, as `popen_job` returns it: the part
    of `subprocess.Popen`'s interface (text mode, stdout and stderr piped apart) the tests use.
    Both pipes are drained from the start, so a chatty process never blocks on a full pipe."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid, self.args = proc.pid, proc.args
        self._chunks: tuple[list[bytes], list[bytes]] = ([], [])
        self._drains = [threading.Thread(target=lambda r=r, out=out: out.extend(iter(lambda: r.read(65536), b"")),
                                         daemon=True) for r, out in zip((proc.stdout, proc.stderr), self._chunks)]
        for t in self._drains:
            t.start()

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self._proc.poll()  # type: ignore[no-any-return]

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)  # type: ignore[no-any-return]

    def send_signal(self, sig: int) -> None:
        self._proc.send_signal(sig)

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end and for both pipes' end; `subprocess.TimeoutExpired` (with what
        came so far) after ``timeout`` seconds, as `subprocess.Popen.communicate` raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._proc.wait(timeout)
            for t in self._drains:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if t.is_alive():  # a child of the process holds the pipe open
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        except subprocess.TimeoutExpired:
            out, err = (b"".join(c).decode(errors="replace") for c in self._chunks)
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0, output=out, stderr=err) from None
        for reader in (self._proc.stdout, self._proc.stderr):
            reader.close()
        out, err = (b"".join(c).decode(errors="replace") for c in self._chunks)
        return out, err


def popen_job(cmd: Sequence[str], *, cwd: Path | str, env: Mapping[str, str], preload: bool = True) -> Any:
    """``subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True)``
    for ``python ... script|-m module args``, forked from the session's preload server where
    ``env`` names one and the command qualifies (its stdout and stderr still apart), else that
    very `Popen`. The caller ends it as a `Popen`: ``communicate``, ``send_signal``, ``kill``,
    ``os.killpg(pid)`` (it leads a session of its own either way)."""
    command = [str(c) for c in cmd]
    proc = _fork(command, cwd=cwd, env=env, split_stderr=True) if preload else None
    if proc is not None:
        return _ForkedPopen(proc)
    return subprocess.Popen(command, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)


def _fork(command: list[str], *, cwd: Path | str, env: Mapping[str, str], split_stderr: bool = False) -> Any:
    """``command`` forked from the session's preload server, or None where it must start plainly."""
    if not (env.get(PRELOAD_VARIABLES[1]) and command and command[0] == sys.executable):
        return None
    from fleetlike.launch.env import tuned_glibc_tunables
    from fleetlike.launch.preload import start_preloaded

    forked = command if command[1:2] == list(PRELOAD_FLAGS) else [command[0], *PRELOAD_FLAGS, *command[1:]]
    # the server started with the launcher's allocator setting (tests/conftest.py), so a child
    # forked from it runs with that setting, and its environment says so
    tuned = {**env, "GLIBC_TUNABLES": tuned_glibc_tunables(env.get("GLIBC_TUNABLES"))}
    return start_preloaded(forked, tuned, stdout=None, rank=0, split_stderr=split_stderr, cwd=cwd)


def _start(cmd: Sequence[str], *, cwd: Path | str, env: Mapping[str, str], preload: bool) -> tuple[Any, Any]:
    command = [str(c) for c in cmd]
    proc = _fork(command, cwd=cwd, env=env) if preload else None
    if proc is not None:
        return proc, proc.stdout
    proc = subprocess.Popen(command, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, proc.stdout


def in_turn_cases(path: Path, cases: Sequence[tuple[str, str | Path, Mapping[str, str]]]) -> Path:
    """Write ``(name, script, env)`` cases for tests/launch_workers/in_turn.py to ``path``."""
    path.write_text(json.dumps([{"name": n, "script": str(s), "env": dict(e)} for n, s, e in cases]))
    return path


def case_logs(log: str) -> dict[str, str]:
    """A log of tests/launch_workers/in_turn.py split by case: name -> the lines that case printed
    (a case that did not end is absent)."""
    found = re.findall(r"^=== begin (\S+)\n(.*?)^=== end \1$", log, flags=re.S | re.M)
    return {name: text for name, text in found}

"""Run a function on N real ranks (processes) and collect what each returns.

Used by the tests and the benchmarks: each rank is a separate process forked from a forkserver
that has torch imported already, so starting a world costs a fraction of a second. A rank's
exception becomes an error in the caller naming the rank and carrying its traceback; a world that
does not finish in ``timeout`` seconds is killed and reported, so nothing can hang or linger.
Either error also carries the Python stack of every rank still running at that moment (what a
rank waits on when its peer failed or the world hung).

No port is picked and handed over: the caller hosts the world's rendezvous store on a port the OS
chooses and holds the other ranks' ports (`fleetlike.launch.host_endpoints`, as
``--started_port=auto`` does), and the ranks join that store (``Role.master_hosted``).

Example:
    >>> def work(role, x):
    ...     world = make_world(role)
    ...     return world.all_reduce(torch.tensor([x + role.rank])).item()
    >>> run_ranks(work, 2, 10)
    [21, 21]
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fleetlike.comm import JobSecret, new_secret
from fleetlike.launch.ports import HostedEndpoints, host_endpoints
from fleetlike.roles.role import Role

__all__ = ["HostedJob", "RankError", "run_ranks", "hosted_job", "node_hosts", "free_ports", "make_world",
           "preload_server", "preloaded_context"]

_CTX: Any = None


class RankError(AssertionError):
    """A rank raised, or the world did not finish in time."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # torch._dynamo: torch imports it on the first optimizer or DDP a process builds (both
        # wrap methods in dynamo's disable), 2 s of CPU that every rank would pay again
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "numpy", "fleetlike.comm"])
        _CTX = ctx
    return _CTX


def preloaded_context() -> Any:
    """The multiprocessing context `run_ranks` starts its ranks from: a forkserver that has
    imported torch (``torch._dynamo`` included), numpy and ``fleetlike.comm``, so that a
    process a test starts and ends by itself (``ctx.Process(target=module_level_fn, ...)``)
    starts in a fraction of a second instead of re-importing torch as a ``spawn`` start does.
    Its processes start with the forkserver's environment (the one of the first start in this
    process), not the caller's of the moment: pass what a target needs as arguments."""
    return _context()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` right now (the OS picks them), then released.

    Racy by nature: anything may bind them before the caller does. Only for a port that is
    never bound (a world of one) or bound by this same process at once; a world of several
    ranks takes `hosted_job` / `run_ranks`, which hold their ports.
    """
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def node_hosts(nodes: int | Sequence[int], world_size: int | None = None) -> list[str]:
    """The host of each rank: node i is 127.0.0.(i+1), as two launchers on one machine would be.

    ``nodes`` is a node count (``world_size`` split evenly) or the rank count of each node.
    """
    if isinstance(nodes, int):
        if world_size is None or nodes < 1 or world_size % nodes:
            raise ValueError(f"world_size={world_size} must be a multiple of nodes={nodes}")
        counts = [world_size // nodes] * nodes
    else:
        counts = list(nodes)
        if world_size is not None and sum(counts) != world_size:
            raise ValueError(f"nodes={counts} holds {sum(counts)} ranks but world_size={world_size}")
    return [f"127.0.0.{1 + i}" for i, count in enumerate(counts) for _ in range(count)]


class HostedJob:
    """A job whose store this process hosts and whose ports it holds; `role` gives each rank's.

    Example:
        >>> with hosted_job([3], job_id="lonely") as job:
        ...     create_world(job.role(0), timeout=1.5)   # waits for ranks 1 and 2
    """

    def __init__(self, hosted: HostedEndpoints, job_id: str, secret: str = "") -> None:
        self.hosted = hosted
        self.job_id = job_id
        #: the job's secret (`fleetlike.comm.secret`), in every rank's `Role`
        self.secret = secret

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.hosted.endpoints

    def role(self, rank: int) -> Role:
        return Role.from_endpoints(rank, self.endpoints, job_id=self.job_id, master_hosted=True,
                                   secret=self.secret)

    def close(self) -> None:
        self.hosted.close()

    def __enter__(self) -> HostedJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hosted_job(
    nodes: int | Sequence[int] = 1, world_size: int | None = None, *, job_id: str = "test"
) -> HostedJob:
    """Host a job of ``world_size`` ranks over ``nodes`` loopback nodes (see `node_hosts`)."""
    secret = new_secret()
    hosted = host_endpoints(node_hosts(nodes, world_size), job_id, secret=JobSecret(secret))
    return HostedJob(hosted, job_id, secret)


def make_world(role: Role, backend: str = "auto", timeout: float = 60.0) -> Any:
    """The world communicator for a test rank (gloo unless the world is one rank)."""
    from fleetlike.comm import create_world

    return create_world(role, backend=backend, timeout=timeout)


def _child(fn: Callable[..., Any], role: Role, args: tuple, kwargs: dict, q: Any, stacks: str,
           environ: dict[str, str]) -> None:
    # the caller's environment now, as a forked rank would see it: a forkserver's children
    # inherit the server's, taken when the first job of the process started it
    os.environ.clear()
    os.environ.update(environ)
    import torch

    torch.set_num_threads(1)
    # what the forkserver and the unpickling imported stays for the rank's life: frozen, it is
    # left out of the rank's garbage collections (a full one would walk torch's million objects)
    gc.freeze()
    # the parent asks for this rank's stack (SIGUSR1) when another rank failed or time ran out;
    # the file outlives the rank's own stderr, which the forkserver's children share
    path = os.path.join(stacks, f"rank{role.rank}")
    stack_file = open(path + ".tmp", "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.rename(path + ".tmp", path)  # the parent signals only a rank whose handler is in place
    try:
        # Plain pickle (bytes), not the queue's pickler: torch would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        result = pickle.dumps(fn(role, *args, **kwargs))
        q.put((role.rank, True, result))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        q.put((role.rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int | None = None,
    *args: Any,
    endpoints: Sequence[str] | None = None,
    nodes: int | Sequence[int] = 1,
    timeout: float = 60.0,
    job_id: str = "test",
    may_die: Sequence[int] = (),
    job: HostedJob | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(role, *args, **kwargs)`` on every rank; return the results in rank order.

    Give ``world_size`` (ranks spread over ``nodes`` loopback "nodes": a count, or the ranks of
    each node), or a ``job`` from `hosted_job` that the caller keeps open (to learn its
    endpoints while it runs). Either way this process hosts the store and holds the ports.
    Explicit ``endpoints`` are joined as given, rank 0 hosting the store itself: only for a test
    of exactly that (two jobs on one port). ``fn`` must be importable by name (a module-level
    function). Ranks in ``may_die`` may end without reporting (a test that kills them); their
    result is None.
    """
    own: HostedJob | None = None
    if endpoints is not None:
        secret = new_secret()
        roles = [Role.from_endpoints(r, list(endpoints), job_id=job_id, secret=secret)
                 for r in range(len(endpoints))]
    else:
        if job is None:
            job = own = hosted_job(nodes, world_size, job_id=job_id)
        roles = [job.role(r) for r in range(len(job.endpoints))]
    try:
        return _run_roles(fn, roles, args, kwargs, timeout, may_die)
    finally:
        if own is not None:
            own.close()


def _run_roles(
    fn: Callable[..., Any],
    roles: list[Role],
    args: tuple,
    kwargs: dict,
    timeout: float,
    may_die: Sequence[int],
) -> list[Any]:
    eps = roles[0].endpoints
    ctx = _context()
    q = ctx.Queue()
    stacks = tempfile.mkdtemp(prefix="fleetlike-stacks-")
    procs = []
    for role in roles:
        p = ctx.Process(target=_child, args=(fn, role, args, kwargs, q, stacks, dict(os.environ)), daemon=True)
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        def finished() -> bool:
            dead = {i for i in may_die if procs[i].exitcode is not None}
            return len(set(results) | dead) >= len(eps)

        while not finished():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(len(eps))) - set(results))
                raise RankError(f"ranks {missing} of {len(eps)} did not finish within {timeout:g}s")
            try:
                rank, ok, value = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [
                    i for i, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and i not in results and i not in may_die
                ]
                if dead:
                    raise RankError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting"
                    ) from None
                continue
            reported.add(rank)
            if not ok:
                raise RankError(f"rank {rank} raised:\n{value}")
            results[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 5.0))
    except RankError as exc:
        raise RankError(f"{exc}{_stacks_of_running(procs, stacks, reported)}") from None
    finally:
        _reap(procs)
        q.close()
        shutil.rmtree(stacks, ignore_errors=True)
    return [results.get(r) for r in range(len(eps))]


def _stacks_of_running(procs: list[Any], stacks: str, reported: set[int]) -> str:
    """The Python stacks of the ranks still running that have not reported, each asked to write
    its own (faulthandler), as text to append to the error."""
    running = [r for r, p in enumerate(procs) if p.is_alive() and r not in reported]
    text = ""
    ready = [r for r in running if os.path.exists(os.path.join(stacks, f"rank{r}"))]
    for r in ready:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    for r in sorted(set(running) - set(ready)):
        text += f"\n\nrank {r} was still running, before its function started"
    for r in ready:
        path = os.path.join(stacks, f"rank{r}")
        deadline = time.monotonic() + 2.0  # a rank inside a C++ call writes when it gets the GIL
        while time.monotonic() < deadline and not _read(path):
            time.sleep(0.05)
        time.sleep(0.1)  # the rank may still be writing its other threads
        text += f"\n\nrank {r} was still running, at:\n{_read(path) or '(no stack: the rank did not answer)'}"
    return text


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _reap(procs: list[Any]) -> None:
    """Kill whatever is still running: a failed test must not leave ranks behind."""
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(timeout=5)


_SERVER_CODE = (
    "import os, socket\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
    "old = os.umask(0o177)\n"
    "s.bind({path!r})\n"
    "os.umask(old)\n"
    "s.listen(64)\n"
    "from fleetlike.launch.preload import serve_forever\n"
    "serve_forever({path!r}, listener=s)\n"
)


@contextlib.contextmanager
def preload_server(env: Mapping[str, str] | None = None, flags: Sequence[str] = ("-u",)) -> Iterator[str]:
    """A shared preload server (`fleetlike.launch.preload.serve_forever`) for the launchers a test
    session starts; yields its socket path, for ``FLEETLIKE_PRELOAD_SOCKET`` (with
    ``FLEETLIKE_PRELOAD=torch``). ``env`` and ``flags`` are the workers' start-up environment
    and interpreter flags (the launcher's workers run ``python -u``); a worker whose differ starts
    as a plain process, with one line saying why. The socket is bound before this returns, the
    imports go on in the background (a launcher that connects meanwhile waits for them); the
    server and its children are ended on exit."""
    folder = tempfile.mkdtemp(prefix="fleetlike-preload-")
    path = os.path.join(folder, "server.sock")
    proc = subprocess.Popen([sys.executable, *flags, "-c", _SERVER_CODE.format(path=path)],
                            env=dict(os.environ if env is None else env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the preload server did not bind {path} (exit code {proc.poll()})")
            time.sleep(0.01)
        yield path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)

"""``--preload=torch``: start workers by forking an interpreter that has imported torch already.

Importing torch costs seconds of CPU in every new interpreter, and a launcher pays it again for
each worker it starts or restarts. With ``--preload=torch`` (or ``FLEETLIKE_PRELOAD=torch``) the
launcher starts one preload server per job: ``python -c`` with the workers' interpreter flags and
start-up environment, which imports torch, numpy and fleetlike once and then forks one child per worker. The child becomes what
``python [flags] script.py args`` (or ``-m module``) would have been: a new session (its own
process group), the worker's environment, argv, working directory and ``sys.path[0]``, stdin from
``/dev/null``, stdout and stderr to the worker's log (or the echo pipe), the script run as
``__main__``, torch's and numpy's default generators seeded afresh from the OS, the launcher's
umask, CPU affinity and resource limits. The server reports each child's wait status, which the
launcher turns into an exit code or signal exactly as for a `Popen`'d worker, so restarts, kill -9
detection, SIGTERM forwarding and elastic re-forming are unchanged. A child dies with the server
(``PR_SET_PDEATHSIG``), and the server kills its children and exits when the launcher's end of the
socket closes, however the launcher ended.

``FLEETLIKE_PRELOAD_SOCKET=PATH`` points launchers at a server that is already running
(``python -c 'from fleetlike.launch.preload import serve_forever; serve_forever("PATH")'``, or
`fleetlike.testing.preload_server`), so many short jobs share one import: a test suite, a sweep.
It serves processes of the same user only. This module is the launcher's side (the client); the
server, its messages and what a forked child does are `fleetlike.launch.preload_server`.

What a preloaded worker cannot differ in is checked before it starts; anything else starts the
worker as a plain process, with one line saying why:

- the command must be this interpreter with plain flags (``-u``, ``-O``, ``-X opt``...) and a
  script file or ``-m module``;
- the start-up environment (``PYTHON*``, ``LD_*``, ``GLIBC_TUNABLES``, ``MALLOC_*``, ``OMP_*``,
  ``MKL_*``, ``KMP_*``, ``GOMP_*``, ``OPENBLAS_*``, ``TORCH_*``, ``PYTORCH_*``, ``LANG``, ``LC_*``)
  must equal the server's: these are read once, when an interpreter or a library (glibc's
  allocator, the OpenMP and BLAS thread pools) starts. One
  difference is honoured: ``--accelerate_ddp``'s folder first on ``PYTHONPATH``
  (`fleetlike.launch.env.ACCELERATE_SITE`), the rest as the server's: the child puts it on
  ``sys.path`` where the interpreter would and runs that folder's ``sitecustomize``, as a plain
  start does (which leaves alone the ``sitecustomize`` it shadows: that one ran in the server,
  from the same path);
- torch, numpy and fleetlike must resolve, on the worker's ``sys.path``, to the files the server
  imported.

Two differences remain, as with any fork-based start (``multiprocessing``'s ``forkserver``):
the workers share the server's string-hash seed (``PYTHONHASHSEED``), and a variable a script sets
in ``os.environ`` before ``import torch`` (``OMP_NUM_THREADS``, say) no longer reaches torch's
start-up; set it in the launcher's environment, or call ``torch.set_num_threads``.

Example::

    python -m fleetlike.launch --nproc_per_node=4 --preload=torch --max_restarts=3 train.py
"""

from __future__ import annotations

import io
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from fleetlike.config import envvars
from fleetlike.launch.preload_server import PRELOADED_MODULES, namespaces, receive, send, serve_forever, startup_env

__all__ = [
    "PRELOAD_CHOICES", "PRELOAD_ENV", "PRELOADED_MODULES", "SOCKET_ENV", "PreloadedProcess",
    "preload_mode", "serve_forever", "start_preloaded", "startup_env",
]

#: ``--preload``'s default comes from this variable.
PRELOAD_ENV = envvars.PRELOAD
#: A running server to use instead of starting one (`serve_forever`).
SOCKET_ENV = envvars.PRELOAD_SOCKET
PRELOAD_CHOICES = ("off", "torch")

#: ``--accelerate_ddp`` / ``--accelerate_horovod``: the folder whose ``sitecustomize.py`` makes every
#: worker import ``fleetlike.auto`` / answer ``import horovod.torch`` before the script (a path, not
#: an import: launch sits below the faces);
#: `fleetlike.launch.env` puts it first on the workers' PYTHONPATH, a preloaded start honours it
ACCELERATE_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_site")

_PREFIX = "fleetlike.launch:"
_FLAGS = ("-u", "-B", "-E", "-s", "-S", "-O", "-OO", "-b", "-bb", "-q", "-I", "-P")
#: the launcher's resource limits each child takes over, as a Popen'd worker inherits them
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_STACK",
           "RLIMIT_NPROC", "RLIMIT_MEMLOCK", "RLIMIT_CPU")


def _umask() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022



def preload_mode(value: str | None = None) -> str:
    """``--preload``'s value (default: `PRELOAD_ENV`, else ``off``), checked."""
    text = (os.environ.get(PRELOAD_ENV, "") if value is None else value).strip() or "off"
    if text not in PRELOAD_CHOICES:
        source = f"{PRELOAD_ENV}={text!r}" if value is None else f"--preload={text!r}"
        raise ValueError(f"{source}: choose one of {', '.join(PRELOAD_CHOICES)} ('torch' starts "
                         "workers from an interpreter that has imported torch already)")
    return text


def _parse_command(command: Sequence[str]) -> tuple[list[str], str, str, list[str]] | str:
    """``(flags, kind, target, args)`` of ``python [flags] script|-m module args``, else why not."""
    if not command or os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return f"the worker command {command[:1]} is not this interpreter ({sys.executable})"
    flags: list[str] = []
    i = 1
    while i < len(command):
        word = command[i]
        if word in _FLAGS:
            flags.append(word)
        elif word in ("-X", "-W") and i + 1 < len(command):
            flags += [word, command[i + 1]]
            i += 1
        elif word[:2] in ("-X", "-W") and len(word) > 2:
            flags.append(word)
        elif word == "-m" and i + 1 < len(command):
            return flags, "module", command[i + 1], list(command[i + 2:])
        elif not word.startswith("-"):
            return flags, "path", word, list(command[i + 1:])
        else:
            return f"the interpreter option {word!r} is not one a preloaded start can reproduce"
        i += 1
    return "the worker command names no script"


class PreloadedProcess:
    """A worker forked by the preload server, with the part of `subprocess.Popen`'s interface
    the launcher uses: ``pid``, ``args``, ``stdout``, ``stderr`` (a reader of its own with
    ``split_stderr``, else None), ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``."""

    def __init__(self, pid: int, args: Sequence[str], stdout: io.BufferedReader | None,
                 stderr: io.BufferedReader | None = None) -> None:
        self.pid = pid
        self.args = list(args)
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._done = threading.Event()

    def _ended(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Client:
    """The launcher's connection to one server: requests in order, exit reports by pid."""

    def __init__(self, sock: socket.socket, server: subprocess.Popen[bytes] | None) -> None:
        self._sock = sock
        self._server = server
        self._lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._procs: dict[int, PreloadedProcess] = {}
        self._pending: dict[int, tuple[Sequence[str], io.BufferedReader | None, io.BufferedReader | None]] = {}
        self.hello: dict[str, Any] | None = None
        self.closed = False
        threading.Thread(target=self._read, name="fleetlike-preload", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message, fds = receive(self._sock)
            except (OSError, ValueError):
                message, fds = None, []
            for fd in fds:
                os.close(fd)
            with self._cond:
                if message is None:
                    self.closed = True
                    for proc in self._procs.values():  # the server died: PR_SET_PDEATHSIG killed them
                        proc._ended(-signal.SIGKILL)
                    self._cond.notify_all()
                    return
                if message["op"] == "exit":
                    proc = self._procs.pop(message["pid"], None)
                    if proc is not None:
                        proc._ended(os.waitstatus_to_exitcode(message["status"]))
                    continue
                if message["op"] == "hello":
                    self.hello = message
                elif message["op"] == "refused":
                    self._pending.pop(message["request"], None)
                    self._replies.append(message)
                elif message["op"] == "started":
                    args, stdout, stderr = self._pending.pop(message["request"])
                    self._procs[message["pid"]] = PreloadedProcess(message["pid"], args, stdout, stderr)
                    message["process"] = self._procs[message["pid"]]
                    self._replies.append(message)
                else:
                    self._replies.append(message)
                self._cond.notify_all()

    def wait_hello(self, timeout: float) -> dict[str, Any] | None:
        with self._cond:
            self._cond.wait_for(lambda: self.hello is not None or self.closed, timeout)
            return self.hello

    def start(self, request: dict[str, Any], fds: Sequence[int], args: Sequence[str],
              stdout: io.BufferedReader | None, stderr: io.BufferedReader | None) -> PreloadedProcess | str:
        with self._lock:
            number = id(request)
            request["request"] = number
            with self._cond:
                self._pending[number] = (args, stdout, stderr)
            try:
                send(self._sock, request, fds)
            except OSError as exc:
                return f"the preload server is gone ({exc})"
            with self._cond:
                self._cond.wait_for(lambda: self._replies or self.closed)
                if not self._replies:
                    return "the preload server is gone"
                reply = self._replies.pop(0)
            if reply["op"] == "started":
                return reply["process"]  # type: ignore[no-any-return]
            return str(reply.get("reason", reply))

    def live(self) -> bool:
        with self._cond:
            return any(p.returncode is None for p in self._procs.values())

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
        if self._server is not None:
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()


_CLIENTS: dict[Any, _Client] = {}
_CLIENTS_LOCK = threading.Lock()
_SAID: set[str] = set()


def _say_once(reason: str, rank: int) -> None:
    if reason not in _SAID:
        _SAID.add(reason)
        print(f"{_PREFIX} --preload=torch: {reason}; starting the worker (rank {rank}) as a plain "
              "process", file=sys.stderr, flush=True)


def _server_code() -> str:
    # sys.path before anything is imported: the children's base path (the server's own first
    # entry, the "-c" directory, is replaced by each child's script directory)
    return ("(lambda p: __import__('fleetlike.launch.preload_server', fromlist=['_serve_private'])"
            "._serve_private(p))(__import__('sys').path[:])")


def _accelerate_site(theirs: Mapping[str, str], ours: Mapping[str, str]) -> bool:
    """True where the worker's start-up environment is the server's with `ACCELERATE_SITE`
    put first on PYTHONPATH (``--accelerate_ddp``), and in nothing else."""
    first, _, rest = ours.get(envvars.PYTHONPATH, "").partition(os.pathsep)
    if first != ACCELERATE_SITE:
        return False
    def others(env: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k != envvars.PYTHONPATH}
    return theirs.get(envvars.PYTHONPATH, "") == rest and others(theirs) == others(ours)


def _private_client(flags: list[str], env: Mapping[str, str]) -> _Client | str:
    key = (tuple(flags), tuple(sorted(startup_env(env, flags).items())))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is not None and not client.closed:
            return client
        for other_key, other in list(_CLIENTS.items()):  # one server per start-up environment
            if not other.live():
                other.close()
                del _CLIENTS[other_key]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server = subprocess.Popen(
                [sys.executable, *flags, "-c", _server_code(), str(theirs.fileno())],
                env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=[theirs.fileno()], start_new_session=True)
        except OSError as exc:
            ours.close()
            return f"cannot start the preload server ({exc})"
        finally:
            theirs.close()
        client = _Client(ours, server)
        if client.wait_hello(timeout=300) is None:
            client.close()
            return "the preload server did not start (run python -c 'import torch' to see why)"
        _CLIENTS[key] = client
        return client


def _shared_client(path: str) -> _Client | str:
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(path)
        if client is not None and not client.closed:
            return client
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            return f"cannot reach the preload server at {SOCKET_ENV}={path} ({exc})"
        client = _Client(sock, None)
        if client.wait_hello(timeout=60) is None:
            client.close()
            return f"the preload server at {SOCKET_ENV}={path} did not answer"
        _CLIENTS[path] = client
        return client


def start_preloaded(command: Sequence[str], env: Mapping[str, str], *, stdout: int | None,
                    rank: int, split_stderr: bool = False, cwd: str | os.PathLike[str] | None = None,
                    ) -> PreloadedProcess | None:
    """Fork the worker ``command`` from a preload server; None (after one line saying why) when
    it must start as a plain process. ``stdout`` is the log file's descriptor, or None for a
    pipe (the echoed worker), read from the returned process's ``stdout``; stderr goes with
    stdout, or with ``split_stderr`` (and ``stdout=None``) to a pipe of its own, read from the
    process's ``stderr``. ``cwd``: the worker's directory (the caller's by default), as
    `subprocess.Popen`'s: threads that start workers in different directories need no
    process-wide ``chdir``."""
    if split_stderr and stdout is not None:
        raise ValueError("split_stderr=True needs stdout=None (both streams to pipes)")
    parsed = _parse_command(command)
    if isinstance(parsed, str):
        _say_once(parsed, rank)
        return None
    flags, kind, target, args = parsed
    path = env.get(SOCKET_ENV, "").strip()
    client = _shared_client(path) if path else _private_client(flags, env)
    if isinstance(client, str):
        _say_once(client, rank)
        return None
    hello = client.hello or {}
    reason, site = "", False
    if hello.get("flags") != flags:
        reason = f"the server runs with interpreter flags {hello.get('flags')}, the worker with {flags}"
    elif hello.get("namespaces") != namespaces():
        theirs = hello.get("namespaces") or {}
        differ = sorted(k for k, v in namespaces().items() if theirs.get(k) != v)
        reason = (f"the server runs in other Linux namespaces ({', '.join(differ) or 'unknown'}: "
                  "`ip netns exec`, a container) and its workers would run there")
    elif hello.get("threads", 1) != 1:
        reason = f"the server runs {hello.get('threads')} Python threads after its imports and cannot fork safely"
    else:
        theirs, ours = startup_env(hello.get("startup", {}), flags), startup_env(env, flags)
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        site = _accelerate_site(theirs, ours)
        if differ and not site:
            reason = (f"the worker's start-up environment differs from the server's in {', '.join(differ)} "
                      "(read once at interpreter start)")
    if reason:
        _say_once(reason, rank)
        return None
    reader: io.BufferedReader | None = None
    err_reader: io.BufferedReader | None = None
    if stdout is None:
        r, w = os.pipe()
        reader, fds = os.fdopen(r, "rb"), [w]
        if split_stderr:
            r, w = os.pipe()
            err_reader = os.fdopen(r, "rb")
            fds.append(w)
    else:
        fds = [stdout]
    request = {"op": "start", "kind": kind, "target": target, "args": args, "argv": list(command),
               "env": dict(env), "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()), "umask": _umask(),
               # the child runs the folder's sitecustomize, as a plain start would (`_accelerate_site`)
               "site": ACCELERATE_SITE if site else None,
               "affinity": sorted(os.sched_getaffinity(0)),
               "limits": {name: resource.getrlimit(getattr(resource, name)) for name in _LIMITS}}
    try:
        got = client.start(request, fds, command, reader, err_reader)
    finally:
        if stdout is None:
            for fd in fds:
                os.close(fd)
    if isinstance(got, str):
        for opened in (reader, err_reader):
            if opened is not None:
                opened.close()
        _say_once(got, rank)
        return None
    return got

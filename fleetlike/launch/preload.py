"""``--preload=torch``: start workers by forking an interpreter that has imported torch already.

Importing torch costs seconds of CPU in every new interpreter, and a launcher pays it again for
each worker it starts or restarts. With ``--preload=torch`` (or ``FLEETLIKE_PRELOAD=torch``) the
launcher starts one preload server per job: ``python -c`` with the workers' interpreter flags and
start-up environment, which imports torch, numpy and fleetlike once and then forks one child per
worker. The child becomes what ``python [flags] script.py args`` (or ``-m module``) would have
been: a new session (its own process group), the worker's environment, argv, working directory
and ``sys.path[0]``, stdin from ``/dev/null``, stdout and stderr to the worker's log (or the
echo pipe), the script run as ``__main__``, torch's and numpy's default generators seeded
afresh from the OS, the launcher's umask, CPU affinity and resource limits. The server reports each child's
wait status, which the launcher turns into an exit code or signal exactly as for a `Popen`'d
worker, so restarts, kill -9 detection, SIGTERM forwarding and elastic re-forming are unchanged.
A child dies with the server (``PR_SET_PDEATHSIG``), and the server kills its children and exits
when the launcher's end of the socket closes, however the launcher ended.

``FLEETLIKE_PRELOAD_SOCKET=PATH`` points launchers at a server that is already running
(``python -c 'from fleetlike.launch.preload import serve_forever; serve_forever("PATH")'``, or
`fleetlike.testing.preload_server`), so many short jobs share one import: a test suite, a sweep.
It serves processes of the same user only.

What a preloaded worker cannot differ in is checked before it starts; anything else starts the
worker as a plain process, with one line saying why:

- the command must be this interpreter with plain flags (``-u``, ``-O``, ``-X opt``...) and a
  script file or ``-m module``;
- the start-up environment (``PYTHON*``, ``LD_*``, ``GLIBC_TUNABLES``, ``MALLOC_*``, ``OMP_*``,
  ``MKL_*``, ``KMP_*``, ``GOMP_*``, ``OPENBLAS_*``, ``TORCH_*``, ``PYTORCH_*``, ``LANG``,
  ``LC_*``) must equal the server's: these are read once, when an interpreter or a library
  (glibc's allocator, the OpenMP and BLAS thread pools) starts;
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

import ctypes
import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from fleetlike.config import envvars

__all__ = [
    "PRELOAD_CHOICES", "PRELOAD_ENV", "PRELOADED_MODULES", "SOCKET_ENV", "PreloadedProcess",
    "preload_mode", "serve_forever", "start_preloaded", "startup_env",
]

#: ``--preload``'s default comes from this variable.
PRELOAD_ENV = envvars.PRELOAD
#: A running server to use instead of starting one (`serve_forever`).
SOCKET_ENV = envvars.PRELOAD_SOCKET
PRELOAD_CHOICES = ("off", "torch")
#: What the server imports before forking.
PRELOADED_MODULES = ("torch", "numpy", "fleetlike")

_PREFIX = "fleetlike.launch:"
_NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")
_STARTUP_PREFIXES = ("PYTHON", "LD_", "GLIBC_", "MALLOC_", "OMP_", "KMP_", "GOMP_", "MKL_",
                     "OPENBLAS_", "TORCH_", "PYTORCH_", "LC_")
_FLAGS = ("-u", "-B", "-E", "-s", "-S", "-O", "-OO", "-b", "-bb", "-q", "-I", "-P")
_MESSAGE_BYTES = 1 << 20
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


def startup_env(env: Mapping[str, str], flags: Sequence[str] = ()) -> dict[str, str]:
    """The variables an interpreter or a library reads once at start (see the module doc);
    with ``-u`` in ``flags``, PYTHONUNBUFFERED says nothing more and is left out."""
    return {k: v for k, v in env.items() if (k.startswith(_STARTUP_PREFIXES) or k in ("LANG", "LANGUAGE"))
            and not (k == "PYTHONUNBUFFERED" and "-u" in flags)}


def _namespaces() -> dict[str, str]:
    """This process's Linux namespaces (``net:[4026531840]``...): a forked worker lives in its
    server's, so a launcher in another network namespace (``ip netns exec``) or container must
    not use it."""
    found = {}
    for kind in _NAMESPACES:
        try:
            found[kind] = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            found[kind] = "-"
    return found


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
    the launcher uses: ``pid``, ``args``, ``stdout``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, pid: int, args: Sequence[str], stdout: io.BufferedReader | None) -> None:
        self.pid = pid
        self.args = list(args)
        self.stdout = stdout
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


def _send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 4)
    return (json.loads(data) if data else None), fds


class _Client:
    """The launcher's connection to one server: requests in order, exit reports by pid."""

    def __init__(self, sock: socket.socket, server: subprocess.Popen[bytes] | None) -> None:
        self._sock = sock
        self._server = server
        self._lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._procs: dict[int, PreloadedProcess] = {}
        self._pending: dict[int, tuple[Sequence[str], io.BufferedReader | None]] = {}
        self.hello: dict[str, Any] | None = None
        self.closed = False
        threading.Thread(target=self._read, name="fleetlike-preload", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message, fds = _receive(self._sock)
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
                    args, stdout = self._pending.pop(message["request"])
                    self._procs[message["pid"]] = PreloadedProcess(message["pid"], args, stdout)
                    message["process"] = self._procs[message["pid"]]
                    self._replies.append(message)
                else:
                    self._replies.append(message)
                self._cond.notify_all()

    def wait_hello(self, timeout: float) -> dict[str, Any] | None:
        with self._cond:
            self._cond.wait_for(lambda: self.hello is not None or self.closed, timeout)
            return self.hello

    def start(self, request: dict[str, Any], fd: int, args: Sequence[str],
              stdout: io.BufferedReader | None) -> PreloadedProcess | str:
        with self._lock:
            number = id(request)
            request["request"] = number
            with self._cond:
                self._pending[number] = (args, stdout)
            try:
                _send(self._sock, request, [fd])
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
    return ("(lambda p: __import__('fleetlike.launch.preload', fromlist=['_serve_private'])"
            "._serve_private(p))(__import__('sys').path[:])")


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
                    rank: int) -> PreloadedProcess | None:
    """Fork the worker ``command`` from a preload server; None (after one line saying why) when
    it must start as a plain process. ``stdout`` is the log file's descriptor, or None for a
    pipe (the echoed worker), read from the returned process's ``stdout``."""
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
    reason = ""
    if hello.get("flags") != flags:
        reason = f"the server runs with interpreter flags {hello.get('flags')}, the worker with {flags}"
    elif hello.get("namespaces") != _namespaces():
        theirs = hello.get("namespaces") or {}
        differ = sorted(k for k, v in _namespaces().items() if theirs.get(k) != v)
        reason = (f"the server runs in other Linux namespaces ({', '.join(differ) or 'unknown'}: "
                  "`ip netns exec`, a container) and its workers would run there")
    elif hello.get("threads", 1) != 1:
        reason = f"the server runs {hello.get('threads')} Python threads after its imports and cannot fork safely"
    else:
        theirs, ours = startup_env(hello.get("startup", {}), flags), startup_env(env, flags)
        differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        if differ:
            reason = (f"the worker's start-up environment differs from the server's in {', '.join(differ)} "
                      "(read once at interpreter start)")
    if reason:
        _say_once(reason, rank)
        return None
    reader: io.BufferedReader | None = None
    if stdout is None:
        r, w = os.pipe()
        reader, fd = os.fdopen(r, "rb"), w
    else:
        fd = stdout
    request = {"op": "start", "kind": kind, "target": target, "args": args, "argv": list(command),
               "env": dict(env), "cwd": os.getcwd(), "umask": _umask(),
               "affinity": sorted(os.sched_getaffinity(0)),
               "limits": {name: resource.getrlimit(getattr(resource, name)) for name in _LIMITS}}
    try:
        got = client.start(request, fd, command, reader)
    finally:
        if stdout is None:
            os.close(fd)
    if isinstance(got, str):
        if reader is not None:
            reader.close()
        _say_once(got, rank)
        return None
    return got


# --- the server (runs in its own interpreter) -------------------------------------------------


def _prctl_pdeathsig() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Child:
    """What a forked child runs (returned out of the server loop, in the child only)."""

    def __init__(self, request: dict[str, Any], base_path: list[str]) -> None:
        self.request = request
        self.base_path = base_path


def _child_path(request: Mapping[str, Any], base_path: list[str]) -> list[str]:
    if sys.flags.safe_path:
        return list(base_path)
    if request["kind"] == "path":
        target = os.path.join(request["cwd"], request["target"])
        return [os.path.dirname(os.path.realpath(target)), *base_path]
    return [request["cwd"], *base_path]


def _where_from(name: str, path: list[str]) -> str | None:
    """The file ``import name`` would load with ``sys.path = path`` (the module is already
    imported here, so the finders are asked directly)."""
    saved = sys.path
    sys.path = path
    try:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, None) if find is not None else None
            if spec is not None:
                return spec.origin
        return None
    finally:
        sys.path = saved


def _refusal(request: Mapping[str, Any], base_path: list[str]) -> str | None:
    """Why this server cannot start ``request`` as a fresh interpreter would, or None."""
    if request["kind"] == "path":
        target = os.path.join(request["cwd"], request["target"])
        if not os.path.isfile(target) or not target.endswith(".py"):
            return f"{request['target']!r} is not a .py file (the interpreter reports that itself)"
    for name, (_, hard) in request["limits"].items():
        mine = resource.getrlimit(getattr(resource, name))[1]
        if mine != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > mine):
            return f"the launcher's hard {name} ({hard}) is above the server's ({mine})"
    path = _child_path(request, base_path)
    for name in PRELOADED_MODULES:
        loaded = getattr(sys.modules.get(name), "__file__", None)
        found = _where_from(name, path)
        if loaded and (found is None or os.path.realpath(found) != os.path.realpath(loaded)):
            return (f"{name} would be imported from {found} by this worker, but the server "
                    f"imported {loaded}")
    return None


def _serve(conns: list[socket.socket], listener: socket.socket | None, base_path: list[str],
           startup: dict[str, str]) -> _Child | None:
    """Serve until the last connection closes (a private server) or forever (a listener).
    Returns in a forked child only, with what it must run."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    owner: dict[int, socket.socket] = {}
    hello = {"op": "hello", "pid": os.getpid(), "flags": _interpreter_flags(),
             "startup": startup, "threads": threading.active_count(), "namespaces": _namespaces()}
    for conn in conns:
        _send(conn, hello)
    while conns or listener is not None:
        readable = select.select([wake_r, *conns, *([listener] if listener else [])], [], [])[0]
        if listener is not None and listener in readable:
            conn, _ = listener.accept()
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():
                conn.close()
            else:
                conns.append(conn)
                _send(conn, hello)
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        _reap(owner)
        for conn in [c for c in conns if c in readable]:
            try:
                request, fds = _receive(conn)
            except OSError:
                request, fds = None, []
            if request is None:  # the launcher is gone: its workers die as with PR_SET_PDEATHSIG
                for pid, held in list(owner.items()):
                    if held is conn:
                        _kill(pid)
                conns.remove(conn)
                conn.close()
                continue
            refused = _refusal(request, base_path)
            if refused is not None:
                for fd in fds:
                    os.close(fd)
                _send(conn, {"op": "refused", "request": request["request"], "reason": refused})
                continue
            ready_r, ready_w = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                _settle_child(fds[0], ready_w)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for c in conns:
                    c.close()
                if listener is not None:
                    listener.close()
                return _Child(request, base_path)
            os.close(ready_w)
            for fd in fds:
                os.close(fd)
            os.read(ready_r, 1)  # the child is in its own session: signals to its group reach it
            os.close(ready_r)
            owner[pid] = conn
            _send(conn, {"op": "started", "request": request["request"], "pid": pid})
    for pid in owner:
        _kill(pid)
    _reap(owner, block=True)
    return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(owner: dict[int, socket.socket], block: bool = False) -> None:
    while owner:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = owner.pop(pid, None)
        if conn is not None and conn.fileno() >= 0:
            try:
                _send(conn, {"op": "exit", "pid": pid, "status": status})
            except OSError:
                pass


def _interpreter_flags() -> list[str]:
    """The flags this interpreter was started with, as `_parse_command` spells them."""
    argv = list(getattr(sys, "orig_argv", []))[1:]
    flags: list[str] = []
    i = 0
    while i < len(argv) and argv[i] != "-c":
        flags.append(argv[i])
        i += 1
    return flags


def _settle_child(out_fd: int, ready_w: int) -> None:
    """In the child, first: its own session, death with the server, its stdio."""
    os.setsid()
    _prctl_pdeathsig()
    os.close(ready_w)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _become(child: _Child) -> None:
    """Turn this forked child into the worker and run it (the interpreter's own exit handling
    then applies: SystemExit's code, 1 after an uncaught exception, atexit, thread joins)."""
    request = child.request
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["affinity"])
    for name, limits in request["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(limits))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = _child_path(request, child.base_path)
    sys.orig_argv = list(request["argv"])
    # a fresh interpreter seeds both from the OS; children of one server would share its draws
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    try:
        if request["kind"] == "module":
            sys.argv = ["-m", *request["args"]]
            runpy._run_module_as_main(request["target"], alter_argv=True)  # type: ignore[attr-defined]
            return
        path = os.path.abspath(request["target"])
        sys.argv = [request["target"], *request["args"]]
        main = sys.modules["__main__"]
        for name in [n for n in vars(main) if n not in ("__builtins__",)]:
            delattr(main, name)
        from importlib.machinery import SourceFileLoader

        main.__dict__.update(__name__="__main__", __file__=path, __cached__=None, __doc__=None,
                             __package__=None, __spec__=None,
                             __loader__=SourceFileLoader("__main__", path))
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next
        sys.excepthook(type(exc), exc, tb)
        raise SystemExit(1) from None


def _preload() -> None:
    """Import what the children share."""
    for name in PRELOADED_MODULES:
        __import__(name)


def _serve_private(base_path: list[str]) -> None:
    """Entry of a launcher's own server: ``python [flags] -c CODE FD``."""
    fd = int(sys.argv[1])
    del base_path[0:0 if sys.flags.safe_path else 1]
    startup = startup_env(os.environ)
    _preload()
    child = _serve([socket.socket(fileno=fd)], None, base_path, startup)
    if child is not None:
        _become(child)


def serve_forever(path: str, listener: socket.socket | None = None) -> None:
    """Run a shared server on the unix socket ``path`` (mode 0600) until SIGTERM/SIGINT; point
    launchers at it with ``FLEETLIKE_PRELOAD_SOCKET=path``. Start it as
    ``python [the workers' flags, e.g. -u] -c 'from fleetlike.launch.preload import
    serve_forever; serve_forever("/run/user/1000/preload.sock")'`` in the workers' environment.
    ``listener``: the socket already bound to ``path`` and listening (launchers that connect
    before the imports are done wait for them)."""
    base_path = list(sys.path)
    if not sys.flags.safe_path and base_path and base_path[0] in ("", os.getcwd()):
        del base_path[0]
    startup = startup_env(os.environ)
    if listener is None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        listener.listen(64)
    _preload()

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        child = _serve([], listener, base_path, startup)
    except SystemExit:
        listener.close()
        os.unlink(path)
        _kill_children()
        raise
    if child is not None:
        _become(child)


def _kill_children() -> None:
    """SIGKILL every child of this process (the shared server ending), then reap them."""
    me = str(os.getpid())
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().decode(errors="replace").rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[1] == me:
            _kill(int(pid))
    try:
        while os.waitpid(-1, 0):
            pass
    except ChildProcessError:
        pass

"""The preload server of ``--preload=torch`` (`fleetlike.launch.preload`): an interpreter that has
imported torch, numpy and fleetlike, and forks one child per worker a launcher asks for.

A launcher's own server is ``python [flags] -c CODE FD`` (`_serve_private`), serving the one
socket it inherited until the launcher closes it; a shared one (`serve_forever`) listens on a
unix socket for launchers of the same user. The messages both ways are JSON over a
``SOCK_SEQPACKET`` socket (`send` / `receive`): the server's ``hello`` (its pid, interpreter
flags, start-up environment, thread count and Linux namespaces), then ``start`` requests with
the worker's stdout descriptor attached, answered by ``started`` (the child's pid) or
``refused`` (why), and an ``exit`` (the wait status) for each child that ends. A child becomes
the worker (`_become`): its session, its death with the server, its stdio, the launcher's
umask, affinity and limits, the worker's environment, argv, working directory and path, the
default generators seeded afresh, and the script run as ``__main__``.

A child ends as the interpreter does (its non-daemon threads joined, ``atexit`` run, the files
it opened flushed and closed, the exit code or signal of ``SystemExit``, an uncaught exception
or Ctrl-C) but without the interpreter's teardown, as ``multiprocessing``'s forked children do:
freeing every object of the preloaded modules writes to each of their pages, which the fork
shares until then, and costs a second of CPU per child. Objects still alive at exit are
therefore not finalized (their ``__del__`` does not run) apart from open files; the server
freezes its preloaded objects (`gc.freeze`) so that the child's garbage collections, and that
last look for open files, do not walk them either.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib.util
import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PRELOADED_MODULES", "exit_without_teardown", "namespaces", "receive",
           "send", "serve_forever", "startup_env"]

#: What the server imports before forking. Not ``torch._dynamo`` (which torch imports on a
#: process's first optimizer or DDP model, about 2 s of CPU): workers forked from a server that
#: had imported it now and then hung at their end, in ProcessGroupGloo's destructor.
PRELOADED_MODULES = ("torch", "numpy", "fleetlike")

_NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")
_STARTUP_PREFIXES = ("PYTHON", "LD_", "GLIBC_", "MALLOC_", "OMP_", "KMP_", "GOMP_", "MKL_",
                     "OPENBLAS_", "TORCH_", "PYTORCH_", "LC_")
_MESSAGE_BYTES = 1 << 20
#: the signals that stop a server (and, reset to their defaults, a worker)
_STOPS = {signal.SIGTERM, signal.SIGINT}


def startup_env(env: Mapping[str, str], flags: Sequence[str] = ()) -> dict[str, str]:
    """The variables an interpreter or a library reads once at start (the list is in
    `fleetlike.launch.preload`'s doc); a worker forked from a server started with others would
    not see its own;
    with ``-u`` in ``flags``, PYTHONUNBUFFERED says nothing more and is left out."""
    return {k: v for k, v in env.items() if (k.startswith(_STARTUP_PREFIXES) or k in ("LANG", "LANGUAGE"))
            and not (k == "PYTHONUNBUFFERED" and "-u" in flags)}


def namespaces() -> dict[str, str]:
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


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One message (JSON) on the server's socket, with ``fds`` attached (``SCM_RIGHTS``)."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; None when the peer closed."""
    data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 4)
    return (json.loads(data) if data else None), fds


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
             "startup": startup, "threads": threading.active_count(), "namespaces": namespaces()}
    for conn in conns:
        send(conn, hello)
    while conns or listener is not None:
        readable = select.select([wake_r, *conns, *([listener] if listener else [])], [], [])[0]
        if listener is not None and listener in readable:
            conn, _ = listener.accept()
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():
                conn.close()
            else:
                conns.append(conn)
                send(conn, hello)
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        _reap(owner)
        for conn in [c for c in conns if c in readable]:
            try:
                request, fds = receive(conn)
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
                send(conn, {"op": "refused", "request": request["request"], "reason": refused})
                continue
            ready_r, ready_w = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            # a SIGTERM or SIGINT sent to the child before it drops the server's handlers would run
            # the server's shutdown in it (removing the shared socket): held until the child's own
            # handlers are in place, then delivered to those
            held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                _settle_child(fds, ready_w)
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for c in conns:
                    c.close()
                if listener is not None:
                    listener.close()
                return _Child(request, base_path)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            os.close(ready_w)
            for fd in fds:
                os.close(fd)
            os.read(ready_r, 1)  # the child is in its own session: signals to its group reach it
            os.close(ready_r)
            owner[pid] = conn
            send(conn, {"op": "started", "request": request["request"], "pid": pid})
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
                send(conn, {"op": "exit", "pid": pid, "status": status})
            except OSError:
                pass


def _interpreter_flags() -> list[str]:
    """The flags this interpreter was started with, as the client's command parsing spells them."""
    argv = list(getattr(sys, "orig_argv", []))[1:]
    flags: list[str] = []
    i = 0
    while i < len(argv) and argv[i] != "-c":
        flags.append(argv[i])
        i += 1
    return flags


def _settle_child(out_fds: Sequence[int], ready_w: int) -> None:
    """In the child, first: its own session, death with the server, its stdio (stdout and
    stderr to the first descriptor, or stderr to the second where the client sent two)."""
    os.setsid()
    _prctl_pdeathsig()
    os.close(ready_w)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_fds[0], 1)
    os.dup2(out_fds[-1], 2)
    for fd in set(out_fds):
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _become(child: _Child) -> None:
    """Turn this forked child into the worker, run it and end the process
    (`exit_without_teardown`)."""
    try:
        _run(child)
    except SystemExit as exc:
        exit_without_teardown(_exit_code(exc.code))
    except KeyboardInterrupt as exc:
        _report(exc)
        exit_without_teardown(None)
    exit_without_teardown(0)


def _exit_code(code: Any) -> int:
    """The process's exit code for ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def exit_without_teardown(code: int | None) -> None:
    """End this process with the interpreter's exit steps, in its order (non-daemon threads
    joined, ``atexit`` run, open files flushed and closed, stdout and stderr flushed), then
    ``os._exit(code)`` instead of its teardown, which with torch imported costs most of a second
    (and, in a forked child, copies every shared page). ``None``: end by SIGINT, as after an
    uncaught Ctrl-C."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls first
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    _close_open_files()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if code is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code)


def _close_open_files() -> None:
    """Flush, then close, the file objects the child still holds, as their finalizers would:
    text layers first, so that their buffers reach the binary files under them. Only the
    child's own objects are looked at (the preloaded ones are frozen: `gc.get_objects` skips
    them)."""
    std = {id(sys.stdout), id(sys.stderr), id(sys.stdin), id(sys.__stdout__), id(sys.__stderr__),
           id(sys.__stdin__)}
    # type(o), not isinstance: some of torch's objects warn when asked for their __class__
    files = [o for o in gc.get_objects() if issubclass(type(o), io.IOBase) and id(o) not in std]
    files.sort(key=lambda f: not isinstance(f, io.TextIOBase))
    for step in ("flush", "close"):
        for f in files:
            with contextlib.suppress(BaseException):
                if not f.closed:
                    getattr(f, step)()


def _run_sitecustomize(path: str) -> None:
    """Run the ``sitecustomize.py`` at ``path`` as the interpreter runs the first one on its path
    at start-up: it becomes ``sys.modules["sitecustomize"]``, an exception is reported and the
    start goes on, a SystemExit ends it."""
    spec = importlib.util.spec_from_file_location("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return
    sys.modules["sitecustomize"] = module


def _run(child: _Child) -> None:
    """Run the worker's script or module as ``__main__`` in this forked child."""
    request = child.request
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["affinity"])
    for name, limits in request["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(limits))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = _child_path(request, child.base_path)
    if request.get("site"):  # a PYTHONPATH entry before the server's: where the interpreter puts it
        sys.path.insert(0 if sys.flags.safe_path else 1, request["site"])
    sys.orig_argv = list(request["argv"])
    # a fresh interpreter seeds both from the OS; children of one server would share its draws
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if request.get("site"):
        _run_sitecustomize(os.path.join(request["site"], "sitecustomize.py"))
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
        _report(exc)
        raise SystemExit(1) from None


def _report(exc: BaseException) -> None:
    """Print an uncaught exception as the interpreter would for the script: its traceback
    starts at the script (this module's and runpy's frames left out)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def _preload() -> None:
    """Import what the children share, then freeze it (`gc.freeze`): a child's collections
    leave these objects, and so their shared pages, untouched."""
    for name in PRELOADED_MODULES:
        __import__(name)
    gc.collect()
    gc.freeze()


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
    server = os.getpid()
    conns: list[socket.socket] = []  # the launchers' connections, which `_serve` keeps in this list
    try:
        child = _serve(conns, listener, base_path, startup)
    except SystemExit:
        if os.getpid() != server:  # a child ending before it became a worker owns none of this
            raise
        for conn in conns:  # closed here, not left to the interpreter's exit (a ResourceWarning each)
            conn.close()
        listener.close()
        with contextlib.suppress(FileNotFoundError):
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

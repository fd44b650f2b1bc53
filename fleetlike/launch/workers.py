"""Starting and stopping worker processes, each in its own process group.

A training script often has children of its own (DataLoader workers, a tokenizer pool). Starting
each worker as the leader of a new session lets the launcher signal the whole group at once, so
stopping a job leaves nothing behind: SIGTERM first, SIGKILL after a grace period.

A launcher killed with SIGKILL cannot stop anything. Its workers die with it
(``PR_SET_PDEATHSIG``), but that setting is not inherited, so their own children would live on.
A small guard process (`_Guard`, the standard library only) holds the other end of a pipe from
the launcher and the list of the workers' process groups; when the pipe closes without the
groups having been stopped (the launcher is gone, however it ended), it kills those groups.

A child that calls ``setsid`` leaves its worker's group; the launcher finds it by the tag every
worker's environment carries (`fleetlike.launch.family`, which says why a tag rather than a
subreaper or a cgroup) and stops it with the worker, as the guard does when the launcher died.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, TextIO, Union

from fleetlike.launch.family import TAG_VARIABLE, alive, new_tag, signal_tagged, tagged
from fleetlike.launch.preload import PreloadedProcess, start_preloaded

__all__ = ["Worker", "start_worker", "stop_workers", "close_logs", "describe_exit", "last_line", "log_problem"]


@dataclasses.dataclass
class Worker:
    """One running worker: its process, log file and (for the echoed worker) its tee thread."""

    local_rank: int
    rank: int
    log_path: str
    process: Union[subprocess.Popen[bytes], PreloadedProcess]
    log_file: IO[bytes]
    tee: threading.Thread | None = None
    #: why the echoed worker's log stopped taking its output (ENOSPC, EIO), set by its tee thread,
    #: which keeps reading the pipe so the worker never blocks on it; the launcher ends the job
    log_error: str | None = None
    #: the value of `TAG_VARIABLE` this start's processes carry, wherever they went
    tag: str = ""

    def group_alive(self) -> bool:
        """True while any process of this worker's group exists (zombies count as gone)."""
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return self.process.poll() is None or _group_has_live_member(self.process.pid)


def _group_has_live_member(pgid: int) -> bool:
    """Scan /proc for a non-zombie process in group ``pgid`` (Linux; elsewhere assume yes)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            return True
    return False


def _tee(source: IO[bytes], worker: Worker, console: TextIO, prefix: str) -> None:
    """Copy the worker's output to its log file and, prefixed, to the launcher's console. A log
    write that fails (a full disk, an I/O error) is recorded on ``worker`` (the launcher ends
    the job, naming the log), and the pipe is still read to its end: a worker must never block
    on a pipe nobody reads."""
    for line in iter(source.readline, b""):
        if worker.log_error is None:
            try:
                worker.log_file.write(line)
                worker.log_file.flush()
            except (OSError, ValueError) as exc:
                worker.log_error = f"{exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
        try:
            console.write(prefix + line.decode(errors="replace"))
            console.flush()
        except (OSError, ValueError):  # console closed: keep logging to the file
            pass
    source.close()


def log_problem(path: str) -> str | None:
    """Why ``path`` (a worker's log) cannot be written now (``No space left on device``), or None.
    Asked after a worker failed: its own writes to the log may have been what failed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        os.write(fd, b"\n")
        os.fsync(fd)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(fd)
    return None


def _open_log(path: str) -> IO[bytes]:
    """The worker's log, readable by its owner only (a log may quote what the job holds)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # a log left by an earlier run keeps its mode otherwise
    except OSError:
        pass
    return os.fdopen(fd, "wb")


def start_worker(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    local_rank: int,
    rank: int,
    log_path: str,
    echo: bool,
    preload: str = "off",
) -> Worker:
    """Start one worker in a new session; ``echo`` also copies its output to ``sys.stdout``.
    ``preload="torch"`` forks it from a preload server when it can (`fleetlike.launch.preload`)."""
    log_file = _open_log(log_path)
    tag = new_tag()
    env = {**env, TAG_VARIABLE: tag}
    try:
        process: subprocess.Popen[bytes] | PreloadedProcess | None = None
        if preload != "off":
            process = start_preloaded(command, env, stdout=None if echo else log_file.fileno(), rank=rank)
        if process is None:
            process = subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if echo else log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_launcher,
        )
    except BaseException:
        log_file.close()
        raise
    _Guard.shared().watch(process.pid, tag)
    worker = Worker(local_rank, rank, log_path, process, log_file, tag=tag)
    if echo and process.stdout is not None:
        worker.tee = threading.Thread(
            target=_tee,
            args=(process.stdout, worker, sys.stdout, f"[rank {rank}] "),
            name=f"fleetlike-tee-{rank}",
            daemon=True,
        )
        worker.tee.start()
    return worker


def _signal_group(worker: Worker, sig: int) -> None:
    try:
        os.killpg(worker.process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_workers(workers: Sequence[Worker], *, grace: float, first_signal: int = signal.SIGTERM) -> None:
    """Stop every worker's whole process group: ``first_signal``, then SIGKILL after ``grace``.

    Groups of workers that already exited are signalled too, because their children may live on,
    and so is every process carrying a stopped worker's tag (a child that left the group).
    Returns once every leader is reaped and every group is gone (or after SIGKILL had its say).
    """
    tags = {w.tag for w in workers if w.tag}
    for worker in workers:
        _signal_group(worker, first_signal)
    # the workers' own processes got it with their group: the tagged ones are those that left it
    strays = signal_tagged(tags, first_signal, signalled_groups=[w.process.pid for w in workers])
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(w.group_alive() for w in workers) or alive(strays)):
        time.sleep(0.05)
    for worker in workers:
        if worker.group_alive():
            _signal_group(worker, signal.SIGKILL)
    signal_tagged(tags, signal.SIGKILL)  # also any started while the first signal was handled
    for worker in workers:
        try:
            worker.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): report, do not hang
            print(
                f"fleetlike.launch: rank {worker.rank} (pid {worker.process.pid}) did not exit "
                "after SIGKILL",
                file=sys.stderr,
            )
    signal_tagged(tags, signal.SIGKILL)  # children a dying worker started at the last moment
    for worker in workers:
        if not worker.group_alive() and not tagged({worker.tag}):
            _Guard.shared().forget(worker.process.pid, worker.tag)
    close_logs(workers)


_GUARD_CODE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = {}
for line in sys.stdin:
    words = line.split()
    if len(words) != 2:
        continue
    if words[0].startswith("-"):
        groups.pop(int(words[0][1:]), None)
    else:
        groups[int(words[0])] = words[1]
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
wanted = {("%s=%s" % (sys.argv[1], tag)).encode() for tag in groups.values()}
me, uid = os.getpid(), os.getuid()
for name in os.listdir("/proc") if wanted else ():
    try:
        if not name.isdigit() or int(name) == me or os.stat("/proc/" + name).st_uid != uid:
            continue
        with open("/proc/%s/environ" % name, "rb") as fh:
            if wanted.intersection(fh.read().split(b"\\0")):
                os.kill(int(name), signal.SIGKILL)
    except OSError:
        pass
"""


class _Guard:
    """The process that kills the workers' groups if this launcher dies without stopping them."""

    _shared: _Guard | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        # its own session: a signal to the launcher's group (Ctrl-C) does not reach it; no
        # PDEATHSIG: it must outlive the launcher to do its work
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-S", "-c", _GUARD_CODE, TAG_VARIABLE], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    @classmethod
    def shared(cls) -> _Guard:
        with cls._lock:
            if cls._shared is None or cls._shared._proc is None or cls._shared._proc.poll() is not None:
                cls._shared = cls()
            return cls._shared

    def _say(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                return
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                self._proc = None  # it died: the launcher's own stop logic still covers the rest

    def watch(self, group: int, tag: str) -> None:
        self._say(f"{group} {tag}")

    def forget(self, group: int, tag: str) -> None:
        self._say(f"-{group} {tag}")


def _die_with_launcher() -> None:
    """In the child, before exec: Linux delivers SIGKILL to it when the launcher dies, so a
    launcher killed with SIGKILL (no chance to clean up) does not leave its workers running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own stop logic still covers every other way of ending


def close_logs(workers: Sequence[Worker]) -> None:
    """Finish the tee threads and close the log files (idempotent)."""
    for worker in workers:
        if worker.tee is not None:
            worker.tee.join(timeout=2)
        if not worker.log_file.closed and (worker.tee is None or not worker.tee.is_alive()):
            worker.log_file.close()


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by signal SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


def last_line(path: str) -> str:
    """The failing worker's last words (its exception, usually), for the one summary line."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 8192))
            lines = [ln.strip() for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""

"""Finding every process a worker started, including those that left its process group.

A worker runs as the leader of its own session, so one ``killpg`` reaches its children (a
DataLoader's workers, a tokenizer pool). A child that calls ``setsid`` (a daemonising helper, a
``start_new_session=True`` subprocess) leaves that group, and once the worker is gone it is
re-parented away from the job: killing groups alone leaves it running after the job ended.

How supervisors find such processes, and why this one tags them:

- systemd puts a service in a cgroup and kills the cgroup. Creating one needs a delegated
  cgroup subtree, which a user running a training job rarely has.
- torchrun signals each worker's process group only: the ``setsid`` child survives it.
- tini / ``PR_SET_CHILD_SUBREAPER`` re-parents orphans to the supervisor, so it can kill its
  own descendants. Workers forked by a preload server (``--preload=torch``, shared by several
  jobs) are not the launcher's descendants, and a launcher run in-process (`fleetlike.launch.main`
  inside a larger program) would adopt and kill that program's orphans as well.
- HTCondor's process-family tracking (and Slurm's ``proctrack/linuxproc`` family) tags each job's
  environment and finds the family by the tag, wherever its members were re-parented.

So the launcher gives each worker ``FLEETLIKE_PROCESS_TAG`` (a random value per worker start),
which every child inherits across ``fork``, ``exec`` and ``setsid``, and at the end of the worker
kills the processes of this user whose environment (``/proc/PID/environ``) carries that tag, as
well as the worker's process group. A child that empties its environment, or a preloaded worker's
child made by ``fork`` alone (its ``/proc`` environment is the server's), is reached by the
process group only. Scanning ``/proc`` costs about a millisecond per hundred processes, and only
when a worker is stopped.

Example::

    tag = new_tag()
    env = {**os.environ, TAG_VARIABLE: tag}      # the worker's environment
    ...
    signal_tagged({tag}, signal.SIGKILL)        # every process of that worker, wherever it is
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Collection, Iterable

from fleetlike.config import envvars

__all__ = ["TAG_VARIABLE", "alive", "new_tag", "signal_tagged", "tagged"]

#: The variable every worker and its descendants carry.
TAG_VARIABLE = envvars.PROCESS_TAG

_LAUNCHER = secrets.token_hex(8)
_serial = 0


def new_tag() -> str:
    """A tag no other worker start carries: this launcher's random part and a serial number."""
    global _serial
    _serial += 1
    return f"{_LAUNCHER}.{os.getpid()}.{_serial}"


def tagged(tags: Collection[str]) -> list[int]:
    """The pids of this user's processes (this one excepted) whose environment carries one of
    ``tags``. Processes of other users are never read (nor could they carry the tag by chance:
    it is random and only the job's processes can read it)."""
    if not tags:
        return []
    wanted = {f"{TAG_VARIABLE}={tag}".encode() for tag in tags}
    me, uid = os.getpid(), os.getuid()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []  # no /proc (not Linux): the process groups are all that can be reached
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as fh:
                entries = fh.read().split(b"\0")
        except OSError:
            continue  # ended meanwhile, or not ours to read
        if wanted.intersection(entries):
            found.append(int(name))
    return found


def signal_tagged(tags: Collection[str], sig: int, *, signalled_groups: Collection[int] = ()) -> list[int]:
    """Send ``sig`` to every process `tagged` with one of ``tags`` but those in
    ``signalled_groups`` (process groups just sent ``sig``); return the pids signalled here.

    Why the groups are left out: a worker is in its own group and carries its tag, so it would
    get the signal twice, and a second SIGTERM runs its handler again inside the first (a
    checkpoint being saved on SIGTERM is cut short by the second run's exit), or late in the
    interpreter's shutdown, where its ``open(path, "w")`` truncates the file and then fails."""
    pids = tagged(tags)
    if signalled_groups:
        groups = set(signalled_groups)
        pids = [pid for pid in pids if _group_of(pid) not in groups]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return pids


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None  # ended meanwhile


def alive(pids: Iterable[int]) -> bool:
    """True while one of ``pids`` runs (a zombie counts as gone)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z":
                    return True
        except (OSError, IndexError):
            continue
    return False

"""Rendezvous: a TCP key-value store hosted by rank 0, closed to other jobs.

Rank 0 listens on the master endpoint's own IP only (never 0.0.0.0), writes the job id under a fixed
key, and every peer compares it with its own before doing anything else: two jobs that share a
port refuse each other with a message instead of silently forming one wrong world. All further
keys live under ``job/<id>/`` so nothing of one job can collide with another.

A process may meet its job more than once (``fleet.shutdown()`` then ``fleet.init()``): rank 0
keeps serving the store it hosts, and each meeting of a job in a process gets its own key space
(``job/<id>/<n>/``, n counting the meetings, which every rank makes in the same order), so keys
of an earlier world never answer a later one.

When peers do not arrive the error names the store's ``host:port``, how long it waited and which
ranks are missing, because "it hangs at init" is the most common report in this field.

Example:
    >>> store = connect(role, timeout=60.0)      # every rank of the job calls this
    >>> store.set("hello", "world")
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

import torch.distributed as dist

from fleetlike.comm.base import CommError
from fleetlike.roles.role import Role, parse_endpoint

__all__ = ["RendezvousError", "JobMismatchError", "connect", "host_store", "JOB_KEY"]

JOB_KEY = "fleetlike/job_id"

_LOCK = threading.Lock()
#: stores this process hosts, by (host, port): a later meeting of the job reuses the server
_HOSTED: dict[tuple[str, int], dist.TCPStore] = {}
#: meetings so far per job id in this process
_MEETINGS: dict[str, int] = {}


class RendezvousError(CommError):
    """The ranks of a job could not meet."""


class JobMismatchError(RendezvousError):
    """The store at the master endpoint belongs to another job."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def connect(role: Role, timeout: float = 300.0) -> dist.Store:
    """Meet every rank of ``role``'s job; return the job's (prefixed) store.

    Blocks until all ``role.world_size`` ranks have arrived or ``timeout`` seconds passed.
    """
    host, port = parse_endpoint(role.master_endpoint, name="master_endpoint")
    start = time.monotonic()
    if role.rank == 0 and not role.master_hosted:
        try:
            with _LOCK:
                raw = _HOSTED.get((host, port))
                if raw is None:
                    raw = _HOSTED[(host, port)] = host_store(host, role.job_id, timeout, port=port)
        except Exception as exc:  # noqa: BLE001 - torch raises several types for bind errors
            raise RendezvousError(
                f"rank 0 cannot host the rendezvous store on {host}:{port}: {exc}. Is another "
                "job using that port? Pick another --started_port / MASTER_PORT."
            ) from exc
    else:
        try:
            raw = dist.TCPStore(host, port, role.world_size, False, _td(timeout))
        except Exception as exc:  # noqa: BLE001
            waited = time.monotonic() - start
            raise RendezvousError(
                f"rank {role.rank} could not reach the rendezvous store at {host}:{port} after "
                f"waiting {waited:.1f}s (timeout {timeout:g}s): {exc}. Check that rank 0 is "
                "running and that every worker was given the same master endpoint."
            ) from exc
        _check_job(raw, role, host, port, timeout, start)
    with _LOCK:
        meeting = _MEETINGS.get(role.job_id, 0)
        _MEETINGS[role.job_id] = meeting + 1
    store = dist.PrefixStore(f"job/{role.job_id}/{meeting}/", raw)
    # The prefix store holds a reference to the raw one, so rank 0's server lives as long.
    _meet(store, role, host, port, timeout, start)
    return store


def host_store(host: str, job_id: str, timeout: float = 300.0, *, port: int = 0) -> dist.TCPStore:
    """Host job ``job_id``'s store on ``host`` (only) at ``port``; 0 lets the OS choose it.

    Rank 0 calls this with its endpoint's port. ``python -m fleetlike.launch
    --started_port=auto`` and `fleetlike.testing` call it with port 0 and give the workers the
    store's ``port`` with ``Role.master_hosted`` set: the port is bound before anyone knows it,
    so nothing can take it between its choice and its use.
    """
    fd, bound = _listen(host, port)
    store = dist.TCPStore(
        host, bound, None, True, _td(timeout), wait_for_workers=False, master_listen_fd=fd
    )
    store.set(JOB_KEY, job_id)
    return store


def _listen(host: str, port: int) -> tuple[int, int]:
    """(descriptor, port) of a socket listening on ``host`` only (TCPStore alone would listen
    on every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return sock.detach(), bound  # the store owns the descriptor from here on


def _check_job(raw: dist.Store, role: Role, host: str, port: int, timeout: float, start: float) -> None:
    try:
        raw.wait([JOB_KEY], _td(max(timeout - (time.monotonic() - start), 1.0)))
        theirs = raw.get(JOB_KEY).decode()
    except Exception as exc:  # noqa: BLE001
        raise RendezvousError(
            f"rank {role.rank}: the store at {host}:{port} never announced a fleetlike job "
            f"within {time.monotonic() - start:.1f}s; something else may be listening there"
        ) from exc
    if theirs != role.job_id:
        raise JobMismatchError(
            f"rank {role.rank} (job {role.job_id!r}) reached the rendezvous store at {host}:{port}, "
            f"but it belongs to job {theirs!r}; refusing to join another job. Give each job its "
            "own --started_port, or the same --job_id to every launcher of one job."
        )


def _meet(store: dist.Store, role: Role, host: str, port: int, timeout: float, start: float) -> None:
    """Every rank announces itself, then waits for all others, naming who is missing."""
    store.set(f"arrived/{role.rank}", role.current_endpoint)
    keys = [f"arrived/{r}" for r in range(role.world_size)]
    remaining = max(timeout - (time.monotonic() - start), 1.0)
    try:
        store.wait(keys, _td(remaining))
    except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
        missing = [r for r, k in enumerate(keys) if not _has(store, k)]
        raise RendezvousError(
            f"rank {role.rank}: waited {time.monotonic() - start:.1f}s at the rendezvous store "
            f"{host}:{port} (job {role.job_id!r}); ranks {missing} of {role.world_size} did not "
            "arrive. Are all workers started, with the same endpoints and job id?"
        ) from exc


def _has(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - a dead server answers nothing
        return False

"""Ports without a race: ``--started_port=auto`` (and `fleetlike.testing`).

Picking a free port, closing it and handing the number to another process is a race: anything
on the machine may bind it in between (CI once failed with "port 60154 ... is already in use").
The only port of a fleetlike job that is really listened on is the rendezvous store's (rank 0's
endpoint); gloo's connections between ranks use ports the OS assigns as they are made. So the
host of the job binds that socket on port 0 and serves the store on it itself, the way torchrun's
agent does, and the workers connect to it (``Role.master_hosted``): the port is bound before its
number exists anywhere, and stays bound until the job ends.

The other ranks' endpoints are only names (they tell nodes apart and appear in messages), but a
name should not point at a port some other program owns: each is bound too (not listening, no
``SO_REUSEADDR``) and held as long as the job runs, so no other process can bind it meanwhile.

On several nodes only the first node's launcher hosts the store (`host_endpoints`); the others
hold all their ranks' ports (`hold_endpoints`) and learn the store's address from the rendezvous
file (`fleetlike.launch.meeting`).

Example:
    >>> with host_endpoints(["127.0.0.1", "127.0.0.1"], job_id="demo") as hosted:
    ...     hosted.endpoints          # ('127.0.0.1:41233', '127.0.0.1:39017'), say
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from types import TracebackType

import torch.distributed as dist

from fleetlike.comm import host_store
from fleetlike.comm import JobSecret

__all__ = ["HostedEndpoints", "hold_endpoints", "host_endpoints", "reserve_port"]


def reserve_port(host: str) -> socket.socket:
    """A socket bound to a port the OS chose on ``host``, held (not listening) by the caller.

    No ``SO_REUSEADDR``: on Linux two sockets that both set it may share a port while neither
    listens, so leaving it off is what makes the port this socket's alone.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


class HostedEndpoints:
    """A job's endpoints whose ports this process holds: rank 0's is the store it hosts, if
    ``store`` is not None (`host_endpoints`); else every port is only held (`hold_endpoints`).

    Close it (or leave the ``with`` block) only once the job's processes are gone: that lets the
    ports go.
    """

    def __init__(
        self, endpoints: tuple[str, ...], store: dist.TCPStore | None, held: list[socket.socket]
    ) -> None:
        self.endpoints = endpoints
        self.store: dist.TCPStore | None = store
        self._held = held

    @property
    def ports(self) -> tuple[int, ...]:
        """The port of each endpoint, in rank order."""
        return tuple(int(e.rsplit(":", 1)[1]) for e in self.endpoints)

    def close(self) -> None:
        """Stop the store and release the reserved ports (idempotent)."""
        for sock in self._held:
            sock.close()
        self._held = []
        self.store = None  # the server thread ends with the last reference

    def __enter__(self) -> HostedEndpoints:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def host_endpoints(hosts: Sequence[str], job_id: str, timeout: float = 300.0, *,
                   secret: JobSecret | None = None) -> HostedEndpoints:
    """Endpoints for ranks on ``hosts`` (one entry per rank, rank order), ports chosen by the OS.

    Rank 0's port is a rendezvous store for ``job_id`` hosted here (on ``hosts[0]`` only),
    greeting with ``secret`` (`fleetlike.comm.rendezvous.host_store`); the others are reserved
    sockets. Raises OSError when a host is not an address of this machine.
    """
    if not hosts:
        raise ValueError("hosts is empty: give one host per rank (at least one)")
    store = host_store(hosts[0], job_id, timeout, secret=secret)
    held = _hold(hosts[1:])
    ports = [int(store.port)] + [sock.getsockname()[1] for sock in held]
    return HostedEndpoints(_endpoints(hosts, ports), store, held)


def hold_endpoints(hosts: Sequence[str]) -> HostedEndpoints:
    """Endpoints for ranks on ``hosts`` whose ports are all only held (no store): a node other
    than the first of a several-node ``--started_port=auto`` job. Raises OSError as above."""
    if not hosts:
        raise ValueError("hosts is empty: give one host per rank (at least one)")
    held = _hold(hosts)
    return HostedEndpoints(_endpoints(hosts, [s.getsockname()[1] for s in held]), None, held)


def _hold(hosts: Sequence[str]) -> list[socket.socket]:
    held: list[socket.socket] = []
    try:
        for host in hosts:
            held.append(reserve_port(host))
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held


def _endpoints(hosts: Sequence[str], ports: Sequence[int]) -> tuple[str, ...]:
    shown = [f"[{h}]" if ":" in h else h for h in hosts]
    return tuple(f"{h}:{p}" for h, p in zip(shown, ports))

"""Several launchers and no exported secret: the secret goes through this user's private folder.

Paddle's launch form starts each node's launcher on its own with nothing shared but the flags,
and an elastic job's nodes (``--nnodes MIN:MAX``) start one by one. Whatever every launcher can
compute from the flags, anyone who can read ``/proc/*/cmdline`` can compute too, so the secret
is never derived from them. The launcher that hosts the job's store (elastic: the node of
``--rdzv_endpoint``; fixed ports: node 0, whose rank 0 hosts it; torch's static flags: node 0's
launcher at ``--master_addr:--master_port``) makes a random one and leaves
it in this user's private directory (`fleetlike.comm.secret.private_dir`: mode 0700, the file
0600, keyed by the store's endpoint) before the store exists; the other launchers read it there
and check it against the store's signed greeting before starting anything. That works for
launchers of one user on one machine, or where the nodes share that directory (a shared home);
elsewhere the other launchers find no such file once the store is up and refuse at once with
the way to share a secret (`SECRET_ENV`). A file a killed run left behind holds another secret,
which the greeting refuses, so it is never used; the host overwrites it and removes its own
at exit.

Example::

    config = settle(config, stop_event)   # in the launcher, before anything is started
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import time
from typing import Any

from fleetlike.comm import (
    JOB_KEY, SECRET_DIR_ENV, SECRET_ENV, JobSecret, SecretError, challenge_of, read_private, secret_file,
    write_private,
)
from fleetlike.launch.config import LaunchConfig
from fleetlike.launch.flags import LaunchInputError
from fleetlike.launch.stop import StopFlag
from fleetlike.roles import parse_endpoint

__all__ = ["SHARE_HINT", "meeting_point", "settle", "secret_path"]

#: How to give several launchers one secret (quoted by every refusal).
SHARE_HINT = (f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') and "
              "give that same value to every node's launcher (or use --started_port=auto with "
              f"--rendezvous_file, or point {SECRET_DIR_ENV} at a directory only you can read "
              "that every node shares); see docs/security.md")
#: Seconds a launcher keeps looking for the secret file once the store has greeted (a shared
#: home's attribute cache may show a fresh file late).
_FILE_GRACE = 5.0
_POLL = 0.1


def meeting_point(config: LaunchConfig) -> tuple[str, bool]:
    """(the store's ``host:port``, whether this launcher makes the secret)."""
    if config.min_nodes:
        endpoint = str(config.rdzv_endpoint)
        try:
            host, _ = parse_endpoint(endpoint, name="--rdzv_endpoint")
        except ValueError as exc:
            raise LaunchInputError(str(exc)) from None
        return endpoint, host == config.node_ip
    static = config.static_nodes
    if static is not None:  # torch's static form: node 0's launcher hosts the meeting at master_addr:master_port
        return f"{static.master_addr}:{static.master_port}", static.node_rank == 0
    return config.master_endpoint, config.node_index == 0


def secret_path(endpoint: str) -> str:
    """The private file of the launchers' secret for the store at ``endpoint``."""
    return secret_file("launch", endpoint)


def _with(config: LaunchConfig, secret: str) -> LaunchConfig:
    return dataclasses.replace(config, job_secret=secret,
                               job_id=config.job_id if config.job_id_given else JobSecret(secret).job_id())


def settle(config: LaunchConfig, stop: StopFlag | None = None) -> LaunchConfig:
    """``config`` with the job's secret (and its job id, unless given) settled; unchanged when
    the secret was exported or needs no sharing. `LaunchInputError` when this launcher cannot
    get the secret (`SHARE_HINT`)."""
    if not config.secret_at_home:
        return config
    endpoint, makes = meeting_point(config)
    try:
        path = secret_path(endpoint)
        if makes:
            write_private(path, config.job_secret)
            return _with(config, config.job_secret)
    except (OSError, SecretError) as exc:
        raise LaunchInputError(f"no {SECRET_ENV} is set and the job's secret cannot be kept in "
                               f"this user's private directory ({exc}); {SHARE_HINT}") from None
    return _with(config, _find(config, endpoint, path, stop))


def forget(config: LaunchConfig) -> None:
    """Remove the secret file this launcher made (at its exit)."""
    if config.secret_at_home:
        endpoint, makes = meeting_point(config)
        if makes:
            with contextlib.suppress(OSError, SecretError):
                os.unlink(secret_path(endpoint))


def _client(host: str, port: int) -> Any | None:
    """A store client once something listens at ``host:port`` (None while nothing does)."""
    import torch.distributed as dist

    try:
        with socket.create_connection((host, port), timeout=0.5):
            pass
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=5))
    except Exception:  # noqa: BLE001 - not up yet: torch raises several types
        return None


def _find(config: LaunchConfig, endpoint: str, path: str, stop: StopFlag | None) -> str:
    host, port = parse_endpoint(endpoint, name="--rdzv_endpoint" if config.min_nodes else "master endpoint")
    deadline = time.monotonic() + config.rendezvous_timeout
    greeted: float | None = None
    raw = None
    problem = "no such file"
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if raw is None:
            raw = _client(host, port)
        if raw is not None:
            try:
                found = read_private(path)
            except (OSError, SecretError) as exc:
                raise LaunchInputError(f"no {SECRET_ENV} is set: {exc}; {SHARE_HINT}") from None
            try:
                if found is not None and challenge_of(raw, found) is not None:
                    return found.hex
                if greeted is None and raw.check([JOB_KEY]):
                    greeted = time.monotonic()
            except Exception:  # noqa: BLE001 - the store went away (a killed host): look again
                raw = None
            problem = "no such file" if found is None else "it holds another job's secret (a stale file)"
            if greeted is not None and time.monotonic() - greeted > _FILE_GRACE:
                break
        time.sleep(_POLL)
    if stop is not None and stop.is_set():
        raise LaunchInputError(f"stopped while waiting for the job's secret from the launcher at {endpoint}; "
                               "nothing was started")
    waited = "" if greeted is not None else f" (the store at {endpoint} did not answer within " \
                                            f"{config.rendezvous_timeout:g}s)"
    raise LaunchInputError(
        f"no {SECRET_ENV} is set, so the launcher at {endpoint} made this job's secret and left "
        f"it in {path} (mode 0600), but this node cannot read it there ({problem}){waited}: the "
        f"nodes share no such directory. Nothing was started. {SHARE_HINT}")

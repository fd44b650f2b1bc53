"""Several nodes with ``--started_port=auto``: the launchers meet through a shared file.

On one node the launcher binds port 0 and hosts the rendezvous store itself
(`fleetlike.launch.ports`). On several nodes the other launchers must learn where that store is,
and nobody may choose a port for them in advance. So, the way torch's ``file://`` initialization
works on a shared filesystem:

1. the launcher of the first node in ``--cluster_node_ips`` hosts the store on a port the OS
   chooses (rank 0's endpoint, as on one node), puts a random token in it, then writes the
   store's ``host:port``, the job id, the token and the job's secret to ``--rendezvous_file``
   atomically (a temporary file in the same directory, mode 0600, renamed over the path, so a
   reader sees the old file or the new one, never half of one);
2. every other launcher waits for the file (up to ``--rendezvous_timeout``) and joins the store
   it names only if the file is its user's own and nobody else may write it, the store's host
   is ``--cluster_node_ips[0]`` (a file naming any other address is refused, naming both: whoever
   can write the file must not be able to send the nodes elsewhere), the file names this
   launcher's job (``--job_id`` given; without it the file's id is taken), and the store is
   alive, greets with the file's secret and holds the same token. A file of another job, or
   one left by an earlier run (its store gone, or a store with another token), is never joined:
   the launcher keeps waiting for node 0's launcher to replace it, and its error names what it
   found;
3. every launcher claims its node's slot (once: a second launcher for the same node is refused),
   publishes the endpoints of its local ranks (ports it binds and holds, as on one node) under
   ``fleetlike/launch/<job_id>/``, and waits for every node's list. Their concatenation, node by
   node, is every rank's endpoint, identical on all nodes; rank 0's is the store.

Once every node has joined, nobody needs the file: node 0's launcher removes it (if it still
holds its token), and keeps hosting the store for the workers until the job ends.

Example (what `fleetlike.launch.main.launch` does)::

    config, hosted = host_ports(config)       # bind this node's ports (node 0: host the store)
    config = meet(config, hosted)             # config.endpoints: every rank's, all nodes
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import secrets
import socket
import stat
import tempfile
import threading
import time

import torch.distributed as dist

from fleetlike.comm import challenge_of, job_store, read_job_id
from fleetlike.comm import JobSecret, SecretError
from fleetlike.launch.config import LaunchConfig
from fleetlike.launch.ports import HostedEndpoints
from fleetlike.launch.stop import StopFlag
from fleetlike.roles import parse_endpoint

__all__ = [
    "FILE_FORMAT", "MeetingError", "StoreAddress", "meet", "read_address", "remove_address",
    "write_address",
]

#: The ``format`` field of a rendezvous file: tells it apart from any other file at the path.
FILE_FORMAT = "fleetlike.launch rendezvous 1"

_POLL_SECONDS = 0.1
#: Longest wait for one connection attempt to the store a file names (a dead port refuses at once).
_PROBE_SECONDS = 2.0
#: Longest single store operation of a joining launcher (the whole meeting is bounded separately).
_STORE_SECONDS = 30.0


class MeetingError(RuntimeError):
    """The launchers of a several-node ``--started_port=auto`` job could not meet (exit code 1)."""


@dataclasses.dataclass(frozen=True)
class StoreAddress:
    """What node 0's launcher writes to the rendezvous file: where its store is, for which job,
    and the token that store holds (so a file left by an earlier run of the same job is told
    apart from the current one)."""

    store: str
    job_id: str
    token: str
    secret: str = dataclasses.field(default="", repr=False)

    def to_json(self) -> str:
        return json.dumps({"format": FILE_FORMAT, "store": self.store, "job_id": self.job_id,
                           "token": self.token, "secret": self.secret}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> StoreAddress:
        """Parse a rendezvous file's text; ValueError saying what is wrong with it."""
        try:
            data = json.loads(text)
        except ValueError:
            raise ValueError("not JSON") from None
        if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
            raise ValueError(f"no \"format\": {FILE_FORMAT!r} field")
        fields = {name: data.get(name) for name in ("store", "job_id", "token", "secret")}
        bad = [name for name, value in fields.items() if not isinstance(value, str) or not value]
        if bad:
            raise ValueError(f"{', '.join(bad)} missing or empty")
        parse_endpoint(fields["store"], name="store")
        return cls(**fields)  # type: ignore[arg-type]


def write_address(path: str, address: StoreAddress) -> None:
    """Write ``address`` to ``path`` atomically: a temporary file in the same directory (so on
    the same filesystem), flushed to disk, then renamed over ``path``, replacing any old file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(address.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(temp, 0o600)  # it holds the job's secret: the job's user's launchers only
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def read_address(path: str) -> StoreAddress | None:
    """The address in ``path``; None while the file does not exist. ValueError for a file that
    is not a rendezvous file, OSError when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as fh:
        info = os.fstat(fh.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise ValueError(
                f"it is owned by uid {info.st_uid} (this launcher runs as {os.getuid()}) with mode "
                f"{stat.S_IMODE(info.st_mode):o}; a rendezvous file is trusted only when it is this "
                "user's and nobody else may write it"
            )
        text = fh.read()
    return StoreAddress.from_json(text)


def remove_address(path: str, token: str) -> bool:
    """Remove ``path`` if it still holds ``token`` (a later job's file is left alone)."""
    try:
        address = read_address(path)
    except (OSError, ValueError):
        return False
    if address is None or address.token != token:
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


def meet(config: LaunchConfig, hosted: HostedEndpoints, *, stop: StopFlag | None = None,
         poll: float = _POLL_SECONDS) -> LaunchConfig:
    """Meet the other nodes' launchers; ``config`` with every rank's endpoint filled in
    (``cluster_endpoints``).

    ``hosted`` holds this node's ports (`fleetlike.launch.checks.host_ports`); on node 0 it also
    hosts the store. Raises `MeetingError` when the file or a node does not turn up within
    ``config.rendezvous_timeout`` seconds, or when ``stop`` is set meanwhile.
    """
    if not config.meets_through_file or config.rendezvous_file is None:
        raise ValueError(
            "meet() is for --started_port=auto on several nodes with --rendezvous_file"
        )
    stop = stop or threading.Event()
    deadline = time.monotonic() + config.rendezvous_timeout
    if config.node_index != 0:
        store, address = _find_store(config, deadline, stop, poll)
        config = dataclasses.replace(config, job_id=address.job_id, job_secret=address.secret,
                                     job_id_from_file=False)
        return _exchange(config, hosted, store, address, deadline, stop, poll)
    if hosted.store is None:
        raise ValueError("node 0's HostedEndpoints must host the store (host_endpoints)")
    store = _job_store(hosted.store, config)
    address = StoreAddress(hosted.endpoints[0], config.job_id, secrets.token_hex(16), config.job_secret)
    store.set("token", address.token)
    path = config.rendezvous_file
    try:
        write_address(path, address)
    except OSError as exc:
        raise MeetingError(
            f"node 0 ({config.node_ip}) cannot write --rendezvous_file={path}: "
            f"{exc.strerror or exc}; give a writable path on a filesystem every node shares"
        ) from None
    try:
        return _exchange(config, hosted, store, address, deadline, stop, poll)
    finally:
        remove_address(path, address.token)  # every node has read it, or the job is over


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _job_store(raw: dist.Store, config: LaunchConfig) -> dist.Store:
    return dist.PrefixStore(f"launch/{config.job_id}/", job_store(raw, JobSecret(config.job_secret)))


def _me(config: LaunchConfig) -> str:
    return f"node {config.node_index} ({config.node_ip})"


def _stopped(config: LaunchConfig, what: str) -> MeetingError:
    return MeetingError(f"{_me(config)}: stopped while waiting for {what}")


def _find_store(config: LaunchConfig, deadline: float, stop: StopFlag,
                poll: float) -> tuple[dist.Store, StoreAddress]:
    """Wait for a rendezvous file of this job whose store is alive and holds its token; join it."""
    path = config.rendezvous_file or ""
    refused: set[str] = set()  # tokens whose live store belongs to another run: never valid
    problem = "does not exist"
    while True:
        try:
            address = read_address(path)
        except (OSError, ValueError) as exc:
            address = None
            why = exc.strerror if isinstance(exc, OSError) else exc
            problem = f"is not a readable fleetlike rendezvous file ({why})"
        else:
            if address is None:
                problem = "does not exist"
        if address is not None:
            host = parse_endpoint(address.store, name="store")[0]
            if host != config.cluster_node_ips[0]:
                problem = (
                    f"names a store at {address.store}, but node 0 is --cluster_node_ips[0]="
                    f"{config.cluster_node_ips[0]}: the store's host must be node 0; refusing a "
                    "file that would send this node elsewhere (forged, or written by another job)"
                )
            elif not config.job_id_from_file and address.job_id != config.job_id:
                problem = (
                    f"names job {address.job_id!r}, not this launcher's {config.job_id!r} (a file "
                    "of another job, or launchers started with different flags or --job_id)"
                )
            elif address.token in refused:
                pass  # the problem found then still stands
            else:
                # a file's job id is taken only with its live store: a file a killed run left
                # behind must not bind this launcher to that run's id (node 0's new file would
                # then look like another job's)
                joined = dataclasses.replace(config, job_secret=address.secret, job_id=address.job_id,
                                             job_id_from_file=False)
                store, problem, final = _join(address, joined, deadline)
                if store is not None:
                    return store, address
                if final:
                    refused.add(address.token)
        if stop.is_set():
            raise _stopped(config, f"--rendezvous_file={path}")
        if time.monotonic() >= deadline:
            raise MeetingError(
                f"{_me(config)}: --rendezvous_file={path} {problem} after waiting "
                f"{config.rendezvous_timeout:g}s (--rendezvous_timeout). Node 0's launcher "
                f"({config.cluster_node_ips[0]}) writes it once it hosts the store: start it with "
                "the same --cluster_node_ips, --nproc_per_node and --rendezvous_file, at a path on "
                "a filesystem every node shares"
            )
        stop.wait(poll)


def _join(address: StoreAddress, config: LaunchConfig,
          deadline: float) -> tuple[dist.Store | None, str, bool]:
    """(the job's store, "", _) or (None, what is wrong, whether it can never become right)."""
    host, port = parse_endpoint(address.store, name="store")
    remaining = max(deadline - time.monotonic(), 0.1)
    stale = "a file left by an earlier run, or node 0's launcher has ended"
    try:  # a plain connection first: a dead port answers at once, without torch's retries
        with socket.create_connection((host, port), timeout=min(_PROBE_SECONDS, remaining)):
            pass
    except OSError as exc:
        why = f"names the store at {address.store}, where nothing answers ({exc.strerror or exc}: "
        return None, why + f"{stale})", False
    try:
        secret = JobSecret(address.secret, source=f"the secret in {config.rendezvous_file}")
    except SecretError as exc:
        return None, str(exc), True
    try:
        raw = dist.TCPStore(host, port, None, False, _td(max(min(remaining, _STORE_SECONDS), 1.0)))
        greets = challenge_of(raw, secret) is not None
        job = read_job_id(raw, secret) if greets else None
        store = _job_store(raw, config)
        token = store.get("token").decode() if greets and store.check(["token"]) else None
    except Exception as exc:  # noqa: BLE001 - torch raises several types
        why = f"names {address.store}, which does not answer as a store ({exc}; {stale})"
        return None, why, False
    if not greets:
        return None, (
            f"names the store at {address.store}, which does not greet with the file's secret "
            f"(another job's store, or a forged file): {stale}"
        ), True
    if job != address.job_id or token != address.token:
        return None, (
            f"names the store at {address.store}, which belongs to another run (job {job!r}, "
            f"another token): {stale}"
        ), True
    return store, "", False


def _exchange(config: LaunchConfig, hosted: HostedEndpoints, store: dist.Store,
              address: StoreAddress, deadline: float, stop: StopFlag,
              poll: float) -> LaunchConfig:
    """Claim this node's slot, publish its endpoints, wait for every node's; all endpoints."""
    me = config.node_index
    try:
        claims = store.add(f"claim/{me}", 1)
    except Exception as exc:  # noqa: BLE001
        raise MeetingError(f"{_me(config)}: lost the store at {address.store} ({exc})") from None
    if claims != 1:
        raise MeetingError(
            f"{_me(config)}: another launcher already joined job {config.job_id!r} as node {me} "
            f"at the store {address.store}; run one launcher per node, each with its own --node_ip "
            f"(or give each job its own --rendezvous_file)"
        )
    store.set(f"endpoints/{me}", ",".join(hosted.endpoints))
    keys = [f"endpoints/{k}" for k in range(config.node_num)]
    while True:
        try:
            present = [bool(store.check([key])) for key in keys]
        except Exception as exc:  # noqa: BLE001 - the server is gone
            raise MeetingError(
                f"{_me(config)}: lost the store at {address.store} while waiting for the other "
                f"nodes ({exc}); node 0's launcher ({config.cluster_node_ips[0]}) has ended"
            ) from None
        if all(present):
            break
        if stop.is_set():
            raise _stopped(config, "the other nodes")
        if time.monotonic() >= deadline:
            missing = ", ".join(
                f"{k} ({config.cluster_node_ips[k]})" for k, here in enumerate(present) if not here
            )
            raise MeetingError(
                f"{_me(config)} waited {config.rendezvous_timeout:g}s (--rendezvous_timeout) at "
                f"the store {address.store} of job {config.job_id!r}, but node(s) {missing} did not "
                "join; start their launchers with the same --cluster_node_ips, --nproc_per_node "
                f"and --rendezvous_file={config.rendezvous_file}, on a filesystem every node shares"
            )
        stop.wait(poll)
    endpoints: list[str] = []
    for k, key in enumerate(keys):
        listed = store.get(key).decode().split(",")
        if len(listed) != config.nproc_per_node:
            raise MeetingError(
                f"{_me(config)}: node {k} ({config.cluster_node_ips[k]}) runs {len(listed)} "
                f"processes, this node {config.nproc_per_node}; give every node the same "
                "--nproc_per_node (or --selected_gpus count)"
            )
        endpoints += listed
    return dataclasses.replace(config, cluster_endpoints=tuple(endpoints))

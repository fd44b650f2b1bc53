"""Rendezvous: a TCP key-value store hosted by rank 0, closed to other jobs and to strangers.

Rank 0 listens on the master endpoint's own IP only (never 0.0.0.0). Everything of a job lives
under a prefix derived from the job's secret (`fleetlike.comm.secret`), and every value under it
is signed with the secret (`SignedStore`): a process that learns the key names (TCPStore lists
them to any client, and sends them in clear) can delete or spoil values, never write one a
member takes. The only public
keys are a marker (`JOB_KEY`: "a fleetlike job is here", nothing else: a member holding the
secret never waits for it, and a rank given no secret goes on when its secret's file appears
whatever the marker says, or names a deletion within seconds: `_hello`) and the list where refused processes leave their address (`KNOCK_KEY`). The store's host
writes a random challenge and the job id under the prefix: finding them tells a joining process
that the host holds its secret (two jobs that share a port refuse each other with a message
instead of silently forming one wrong world), and nobody else learns the job's id. Each joining
rank then proves it holds the secret (an HMAC of the challenge, its rank and endpoint) and rank 0
gives it its seat only then, signing the seat so the joiner knows rank 0 holds the secret too. The
challenge is also the run's nonce that every signed value carries (`SignedStore`), and each
proof and seat carry the joiner's own random value, so nothing recorded in an earlier run of a
job with the same secret (same key names) verifies in this one. A process with another secret
(or none) is refused with a message on its side and a line in rank 0's log naming the address it
gave; the job goes on.

A process may meet its job more than once (``fleet.shutdown()`` then ``fleet.init()``): rank 0
keeps serving the store it hosts, and each meeting of a job in a process gets its own key space
(``<prefix>job/<id>/<n>/``, n counting the meetings, which every rank makes in the same order),
so keys of an earlier world never answer a later one.

When peers do not arrive the error names the store's ``host:port``, how long it waited and which
ranks are missing, because "it hangs at init" is the most common report in this field.

Example:
    >>> store = connect(role, timeout=60.0)      # every rank of the job calls this
    >>> store.set("hello", "world")
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets as _random
import socket
import sys
import threading
import time
import weakref

import torch.distributed as dist

from fleetlike.comm.base import CommError
from fleetlike.comm.secret import (
    SECRET_ENV, JobSecret, SecretError, new_secret, secret_from_env, read_private, secret_file,
    set_current, write_private,
)
from fleetlike.comm.signed_store import NONCE_KEY, SignedStore, StoreTampered, read_now
from fleetlike.comm.store_server import StoreServer
from fleetlike.config import envvars
from fleetlike.roles.role import Role, parse_endpoint

__all__ = [
    "JOB_KEY", "KNOCK_KEY", "JobMismatchError", "RendezvousError", "SecretMismatchError",
    "challenge_of", "connect", "greet", "host_store", "job_store", "knock", "read_job_id", "secret_for",
]

#: The store's public marker: a fleetlike job is hosted here (its content says nothing more).
JOB_KEY = "fleetlike/job"
STORE_SERVER_ENV = envvars.STORE_SERVER
#: Where a process refused for want of the secret leaves its address for rank 0's log.
KNOCK_KEY = "fleetlike/knock"
_MAX_KNOCKS_LOGGED = 20
#: proof slots rank 0 watches beyond 4 per rank (a stranger may move the counter by millions)
_PROOF_WINDOW = 64
#: seconds a rank without the secret still looks for its secret's file once the marker it saw
#: was deleted (rank 0 leaves that file before its marker, so it is there by then or never)
_AFTER_DELETION = 5.0

_LOCK = threading.Lock()
#: stores this process hosts, by (host, port): a later meeting of the job reuses the server
_HOSTED: dict[tuple[str, int], dist.TCPStore] = {}
#: the signed key space of each (raw store, secret) in use (`job_store`), with the raw store
_SIGNED: dict[tuple[int, str], tuple[dist.Store, SignedStore]] = {}
_SIGNED_LOCK = threading.Lock()
#: meetings so far per job id in this process
_MEETINGS: dict[str, int] = {}


class RendezvousError(CommError):
    """The ranks of a job could not meet."""


class JobMismatchError(RendezvousError):
    """The store at the master endpoint belongs to another job."""


class SecretMismatchError(JobMismatchError):
    """The store at the master endpoint does not hold this process's job secret."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def job_store(raw: dist.Store, secret: JobSecret) -> dist.Store:
    """The job's key space on ``raw``: under ``secret``'s prefix, every value signed with it
    (`SignedStore`), so knowing the prefix (it crosses the network in clear) is not enough to
    write a value a member would take."""
    key = (id(raw), secret.prefix)
    with _SIGNED_LOCK:
        found = _SIGNED.get(key)
        if found is None:
            # torch keeps only the C++ half of a Python store it wraps (a PrefixStore over this
            # one): the Python object must stay referenced for as long as ``raw`` may be used
            found = _SIGNED[key] = (raw, SignedStore(dist.PrefixStore(secret.prefix, raw), secret))
    return found[1]


def greet(raw: dist.Store, secret: JobSecret, job_id: str, *, only_if_absent: bool = False,
          marker: str = "fleetlike") -> bool:
    """Write the challenge and ``job_id`` under the secret's prefix on ``raw``, then `JOB_KEY`
    (``marker``: which start of the workers greeted, where one store serves several).

    ``only_if_absent``: leave a challenge already there (rank 0 on a store another holder of
    the secret hosts: the launcher); returns whether this call wrote it."""
    return _write_greeting(raw, job_store(raw, secret), job_id, only_if_absent, marker)


def _write_greeting(raw: dist.Store, private: dist.Store, job_id: str, only_if_absent: bool,
                    marker: str) -> bool:
    challenge = _random.token_hex(16)
    wrote = True
    if only_if_absent:
        wrote = private.compare_set("challenge", "", challenge).decode() == challenge
    else:
        private.set("challenge", challenge)
    if wrote:
        private.set("job_id", job_id)
    raw.set(JOB_KEY, marker)
    return wrote


class _Recorder(dist.Store):
    """Keeps what is set on it, as a TCPStore server holds it (torch's client puts ``/`` before
    every key it sends): the greeting, for a server to hold before it serves anyone
    (`host_store`)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: dict[bytes, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.keys[b"/" + key.encode()] = value.encode() if isinstance(value, str) else bytes(value)


def _greeting(secret: JobSecret, job_id: str) -> tuple[dict[bytes, bytes], tuple[bytes, ...]]:
    """The keys and values `greet` would write on an empty store, without a store, and the
    key of the challenge among them (the run's nonce: it never changes within a run)."""
    recorder = _Recorder()  # referenced here: the prefix store keeps only its C++ half
    private = SignedStore(dist.PrefixStore(secret.prefix, recorder), secret)
    _write_greeting(recorder, private, job_id, False, "fleetlike")
    challenge = f"/{secret.prefix}/{NONCE_KEY}".encode()
    assert challenge in recorder.keys, "the prefix store joins keys with '/'"
    return recorder.keys, (challenge,)


def challenge_of(raw: dist.Store, secret: JobSecret) -> str | None:
    """The challenge the store's host left under ``secret``'s prefix; None: the host does not
    hold ``secret`` (another job's store, or this process was given another secret)."""
    found = job_store(raw, secret).get_now("challenge")
    return None if found is None else found.decode()


def read_job_id(raw: dist.Store, secret: JobSecret) -> str | None:
    """The job id on ``raw`` under ``secret``'s prefix (None when there is none)."""
    found = job_store(raw, secret).get_now("job_id")
    return None if found is None else found.decode()


def secret_for(role: Role) -> JobSecret | None:
    """``role.secret``, else `SECRET_ENV`; None when neither is given."""
    if role.secret:
        return JobSecret(role.secret, source="Role.secret")
    return secret_from_env()


def connect(role: Role, timeout: float = 300.0) -> dist.Store:
    """Meet every rank of ``role``'s job; return the job's (prefixed) store.

    Blocks until all ``role.world_size`` ranks have arrived or ``timeout`` seconds passed.
    """
    host, port = parse_endpoint(role.master_endpoint, name="master_endpoint")
    start = time.monotonic()
    try:
        secret = secret_for(role)
    except SecretError as exc:
        raise RendezvousError(str(exc)) from None
    hosts = role.rank == 0 and not role.master_hosted
    made = secret is None and role.rank == 0
    if made:
        secret = _make_private_secret(role)
    if hosts:
        assert secret is not None
        try:
            with _LOCK:
                raw = _HOSTED.get((host, port))
                if raw is None:
                    # a plain ``python train.py`` (no launcher's variables) is a world nobody else
                    # joins: its store takes a port the OS picks, so two such runs, or one left
                    # open in a notebook, never hold the well-known port a launched job needs
                    alone = role.world_size == 1 and role.source == "single"
                    raw = _HOSTED[(host, port)] = host_store(host, role.job_id, timeout, port=0 if alone else port,
                                                             secret=secret)
                else:  # a later world of this process on its store, perhaps under a new secret
                    greet(raw, secret, role.job_id, only_if_absent=True)
        except Exception as exc:  # noqa: BLE001 - torch raises several types for bind errors
            raise RendezvousError(
                f"rank 0 cannot host the rendezvous store on {host}:{port}: {exc}. Is another "
                "job using that port? Pick another --started_port / MASTER_PORT."
            ) from exc
        _hello(raw, role, host, port, timeout, start, secret)
        challenge = challenge_of(raw, secret) or ""
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
        if role.rank == 0:  # on a store another launcher hosts (torchrun's): greet if it did not
            assert secret is not None
            greet(raw, secret, role.job_id, only_if_absent=True, marker=_marker(role))
        _hello(raw, role, host, port, timeout, start, secret)
        if secret is None:
            secret = _find_private_secret(role, raw, host, port)
        challenge = _check_job(raw, secret, role, host, port)
    set_current(secret)
    name = _meeting_name(role)
    with _LOCK:
        meeting = _MEETINGS.get(name, 0)
        _MEETINGS[name] = meeting + 1
    store = dist.PrefixStore(f"job/{name}/{meeting}/", job_store(raw, secret))
    # The prefix store holds a reference to the raw one, so rank 0's server lives as long.
    seal = (challenge, name, meeting)
    if role.rank == 0:
        _admit(store, raw, secret, seal, role, host, port, timeout, start)
        if made:  # every rank read it before proving: nothing needs the file any more
            _forget_private_secret(role)
    else:
        _prove(store, secret, seal, role, host, port, timeout, start)
    _meet(store, role, host, port, timeout, start)
    return store


def host_store(host: str, job_id: str, timeout: float = 300.0, *, port: int = 0,
               secret: JobSecret | None = None) -> dist.TCPStore:
    """Host job ``job_id``'s store on ``host`` (only) at ``port``; 0 lets the OS choose it.

    Rank 0 calls this with its endpoint's port. ``python -m fleetlike.launch
    --started_port=auto`` and `fleetlike.testing` call it with port 0 and give the workers the
    store's ``port`` with ``Role.master_hosted`` set: the port is bound before anyone knows it,
    so nothing can take it between its choice and its use. ``secret`` (default: `SECRET_ENV`)
    keys the challenge (`greet`); a store hosted without one has none yet (rank 0 writes it).
    The server is `fleetlike.comm.store_server`'s (``FLEETLIKE_STORE_SERVER=bounded``, the
    default), in a process of its own with the default `StoreLimits` (bytes, keys and value size
    bounded), holding the greeting before it answers anyone, and stops when the returned store is
    collected or this process ends; with ``FLEETLIKE_STORE_SERVER=torch`` it is torch's own
    (which holds whatever a client sends it: docs/security.md says what each allows).
    """
    bounded = _bounded_server()  # a bad value raises before a port is taken
    secret = secret or secret_from_env()
    fd, bound = _listen(host, port)
    if bounded:
        # the port takes connections from here on: a member or a launcher that reaches it while
        # the server's process starts must find the greeting, not an empty store it would take
        # for a store without its secret (torch's own server starts empty and is greeted after)
        # ... and the greeting stays this run's: a stranger who read an earlier run's greeting
        # off the wire (same secret, same key) cannot put it back for a late member to take
        initial, fixed = _greeting(secret, job_id) if secret is not None else ({}, ())
        server = StoreServer.start(fd, initial=initial, fixed=fixed)
        try:
            store = dist.TCPStore(host, bound, None, False, _td(timeout))
        except Exception:
            server.close()
            raise
        weakref.finalize(store, server.close)  # the server lives as long as the host's store
    else:
        store = dist.TCPStore(host, bound, None, True, _td(timeout), wait_for_workers=False,
                              master_listen_fd=fd)
        if secret is not None:
            greet(store, secret, job_id)
    return store


def _bounded_server() -> bool:
    """``FLEETLIKE_STORE_SERVER``: ``bounded`` (default) or ``torch``; anything else raises."""
    value = os.environ.get(STORE_SERVER_ENV, "bounded").strip().lower()
    if value not in ("torch", "bounded"):
        raise RendezvousError(f"{STORE_SERVER_ENV}={value!r} is not a store server: use 'bounded' (the "
                              "default, fleetlike's, with limits) or 'torch' (torch's own)")
    return value == "bounded"


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


def _hello(raw: dist.Store, role: Role, host: str, port: int, timeout: float, start: float,
           secret: JobSecret | None = None) -> None:
    """Wait until the store's host has greeted: the job's challenge under ``secret``'s prefix
    (what a member needs: a stranger cannot delete it without the secret's prefix), or the
    public marker (another job's store, or a rank that must still find its secret). A stranger
    deleting the marker therefore stalls nobody who holds the secret; a rank without one that
    saw the marker and then finds it gone (the host never deletes it) waits `_AFTER_DELETION`
    seconds for its secret's file, then names the deletion."""
    pause = 0.001
    seen = False
    deleted: float | None = None  # when the marker this rank saw was found gone
    while True:
        try:
            if secret is not None and challenge_of(raw, secret) is not None:
                return
            there = raw.check([JOB_KEY])
            if there and secret is not None:
                return
            if there:
                seen = True
                # one request that never waits: a get waits out the store's timeout for a
                # marker a stranger deleted after the check
                marker = read_now(raw, JOB_KEY)
                if marker is not None and marker.decode(errors="replace") == _marker(role):
                    return
                there = marker is not None
            if seen and not there and deleted is None:
                deleted = time.monotonic()
            if secret is None and _private_secret(role, raw) is not None:
                return
        except SecretError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises several types when the host is gone
            raise RendezvousError(
                f"rank {role.rank}: the store at {host}:{port} stopped answering while this rank "
                f"waited for its greeting ({type(exc).__name__}); has rank 0 died?") from None
        if deleted is not None and time.monotonic() - deleted > _AFTER_DELETION:
            raise RendezvousError(
                f"rank {role.rank}: the store's public marker {JOB_KEY!r} at {host}:{port} was deleted "
                "while this rank waited for its greeting: the job's host never deletes it, so a "
                "process that is not one of the job's is writing to the store, and a rank given no "
                f"{SECRET_ENV} cannot tell its job is there without it. Set {SECRET_ENV} to the same "
                "random value in every rank's environment (python -c 'import secrets; "
                "print(secrets.token_hex(32))'): a rank that holds it is stalled by no deletion")
        if time.monotonic() - start > timeout:
            raise RendezvousError(
                f"rank {role.rank}: the store at {host}:{port} never greeted this rank within "
                f"{time.monotonic() - start:.1f}s: no fleetlike job is hosted there (something else "
                "may be listening), or its host has not started")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _meeting_name(role: Role) -> str:
    """The job id, and the start of its workers after the first: a launcher's store outlives a
    restart of the workers (torchrun's agent keeps one), so each generation meets, proves and
    leaves its private secret under its own name, never among a dead generation's keys."""
    return f"{role.job_id}.restart{role.generation}" if role.generation else role.job_id


def _marker(role: Role) -> str:
    """`JOB_KEY`'s value once this generation's rank 0 greeted (a rank that must still find its
    secret waits for this one, not a dead generation's)."""
    return "fleetlike" if not role.generation else f"fleetlike restart {role.generation}"


def _private_secret(role: Role, raw: dist.Store) -> JobSecret | None:
    """The secret rank 0 left in this user's private directory, once the store greets with it."""
    try:
        found = read_private(secret_file(_meeting_name(role), role.master_endpoint))
    except (OSError, SecretError):
        return None
    return found if found is not None and challenge_of(raw, found) is not None else None


def knock(raw: dist.Store, endpoint: str, host: str = "") -> None:
    """Leave this process's address where the store's job reports the processes it refused."""
    try:
        n = raw.add(KNOCK_KEY, 1)
        raw.set(f"{KNOCK_KEY}/{n}", json.dumps({"endpoint": endpoint, "pid": os.getpid(),
                                                "host": host or socket.gethostname()}))
    except Exception:  # noqa: BLE001 - the refusal that follows is what matters
        pass


def _printable(value: object, limit: int) -> str:
    """``value`` as one line of printable ASCII (a stranger wrote it: no newline, no terminal
    escape, no forged log line), at most ``limit`` characters before escaping."""
    return str(value)[:limit].encode("unicode_escape").decode("ascii")


def _check_job(raw: dist.Store, secret: JobSecret, role: Role, host: str, port: int) -> str:
    challenge = challenge_of(raw, secret)
    if challenge is None:
        knock(raw, role.current_endpoint)
        raise SecretMismatchError(
            f"rank {role.rank} (job {role.job_id!r}) reached the rendezvous store at {host}:{port}, "
            "but it does not hold this job's secret: it belongs to another job, or this process "
            f"was given another {SECRET_ENV}; refusing to join. Give each job its own "
            "--started_port, and every process of one job the secret its launcher made."
        )
    theirs = read_job_id(raw, secret)
    if theirs != role.job_id:
        raise JobMismatchError(
            f"rank {role.rank} (job {role.job_id!r}) reached the rendezvous store at {host}:{port}, "
            f"but it belongs to job {theirs!r}; refusing to join another job. Give each job its "
            "own --started_port, or the same --job_id to every launcher of one job."
        )
    return challenge


def _make_private_secret(role: Role) -> JobSecret:
    """Rank 0 of a job started without `SECRET_ENV`: a fresh secret in a file of this user's."""
    secret = JobSecret(new_secret())
    try:
        write_private(secret_file(_meeting_name(role), role.master_endpoint), secret.hex)
    except (OSError, SecretError) as exc:
        raise RendezvousError(
            f"rank 0: no {SECRET_ENV} was given and the secret cannot be left for the other ranks "
            f"({exc}); set {SECRET_ENV} to the same random value in every rank's environment"
        ) from None
    return secret


def _forget_private_secret(role: Role) -> None:
    with contextlib.suppress(OSError, SecretError):
        os.unlink(secret_file(_meeting_name(role), role.master_endpoint))


def _find_private_secret(role: Role, raw: dist.Store, host: str, port: int) -> JobSecret:
    """The secret rank 0 left in this user's private directory. Rank 0 writes that file before
    the store's marker, so once the marker is seen the file is there, or never will be."""
    try:
        path = secret_file(_meeting_name(role), role.master_endpoint)
        found = read_private(path)
    except (OSError, SecretError) as exc:
        raise RendezvousError(f"rank {role.rank}: {exc}") from None
    if found is not None and challenge_of(raw, found) is not None:
        return found
    knock(raw, role.current_endpoint)
    problem = "no such file" if found is None else "it holds another job's secret"
    raise SecretMismatchError(
        f"rank {role.rank}: no {SECRET_ENV} was given, and the secret of the job at the store "
        f"{host}:{port} is not in {path} ({problem}): this process is not one of the job's, or "
        f"the job's nodes share no such directory. Set {SECRET_ENV} to the same random value in "
        "every rank's environment (python -c 'import secrets; print(secrets.token_hex(32))')"
    )


def _admit(store: dist.Store, raw: dist.Store, secret: JobSecret, seal: tuple[str, str, int],
           role: Role, host: str, port: int, timeout: float, start: float) -> None:
    """Rank 0: check each joiner's proof and give it its seat; log the processes refused.

    A holder of the key prefix (it crosses the wire in clear) may move the proofs' counter or
    write where a proof should be; neither stops the job: a slot counted but never written is
    not waited for (rank 0 only looks at slots whose proof is there), a value that is not a
    signed proof is logged and dropped, and only the latest `_PROOF_WINDOW` slots are watched,
    so a counter moved by millions costs nothing."""
    waiting = set(range(1, role.world_size))
    window = _PROOF_WINDOW + 4 * role.world_size
    pending: set[int] = set()  # slots counted whose proof has not been read yet
    proofs = knocks = 0
    logged = 0
    pause = 0.001
    while waiting:
        moved = False
        count = _count(store, "proofs", role, host, port)
        if count > proofs:
            pending.update(range(max(proofs + 1, count - window + 1), count + 1))
            if len(pending) > window:  # keep the latest: joiners count after any stranger
                pending = set(sorted(pending)[-window:])
            proofs, moved = count, True
        for n in sorted(pending):
            if not store.check([f"proof/{n}"]):
                continue
            pending.discard(n)
            moved = True
            try:
                proof = json.loads(store.get(f"proof/{n}").decode())
                rank, endpoint = int(proof["rank"]), str(proof["endpoint"])
                tag, fresh = str(proof["tag"]), str(proof["fresh"])
            except (StoreTampered, ValueError, KeyError, TypeError, AttributeError) as exc:
                print(f"fleetlike.rendezvous: rank 0 dropped proof {n}: it is not a proof signed with "
                      f"this job's secret for this run ({type(exc).__name__}); the job goes on",
                      file=sys.stderr, flush=True)
                continue
            if rank in waiting and secret.verify(tag, "join", *seal, rank, endpoint, fresh):
                store.set(f"seat/{rank}", secret.mac("seat", *seal, rank, endpoint, fresh))
                waiting.discard(rank)
            else:
                print(f"fleetlike.rendezvous: rank 0 refused a claim to rank {_printable(rank, 12)} from "
                      f"{_printable(endpoint, 80)}: that rank is seated already, or its proof does not "
                      "verify", file=sys.stderr, flush=True)
        # never ``add`` on a public key: a stranger may have made it a non-number, and the
        # store's server drops the connection of a client that adds to one
        count = knocks
        while logged + count - knocks < _MAX_KNOCKS_LOGGED and raw.check([f"{KNOCK_KEY}/{count + 1}"]):
            count += 1
        for n in range(knocks + 1, count + 1):
            if logged < _MAX_KNOCKS_LOGGED:
                logged += 1
                try:
                    who = json.loads(raw.get(f"{KNOCK_KEY}/{n}").decode()[:512])
                    said = (f"{_printable(who.get('endpoint'), 80)} (host {_printable(who.get('host'), 64)}, "
                            f"pid {_printable(who.get('pid'), 12)})")
                except Exception:  # noqa: BLE001 - whatever a stranger wrote
                    said = "an unreadable address"
                print(f"fleetlike.rendezvous: refused a process without this job's secret at "
                      f"{host}:{port}: it says it is {said}; the job goes on",
                      file=sys.stderr, flush=True)
        knocks, moved = count, count > knocks or moved
        if not waiting:
            break
        if time.monotonic() - start > timeout:
            raise RendezvousError(
                f"rank 0: waited {time.monotonic() - start:.1f}s at the rendezvous store "
                f"{host}:{port} (job {role.job_id!r}); ranks {sorted(waiting)} of {role.world_size} "
                "did not arrive. Are all workers started, with the same endpoints and job id?"
            )
        pause = 0.001 if moved else min(pause * 2, 0.05)
        time.sleep(pause)


def _count(store: dist.Store, key: str, role: Role, host: str, port: int, amount: int = 0) -> int:
    """``store.add(key, amount)``, or a clear error when a stranger made the counter a
    non-number (the store's server then drops this process's connection: nothing more can be
    read from it)."""
    try:
        return int(store.add(key, amount))
    except Exception as exc:  # noqa: BLE001 - torch raises DistNetworkError / DistStoreError
        raise RendezvousError(
            f"rank {role.rank}: the job's counter {key!r} at the rendezvous store {host}:{port} "
            f"cannot be read ({type(exc).__name__}): a process without the secret overwrote it with "
            "something that is not a number (interference: someone who saw the job's store "
            "traffic), and the store dropped this connection; run the job on a network that only "
            "its nodes reach"
        ) from None


def _prove(store: dist.Store, secret: JobSecret, seal: tuple[str, str, int], role: Role, host: str,
           port: int, timeout: float, start: float) -> None:
    """A joining rank: prove the secret, wait for rank 0's signed seat."""
    endpoint = role.current_endpoint
    # this rank's own random value, bound into its proof and into the seat rank 0 signs back:
    # a seat captured in an earlier run (same secret, same keys) never verifies here
    fresh = _random.token_hex(16)
    n = _count(store, "proofs", role, host, port, 1)
    store.set(f"proof/{n}", json.dumps({"rank": role.rank, "endpoint": endpoint, "fresh": fresh,
                                        "tag": secret.mac("join", *seal, role.rank, endpoint, fresh)}))
    try:
        store.wait([f"seat/{role.rank}"], _td(max(timeout - (time.monotonic() - start), 1.0)))
    except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
        raise RendezvousError(
            f"rank {role.rank}: rank 0 gave this process no seat at the rendezvous store "
            f"{host}:{port} (job {role.job_id!r}) within {time.monotonic() - start:.1f}s: is rank 0 "
            "running, and is another process already rank "
            f"{role.rank}?"
        ) from exc
    if not secret.verify(store.get(f"seat/{role.rank}"), "seat", *seal, role.rank, endpoint, fresh):
        raise SecretMismatchError(
            f"rank {role.rank}: the seat given at {host}:{port} is not signed with this job's "
            "secret (another process claimed this rank); refusing to join"
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

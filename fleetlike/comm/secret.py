"""The job secret: what makes a process a member of a job, and how members recognise each other.

Every job has a random secret (256 bits, hex). The launcher (``python -m fleetlike.launch``, in
all its forms) makes it and hands it to its workers in `SECRET_ENV`; several nodes' launchers
share it through the ``--rendezvous_file`` (readable by its owner only) or, where nothing is
shared, through `SECRET_ENV` given to every launcher (the ``-np/-H`` form sends it to its node
agents over the remote shell's standard input, never on a command line). A job started by
another launcher (torchrun, mpiexec, Slurm) reads `SECRET_ENV` when the user set it; otherwise
rank 0 makes one and hands it over through a file only this user can read (`SECRET_DIR_ENV`,
default ``~/.fleetlike/jobs``: one node, or a home directory the nodes share).

What it protects (`fleetlike.comm.rendezvous`): every key of the job lives under a prefix derived
from it, and every value under it is signed (the key names are no secret: TCPStore lists them
to any client and sends them in clear), the store's
host proves it holds the secret in a signed greeting, and each joining rank proves it with an
HMAC of the greeting's challenge before rank 0 gives it its seat. Payloads that peers unpickle
(the object collectives, the elastic state sync) carry an HMAC too, checked before unpickling.

Example:
    >>> secret = JobSecret(new_secret())
    >>> tag = secret.mac("join", "rank", 1)
    >>> secret.verify(tag, "join", "rank", 1)
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import secrets
import stat
import tempfile
import threading

from fleetlike.config import envvars

__all__ = [
    "SECRET_DIR_ENV", "SECRET_ENV", "JobSecret", "PayloadRefused", "SecretError", "current",
    "current_or_none", "dumps_signed", "loads_signed", "new_secret", "seal", "secret_from_env", "set_current",
    "unseal",
]

#: The variable that carries a job's secret to its processes (hex, at least 32 digits).
SECRET_ENV = envvars.JOB_SECRET
#: Where rank 0 of a job started without the secret leaves it for the other ranks (mode 0700).
SECRET_DIR_ENV = envvars.SECRET_DIR
_MIN_HEX = 32
_MAC_HEX = 64


class SecretError(RuntimeError):
    """A job secret is malformed, missing, or a place that would hold it is unsafe."""


class PayloadRefused(RuntimeError):
    """A peer's payload did not carry this job's signature: it is dropped, never unpickled."""


def new_secret() -> str:
    """A fresh random secret (64 hex digits)."""
    return secrets.token_hex(32)


class JobSecret:
    """One job's secret; `mac` / `verify` sign and check, `prefix` names the job's key space."""

    __slots__ = ("_key",)

    def __init__(self, text: str, *, source: str = SECRET_ENV) -> None:
        text = text.strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(text) < _MIN_HEX or not key:
            raise SecretError(
                f"{source}: the job secret must be at least {_MIN_HEX} hexadecimal digits (got "
                f"{len(text)} characters{'' if key or not text else ', not hex'}); make one with "
                "python -c 'import secrets; print(secrets.token_hex(32))'"
            )
        if key and not any(key):
            raise SecretError(
                f"{source}: the job secret is all zeros ({len(text)} hex digits): not a random value "
                "(an unset placeholder?); make one with python -c 'import secrets; "
                "print(secrets.token_hex(32))'"
            )
        self._key = key

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    @property
    def hex(self) -> str:
        return self._key.hex()

    def mac(self, *parts: object) -> str:
        """HMAC-SHA256 of ``parts`` (joined unambiguously), hex."""
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode()
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)
        return h.hexdigest()

    def verify(self, tag: str | bytes, *parts: object) -> bool:
        """Whether ``tag`` is `mac` of ``parts`` (constant-time comparison)."""
        if isinstance(tag, bytes):
            try:
                tag = tag.decode("ascii")
            except UnicodeDecodeError:
                return False
        return hmac.compare_digest(tag.encode(), self.mac(*parts).encode())

    @property
    def prefix(self) -> str:
        """The store prefix of the job's keys: unguessable without the secret."""
        return f"fleetlike/{self.mac('key prefix')[:32]}/"

    def job_id(self) -> str:
        """A job id every holder of the secret derives alike (launchers on several nodes)."""
        return self.mac("job id")[:12]


_LOCK = threading.Lock()
_CURRENT: JobSecret | None = None


def set_current(secret: JobSecret) -> None:
    """Record the secret of the job this process has joined (the payload checks use it)."""
    global _CURRENT
    with _LOCK:
        _CURRENT = secret


def current_or_none() -> JobSecret | None:
    """The secret of the job this process joined through the rendezvous; None when it joined
    none (one process, or an MPI world: MPI's launcher admits its ranks)."""
    with _LOCK:
        return _CURRENT


def current(what: str) -> JobSecret:
    """The secret of the job this process joined; SecretError naming ``what`` before any."""
    with _LOCK:
        found = _CURRENT
    if found is None:
        raise SecretError(f"{what}: this process has not joined a job yet (fleet.init / hvd.init)")
    return found


def secret_from_env(environ: dict[str, str] | None = None) -> JobSecret | None:
    """The secret in `SECRET_ENV`, or None when it is not set."""
    text = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    return JobSecret(text) if text.strip() else None


def seal(data: bytes, context: str, sender: int, secret: JobSecret | None = None) -> bytes:
    """``data`` with its HMAC in front (by ``sender``, for ``context``), for a peer to `unseal`."""
    key = secret or current(context)
    return key.mac("payload", context, sender, data).encode() + data


def unseal(blob: bytes, context: str, sender: int, secret: JobSecret | None = None) -> bytes:
    """The data of a `seal`-ed ``blob``; `PayloadRefused` when its HMAC is not the job's."""
    key = secret or current(context)
    tag, data = blob[:_MAC_HEX], blob[_MAC_HEX:]
    if len(blob) < _MAC_HEX or not key.verify(tag, "payload", context, sender, data):
        raise PayloadRefused(
            f"{context}: the payload from rank {sender} does not carry this job's signature "
            f"({len(blob)} bytes); it was dropped without unpickling. Only processes holding the "
            f"job's secret ({SECRET_ENV}) may send data to its members"
        )
    return data


def dumps_signed(obj: object, context: str, sender: int) -> bytes:
    """``obj`` pickled and `seal`-ed with the joined job's secret (only pickled when the world
    was not formed through the rendezvous: see `current_or_none`)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    key = current_or_none()
    return data if key is None else seal(data, context, sender, key)


def loads_signed(blob: bytes, context: str, sender: int) -> object:
    """The object `dumps_signed` made at ``sender``; `PayloadRefused` before unpickling anything
    whose HMAC is not the job's."""
    key = current_or_none()
    return pickle.loads(blob if key is None else unseal(blob, context, sender, key))


def private_dir(environ: dict[str, str] | None = None) -> str:
    """`SECRET_DIR_ENV`, or ``~/.fleetlike/jobs``: created 0700; SecretError when another user
    owns it or others may enter it."""
    env = os.environ if environ is None else environ
    path = env.get(SECRET_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".fleetlike", "jobs")
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SecretError(
            f"{SECRET_DIR_ENV}={path} is owned by uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}; the job secret is kept only in a directory of your "
            f"own that nobody else may open (chmod 700 it, or point {SECRET_DIR_ENV} elsewhere)"
        )
    return path


def secret_file(job_id: str, master_endpoint: str, environ: dict[str, str] | None = None) -> str:
    """Where rank 0 leaves the secret of job ``job_id`` meeting at ``master_endpoint``."""
    name = hashlib.sha256(f"{job_id}|{master_endpoint}".encode()).hexdigest()[:24]
    return os.path.join(private_dir(environ), f"{name}.secret")


def write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0600) atomically."""
    fd, temp = tempfile.mkstemp(prefix=".secret.", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as fh:  # mkstemp creates it 0600
            fh.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def read_private(path: str) -> JobSecret | None:
    """The secret in ``path`` (None while it does not exist); SecretError for a file another
    user owns or others may read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as fh:
        info = os.fstat(fh.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise SecretError(
                f"{path}: owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}; a "
                "job secret is read only from a file of your own that nobody else may read"
            )
        return JobSecret(fh.read(), source=path)

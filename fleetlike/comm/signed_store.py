"""A job's key space whose every value carries an HMAC with the job's secret.

The job's keys live under a prefix derived from the secret, but the prefix is no password: it
crosses the network in clear with every store request, so whoever watches the wire learns it.
So every value a member (or torch: gloo's connection details, the elastic rendezvous state,
which torch unpickles) reads back is signed: `SignedStore.set` writes ``HMAC(run nonce, key, value) +
value``, `SignedStore.get` checks it and refuses a value a stranger wrote (`StoreTampered`,
naming the key relative to the prefix) before anyone uses it. The HMAC binds the key, so a
signed value cannot be moved to another key, and the run: the nonce is the random challenge
the store's host writes when it creates the store (`NONCE_KEY`, the one value signed without
it), which every member reads once, before its first signed value. A job that exports the same
secret for every run uses the same key names every run, so without the nonce a value captured
off the wire in one run would verify when written back at its key in the next. Counters (``add``) are plain numbers, as TCPStore
keeps them; what a member derives from one (the proof it reads next, the record it prints) is
signed or escaped itself; a holder of the prefix can still move a counter, and a member that
then reads a record the count promises waits for it until the store's timeout. Errors (a wait,
a read that timed out) quote keys without the secret-derived prefix.

Example:
    >>> store = SignedStore(dist.PrefixStore(secret.prefix, raw), secret)
    >>> store.set("hello", "world"); store.get("hello")
    b'world'
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from fleetlike.comm.secret import JobSecret

__all__ = ["NONCE_KEY", "SignedStore", "StoreTampered", "read_now"]

_TAG = 64  # hex digits of an HMAC-SHA256
#: what `read_now` expects: never a value of the store's, so a compare-and-set with it only reads
_ABSENT = b"\x00fleetlike: no value"
#: The run's nonce: the challenge the store's host writes once, when it creates the store.
NONCE_KEY = "challenge"


def read_now(store: dist.Store, key: str) -> bytes | None:
    """``key``'s value, or None when it has none, in one request that never waits: a check and
    then a get are two, and the get waits up to the store's timeout for a key a stranger deleted
    between them. A compare-and-set that expects `_ABSENT` (a value nobody writes) changes
    nothing and answers the stored value, or `_ABSENT` for a key that is not there.

    Example:
        >>> read_now(raw, "fleetlike/job")
        b'fleetlike'
    """
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT else value


class StoreTampered(RuntimeError):
    """A value in the job's key space was not written by a holder of the job's secret."""


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SignedStore(dist.Store):
    """``inner`` (the job's prefixed key space) with every value signed and checked."""

    def __init__(self, inner: dist.Store, secret: JobSecret, *, where: str = "") -> None:
        super().__init__()
        self._inner = inner
        self._secret = secret
        self._where = where
        self._nonce: bytes | None = None

    def _parts(self, key: str, value: bytes) -> tuple[Any, ...]:
        if key == NONCE_KEY:
            return ("store", key, value)
        return ("store", self._run_nonce(), key, value)

    def _run_nonce(self) -> bytes:
        """The run's nonce (read once, then kept: no cost per value after the first)."""
        nonce = self._nonce
        if nonce is None:
            blob = read_now(self._inner, NONCE_KEY)
            if blob is None:
                raise StoreTampered(
                    f"the job's store{self._at()}: it holds no greeting ({NONCE_KEY!r}), which its host "
                    "writes when it creates the store: the host has not greeted yet, or a process "
                    "without the secret deleted it; no value can be signed or checked for this run")
            nonce = self._nonce = self._open(NONCE_KEY, blob)
        return nonce

    def _at(self) -> str:
        return f" at {self._where}" if self._where else ""

    def _sign(self, key: str, value: bytes) -> bytes:
        signed = self._secret.mac(*self._parts(key, value)).encode() + value
        if key == NONCE_KEY:
            self._nonce = value  # the host writes it: its own values carry it from here on
        return signed

    def _open(self, key: str, blob: bytes) -> bytes:
        tag, value = blob[:_TAG], blob[_TAG:]
        if len(blob) < _TAG or not self._secret.verify(tag, *self._parts(key, value)):
            raise StoreTampered(
                f"the job's store{self._at()}: the value of {key!r} ({len(blob)} bytes) is not signed "
                "with this job's secret for this run: a process without the secret wrote it, or it "
                "was captured in an earlier run of the job and written back (interference: someone "
                "who saw the job's store traffic); it was refused unread")
        return value

    def _scrubbed(self, exc: Exception) -> Exception:
        """``exc`` without the secret-derived prefix: torch's store errors quote the full key
        names (``wait timeout after 1000ms, keys: /fleetlike/<prefix>/...``), and they reach
        logs and summaries."""
        prefix = self._secret.prefix
        text = str(exc)
        if prefix not in text:
            return exc
        text = text.replace("/" + prefix, "").replace(prefix, "")
        try:
            clean = type(exc)(text)
        except Exception:  # noqa: BLE001 - a type that takes other arguments
            clean = dist.DistStoreError(text)
        return clean

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, self._sign(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        try:
            blob = self._inner.get(key)
        except Exception as exc:  # noqa: BLE001 - re-raised without the prefix
            raise self._scrubbed(exc) from None
        return self._open(key, blob)

    def get_now(self, key: str) -> bytes | None:
        """``key``'s checked value, or None at once when it has none (`read_now`): never a wait
        for a key a stranger deleted."""
        blob = read_now(self._inner, key)
        return None if blob is None else self._open(key, blob)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        want = _bytes(expected)
        raw = self._inner.compare_set(key, self._sign(key, want) if want else b"",
                                      self._sign(key, _bytes(desired)))
        if key == NONCE_KEY:
            self._nonce = None  # another host's greeting may stand: the value read back decides
        value = self._open(key, raw)
        if key == NONCE_KEY:
            self._nonce = value
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        try:
            blobs = self._inner.multi_get(keys)
        except Exception as exc:  # noqa: BLE001 - re-raised without the prefix
            raise self._scrubbed(exc) from None
        return [self._open(k, v) for k, v in zip(keys, blobs)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._inner.multi_set(keys, [self._sign(k, _bytes(v)) for k, v in zip(keys, values)])

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        try:
            if timeout is None:
                self._inner.wait(keys)
            else:
                self._inner.wait(keys, timeout)
        except Exception as exc:  # noqa: BLE001 - torch's text lists the prefixed key names
            missing = ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else "")
            raise dist.DistStoreError(
                f"timed out waiting for the job's store keys [{missing}] ({type(exc).__name__})") from None

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

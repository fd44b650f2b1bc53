"""A stranger deletes the store's public marker while a rank without the secret reads it.

A rank given no ``FLEETLIKE_JOB_SECRET`` learns that its job's host has greeted from the public
marker (`JOB_KEY`). A check that finds it and a get that then reads it are two requests, and a
get waits up to the store's whole timeout for a key deleted between them. The rank reads the
marker in one request that never waits instead, and a marker it saw that is gone (the host
never deletes it) ends its wait within seconds, naming the deletion, unless its secret's file
is there (then it goes on). The deletion is made in that window deterministically: a stranger's
client deletes the marker right after the member's check finds it. The signed greeting and the
job id (a stranger learns their key names from the store) are read the same way: there is no
window, and a deleted one is missed at once.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fleetlike.comm import JOB_KEY, JobSecret, RendezvousError, SecretMismatchError, challenge_of, job_store
from fleetlike.comm import read_job_id, rendezvous
from fleetlike.comm.rendezvous import greet
from fleetlike.comm.signed_store import StoreTampered
from fleetlike.comm.secret import SECRET_DIR_ENV, SECRET_ENV, new_secret, secret_file, write_private
from fleetlike.roles.role import Role

pytestmark = pytest.mark.timeout(60)

#: the store's timeout: what a get of the deleted marker would wait (the test allows far less)
_STORE_TIMEOUT = 30.0


class _DeletedAfterCheck(dist.Store):
    """A member's client of the store; a stranger's client deletes ``key`` (the marker unless
    told) right after this one's first check finds it."""

    def __init__(self, inner: dist.Store, stranger: dist.Store, key: str = JOB_KEY) -> None:
        super().__init__()
        self.inner, self.stranger, self.key, self.deleted = inner, stranger, key, False

    def check(self, keys: list[str]) -> bool:
        found = self.inner.check(keys)
        if found and keys == [self.key] and not self.deleted:
            self.deleted = self.stranger.delete_key(self.key)
        return found

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)


def _role(rank: int, port: int) -> Role:
    return Role(rank=rank, world_size=2, endpoints=("127.0.0.1:1", "127.0.0.1:2"), local_rank=rank,
                local_size=2, node_index=0, node_num=1, job_id="job", master_endpoint=f"127.0.0.1:{port}")


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Rank 0's store, greeted under a secret of its own (no secret exported anywhere)."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_DIR_ENV, str(tmp_path / "secrets"))
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=_STORE_TIMEOUT),
                           wait_for_workers=False)
    secret = JobSecret(new_secret())
    greet(server, secret, "job")
    return server, secret


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=_STORE_TIMEOUT))


def test_a_marker_deleted_between_check_and_read_ends_the_wait_within_seconds_naming_it(
        host, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 (no secret, no secret's file: another node) joins through `connect`; the marker
    goes between its check and its read. It fails within `_AFTER_DELETION` and a little, naming
    the deleted marker, the store and the fix, not after the store's 30 s timeout."""
    server, _ = host
    real = dist.TCPStore
    member = _DeletedAfterCheck(_client(server), _client(server))
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: member)
    started = time.monotonic()
    with pytest.raises(RendezvousError) as raised:
        rendezvous.connect(_role(1, server.port), timeout=_STORE_TIMEOUT)
    took = time.monotonic() - started
    monkeypatch.setattr(dist, "TCPStore", real)
    assert member.deleted and not server.check([JOB_KEY])
    assert took < rendezvous._AFTER_DELETION + 3, took
    text = str(raised.value)
    assert f"rank 1: the store's public marker 'fleetlike/job' at 127.0.0.1:{server.port} was deleted" in text
    assert "a process that is not one of the job's is writing to the store" in text
    assert f"Set {SECRET_ENV} to the same random value in every rank's environment" in text

    # the same rank with the marker left alone: told at once that it lacks the job's secret
    server.set(JOB_KEY, "fleetlike")
    started = time.monotonic()
    with pytest.raises(SecretMismatchError, match=f"no {SECRET_ENV} was given"):
        rendezvous.connect(_role(1, server.port), timeout=_STORE_TIMEOUT)
    assert time.monotonic() - started < 3


def test_a_rank_that_finds_its_secrets_file_goes_on_when_the_marker_is_deleted(host) -> None:
    """Rank 0 left its secret's file (one node): the marker deleted in the same window stalls
    nobody, the rank's wait ends at once and it finds the secret."""
    server, secret = host
    role = _role(1, server.port)
    write_private(secret_file("job", role.master_endpoint), secret.hex)
    member = _DeletedAfterCheck(_client(server), _client(server))
    started = time.monotonic()
    rendezvous._hello(member, role, "127.0.0.1", server.port, _STORE_TIMEOUT, started)
    assert time.monotonic() - started < 2
    assert member.deleted and not server.check([JOB_KEY])
    assert rendezvous._find_private_secret(role, member, "127.0.0.1", server.port).hex == secret.hex


def test_the_greeting_and_the_job_id_are_read_in_one_request_and_missed_at_once(host) -> None:
    """A stranger set to delete the greeting or the job id right after a member's check finds it
    never gets the chance (the member reads each in one request that never waits), and once
    they are deleted a member is told at once, not after the store's 30 s timeout."""
    server, secret = host
    for key, expected in (("challenge", challenge_of(_client(server), secret)), ("job_id", "job")):
        member = _DeletedAfterCheck(_client(server), _client(server), f"{secret.prefix}/{key}")
        started = time.monotonic()
        found = challenge_of(member, secret) if key == "challenge" else read_job_id(member, secret)
        assert (found, member.deleted) == (expected, False) and expected
        assert time.monotonic() - started < 2

    stranger = _client(server)
    assert stranger.delete_key(f"{secret.prefix}/challenge") and stranger.delete_key(f"{secret.prefix}/job_id")
    member = _client(server)
    started = time.monotonic()
    assert challenge_of(member, secret) is None and read_job_id(member, secret) is None
    stranger.set(f"{secret.prefix}/seat", b"0" * 80)  # a value a new member would check
    with pytest.raises(StoreTampered, match="it holds no greeting \\('challenge'\\), which its host writes"):
        job_store(_client(server), secret).get("seat")
    assert time.monotonic() - started < 2

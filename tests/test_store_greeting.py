"""A store's greeting is there for whoever reaches the store first, and a launcher's watch that
comes before it waits for it.

The port of a store fleetlike hosts takes connections from the moment it is bound, and the
launchers of an elastic job start together: another launcher's watch, or a member, may send its
first request before the host has greeted. The bounded server holds the greeting before it
answers anyone, so such a request finds it; a launcher's watch that reaches a store still
without one (torch's own server, greeted a moment after it starts) waits for it instead of
taking the empty store for a lost one and never beating (the other launchers then summarised
its node, lost to SIGSTOP, as "still answers").
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time

import pytest
import torch.distributed as dist

from fleetlike.comm import JobSecret, challenge_of, host_store, job_store
from fleetlike.comm import rendezvous
from fleetlike.comm.rendezvous import greet
from fleetlike.launch.nodewatch import BEAT_PREFIX, NodeWatch

pytestmark = pytest.mark.timeout(60)

_T = datetime.timedelta


def _until(what: str, check, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.02)


def test_a_request_waiting_at_the_port_as_the_bounded_server_starts_finds_the_greeting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A member connects and asks for the greeting as soon as the port is bound, before the
    server's process runs; the host greets late (a busy machine). Its answer is the greeting."""
    monkeypatch.setenv(rendezvous.STORE_SERVER_ENV, "bounded")
    secret = JobSecret(secrets.token_hex(32))
    seen: list[str | None] = []
    listen, late = rendezvous._listen, rendezvous.greet

    def listen_and_knock(host: str, port: int) -> tuple[int, int]:
        fd, bound = listen(host, port)

        def member() -> None:
            raw = dist.TCPStore(host, bound, None, False, _T(seconds=20))  # its answer waits for a server
            seen.append(challenge_of(raw, secret))

        threading.Thread(target=member, daemon=True).start()
        time.sleep(0.3)  # the member's connection and its first request wait at the port
        return fd, bound

    def greet_late(*args, **kwargs) -> bool:
        time.sleep(0.5)
        return late(*args, **kwargs)

    monkeypatch.setattr(rendezvous, "_listen", listen_and_knock)
    monkeypatch.setattr(rendezvous, "greet", greet_late)
    store = host_store("127.0.0.1", "early", 30.0, secret=secret)
    _until("the member's answer", lambda: seen)
    assert seen[0] is not None and seen == [challenge_of(store, secret)]
    assert rendezvous.read_job_id(store, secret) == "early"
    assert store.get(rendezvous.JOB_KEY) == b"fleetlike"


def test_the_greeting_the_bounded_server_starts_with_signs_like_a_written_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's own signed key space works on the greeting the server started with: values it
    writes are read back by another member, and a value signed for another run is refused."""
    monkeypatch.setenv(rendezvous.STORE_SERVER_ENV, "bounded")
    secret = JobSecret(secrets.token_hex(32))
    store = host_store("127.0.0.1", "signed", 30.0, secret=secret)
    job_store(store, secret).set("k", "v")
    other = dist.TCPStore("127.0.0.1", store.port, None, False, _T(seconds=10))
    assert job_store(other, secret).get("k") == b"v"
    earlier = host_store("127.0.0.1", "signed", 30.0, secret=secret)  # another run, same secret
    job_store(earlier, secret).set("k", "w")
    other.set(f"{secret.prefix}/k", earlier.get(f"{secret.prefix}/k"))  # replayed at the same key
    with pytest.raises(Exception, match="is not signed with this job's secret for this run"):
        job_store(other, secret).get("k")


def test_a_launchers_watch_that_reaches_the_store_before_its_greeting_waits_and_beats() -> None:
    """torch's own server, greeted 0.5 s after another launcher's watch connected: the watch
    beats once the greeting is there, and its summary knows the store."""
    secret = JobSecret(secrets.token_hex(32))
    host = dist.TCPStore("127.0.0.1", 0, None, True, _T(seconds=10), wait_for_workers=False)
    watch = NodeWatch(f"127.0.0.1:{host.port}", "127.0.0.2", secret=secret)
    watch.start()
    time.sleep(0.5)
    greet(host, secret, "watched")
    mine = job_store(host, secret)
    _until("the watch's beat", lambda: mine.check([BEAT_PREFIX + "127.0.0.2"]))
    watch.finish(0)
    assert watch.summary() == "nodes lost: -; nodes joined: -"
    assert mine.get(BEAT_PREFIX + "127.0.0.2").decode().split()[1:] == ["done", "0"]


def test_a_launchers_watch_on_a_store_that_never_greets_says_so() -> None:
    secret = JobSecret(secrets.token_hex(32))
    host = dist.TCPStore("127.0.0.1", 0, None, True, _T(seconds=10), wait_for_workers=False)
    endpoint = f"127.0.0.1:{host.port}"
    watch = NodeWatch(endpoint, "127.0.0.2", secret=secret, timeout=1.0)
    watch.start()
    _until("the watch's end", lambda: not watch.is_alive())
    watch.finish(0)
    assert watch.summary() == (f"nodes: unknown (the rendezvous store at {endpoint} was lost: TimeoutError: "
                               f"the store at {endpoint} did not greet with this job's secret within 1 s)")


def test_the_greeting_of_a_store_fleetlike_hosts_cannot_be_replaced_or_deleted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of one job with the same secret (same key names). A stranger who read the first
    run's greeting and a signed value off the wire writes them back in the second run's store
    at their keys, then tries to delete the greeting: each request that touches the greeting is
    refused (its connection closed), so a member that joins late reads the second run's greeting
    and refuses the replayed value. The job's own keys beside it (the job id) still change."""
    monkeypatch.setenv(rendezvous.STORE_SERVER_ENV, "bounded")
    secret = JobSecret(secrets.token_hex(32))
    challenge_key, value_key = f"{secret.prefix}/challenge", f"{secret.prefix}/torch.rendezvous.demo"
    first = host_store("127.0.0.1", "job", 30.0, secret=secret)
    job_store(first, secret).set("torch.rendezvous.demo", b"state of run 1")
    captured = {key: first.get(key) for key in (challenge_key, value_key)}  # what the wire shows
    second = host_store("127.0.0.1", "job", 30.0, secret=secret)
    greeting = second.get(challenge_key)
    assert greeting != captured[challenge_key]

    def stranger() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", second.port, None, False, _T(seconds=5))

    attempts = {
        "set": lambda s: (s.set(challenge_key, captured[challenge_key]), s.num_keys()),
        "compare_set": lambda s: s.compare_set(challenge_key, greeting, captured[challenge_key]),
        "delete": lambda s: s.delete_key(challenge_key),
        "multi_set": lambda s: (s.multi_set([challenge_key], [captured[challenge_key]]), s.num_keys()),
        "append": lambda s: (s.append(challenge_key, b"x"), s.num_keys()),
        "add": lambda s: s.add(challenge_key, 1),
    }
    for what, attempt in attempts.items():
        with pytest.raises(dist.DistError):
            attempt(stranger())
        assert second.get(challenge_key) == greeting, what
    unchanged = stranger()
    assert unchanged.compare_set(challenge_key, b"not it", b"other") == greeting  # a read, as read_now's
    stranger().set(value_key, captured[value_key])
    late = dist.TCPStore("127.0.0.1", second.port, None, False, _T(seconds=5))
    assert challenge_of(late, secret) == challenge_of(second, secret) != challenge_of(first, secret)
    with pytest.raises(Exception, match="is not signed with this job's secret for this run"):
        job_store(late, secret).get("torch.rendezvous.demo")
    job_store(second, secret).set("job_id", "job-g1")  # a launcher's next start rewrites it
    assert rendezvous.read_job_id(late, secret) == "job-g1"

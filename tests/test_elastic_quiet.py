"""An elastic worker's heartbeat threads end before its interpreter does.

A daemon thread still inside a TCP store call when the interpreter finalizes is ended by CPython
while it takes the GIL back, which unwinds through torch's C++ frames and aborts the process
(``terminate called without an active exception``, SIGABRT) after the script succeeded. Two
threads of an elastic worker beat on the store every second: the world's `Watch` and torch's
rendezvous keep-alive. `Membership.quiet` (run at exit by `fleetlike.elastic.init`, and by
`Membership.close`) stops both and waits for them, leaving the rendezvous open for a restarted
worker; here on two real members of one rendezvous in this process.
"""

from __future__ import annotations

import atexit
import importlib
import os
import threading

import pytest
import torch

import fleetlike.comm.secret as secret
from fleetlike.comm import JobSecret, host_store
from fleetlike import elastic
from fleetlike.elastic.membership import ENV, ElasticSettings, Membership

pytestmark = pytest.mark.timeout(60)

#: the module (the package's ``run`` is the decorator of the same name)
elastic_run = importlib.import_module("fleetlike.elastic.run")


def _beating() -> list[str]:
    """The heartbeat threads alive in this process (the watch's name and torch's timer's)."""
    return sorted(t.name for t in threading.enumerate()
                  if t.is_alive() and (t.name == "fleetlike-elastic-watch" or "KeepAlive" in t.name))


def _restored_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """What joining a rendezvous sets process-wide (the job's secret, torch's store sharing
    switch) is put back after the test."""
    monkeypatch.setattr(secret, "_CURRENT", secret.current_or_none())
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"))


def test_quiet_stops_both_heartbeats_and_keeps_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    job = secret.new_secret()
    _restored_after(monkeypatch)
    monkeypatch.setenv(secret.SECRET_ENV, job)
    store = host_store("127.0.0.1", "quiet-job", 30.0, secret=JobSecret(job))
    members = [Membership(ElasticSettings(f"127.0.0.1:{store.port}", 2, 2, 1.0, "quiet-job", "127.0.0.1",
                                          f"127.0.0.1:{41000 + i}", i), join_timeout=30.0) for i in range(2)]
    sums: dict[int, float] = {}

    def member(m: Membership) -> None:
        role, world = m.form(timeout=30.0)
        sums[role.rank] = world.all_reduce(torch.tensor([float(role.rank + 1)])).item()

    try:
        threads = [threading.Thread(target=member, args=(m,)) for m in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=40)
        assert sums == {0: 3.0, 1: 3.0}
        assert len(_beating()) == 4, _beating()  # two watches, two keep-alives
        monkeypatch.setattr(elastic_run, "_MEMBERSHIP", members[0])
        elastic_run._quiet_at_exit()  # what the exit hook runs: this process's member
        assert len(_beating()) == 2, _beating()
        members[1].quiet()
        assert _beating() == []
        assert not members[0].handler.is_closed()  # still in the rendezvous: a restart may rejoin
    finally:
        for m in members:
            m.close()
    assert _beating() == []


def test_init_registers_the_exit_hook_once(monkeypatch: pytest.MonkeyPatch) -> None:
    job = secret.new_secret()
    store = host_store("127.0.0.1", "hook-job", 30.0, secret=JobSecret(job))
    for name, value in {secret.SECRET_ENV: job, ENV["store"]: f"127.0.0.1:{store.port}", ENV["min"]: "1",
                        ENV["max"]: "1", ENV["last_call"]: "1", ENV["run_id"]: "hook-job"}.items():
        monkeypatch.setenv(name, value)
    _restored_after(monkeypatch)
    registered: list[object] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered else None)
    for _ in range(2):
        elastic.init(timeout=30.0)
        elastic.shutdown()
    assert registered == [elastic_run._quiet_at_exit]

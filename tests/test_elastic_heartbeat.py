"""``--heartbeat_timeout``: how long an elastic worker's heartbeats may stop before the others
count it as gone. The launcher checks the flag, hands it to its workers (and to the launchers
of discovered nodes), and each world's `Watch` beats a third of it apart and interrupts the
world's collectives once a seat has been silent for it: never sooner, and within a period
after."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch.distributed as dist

from fleetlike.config import envvars
from fleetlike.elastic.membership import (DEFAULT_HEARTBEAT_TIMEOUT, ENV, HEARTBEAT_ENV, HEARTBEATS_MISSED,
                                          ElasticSettings, Watch)
from fleetlike.launch import LaunchInputError, parse_config
from fleetlike.launch import config as launch_config
from fleetlike.launch import flags as launch_flags
from fleetlike.launch.discovery import node_launcher_args
from fleetlike.launch.elastic_agent import HEARTBEAT_ENV as LAUNCH_HEARTBEAT_ENV
from fleetlike.launch.elastic_agent import elastic_env

pytestmark = pytest.mark.timeout(60)

ELASTIC = ["--nnodes=1:2", "--rdzv_endpoint=127.0.0.1:29400"]


def test_the_flag_reaches_the_workers_and_discovered_nodes() -> None:
    assert LAUNCH_HEARTBEAT_ENV == HEARTBEAT_ENV == envvars.ELASTIC_HEARTBEAT_TIMEOUT
    assert launch_flags.DEFAULT_HEARTBEAT_TIMEOUT == DEFAULT_HEARTBEAT_TIMEOUT == 3.0
    default = parse_config([*ELASTIC, "t.py"])
    assert default.heartbeat_timeout == 3.0 and elastic_env(default)[HEARTBEAT_ENV] == "3"
    config = parse_config([*ELASTIC, "--heartbeat_timeout=7.5", "t.py"])
    env = elastic_env(config)
    assert env[HEARTBEAT_ENV] == "7.5"
    settings = ElasticSettings.from_env({**env, envvars.NODE_IP: "127.0.0.1"})
    assert (settings.heartbeat_timeout, settings.heartbeat_seconds) == (7.5, 7.5 / HEARTBEATS_MISSED)
    # a discovered node's launcher gets the same flag, and so its workers the same timeout
    node = parse_config(node_launcher_args(config, "127.0.0.2"), environ={"FLEETLIKE_JOB_SECRET": config.job_secret})
    assert node.heartbeat_timeout == 7.5
    assert "heartbeat timeout 7.5 s" in launch_config.format_config(config)


@pytest.mark.parametrize("flags, said", [
    (["--heartbeat_timeout=10"], "--heartbeat_timeout=10 applies to elastic jobs only"),
    ([*ELASTIC, "--heartbeat_timeout=0"], "--heartbeat_timeout=0 must be more than 0 seconds"),
    ([*ELASTIC, "--heartbeat_timeout=-1"], "must be a finite number of seconds >= 0"),
    ([*ELASTIC, "--heartbeat_timeout=soon"], "--heartbeat_timeout='soon' is not a number of seconds"),
])
def test_bad_flags_are_named(flags: list[str], said: str) -> None:
    with pytest.raises(LaunchInputError, match=re.escape(said)):
        parse_config([*flags, "t.py"])


def test_a_worker_without_the_variable_uses_the_default_and_a_bad_one_is_named() -> None:
    env = {ENV["store"]: "127.0.0.1:1", ENV["min"]: "2", ENV["max"]: "4", ENV["last_call"]: "1",
           ENV["run_id"]: "job"}
    assert ElasticSettings.from_env(env).heartbeat_timeout == DEFAULT_HEARTBEAT_TIMEOUT
    for bad in ("0", "nan", "inf", "three"):
        with pytest.raises(RuntimeError, match=re.escape(f"{HEARTBEAT_ENV}='{bad}' is not a number of seconds > 0")):
            ElasticSettings.from_env({**env, HEARTBEAT_ENV: bad})


class BeatClock:
    """The store, with the time just before each seat's latest beat: the earliest moment any
    watch can have seen that beat, so the first moment a seat may be taken for lost is that plus
    the timeout, however late a starved beat thread ran."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.before = store, {}

    def set(self, key: str, value: str) -> None:
        self.before[key] = time.monotonic()
        self.store.set(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.store.multi_get(keys)


@pytest.mark.parametrize("timeout", [0.6, 1.5])
def test_a_silent_seat_is_found_after_the_timeout_and_not_before(timeout: float) -> None:
    """Three seats beat on one store; seat 2 stops. Seat 0's watch interrupts its world once
    seat 2's last beat is ``timeout`` s old, never before, and within two periods and some
    scheduling after the stop."""
    store, period = BeatClock(dist.HashStore()), timeout / HEARTBEATS_MISSED
    interrupts = [threading.Event() for _ in range(3)]
    watches = [Watch(store, seat, 3, interrupts[seat], period=period) for seat in range(3)]  # type: ignore[arg-type]
    for w in watches:
        w.start()
    try:
        time.sleep(3 * period)  # every seat has beaten: each watch has seen each counter move
        assert not any(e.is_set() for e in interrupts)
        watches[2].stop(wait=5)
        silent = time.monotonic()
        assert interrupts[0].wait(timeout + 10 * period + 5), "the silent seat was never found"
        found = time.monotonic()
        since_beat = found - store.before["alive/2"]
        assert since_beat >= timeout, f"seat 2 taken for lost {since_beat:.2f}s after its last beat ({timeout}s timeout)"
        # a period to notice, one more to the next look, and scheduling (3 s: the old fixed beat)
        assert found - silent <= timeout + 2 * period + 1.5, f"seat 2 found only after {found - silent:.2f}s"
        assert not interrupts[2].is_set()
    finally:
        for w in watches:
            w.stop(wait=5)

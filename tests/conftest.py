"""Shared test setup: tests/ on sys.path for the rank functions, hypothesis profiles, and a known
state of the process-wide singletons (the collective watchdog, the `fleet` facade) around every
test, so the order in which pytest runs tests does not matter."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from fleetlike.comm.watchdog import WATCHDOG
from fleetlike.fleet import fleet

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(autouse=True)
def _fresh_singletons():  # type: ignore[no-untyped-def]
    """No communicator, program or watched collective of an earlier test survives into this one
    (an entry left in WATCHDOG could otherwise abort the test process much later)."""
    fleet.shutdown()
    WATCHDOG.clear()
    yield
    fleet.shutdown()
    WATCHDOG.clear()

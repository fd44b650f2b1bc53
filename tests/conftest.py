"""Shared test setup: tests/ on sys.path for the rank functions, hypothesis profiles, a known
state of the process-wide singletons (the collective watchdog, the `fleet` facade) around every
test, so the order in which pytest runs tests does not matter, and one preload server for the
workers of every launcher the tests start (`fleetlike.launch.preload`): each launcher job then
skips its workers' torch import. ``FLEETLIKE_PRELOAD=off`` in the environment runs the suite with
plain worker starts; tests that must see a plain start remove the two variables themselves. Under
pytest-xdist the server is started once, by the controlling process: its workers inherit the
socket's variable and share it."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

from fleetlike.comm.watchdog import WATCHDOG
from fleetlike.fleet import fleet
from fleetlike.launch.env import tuned_glibc_tunables
from fleetlike.launch.preload import PRELOAD_ENV, SOCKET_ENV
from fleetlike.testing import preload_server

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


_SESSION = contextlib.ExitStack()


def pytest_configure(config: pytest.Config) -> None:
    """Start the preload server while the tests are collected. Its start-up environment is the
    one the launcher gives several workers by default (OMP_NUM_THREADS=1 where unset, glibc's
    malloc cache off); a job whose workers differ starts them plainly, saying so."""
    if os.environ.get(PRELOAD_ENV, "torch") == "off" or SOCKET_ENV in os.environ:
        return
    # scikit-learn (imported by the tests that read its digits) sets these two in os.environ on
    # import; set first, the server and every later launcher see the same start-up environment
    os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")
    os.environ.setdefault("KMP_INIT_AT_FORK", "FALSE")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLIBC_TUNABLES"] = tuned_glibc_tunables(env.get("GLIBC_TUNABLES"))
    os.environ[SOCKET_ENV] = _SESSION.enter_context(preload_server(env))
    os.environ[PRELOAD_ENV] = "torch"


def pytest_unconfigure(config: pytest.Config) -> None:
    _SESSION.close()


@pytest.fixture(autouse=True)
def _fresh_singletons():  # type: ignore[no-untyped-def]
    """No communicator, program or watched collective of an earlier test survives into this one
    (an entry left in WATCHDOG could otherwise abort the test process much later)."""
    fleet.shutdown()
    WATCHDOG.clear()
    yield
    fleet.shutdown()
    WATCHDOG.clear()

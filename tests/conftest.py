"""Shared test setup: tests/ on sys.path for the rank functions, hypothesis profiles, a known
state of the process-wide singletons (the collective watchdog, the `fleet` facade) around every
test, so the order in which pytest runs tests does not matter, and one preload server for the
workers of every launcher the tests start (`fleetlike.launch.preload`): each launcher job then
skips its workers' torch import. ``FLEETLIKE_PRELOAD=off`` in the environment runs the suite with
plain worker starts; tests that must see a plain start remove the two variables themselves. Under
pytest-xdist the server is started once, by the controlling process: its workers inherit the
socket's variable and share it; a test file marked ``alone`` runs while the other worker waits
(`_MachineShare`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile

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

#: the folder of the xdist workers' machine lock (`_MachineShare`), made by the controlling
#: process (not a FLEETLIKE_ name: `fleetlike.auto` refuses names of its own it does not know)
SHARE_ENV = "TESTS_MACHINE_LOCK_DIR"


class _MachineShare:
    """Under pytest-xdist, each worker holds the machine lock for the test file it runs: shared,
    or exclusive for a file marked ``alone`` (its jobs fill both cores by themselves, and elastic
    jobs starved of CPU miss heartbeats and re-form worlds the test does not expect). A turnstile
    before the lock keeps the other worker from starting new files while an ``alone`` file
    waits. Taken around each test's whole run protocol, outside its timeout: waiting for the
    other worker's file is not the test's time."""

    def __init__(self, folder: str) -> None:
        self.gate = open(os.path.join(folder, "turnstile"), "a")  # noqa: SIM115 - held for the session
        self.lock = open(os.path.join(folder, "machine"), "a")  # noqa: SIM115
        self.held: str | None = None

    def default_port(self) -> contextlib.AbstractContextManager[None]:
        """Held while a test marked ``default_port`` runs: its job uses the launcher's and the
        roles' default port (6170), as a user's first run does, so no two such tests run at once."""
        return _flocked(os.path.join(os.path.dirname(self.lock.name), "default-port"))

    def take(self, path: str, alone: bool) -> None:
        if self.held == path:
            return
        self.release()
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.held = path

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.held = None

    def close(self) -> None:
        """At the session's end: let the lock go and close both files (left to the interpreter's
        exit, each was a ResourceWarning)."""
        self.release()
        self.gate.close()
        self.lock.close()


_SHARE: _MachineShare | None = None


@contextlib.contextmanager
def _flocked(path: str):  # type: ignore[no-untyped-def]
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files marked ``alone`` last (the sort is stable): under xdist they then start when the
    other worker has no file left to begin, so its wait for the lock costs nothing."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is not None)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    if _SHARE is None:
        yield
        return
    path = str(item.path)
    _SHARE.take(path, alone=item.get_closest_marker("alone") is not None)
    port = _SHARE.default_port() if item.get_closest_marker("default_port") else contextlib.nullcontext()
    try:
        with port:
            yield
    finally:  # the file's last test has run its module teardown too
        if nextitem is None or str(nextitem.path) != path:
            _SHARE.release()


def pytest_configure(config: pytest.Config) -> None:
    """Make the xdist workers' machine lock (the controlling process) or open it (a worker),
    then start the preload server while the tests are collected. Its start-up environment is the
    one the launcher gives several workers by default (OMP_NUM_THREADS=1 where unset, glibc's
    malloc cache off); a job whose workers differ starts them plainly, saying so."""
    global _SHARE
    if hasattr(config, "workerinput"):
        if os.environ.get(SHARE_ENV):
            _SHARE = _MachineShare(os.environ[SHARE_ENV])
            _SESSION.callback(_SHARE.close)
    elif SHARE_ENV not in os.environ:
        folder = tempfile.mkdtemp(prefix="fleetlike-tests-")
        _SESSION.callback(shutil.rmtree, folder, ignore_errors=True)
        os.environ[SHARE_ENV] = folder
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


@pytest.fixture(autouse=True)
def _own_environment():  # type: ignore[no-untyped-def]
    """Every test starts from the session's environment: a variable a test (or the code it runs
    in this process, e.g. torchrun's variables a one-rank group exports) sets or removes is put
    back after it, so the jobs later tests start (mpiexec, launchers) never inherit it."""
    before = dict(os.environ)
    yield
    changed = [k for k in set(before) | set(os.environ)
               if before.get(k) != os.environ.get(k) and k != "PYTEST_CURRENT_TEST"]  # pytest's own, per phase
    for name in changed:
        if name in before:
            os.environ[name] = before[name]
        else:
            del os.environ[name]

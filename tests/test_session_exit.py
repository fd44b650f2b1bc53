"""A test session of this suite ends clean: run as CI runs it (pytest-xdist's two workers, the
preload server, warnings shown), one quick test file's session prints no ResourceWarning at
exit: the workers close their machine-lock files (`conftest._MachineShare`) and the preload
server closes the connections it holds (`fleetlike.launch.preload_server.serve_forever`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARE_ENV
from fleetlike.launch.preload import PRELOAD_ENV, SOCKET_ENV

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_session_under_xdist_ends_without_resource_warnings() -> None:
    # a session of its own: its own lock folder and preload server, not this session's
    env = {k: v for k, v in os.environ.items() if k not in (SHARE_ENV, SOCKET_ENV, PRELOAD_ENV)}
    env["PYTHONWARNINGS"] = "default::ResourceWarning"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "tests/test_api.py",
         "-k", "test_all_names_what_the_module_exports"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert " passed" in said, said
    assert "ResourceWarning" not in said, said

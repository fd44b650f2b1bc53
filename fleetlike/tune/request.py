"""Whether a job tunes itself, and where the trial log goes: the strategy, or the environment.

``strategy.auto_tune = True`` asks for the online tuner; so does ``FLEETLIKE_AUTOTUNE=1`` for a
job whose script does not say (AIACC's and Horovod's users turn it on from the launch line).
``FLEETLIKE_AUTOTUNE_LOG`` names the trial log (rank 0 writes it). Any other value than ``0``
or ``1`` raises: a misspelt switch must not leave a job untuned without a word.

Example:
    >>> s = requested(strategy, {"FLEETLIKE_AUTOTUNE": "1"})    # a copy with auto_tune on
    >>> s.auto_tune
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fleetlike.config import DistributedStrategy, envvars

__all__ = ["AUTOTUNE", "AUTOTUNE_LOG", "log_path", "requested"]

AUTOTUNE = envvars.AUTOTUNE
AUTOTUNE_LOG = envvars.AUTOTUNE_LOG


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    if raw.strip() in ("0", "1"):
        return raw.strip() == "1"
    raise ValueError(f"{name}={raw!r}: expected 1 (tune the gradient communication while the job runs) or 0. "
                     f"Fix: export {name}=1, or unset it")


def requested(s: DistributedStrategy, environ: Mapping[str, str] | None = None) -> DistributedStrategy | None:
    """``s`` with ``auto_tune`` on when the strategy or ``FLEETLIKE_AUTOTUNE=1`` asks for it, else
    None (``FLEETLIKE_AUTOTUNE=0`` does not turn off a strategy's ``auto_tune``: the script wins)."""
    env = os.environ if environ is None else environ
    if s.auto_tune:
        return s
    if _flag(env, AUTOTUNE):
        out = s.copy()
        out.auto_tune = True
        return out
    return None


def log_path(environ: Mapping[str, str] | None = None, name: str = AUTOTUNE_LOG) -> str | None:
    """The trial log's path from ``name`` (None: no log)."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    return raw or None

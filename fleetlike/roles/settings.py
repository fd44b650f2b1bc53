"""Process-wide switches read from the environment, turned into plain values here.

`fleet.init` and the DDP face ask this function rather than the environment; the other readers
are the role makers, the launcher, elastic membership and the DDP knobs (docs/ARCHITECTURE.md).

==========================  ===============================================================
``FLEETLIKE_STRATEGY``      JSON text or a path to a JSON file, applied over the script's
                            `DistributedStrategy` (for changing a running job's strategy
                            without editing the script)
``FLEETLIKE_BACKEND``       force a backend: gloo, mpi, nccl, single (default: auto)
``FLEETLIKE_CHECK_COLLECTIVES``  "1" turns the collective desync check on (debugging)
``CUDA_VISIBLE_DEVICES``    set: the process trains on a GPU even without FLAGS_selected_gpus
==========================  ===============================================================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

__all__ = ["EnvSettings", "env_settings"]


@dataclasses.dataclass(frozen=True)
class EnvSettings:
    strategy_override: str | None = None
    backend: str | None = None
    check_collectives: bool = False
    #: CUDA_VISIBLE_DEVICES as set (a GPU job launched without FLAGS_selected_gpus)
    cuda_visible_devices: str | None = None


def env_settings(environ: Mapping[str, str] | None = None) -> EnvSettings:
    env = os.environ if environ is None else environ
    flag = env.get("FLEETLIKE_CHECK_COLLECTIVES", "").strip().lower()
    if flag not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ValueError(
            f"FLEETLIKE_CHECK_COLLECTIVES={flag!r} is not a switch; use 1 or 0"
        )
    return EnvSettings(
        strategy_override=env.get("FLEETLIKE_STRATEGY") or None,
        backend=env.get("FLEETLIKE_BACKEND") or None,
        check_collectives=flag in ("1", "true", "yes"),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES") or None,
    )

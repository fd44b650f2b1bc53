"""Process-wide switches read from the environment, turned into plain values here.

`fleet.init` and the DDP face ask this function rather than the environment, and every face
builds its strategy with `strategy_with_env` (``FLEETLIKE_STRATEGY`` and the knobs of
`fleetlike.config.knobs`); the other readers are the role makers, the launcher and elastic
membership (docs/ARCHITECTURE.md).

==========================  ===============================================================
``FLEETLIKE_STRATEGY``      JSON text or a path to a JSON file, applied over the script's
                            `DistributedStrategy` (for changing a running job's strategy
                            without editing the script)
``FLEETLIKE_BACKEND``       force a backend: gloo, mpi, nccl, single (default: auto)
``FLEETLIKE_CHECK_COLLECTIVES``  "1" turns the collective desync check on (debugging)
``FLEETLIKE_DIVERGENCE_CHECK_N_STEPS``  steps between two parameter checksums across ranks in
                            every face (0: only after the starting broadcast; unset: the
                            guard's default, `fleetlike.collectives.divergence.DEFAULT_EVERY`)
``CUDA_VISIBLE_DEVICES``    set: the process trains on a GPU even without FLAGS_selected_gpus
==========================  ===============================================================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from fleetlike.config import DistributedStrategy, envvars, rules
from fleetlike.config.epl_env import EplConfig, apply_epl_env
from fleetlike.config.knobs import apply_knobs, knob_options

__all__ = ["EnvSettings", "env_settings", "every_from_env", "strategy_with_env", "with_epl_env"]


@dataclasses.dataclass(frozen=True)
class EnvSettings:
    strategy_override: str | None = None
    backend: str | None = None
    check_collectives: bool = False
    #: CUDA_VISIBLE_DEVICES as set (a GPU job launched without FLAGS_selected_gpus)
    cuda_visible_devices: str | None = None
    #: FLEETLIKE_DIVERGENCE_CHECK_N_STEPS as an int >= 0; None when unset (the guard's default)
    divergence_every: int | None = None
    #: the strategy options the knobs set (``FLEETLIKE_*``, ``PERSEUS_*``, ``TIACC_*``,
    #: ``LIGHT_*``; `fleetlike.config.knobs`), checked when the settings are read
    knob_options: dict = dataclasses.field(default_factory=dict)
    #: the ``EPL_*`` variables set, by name (`fleetlike.config.epl_env`)
    epl_variables: dict = dataclasses.field(default_factory=dict)


def env_settings(environ: Mapping[str, str] | None = None) -> EnvSettings:
    env = os.environ if environ is None else environ
    flag = env.get(envvars.CHECK_COLLECTIVES, "").strip().lower()
    if flag not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ValueError(
            f"{envvars.CHECK_COLLECTIVES}={flag!r} is not a switch; use 1 or 0"
        )
    return EnvSettings(
        knob_options=knob_options(env),  # a bad, refused or misspelt knob stops the job here
        # and so does a bad or misspelt EPL_* variable (checked on a fresh strategy here; applied by
        # strategy_with_env)
        epl_variables=apply_epl_env(DistributedStrategy(), env),
        divergence_every=every_from_env(env),
        strategy_override=env.get(envvars.STRATEGY) or None,
        backend=env.get(envvars.BACKEND) or None,
        check_collectives=flag in ("1", "true", "yes"),
        cuda_visible_devices=env.get(envvars.CUDA_VISIBLE_DEVICES) or None,
    )


def every_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``FLEETLIKE_DIVERGENCE_CHECK_N_STEPS`` for the divergence guard every face builds: an int
    >= 0, or None when unset (the guard's own default); ValueError naming the variable, its
    value and what is accepted."""
    env = os.environ if environ is None else environ
    text = env.get(envvars.DIVERGENCE_CHECK_N_STEPS)
    if text is None or not text.strip():
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{envvars.DIVERGENCE_CHECK_N_STEPS}={text!r} is not accepted; use an integer >= 0 (steps "
                         "between two parameter checks across ranks; 0 = only after the starting broadcast)")
    return value


def with_epl_env(strategy: DistributedStrategy | None = None,
                 environ: Mapping[str, str] | None = None) -> DistributedStrategy:
    """A copy of ``strategy`` (default: a fresh one) with EPL's ``EPL_*`` variables applied
    (`fleetlike.config.epl_env`); an `EplConfig` read them when it was built, under its own
    dict, and is copied as it is. The first layer of `strategy_with_env`, and what
    ``fleet.distributed_model`` judges init's strategy by before the first forward."""
    env = os.environ if environ is None else environ
    chosen = DistributedStrategy() if strategy is None else strategy.copy()
    if not isinstance(chosen, EplConfig):
        apply_epl_env(chosen, env)
    return chosen


def strategy_with_env(strategy: DistributedStrategy | None = None,
                      environ: Mapping[str, str] | None = None) -> DistributedStrategy:
    """The strategy a face runs: a copy of ``strategy`` (default: a fresh one) with EPL's
    ``EPL_*`` variables applied (`fleetlike.config.epl_env`; an `EplConfig` read them when it was
    built, under its own dict), then ``FLEETLIKE_STRATEGY``, then every knob of the environment
    (`fleetlike.config.knobs`), and the combination checked. The one path from the environment to
    a strategy: Fleet's faces (program and eager), Horovod's optimizer and the DDP hook all take it."""
    env = os.environ if environ is None else environ
    chosen = with_epl_env(strategy, env)
    override = env.get(envvars.STRATEGY)
    if override:
        chosen.update_from_override(override)
    apply_knobs(chosen, env)
    rules.check(chosen)
    return chosen

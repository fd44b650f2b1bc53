"""The environment knobs of `fleetlike.auto`: one table, each knob one `DistributedStrategy` field.

Applied over the strategy in ``FLEETLIKE_STRATEGY`` (JSON text or a file, as for every fleetlike
script), so a knob and a strategy field can never mean different things:

==================================  ===========================  ================================================  ===================================
knob                                values                       strategy field(s)                                 AIACC (seed 004)
==================================  ===========================  ================================================  ===================================
``FLEETLIKE_ALLREDUCE_DTYPE``       fp32, fp16, bf16, mixed      ``fp16_allreduce``, ``fp16_allreduce_configs``    ``PERSEUS_ALLREDUCE_DTYPE`` 1, 0, -, 2
                                                                 ``.dtype`` / ``.mode`` (mixed: fp32 inside a
                                                                 node, fp16 across nodes)
``FLEETLIKE_ALLREDUCE_MODE``        flat, hierarchical, auto     ``use_hierarchical_allreduce`` (auto: two-level   ``PERSEUS_ALLREDUCE_MODE`` 0, 1, unset
                                                                 where the topology allows it, else flat;
                                                                 hierarchical: an error where it cannot)
``FLEETLIKE_ALLREDUCE_STREAMS``     1 .. 16                      ``nccl_comm_num``                                 ``PERSEUS_ALLREDUCE_STREAMS``
``FLEETLIKE_FUSION_MB``             > 0                          ``fuse_grad_size_in_MB`` (DDP's bucket_cap_mb)    ``PERSEUS_ALLREDUCE_FUSION`` (a
                                                                                                                   fraction of the model there)
``FLEETLIKE_GRADIENT_SCALE``        > 0 (needs a 16-bit dtype)   ``fp16_allreduce_configs.grad_scale``             ``PERSEUS_ALLREDUCE_GRADIENT_SCALE``
``FLEETLIKE_ACCUMULATE_N_STEPS``    >= 1                         ``gradient_merge``, ``..._configs.k_steps``       ``PERSEUS_ACCUMULATE_N_STEPS``
``FLEETLIKE_NAN_CHECK``             0, 1                         ``check_nan_inf``                                 ``PERSEUS_ALLREDUCE_NANHECK``
``FLEETLIKE_PERF_CHECK_N_STEPS``    >= 0 (0 = off)               ``slow_rank_check``, ``..._configs.every_n_steps``  ``PERSEUS_PERF_CHECK_N_STEPS``
``FLEETLIKE_DOWNSAMPLE_N_ELEMENTS`` >= 1 (1 = off)               ``gossip``, ``gossip_configs``                    ``PERSEUS_DOWNSAMPLE_N_ELEMENTS``
                                                                 ``.downsample_n_elements``
==================================  ===========================  ================================================  ===================================

The table and its parsing live in `fleetlike.config.knobs` (with AIACC's ``PERSEUS_*`` and TI-ACC's
``TIACC_*`` / ``LIGHT_*`` names beside these), and `fleetlike.roles.settings.strategy_with_env`
applies them: the Fleet and Horovod faces read the same knobs through the same function. Any other
``FLEETLIKE_*`` variable that fleetlike does not read (`KNOWN_ELSEWHERE`), and any value outside a
knob's set, is a `KnobError` naming the variable, the value and what is accepted: a misspelt knob
never silently does nothing.

Example:
    >>> strategy_from_env({"FLEETLIKE_ALLREDUCE_DTYPE": "mixed", "FLEETLIKE_ALLREDUCE_MODE": "flat"}).fp16_allreduce
    True
"""

from __future__ import annotations

from collections.abc import Mapping

from fleetlike.config import DistributedStrategy, envvars
from fleetlike.config.knobs import KNOBS, KNOWN_ELSEWHERE, Knob, KnobError, applied_knobs
from fleetlike.roles.settings import strategy_with_env

__all__ = ["ACCELERATE_VAR", "KNOBS", "KNOWN_ELSEWHERE", "Knob", "KnobError", "applied_knobs", "strategy_from_env"]

#: set by ``python -m fleetlike.launch --accelerate_ddp``: workers import `fleetlike.auto`
ACCELERATE_VAR = envvars.ACCELERATE_DDP


def strategy_from_env(environ: Mapping[str, str]) -> DistributedStrategy:
    """``FLEETLIKE_STRATEGY`` (JSON or file; default strategy when unset) with the knobs of
    ``environ`` applied over it; KnobError names a bad variable, its value and what is accepted."""
    return strategy_with_env(None, environ)

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

Any other ``FLEETLIKE_*`` variable that fleetlike does not read (`KNOWN_ELSEWHERE`), and any
value outside a knob's set, is a `KnobError` naming the variable, the value and what is
accepted: a misspelt knob never silently does nothing.

Example:
    >>> strategy_from_env({"FLEETLIKE_ALLREDUCE_DTYPE": "mixed", "FLEETLIKE_ALLREDUCE_MODE": "flat"}).fp16_allreduce
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from fleetlike.config import STRATEGY_ENV_VAR, DistributedStrategy

__all__ = ["ACCELERATE_VAR", "KNOBS", "KNOWN_ELSEWHERE", "Knob", "KnobError", "applied_knobs", "strategy_from_env"]

#: set by ``python -m fleetlike.launch --accelerate_ddp``: workers import `fleetlike.auto`
ACCELERATE_VAR = "FLEETLIKE_ACCELERATE_DDP"

#: ``FLEETLIKE_*`` variables other parts of fleetlike (and its launcher) read: not knobs, not errors
KNOWN_ELSEWHERE = frozenset({
    STRATEGY_ENV_VAR, ACCELERATE_VAR, "FLEETLIKE_BACKEND", "FLEETLIKE_CHECK_COLLECTIVES",
    "FLEETLIKE_JOB_ID", "FLEETLIKE_JOB_SECRET", "FLEETLIKE_SECRET_DIR", "FLEETLIKE_MASTER_ADDR", "FLEETLIKE_MASTER_PORT", "FLEETLIKE_NODE_IP",
    "FLEETLIKE_NODE_IPS", "FLEETLIKE_NCCL_BENCH", "FLEETLIKE_TEST_MARKER",
    "FLEETLIKE_PROGRESS_DIR", "FLEETLIKE_RESTART_COUNT", "FLEETLIKE_ELASTIC_LAST_CALL",
    "FLEETLIKE_ELASTIC_MAX_WORKERS", "FLEETLIKE_ELASTIC_MIN_WORKERS", "FLEETLIKE_ELASTIC_RUN_ID",
    "FLEETLIKE_ELASTIC_STORE", "FLEETLIKE_DIVERGENCE_CHECK_N_STEPS",
    "FLEETLIKE_PRELOAD", "FLEETLIKE_PRELOAD_SOCKET",
})


class KnobError(ValueError):
    """A ``FLEETLIKE_*`` variable that is unknown or holds a value its knob does not accept."""


@dataclasses.dataclass(frozen=True)
class Knob:
    """One environment knob: its values and the strategy options a value sets."""

    name: str
    accepted: str
    aiacc: str
    parse: Callable[[str], dict[str, Any]]


def _choice(options: Mapping[str, dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def parse(text: str) -> dict[str, Any]:
        return dict(options[text.strip().lower()])  # KeyError -> KnobError
    return parse


def _int(lo: int, hi: int | None, build: Callable[[int], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def parse(text: str) -> dict[str, Any]:
        value = int(text.strip())
        if value < lo or (hi is not None and value > hi):
            raise ValueError(text)
        return build(value)
    return parse


def _positive(build: Callable[[float], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def parse(text: str) -> dict[str, Any]:
        value = float(text.strip())
        if not value > 0 or not math.isfinite(value):
            raise ValueError(text)
        return build(value)
    return parse


_F16 = "fp16_allreduce_configs"
KNOBS: tuple[Knob, ...] = (
    Knob("FLEETLIKE_ALLREDUCE_DTYPE", "fp32, fp16, bf16, mixed", "PERSEUS_ALLREDUCE_DTYPE", _choice({
        "fp32": {"fp16_allreduce": False},
        "fp16": {"fp16_allreduce": True, f"{_F16}.dtype": "float16", f"{_F16}.mode": "all"},
        "bf16": {"fp16_allreduce": True, f"{_F16}.dtype": "bfloat16", f"{_F16}.mode": "all"},
        "mixed": {"fp16_allreduce": True, f"{_F16}.dtype": "float16", f"{_F16}.mode": "mixed"},
    })),
    Knob("FLEETLIKE_ALLREDUCE_MODE", "flat, hierarchical, auto", "PERSEUS_ALLREDUCE_MODE", _choice({
        "flat": {"use_hierarchical_allreduce": False},
        "hierarchical": {"use_hierarchical_allreduce": True},
        "auto": {"use_hierarchical_allreduce": True},
    })),
    Knob("FLEETLIKE_ALLREDUCE_STREAMS", "an integer from 1 to 16", "PERSEUS_ALLREDUCE_STREAMS",
         _int(1, 16, lambda v: {"nccl_comm_num": v})),
    Knob("FLEETLIKE_FUSION_MB", "a number of MB > 0", "PERSEUS_ALLREDUCE_FUSION",
         _positive(lambda v: {"fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": v})),
    Knob("FLEETLIKE_GRADIENT_SCALE", "a number > 0 (with a 16-bit FLEETLIKE_ALLREDUCE_DTYPE)",
         "PERSEUS_ALLREDUCE_GRADIENT_SCALE", _positive(lambda v: {f"{_F16}.grad_scale": v})),
    Knob("FLEETLIKE_ACCUMULATE_N_STEPS", "an integer >= 1", "PERSEUS_ACCUMULATE_N_STEPS",
         _int(1, None, lambda v: {"gradient_merge": v > 1, "gradient_merge_configs.k_steps": v})),
    Knob("FLEETLIKE_NAN_CHECK", "0 or 1", "PERSEUS_ALLREDUCE_NANHECK",
         _choice({"0": {"check_nan_inf": False}, "1": {"check_nan_inf": True}})),
    Knob("FLEETLIKE_PERF_CHECK_N_STEPS", "an integer >= 0 (0 = off)", "PERSEUS_PERF_CHECK_N_STEPS",
         _int(0, None, lambda v: {"slow_rank_check": v > 0, "slow_rank_check_configs.every_n_steps": max(v, 1)})),
    Knob("FLEETLIKE_DOWNSAMPLE_N_ELEMENTS", "an integer >= 1 (1 = off)", "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
         _int(1, None, lambda v: {"gossip": v > 1, "gossip_configs.downsample_n_elements": max(v, 2)})),
)
_BY_NAME = {k.name: k for k in KNOBS}


def _update(s: DistributedStrategy, flat: Mapping[str, Any]) -> None:
    for path, value in flat.items():
        head, dot, tail = path.partition(".")
        if dot:
            s.update({head: {tail: value}})
        else:
            s.update({head: value})


def applied_knobs(environ: Mapping[str, str]) -> dict[str, str]:
    """The knobs set in ``environ`` (by name); KnobError for an unknown ``FLEETLIKE_*`` name."""
    found = {}
    for name, value in sorted(environ.items()):
        if not name.startswith("FLEETLIKE_") or name in KNOWN_ELSEWHERE:
            continue
        if name not in _BY_NAME:
            raise KnobError(
                f"{name}={value!r} is not a fleetlike setting; the DDP knobs are "
                f"{', '.join(k.name for k in KNOBS)} (and fleetlike reads {', '.join(sorted(KNOWN_ELSEWHERE))}). "
                "Fix the name or unset it"
            )
        found[name] = value
    return found


def strategy_from_env(environ: Mapping[str, str]) -> DistributedStrategy:
    """``FLEETLIKE_STRATEGY`` (JSON or file; default strategy when unset) with the knobs of
    ``environ`` applied over it; KnobError names a bad variable, its value and what is accepted."""
    text = environ.get(STRATEGY_ENV_VAR)
    s = DistributedStrategy.from_json_or_path(text) if text else DistributedStrategy()
    knobs = applied_knobs(environ)
    for name, value in knobs.items():
        knob = _BY_NAME[name]
        try:
            options = knob.parse(value)
        except (KeyError, ValueError):
            raise KnobError(f"{name}={value!r} is not accepted; use {knob.accepted}") from None
        _update(s, options)
    if "FLEETLIKE_GRADIENT_SCALE" in knobs and not s.fp16_allreduce:
        raise KnobError(
            f"FLEETLIKE_GRADIENT_SCALE={knobs['FLEETLIKE_GRADIENT_SCALE']!r} scales gradients around a "
            "16-bit cast, but the allreduce stays fp32; set FLEETLIKE_ALLREDUCE_DTYPE to fp16, bf16 or "
            "mixed, or unset FLEETLIKE_GRADIENT_SCALE"
        )
    s.validate_combination()
    return s

"""Horovod's environment variables, with Horovod's meaning and units, or refused with the reason.

A Horovod job is tuned from its launch line (``HOROVOD_FUSION_THRESHOLD=... horovodrun ...``).
`read` parses the variables this face acts on into `HorovodEnv`; ``hvd.DistributedOptimizer``
applies them over the strategy (they win over it, as ``FLEETLIKE_STRATEGY`` does), fixes the
knobs they set so the online tuner leaves them alone, and ``hvd.init`` starts the timeline.
A variable whose meaning fleetlike cannot honour raises with the reason instead of being
ignored; one that is not set changes nothing.

====================================  =======================================================
HOROVOD_FUSION_THRESHOLD              bytes per fused bucket (0: one bucket per gradient)
HOROVOD_HIERARCHICAL_ALLREDUCE        1: two-level allreduce (where nodes allow), 0: flat
HOROVOD_AUTOTUNE                      1: the online tuner (`fleetlike.tune`)
HOROVOD_AUTOTUNE_LOG                  the trial log (Horovod's csv columns first), rank 0
HOROVOD_AUTOTUNE_WARMUP_SAMPLES       unmeasured steps after each switch
HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE     measured steps per candidate
HOROVOD_TIMELINE                      rank 0 writes a chrome://tracing file there at shutdown
HOROVOD_CYCLE_TIME                    refused unless 0 or unset: no background cycle to time
HOROVOD_HIERARCHICAL_ALLGATHER        refused when 1: allgathers are flat
HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES, HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE
                                      refused: the search is coordinate descent, no GP
HOROVOD_TIMELINE_MARK_CYCLES          refused when 1: no cycles to mark
====================================  =======================================================

Example:
    >>> env = read({"HOROVOD_FUSION_THRESHOLD": str(8 << 20), "HOROVOD_AUTOTUNE": "1"})
    >>> env.apply(DistributedStrategy()).fuse_grad_size_in_MB, env.fixed
    (8.0, ('bucket_mb',))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from fleetlike.config import DistributedStrategy

__all__ = ["ACTED", "HorovodEnv", "REFUSED", "read"]

FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
CYCLE_TIME = "HOROVOD_CYCLE_TIME"
HIERARCHICAL_ALLREDUCE = "HOROVOD_HIERARCHICAL_ALLREDUCE"
HIERARCHICAL_ALLGATHER = "HOROVOD_HIERARCHICAL_ALLGATHER"
AUTOTUNE = "HOROVOD_AUTOTUNE"
AUTOTUNE_LOG = "HOROVOD_AUTOTUNE_LOG"
AUTOTUNE_WARMUP_SAMPLES = "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"
AUTOTUNE_STEPS_PER_SAMPLE = "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"
AUTOTUNE_BAYES_OPT_MAX_SAMPLES = "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"
AUTOTUNE_GAUSSIAN_PROCESS_NOISE = "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"
TIMELINE = "HOROVOD_TIMELINE"
TIMELINE_MARK_CYCLES = "HOROVOD_TIMELINE_MARK_CYCLES"

#: the variables that act, and how
ACTED: dict[str, str] = {
    FUSION_THRESHOLD: "bytes per fused gradient bucket (fuse_grad_size_in_MB = bytes / 2**20); 0 = one bucket per "
                      "gradient (fuse_all_reduce_ops = False); never tuned",
    HIERARCHICAL_ALLREDUCE: "1 / 0: use_hierarchical_allreduce on / off; never tuned",
    AUTOTUNE: "1: the online tuner (strategy.auto_tune)",
    AUTOTUNE_LOG: "the trial log rank 0 writes (Horovod's columns first, one row per trial, the best last)",
    AUTOTUNE_WARMUP_SAMPLES: "auto_tune_configs.warmup_steps: unmeasured steps after each switch",
    AUTOTUNE_STEPS_PER_SAMPLE: "auto_tune_configs.steps_per_trial: measured steps per candidate",
    TIMELINE: "rank 0 records the hvd collectives and the gradient buckets and writes a chrome://tracing JSON file "
              "there at hvd.shutdown() or exit",
}
#: the variables refused (when set to a value that asks for something), and why
REFUSED: dict[str, str] = {
    CYCLE_TIME: "fleetlike starts each bucket's allreduce as soon as its gradients are ready; there is no "
                "background cycle whose period could be set. Unset it (or set 0)",
    HIERARCHICAL_ALLGATHER: "hvd.allgather runs flat; only the allreduce has a two-level form. Unset it (or set 0)",
    AUTOTUNE_BAYES_OPT_MAX_SAMPLES: "the tuner searches one knob at a time (a few trials), not by Bayesian "
                                    "optimisation; bound its cost with HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    AUTOTUNE_GAUSSIAN_PROCESS_NOISE: "the tuner fits no Gaussian process; its noise guard is "
                                     "auto_tune_configs.min_gain",
    TIMELINE_MARK_CYCLES: "there are no background cycles to mark. Unset it (or set 0)",
}


@dataclasses.dataclass(frozen=True)
class HorovodEnv:
    """What the Horovod variables of one environment ask for."""

    options: dict[str, Any]
    fixed: tuple[str, ...]
    autotune: bool
    autotune_log: str | None
    timeline: str | None
    #: (variable, value) of every variable that acted, for the optimizer's applied list
    seen: tuple[tuple[str, str], ...]

    @property
    def fixed_by(self) -> dict[str, str]:
        """Each knob in ``fixed`` and the variable that set it, as the tuner reports it."""
        var = {"bucket_mb": FUSION_THRESHOLD, "allreduce_mode": HIERARCHICAL_ALLREDUCE}
        values = dict(self.seen)
        return {k: f"{var[k]}={values.get(var[k], '')} set explicitly" for k in self.fixed}

    def apply(self, s: DistributedStrategy) -> DistributedStrategy:
        """A copy of ``s`` with the variables' settings (and ``auto_tune`` when asked)."""
        out = s.copy()
        if self.options:
            out.update(self.options)
        if self.autotune:
            out.auto_tune = True
        return out


def _bool(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name, "").strip()
    if raw == "":
        return None
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0. Fix: export {name}=1, or unset it")


def _number(env: Mapping[str, str], name: str, kind: type, minimum: float) -> Any:
    raw = env.get(name, "").strip()
    if raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        unit = {FUSION_THRESHOLD: " bytes"}.get(name, "")
        raise ValueError(f"{name}={raw!r}: expected {'an integer' if kind is int else 'a number'} >= {minimum}{unit}. "
                         f"Fix: export {name}=<value>, or unset it")
    return value


def read(environ: Mapping[str, str] | None = None) -> HorovodEnv:
    """The Horovod variables of ``environ`` (default: the process's): ValueError for a refused one
    or a malformed value, naming the variable, the value and the fix."""
    env = os.environ if environ is None else environ
    for name, why in REFUSED.items():
        raw = env.get(name, "").strip()
        if raw == "":
            continue
        asks = True
        if name in (CYCLE_TIME,):
            asks = _number(env, name, float, 0.0) != 0
        elif name in (HIERARCHICAL_ALLGATHER, TIMELINE_MARK_CYCLES):
            asks = bool(_bool(env, name))
        if asks:
            raise ValueError(f"{name}={raw!r} is not supported by fleetlike's Horovod face: {why}")
    options: dict[str, Any] = {}
    fixed: list[str] = []
    seen: list[tuple[str, str]] = []
    threshold = _number(env, FUSION_THRESHOLD, int, 0)
    if threshold is not None:
        if threshold == 0:
            options["fuse_all_reduce_ops"] = False
        else:
            options["fuse_all_reduce_ops"] = True
            options["fuse_grad_size_in_MB"] = threshold / (1 << 20)
        fixed.append("bucket_mb")
    hier = _bool(env, HIERARCHICAL_ALLREDUCE)
    if hier is not None:
        options["use_hierarchical_allreduce"] = hier
        fixed.append("allreduce_mode")
    configs: dict[str, Any] = {}
    warm = _number(env, AUTOTUNE_WARMUP_SAMPLES, int, 0)
    if warm is not None:
        configs["warmup_steps"] = warm
    per = _number(env, AUTOTUNE_STEPS_PER_SAMPLE, int, 1)
    if per is not None:
        configs["steps_per_trial"] = per
    if configs:
        options["auto_tune_configs"] = configs
    for name in (FUSION_THRESHOLD, HIERARCHICAL_ALLREDUCE, AUTOTUNE, AUTOTUNE_LOG, AUTOTUNE_WARMUP_SAMPLES,
                 AUTOTUNE_STEPS_PER_SAMPLE, TIMELINE):
        if env.get(name, "").strip():
            seen.append((name, env[name].strip()))
    return HorovodEnv(options, tuple(fixed), bool(_bool(env, AUTOTUNE)), env.get(AUTOTUNE_LOG, "").strip() or None,
                      env.get(TIMELINE, "").strip() or None, tuple(seen))

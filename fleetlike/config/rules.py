"""Which options cannot work together: the one place where option combinations are judged.

Single options are checked on assignment (`fleetlike.config.fields`); combinations are judged
here, and only when the strategy is used (``distributed_optimizer`` / ``minimize``), so a user may
switch one feature on before switching another off. Keeping every rule in one table means the
fleet layer and the pass pipeline cannot disagree about what is allowed.

Rules read the strategy through its option attributes only (`Options`): this module never
imports `DistributedStrategy`, so ``DistributedStrategy.validate_combination`` can call `check`
without an import circle.

Example:
    >>> from fleetlike.config import DistributedStrategy
    >>> check(DistributedStrategy(localsgd=True, fp16_allreduce=True))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fleetlike.config.fields.StrategyValueError: strategy.localsgd and strategy.fp16_allreduce \
cannot both be True: ... Fix: turn fp16_allreduce off ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from fleetlike.config.fields import StrategyValueError

__all__ = ["CLASHES", "FACE_OPTIONS", "RULES", "Clash", "Conflict", "FaceOptions", "Options", "check", "refuse_unhonoured"]


class Options(Protocol):
    """What the rules need: the strategy's options readable as attributes."""

    def __getattr__(self, name: str) -> Any: ...


class Conflict(NamedTuple):
    """Two on/off options that cannot both be on, why, and what to do instead."""

    first: str
    second: str
    why: str
    fix: str


#: every combination that cannot work, in the order they are checked
RULES: tuple[Conflict, ...] = (
    Conflict("localsgd", "adaptive_localsgd",
             "they are two schedules for the same parameter averaging",
             "turn one off: adaptive_localsgd chooses k itself from loss and learning rate, "
             "localsgd uses the fixed localsgd_configs.k_steps"),
    Conflict("localsgd", "fp16_allreduce",
             "local SGD averages parameters, not gradients; fp16_allreduce compresses gradient "
             "allreduces", "turn fp16_allreduce off and set localsgd_configs.sync_dtype to "
             "'float16' or 'bfloat16' to compress local SGD's traffic"),
    Conflict("adaptive_localsgd", "fp16_allreduce",
             "adaptive local SGD averages parameters, not gradients; fp16_allreduce compresses "
             "gradient allreduces", "turn fp16_allreduce off and set "
             "adaptive_localsgd_configs.sync_dtype to 'float16' or 'bfloat16' to compress local "
             "SGD's traffic"),
    Conflict("localsgd", "gossip",
             "local SGD averages parameters, not gradients; gossip compresses gradient allreduces",
             "turn one off: both cut communication, local SGD by syncing every k steps"),
    Conflict("adaptive_localsgd", "gossip",
             "adaptive local SGD averages parameters, not gradients; gossip compresses gradient "
             "allreduces", "turn one off"),
    Conflict("sharding", "gossip",
             "sharding reduce-scatters whole gradient partitions to their owners; gossip sends "
             "strided samples of every bucket", "turn one off"),
    Conflict("amp", "gossip",
             "gossip's residual would carry the non-finite gradient of a step AMP skips into every "
             "later step", "turn gossip off under AMP (fp16_allreduce compresses AMP's traffic)"),
    Conflict("sharding", "localsgd",
             "sharding gives each rank only its partition's optimizer state and reduces "
             "gradients every step, while local SGD steps every parameter on every rank and "
             "averages parameters every k steps",
             "turn one off: sharding saves optimizer memory, local SGD saves communication"),
    Conflict("sharding", "adaptive_localsgd",
             "sharding gives each rank only its partition's optimizer state and reduces "
             "gradients every step, while adaptive local SGD steps every parameter on every rank "
             "and averages parameters", "turn one off"),
)


class Clash(NamedTuple):
    """A combination that depends on settings, not just two switches: ``test`` says it is on."""

    field: str
    test: Callable[[Options], bool]
    why: str
    fix: str


def _local_clip(s: Options) -> bool:
    return bool(s.sharding) and float(s.sharding_configs["clip_norm"]) > 0 and not s.sharding_configs["clip_after_allreduce"]


#: combinations judged on their settings, checked after `RULES`
CLASHES: tuple[Clash, ...] = (
    Clash("sharding_configs.clip_after_allreduce=False and amp",
          lambda s: _local_clip(s) and bool(s.amp),
          "clipping before communication sees the loss-scaled gradient, whose norm is the "
          "scale times the true one", "set sharding_configs.clip_after_allreduce = True"),
    Clash("sharding_configs.clip_after_allreduce=False and gradient_merge",
          lambda s: _local_clip(s) and bool(s.gradient_merge) and int(s.gradient_merge_configs["k_steps"]) > 1,
          "clipping before communication would clip the sum of the merged micro-steps, not their "
          "average", "set sharding_configs.clip_after_allreduce = True"),
)


def check(strategy: Options) -> None:
    """Raise `StrategyValueError` (a ``ValueError``) for the first rule ``strategy`` breaks.

    The error names both options, why they clash and the fix; ``err.field`` is
    ``"<first> and <second>"``."""
    for rule in RULES:
        if getattr(strategy, rule.first) and getattr(strategy, rule.second):
            names = f"{rule.first} and {rule.second}"
            raise StrategyValueError(
                names, (True, True), "at most one of them True", rule.fix,
                f"strategy.{rule.first} and strategy.{rule.second} cannot both be True: "
                f"{rule.why}. Fix: {rule.fix}")
    for clash in CLASHES:
        if clash.test(strategy):
            raise StrategyValueError(
                clash.field, True, "not together", clash.fix,
                f"strategy.{clash.field} (with a clip_norm) cannot work: {clash.why}. Fix: {clash.fix}")


class FaceOptions(NamedTuple):
    """Which strategy switches a face applies: any other one that is on raises (``why`` and
    ``fix`` say what to do), so no face drops an option without a word."""

    face: str
    honours: frozenset[str]
    why: str
    fix: str


#: the switches (`DistributedStrategy.enabled_features` names) each face applies; Fleet's face
#: (``fleet.distributed_model`` / ``distributed_optimizer``) applies every one
FACE_OPTIONS: dict[str, FaceOptions] = {
    "ddp": FaceOptions(
        "a DDP communication hook",
        frozenset({"gradient_merge", "use_hierarchical_allreduce", "fuse_all_reduce_ops", "fp16_allreduce", "gossip",
                   "find_unused_parameters", "check_nan_inf", "slow_rank_check", "auto_tune"}),
        "it only combines DDP's gradient buckets, it cannot change the optimizer, the forward or the model",
        "turn it off here, or train through fleet.distributed_optimizer, which runs it"),
    "horovod": FaceOptions(
        "hvd.DistributedOptimizer",
        frozenset({"use_hierarchical_allreduce", "fuse_all_reduce_ops", "fp16_allreduce", "auto_tune"}),
        "it averages gradients in buckets and nothing else (plus fuse_grad_size_in_MB, nccl_comm_num and "
        "the hierarchical settings)",
        "turn those off for the Horovod face, or use fleet.distributed_model / fleet.distributed_optimizer, "
        "which apply every option (backward_passes_per_step is Horovod's gradient merge; hvd.SyncBatchNorm "
        "its sync BN)"),
}


def refuse_unhonoured(strategy: Options, face: str) -> None:
    """ValueError naming every switch on in ``strategy`` that ``face`` (a `FACE_OPTIONS` key)
    does not apply, why, and the fix."""
    row = FACE_OPTIONS[face]
    extra = [name for name in strategy.enabled_features() if name not in row.honours]
    if extra:
        raise ValueError(
            f"{', '.join(f'strategy.{n}=True' for n in extra)}: {row.face} applies only "
            f"{', '.join(sorted(row.honours))}; {row.why}, and the strategy also turns on "
            f"{', '.join(extra)}. Fix: {row.fix}")

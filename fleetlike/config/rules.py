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

__all__ = ["CLASHES", "FACE_OPTIONS", "FLEET_ONLY_SETTINGS", "RULES", "Clash", "Conflict", "FaceOptions", "Options", "check", "refuse_unhonoured"]


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


def _local_sgd(s: Options) -> bool:
    return bool(s.localsgd) or bool(s.adaptive_localsgd)


def _local_clip(s: Options) -> bool:
    """Clipping each rank's own gradient before the allreduce."""
    return float(s.sharding_configs["clip_norm"]) > 0 and not s.sharding_configs["clip_after_allreduce"]


def _stage(s: Options) -> int:
    """The ZeRO stage that runs (0: no sharding)."""
    return int(s.sharding_configs["stage"]) if s.sharding else 0


_NO_GRADIENT_ALLREDUCE = "local SGD averages parameters every k steps and allreduces no gradient"

#: combinations judged on their settings, checked after `RULES`
CLASHES: tuple[Clash, ...] = (
    Clash("sharding_configs.gradients_reduce_method='sum' and local SGD",
          lambda s: _local_sgd(s) and s.sharding_configs["gradients_reduce_method"] == "sum",
          _NO_GRADIENT_ALLREDUCE + ", so there is no gradient sum",
          "leave gradients_reduce_method 'mean', or use data parallel (localsgd off)"),
    Clash("sharding_configs.clip_norm and local SGD",
          lambda s: _local_sgd(s) and (float(s.sharding_configs["clip_norm"]) > 0 or bool(s.sharding_configs["clip_after_allreduce"])),
          _NO_GRADIENT_ALLREDUCE + ", so there is no before or after the allreduce to clip at",
          "clip the local gradient yourself (torch.nn.utils.clip_grad_norm_ before optimizer.step()) and leave "
          "clip_norm 0 and clip_after_allreduce False"),
    Clash("sharding_configs.stage >= 2 and clip_after_allreduce=False",
          lambda s: _stage(s) >= 2 and _local_clip(s),
          "at stages 2 and 3 each block's gradients are reduce-scattered as backward produces "
          "them, so no rank ever holds its whole local gradient to clip before communication",
          "set sharding_configs.clip_after_allreduce = True (clip by the global norm over the shards)"),
    Clash("sharding_configs.stage 3 and fp16_allreduce",
          lambda s: _stage(s) == 3 and bool(s.fp16_allreduce),
          "stage 3 reduce-scatters through torch's FSDP2 on the job's process group, which "
          "has no 16-bit wire with fleetlike's scaling", "turn fp16_allreduce off, or use stage 1 or 2"),
    Clash("sharding_configs.stage 3 and use_hierarchical_allreduce",
          lambda s: _stage(s) == 3 and bool(s.use_hierarchical_allreduce),
          "stage 3 reduce-scatters through torch's FSDP2 on one flat process group",
          "turn use_hierarchical_allreduce off, or use stage 1 or 2"),
    Clash("sharding_configs.offload_params without stage 3",
          lambda s: bool(s.sharding) and bool(s.sharding_configs["offload_params"]) and _stage(s) < 3,
          "only stage 3 keeps parameter shards that can live in host memory",
          "set sharding_configs.stage = 3 (EPL: offload.level 'v0' sets it)"),
    Clash("sharding_configs.optimize_offload at stage 1",
          lambda s: bool(s.sharding) and bool(s.sharding_configs["optimize_offload"]) and _stage(s) == 1,
          "offload moves the optimizer state and update of stages 2 and 3 (FSDP2's CPU offload); "
          "stage 1 keeps its state on the device", "set sharding_configs.stage = 2 or 3"),
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
                f"strategy.{clash.field} cannot work: {clash.why}. Fix: {clash.fix}")
    _check_parallelism(strategy)


def _check_parallelism(s: Options) -> None:
    """Tensor parallelism is refused; pipeline degrees need the pipeline switch."""
    if s.tensor_parallel:
        fix = "turn tensor_parallel off; split the model into pipeline stages or shard its optimizer state"
        raise StrategyValueError(
            "tensor_parallel", True, "False (tensor parallelism is not offered)", fix,
            "strategy.tensor_parallel=True: tensor (model) parallelism is not offered by fleetlike, "
            f"so no layer would be split across ranks. Fix: {fix}")
    pp = int(s.hybrid_configs["pp_degree"])
    if pp > 1 and not s.pipeline:
        fix = "set pipeline = True (or pipeline.num_stages), or pp_degree = 1"
        raise StrategyValueError(
            "hybrid_configs.pp_degree", pp, "1 unless pipeline is True", fix,
            f"strategy.hybrid_configs.pp_degree={pp} asks for {pp} pipeline stages but strategy.pipeline "
            f"is False. Fix: {fix}")


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
    "pipeline": FaceOptions(
        "a pipelined model (strategy.pipeline)",
        frozenset({"pipeline", "fuse_all_reduce_ops", "use_hierarchical_allreduce", "fp16_allreduce", "amp",
                   "recompute"}),
        "its stages run torch's pipeline schedules and average each stage's gradients over the "
        "pipelines once per step (buckets, hierarchical, 16-bit), with AMP and recompute inside a "
        "stage; the micro-batches already are the gradient accumulation, and optimizer-state "
        "sharding, local SGD, gossip, sync BatchNorm and the other switches are not wired into "
        "the schedule",
        "turn it off for a pipelined model (pipeline_configs.accumulate_steps is the gradient "
        "merge), or train without pipeline"),
    "horovod": FaceOptions(
        "hvd.DistributedOptimizer",
        frozenset({"use_hierarchical_allreduce", "fuse_all_reduce_ops", "fp16_allreduce", "check_nan_inf", "auto_tune",
                   "gradient_merge", "gossip", "slow_rank_check"}),
        "it averages gradients in buckets and nothing else (plus fuse_grad_size_in_MB, fuse_grad_max_buckets, "
        "nccl_comm_num, the hierarchical settings, the NaN/Inf check of each bucket, the online tuner, gradient "
        "merge as backward_passes_per_step, gossip and the slow-rank check)",
        "turn those off for the Horovod face, or use fleet.distributed_model / fleet.distributed_optimizer, "
        "which apply every option (hvd.SyncBatchNorm is its sync BN)"),
}


#: data-parallel settings (not switches) that only Fleet's face applies: (option, whether it is
#: set, each face's own way to the same result)
FLEET_ONLY_SETTINGS: tuple[tuple[str, Callable[[Options], bool], dict[str, str]], ...] = (
    ("sharding_configs.gradients_reduce_method='sum'",
     lambda s: s.sharding_configs["gradients_reduce_method"] != "mean",
     {"ddp": "DDP averages; multiply the learning rate by the world size (or register a summing comm hook)",
      "horovod": "pass op=hvd.Sum to hvd.DistributedOptimizer"}),
    ("sharding_configs.clip_norm",
     lambda s: float(s.sharding_configs["clip_norm"]) > 0,
     {"ddp": "call torch.nn.utils.clip_grad_norm_ after backward (DDP has reduced the gradients by then: "
             "clip_after_allreduce True)",
      "horovod": "call optimizer.synchronize(), clip_grad_norm_, then optimizer.step() inside "
                 "optimizer.skip_synchronize() (clip_after_allreduce True)"}),
)


def refuse_unhonoured(strategy: Options, face: str) -> None:
    """ValueError naming every switch on in ``strategy`` that ``face`` (a `FACE_OPTIONS` key)
    does not apply, why, and the fix; then every `FLEET_ONLY_SETTINGS` entry set."""
    row = FACE_OPTIONS[face]
    extra = [name for name in strategy.enabled_features() if name not in row.honours]
    if extra:
        raise ValueError(
            f"{', '.join(f'strategy.{n}=True' for n in extra)}: {row.face} applies only "
            f"{', '.join(sorted(row.honours))}; {row.why}, and the strategy also turns on "
            f"{', '.join(extra)}. Fix: {row.fix}")
    for name, is_set, fixes in FLEET_ONLY_SETTINGS:
        if is_set(strategy):
            raise ValueError(
                f"strategy.{name}: {row.face} does not apply it (only fleet.distributed_model / "
                f"fleet.distributed_optimizer do). Fix: leave it at its default here and {fixes[face]}")

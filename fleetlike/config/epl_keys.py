"""EPL's dotted configuration keys (``"amp.level"``, ``"communication.fp16"`` ...), each mapped
onto the `DistributedStrategy` option that does the same thing, or refused with the reason.

EPL (seed 002) configures a job with ``epl.Config({"param_category.attribute": value})``. Each
key of its configuration page that is not a large-model key (``pipeline.*``, ``zero.*``,
``offload.*``, ``optimizer.*``) or a data-input key (``io.*``) is declared here once, as an
`Alias` of the registry: validated on assignment, written through to canonical options, shown by
``DistributedStrategy.describe(key)``. A key whose only meaning in PyTorch is EPL's default is
accepted at that value and refused at any other with the reason (a `Refused` spec), so no key of
the page is an "unknown option" and none is dropped without a word.

=========================================  ===================================================
EPL key                                    fleetlike
=========================================  ===================================================
``amp.level``                              ``amp`` ("O1" on, "" off)
``amp.loss_scale``                         ``amp_configs``: "dynamic" = dynamic scaling, a
                                           number = that fixed scale
``amp.debug_log``                          ``amp_configs.debug_log``
``gradient_checkpoint.type``               ``recompute``: "auto" = the repeated blocks,
                                           "collection" = ``recompute_configs.checkpoints``
``gradient_checkpoint.check_gradients``    ``recompute_configs.check_gradients``
``gradient_checkpoint.end_taskgraph``      -1 only (taskgraphs are EPL's stages)
``communication.num_communicators``        ``nccl_comm_num``
``communication.fp16``                     ``fp16_allreduce``
``communication.fp16_scale``               ``fp16_allreduce_configs.grad_scale``
``communication.max_splits``               ``fuse_grad_max_buckets``
``communication.sparse_as_dense``          True only (buckets carry sparse gradients densely)
``cluster.run_visible_devices``            ``visible_devices``
``cluster.device_place_prefer_intra_node`` True only (a replica is one rank)
``cluster.colocate_split_and_replicate``   False only
``auto.auto_parallel``                     False only (``python -m fleetlike.plan`` instead)
=========================================  ===================================================

Example:
    >>> from fleetlike.config import DistributedStrategy
    >>> s = DistributedStrategy.from_dict({"amp.level": "O1", "amp.loss_scale": 128})
    >>> s.amp, s.amp_configs["use_dynamic_loss_scaling"], s.amp_configs["init_loss_scaling"]
    (True, False, 128.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum
from typing import Any

from fleetlike.config.fields import (
    Alias,
    Bool,
    Choice,
    Int,
    Spec,
    _is_real,
    type_error,
    value_error,
)

__all__ = ["AmpLevel", "DeviceIds", "EPL_ALIASES", "GcType", "LossScale", "Refused"]


class AmpLevel(str, Enum):
    """EPL's ``amp.level``: "" (off) or "O1" (autocast with loss scaling)."""

    OFF = ""
    O1 = "O1"

    def __str__(self) -> str:
        return str(self.value)


class GcType(str, Enum):
    """EPL's ``gradient_checkpoint.type``: "" (off), "auto", "collection"."""

    OFF = ""
    AUTO = "auto"
    COLLECTION = "collection"

    def __str__(self) -> str:
        return str(self.value)


@dataclasses.dataclass(frozen=True)
class LossScale(Spec):
    """``"dynamic"`` or a fixed scale (a number > 0), as EPL's ``amp.loss_scale``."""

    def describe(self) -> str:
        return "'dynamic' or a number > 0 (a fixed loss scale)"

    def check(self, field: str, value: Any) -> str | float:
        if value == "dynamic":
            return "dynamic"
        if isinstance(value, str) or not _is_real(value):
            raise type_error(field, value, self.describe(), "pass 'dynamic' or a number such as 128")
        if not float(value) > 0 or float(value) == float("inf"):
            raise value_error(field, value, self.describe(), "use a finite scale above 0, e.g. 128")
        return float(value)


@dataclasses.dataclass(frozen=True)
class DeviceIds(Spec):
    """GPU ids: ``"0,1"`` (EPL's and CUDA_VISIBLE_DEVICES' form) or a list of ints; ``""`` or
    ``()`` = no restriction. Stored as a tuple of ints."""

    def describe(self) -> str:
        return "comma-separated GPU ids such as '0,1' (or a list of ints), '' for no restriction"

    def check(self, field: str, value: Any) -> tuple[int, ...]:
        items: list[Any]
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",")] if value.strip() else []
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise type_error(field, value, self.describe(), "pass a string such as '0,1'")
        ids: list[int] = []
        for item in items:
            text = str(item).strip()
            if isinstance(item, bool) or not text.isdigit():
                raise value_error(field, value, self.describe(), f"{item!r} is not a GPU id; use ids such as '0,1'")
            ids.append(int(text))
        if len(set(ids)) != len(ids):
            raise value_error(field, value, self.describe(), "name each GPU once")
        return tuple(ids)

    def to_plain(self, value: Any) -> list[int]:
        return list(value)


@dataclasses.dataclass(frozen=True)
class Refused(Spec):
    """A key fleetlike accepts only at ``accepted`` (what fleetlike does, EPL's default except
    for ``communication.sparse_as_dense``); any other valid value is refused with ``reason``."""

    base: Spec
    accepted: Any
    reason: str

    def describe(self) -> str:
        return f"{self.base.describe()}; only {self.accepted!r} in fleetlike"

    def check(self, field: str, value: Any) -> Any:
        checked = self.base.check(field, value)
        if checked != self.accepted:
            raise value_error(field, value, f"{self.accepted!r} (the only value fleetlike can honour)",
                              self.reason)
        return checked


def _nothing(value: Any) -> dict[str, Any]:
    return {}


def _const(value: Any) -> Callable[[Callable[[str], Any]], Any]:
    return lambda get: value


def _write_amp_level(value: Any) -> dict[str, Any]:
    return {"amp": value is AmpLevel.O1}


def _read_amp_level(get: Callable[[str], Any]) -> AmpLevel:
    return AmpLevel.O1 if get("amp") else AmpLevel.OFF


def _write_loss_scale(value: Any) -> dict[str, Any]:
    if value == "dynamic":
        return {"amp_configs.use_dynamic_loss_scaling": True}
    return {"amp_configs.use_dynamic_loss_scaling": False, "amp_configs.init_loss_scaling": float(value)}


def _read_loss_scale(get: Callable[[str], Any]) -> Any:
    return "dynamic" if get("amp_configs.use_dynamic_loss_scaling") else get("amp_configs.init_loss_scaling")


def _write_gc_type(value: Any) -> dict[str, Any]:
    if value is GcType.AUTO:
        return {"recompute": True, "recompute_configs.checkpoints": "auto"}
    if value is GcType.COLLECTION:  # the submodules named in recompute_configs.checkpoints
        return {"recompute": True}
    return {"recompute": False}


def _read_gc_type(get: Callable[[str], Any]) -> GcType:
    if not get("recompute"):
        return GcType.OFF
    return GcType.AUTO if get("recompute_configs.checkpoints") == "auto" else GcType.COLLECTION


def _refused(name: str, base: Spec, accepted: Any, note: str, reason: str) -> Alias:
    return Alias(name, None, note, spec=Refused(base, accepted, reason), read=_const(accepted), write=_nothing)


#: EPL's keys, in the order of its configuration page
EPL_ALIASES: tuple[Alias, ...] = (
    Alias("gradient_checkpoint.type", None,
          "EPL's recompute switch: 'auto' = recompute on with checkpoints 'auto' (the repeated blocks); "
          "'collection' = recompute on over the submodules named in recompute_configs.checkpoints (EPL's "
          "tensors added to the 'checkpoints' collection); '' = off",
          spec=Choice(GcType), read=_read_gc_type, write=_write_gc_type,
          touches=("recompute", "recompute_configs.checkpoints")),
    _refused("gradient_checkpoint.end_taskgraph", Int(min=-1), -1,
             "EPL's last taskgraph (pipeline stage) that auto recompute covers; -1 = all of them",
             "fleetlike's auto recompute covers every repeated block of the model, it has no taskgraphs; to "
             "stop earlier, set gradient_checkpoint.type 'collection' and name the blocks in "
             "recompute_configs.checkpoints"),
    Alias("gradient_checkpoint.check_gradients", "recompute_configs.check_gradients",
          "EPL's name of recompute_configs.check_gradients"),
    Alias("amp.level", None,
          "EPL's AMP switch: 'O1' turns amp on (autocast in amp_configs.dtype with loss scaling), '' off",
          spec=Choice(AmpLevel), read=_read_amp_level, write=_write_amp_level, touches=("amp",)),
    Alias("amp.debug_log", "amp_configs.debug_log", "EPL's name of amp_configs.debug_log"),
    Alias("amp.loss_scale", None,
          "EPL's loss scale: 'dynamic' = amp_configs.use_dynamic_loss_scaling True; a number = that fixed "
          "scale (use_dynamic_loss_scaling False, init_loss_scaling = the number)",
          spec=LossScale(), read=_read_loss_scale, write=_write_loss_scale,
          touches=("amp_configs.use_dynamic_loss_scaling", "amp_configs.init_loss_scaling")),
    _refused("cluster.device_place_prefer_intra_node", Bool(), True,
             "EPL: place one model replica within a node; a fleetlike replica is one rank (data "
             "parallel), so it always is",
             "a fleetlike model replica is one rank, which always lies within one node; leave it True"),
    Alias("cluster.run_visible_devices", "visible_devices", "EPL's name of visible_devices"),
    _refused("cluster.colocate_split_and_replicate", Bool(), False,
             "EPL: let different taskgraphs share devices; fleetlike runs one replica per rank",
             "fleetlike places one replica per rank and never puts two taskgraphs on one device; "
             "leave it False"),
    Alias("communication.num_communicators", "nccl_comm_num", "EPL's name of nccl_comm_num"),
    _refused("communication.sparse_as_dense", Bool(), True,
             "EPL: send sparse gradients densely; fleetlike's gradient buckets always carry a "
             "sparse gradient densely",
             "fleetlike's data parallel always reduces a sparse gradient densely in its bucket (what EPL's "
             "True does); a sparse allgather is hvd.allreduce of a sparse tensor on the Horovod face. Set it "
             "True or leave it out"),
    Alias("communication.max_splits", "fuse_grad_max_buckets", "EPL's name of fuse_grad_max_buckets"),
    Alias("communication.fp16", "fp16_allreduce", "EPL's name of fp16_allreduce"),
    Alias("communication.fp16_scale", "fp16_allreduce_configs.grad_scale",
          "EPL's name of fp16_allreduce_configs.grad_scale (EPL's default 128; fleetlike's 1)"),
    _refused("auto.auto_parallel", Bool(), False,
             "EPL's experimental automatic parallelisation",
             "fleetlike does not choose a strategy inside the job; run python -m fleetlike.plan, which "
             "measures the candidates and writes a strategy JSON (FLEETLIKE_STRATEGY=strategy.json)"),
)

"""What the online tuner may change: four knobs of the gradient communication and their values.

A `Setting` is one point: the allreduce mode (flat, or two-level where the topology allows),
the bucket size, the number of communicators and the wire dtype. `knob_values` lists, for one
job, the values worth trying for each knob that is free: a knob the user set away from its
default or to it (``strategy.fuse_grad_size_in_MB = 32`` written out, ``HOROVOD_FUSION_THRESHOLD``:
`DistributedStrategy.explicit_options`) or named in
``auto_tune_configs.fixed`` keeps one value, the wire dtype is tried only where
``auto_tune_configs.allow_16bit_wire`` lets 16-bit gradients change the numerics, and bucket
sizes that give the same buckets for this model are tried once.

Example:
    >>> start = Setting.of(strategy)
    >>> values = knob_values(strategy, param_bytes=[4096, 64], two_level_ok=False, fixed=set())
    >>> start.applied_to(strategy).fuse_grad_size_in_MB
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence

from fleetlike.config import DistributedStrategy

__all__ = ["AllreduceMode", "BUCKET_LADDER_MB", "KNOB_OPTIONS", "Knob", "Setting", "WIRE_DTYPES", "fixed_knobs",
           "fixed_reasons", "knob_values", "same_buckets"]

#: bucket sizes tried (MiB): Horovod's autotuner searches 0 to 64 MB, fleetlike's default is 32
BUCKET_LADDER_MB: tuple[float, ...] = (0.25, 1, 4, 16, 32, 64)
#: communicator counts tried: one, and two (Fleet's advice across nodes)
COMM_LADDER: tuple[int, ...] = (1, 2)
#: wire dtypes: the gradients' own (no change) and the two 16-bit formats
WIRE_DTYPES: tuple[str, ...] = ("native", "float16", "bfloat16")


class Knob(str, enum.Enum):
    """A tunable setting (``auto_tune_configs.fixed`` takes these names)."""

    ALLREDUCE_MODE = "allreduce_mode"
    BUCKET_MB = "bucket_mb"
    COMM_NUM = "comm_num"
    WIRE_DTYPE = "wire_dtype"


class AllreduceMode(str, enum.Enum):
    FLAT = "flat"
    TWO_LEVEL = "two_level"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the search: what a candidate changes in the strategy."""

    mode: AllreduceMode
    bucket_mb: float
    comm_num: int
    wire: str  # "native", "float16" or "bfloat16"

    @classmethod
    def of(cls, s: DistributedStrategy) -> Setting:
        """The setting ``s`` asks for."""
        wire = str(s.fp16_allreduce_configs["dtype"]) if s.fp16_allreduce else "native"
        return cls(AllreduceMode.TWO_LEVEL if s.use_hierarchical_allreduce else AllreduceMode.FLAT,
                   float(s.fuse_grad_size_in_MB), int(s.nccl_comm_num), wire)

    def applied_to(self, s: DistributedStrategy) -> DistributedStrategy:
        """A copy of ``s`` running this setting (its other options unchanged)."""
        out = s.copy()
        out.use_hierarchical_allreduce = self.mode is AllreduceMode.TWO_LEVEL
        out.fuse_grad_size_in_MB = self.bucket_mb
        out.nccl_comm_num = self.comm_num
        out.fp16_allreduce = self.wire != "native"
        if self.wire != "native":
            out.fp16_allreduce_configs = {"dtype": self.wire}
        return out

    def replace(self, knob: Knob, value: object) -> Setting:
        field = {Knob.ALLREDUCE_MODE: "mode", Knob.BUCKET_MB: "bucket_mb", Knob.COMM_NUM: "comm_num",
                 Knob.WIRE_DTYPE: "wire"}[knob]
        return dataclasses.replace(self, **{field: value})

    def label(self) -> str:
        mb = f"{self.bucket_mb:g}"
        return f"{self.mode.value} {mb}MB x{self.comm_num} {self.wire}"

    def as_dict(self) -> dict[str, object]:
        return {"allreduce_mode": self.mode.value, "bucket_mb": self.bucket_mb, "comm_num": self.comm_num,
                "wire_dtype": self.wire}


_DEFAULTS = DistributedStrategy()
#: the strategy options behind each knob: one the user set (even to its default) fixes the knob
KNOB_OPTIONS: dict[Knob, tuple[str, ...]] = {
    Knob.ALLREDUCE_MODE: ("use_hierarchical_allreduce", "hierarchical_allreduce_inter_nranks"),
    Knob.BUCKET_MB: ("fuse_grad_size_in_MB", "fuse_grad_max_buckets"),
    Knob.COMM_NUM: ("nccl_comm_num",),
    Knob.WIRE_DTYPE: ("fp16_allreduce",),  # a dtype set alone narrows the 16-bit trial to it
}


def fixed_reasons(s: DistributedStrategy, also: Iterable[str] | Mapping[str, str] = ()) -> dict[Knob, str]:
    """The knobs the tuner leaves alone, each with why: an option behind it set by the user
    (`DistributedStrategy.explicit_options`, even to its default value) or away from its
    default, the knob named in ``auto_tune_configs.fixed``, or in ``also`` (a face's own
    explicit settings: name, or name -> why), and the 16-bit wire unless allowed."""
    given = dict(also) if isinstance(also, Mapping) else {n: "fixed by this face" for n in also}
    names = [*s.auto_tune_configs["fixed"], *given]
    known = {k.value for k in Knob}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"auto_tune_configs.fixed={list(s.auto_tune_configs['fixed'])!r} names {bad}, which the "
                         f"tuner does not know. Fix: use some of {sorted(known)}")
    why: dict[Knob, str] = {Knob(n): "named in auto_tune_configs.fixed" for n in s.auto_tune_configs["fixed"]}
    why.update({Knob(n): w for n, w in given.items()})
    for knob, options in KNOB_OPTIONS.items():
        if knob in why:
            continue
        set_ = [o for o in options if s.is_explicit(o)]
        changed = [o for o in options if _value(s, o) != _value(_DEFAULTS, o)]
        if set_:
            why[knob] = f"{set_[0]}={_value(s, set_[0])!r} set explicitly"
        elif changed:
            why[knob] = f"{changed[0]}={_value(s, changed[0])!r} away from its default"
    if Knob.BUCKET_MB not in why and not s.fuse_all_reduce_ops:
        why[Knob.BUCKET_MB] = "fuse_all_reduce_ops=False: one bucket per gradient"
    if Knob.WIRE_DTYPE not in why and not s.auto_tune_configs["allow_16bit_wire"]:
        why[Knob.WIRE_DTYPE] = "auto_tune_configs.allow_16bit_wire is False (16-bit would change the numerics)"
    return why


def fixed_knobs(s: DistributedStrategy, also: Iterable[str] | Mapping[str, str] = ()) -> set[Knob]:
    """The knobs the tuner leaves alone (`fixed_reasons` without the reasons)."""
    return set(fixed_reasons(s, also))


def _value(s: DistributedStrategy, path: str) -> object:
    head, dot, tail = path.partition(".")
    value = getattr(s, head)
    value = value[tail] if dot else value
    return getattr(value, "value", value)


def same_buckets(param_bytes: Sequence[int], cap_mb: float) -> tuple[int, ...]:
    """The bucket sizes (bytes) a cap gives for parameters of these sizes (reverse order, as
    `fleetlike.collectives.plan_buckets` lays them out for one dtype): two caps giving the same
    tuple are the same candidate."""
    cap = int(cap_mb * (1 << 20))
    sizes: list[int] = []
    for n in reversed(list(param_bytes)):
        if sizes and sizes[-1] + n <= cap:
            sizes[-1] += n
        else:
            sizes.append(n)
    return tuple(sizes)


def knob_values(s: DistributedStrategy, *, param_bytes: Sequence[int], two_level_ok: bool,
                fixed: set[Knob]) -> dict[Knob, list[object]]:
    """For each free knob, the values to try (the start's own value first); fixed knobs and
    knobs with one possible value are left out."""
    start = Setting.of(s)
    out: dict[Knob, list[object]] = {}
    if Knob.BUCKET_MB not in fixed:
        seen = {same_buckets(param_bytes, start.bucket_mb)}
        values: list[object] = [start.bucket_mb]
        total_mb = sum(param_bytes) / (1 << 20)
        # a model smaller than the ladder's steps still gets a few buckets to try
        fractions = [float(f"{total_mb / d:.3g}") for d in (8, 2)] if total_mb > 0 else []
        for mb in sorted({*fractions, *BUCKET_LADDER_MB}):
            layout = same_buckets(param_bytes, mb)
            if layout not in seen:
                seen.add(layout)
                values.append(float(mb))
        if len(values) > 1:
            out[Knob.BUCKET_MB] = values
    if Knob.COMM_NUM not in fixed:
        comms: list[object] = [start.comm_num, *[c for c in COMM_LADDER if c != start.comm_num]]
        out[Knob.COMM_NUM] = comms
    if Knob.ALLREDUCE_MODE not in fixed and two_level_ok:
        out[Knob.ALLREDUCE_MODE] = [start.mode, *[m for m in AllreduceMode if m is not start.mode]]
    if Knob.WIRE_DTYPE not in fixed:
        wires = [w for w in WIRE_DTYPES if w != start.wire]
        if s.is_explicit("fp16_allreduce_configs.dtype"):  # the user's 16-bit format, or none
            wires = [w for w in wires if w in ("native", str(s.fp16_allreduce_configs["dtype"]))]
        out[Knob.WIRE_DTYPE] = [start.wire, *wires]
    return out

"""The planner's search space: named strategies, valid per `fleetlike.config.rules`.

Three axes, each value a set of `DistributedStrategy` options:

- **communication**: ``dp`` (flat bucketed allreduce), ``hier`` (two-level allreduce,
  reduce-scatter form in 1 MiB segments), ``fp16`` (16-bit wire, every hop), ``hier_fp16``,
  ``fp16_mixed`` (16-bit across nodes only), ``sharding`` (ZeRO-1: reduce-scatter, partitioned
  update, parameter gather), ``sharding_hier``, ``localsgd`` (parameters averaged every 4 steps), ``gossip`` (one of every 4
  gradient elements per step, error feedback);
- **compute/memory**: none, ``recompute`` ("auto": the model's repeated blocks),
  ``amp`` (bfloat16 autocast);
- **accumulation**: none, ``merge`` (gradient merge, k = 4).

``basic`` (the default) is every communication choice alone plus recompute, AMP and merge on
``dp`` and ``hier``; ``full`` is the whole product. Combinations that `rules.check` refuses are
left out, and so are two-level forms on a cluster where they fall back to the flat allreduce
(one node, or one rank per node: the trace would be ``dp``'s). Adaptive local SGD is not in
the space: its schedule depends on the loss, which no plan made before training knows.

``localsgd``, ``gossip`` and ``merge`` change the training math (a different averaging, delayed
elements, or a different effective batch); `MathChange` names them and `fleetlike.plan.planner`
recommends them only when the user allows them (``--allow localsgd,gossip,gradient_merge``).

Example:
    >>> [c.name for c in candidates("basic", Cluster(2, 2))][:3]
    ['dp', 'hier', 'fp16']
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Mapping
from typing import Any

from fleetlike.comm import parse_choice
from fleetlike.config import DistributedStrategy, rules
from fleetlike.config.fields import StrategyValueError
from fleetlike.plan.spec import Cluster

__all__ = ["COMMUNICATION", "Candidate", "MathChange", "SpaceName", "candidates", "parse_allow"]


class MathChange(str, enum.Enum):
    """Strategies that change what training computes; recommended only when allowed."""

    LOCALSGD = "localsgd"
    GOSSIP = "gossip"
    GRADIENT_MERGE = "gradient_merge"


class SpaceName(str, enum.Enum):
    """The documented search spaces."""

    BASIC = "basic"
    FULL = "full"


_HIER = {"use_hierarchical_allreduce": True}
_FP16 = {"fp16_allreduce": True, "fp16_allreduce_configs": {"dtype": "float16"}}
_SHARD = {"sharding": True, "sharding_configs": {"sharding_degree": 0}}

COMMUNICATION: dict[str, dict[str, Any]] = {
    "dp": {},
    "hier": _HIER,
    "fp16": _FP16,
    "hier_fp16": {**_HIER, **_FP16},
    "fp16_mixed": {"fp16_allreduce": True, "fp16_allreduce_configs": {"dtype": "float16", "mode": "mixed"}},
    "sharding": _SHARD,
    "sharding_hier": {**_SHARD, **_HIER},
    "localsgd": {"localsgd": True, "localsgd_configs": {"k_steps": 4, "begin_step": 1}},
    "gossip": {"gossip": True, "gossip_configs": {"downsample_n_elements": 4}},
}
COMPUTE: dict[str, dict[str, Any]] = {
    "": {},
    "recompute": {"recompute": True, "recompute_configs": {"checkpoints": "auto"}},
    "amp": {"amp": True, "amp_configs": {"dtype": "bfloat16"}},
}
MERGE: dict[str, dict[str, Any]] = {
    "": {},
    "merge": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 4}},
}
_TWO_LEVEL = ("hier", "hier_fp16", "fp16_mixed", "sharding_hier")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A named point of the space: its options and which math-changing strategies it uses."""

    name: str
    options: Mapping[str, Any]
    changes_math: tuple[MathChange, ...]

    def strategy(self) -> DistributedStrategy:
        return DistributedStrategy.from_dict(dict(self.options))


def _merge(*parts: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
                out[k] = {**out[k], **v}
            else:
                out[k] = v
    return out


def _make(comm: str, compute: str, merge: str) -> Candidate:
    name = "+".join(x for x in (comm, compute, merge) if x)
    opts = _merge(COMMUNICATION[comm], COMPUTE[compute], MERGE[merge])
    math = tuple(m for m, on in ((MathChange.LOCALSGD, comm == "localsgd"), (MathChange.GOSSIP, comm == "gossip"),
                                 (MathChange.GRADIENT_MERGE, bool(merge))) if on)
    return Candidate(name, opts, math)


def candidates(space: SpaceName | str, cluster: Cluster) -> list[Candidate]:
    """The valid candidates of ``space`` on ``cluster`` (see the module docstring)."""
    which = parse_choice(SpaceName, space, what="space", noun="search space")
    if which is SpaceName.FULL:
        combos = list(itertools.product(COMMUNICATION, COMPUTE, MERGE))
    else:
        combos = [(c, "", "") for c in COMMUNICATION]
        combos += [(c, x, "") for c in ("dp", "hier") for x in ("recompute", "amp")]
        combos += [(c, "", "merge") for c in ("dp", "hier")]
    two_level = cluster.nodes > 1 and cluster.per_node > 1
    out = []
    for comm, compute, merge in combos:
        if comm in _TWO_LEVEL and not two_level:
            continue
        cand = _make(comm, compute, merge)
        try:
            rules.check(cand.strategy())
        except StrategyValueError:
            continue
        out.append(cand)
    return out


def parse_allow(text: str | None) -> set[MathChange]:
    """``"localsgd,gradient_merge"`` -> the set; an unknown name raises, listing the valid ones."""
    if not text:
        return set()
    out = set()
    for part in text.split(","):
        part = part.strip()
        if part:
            out.add(parse_choice(MathChange, part, what="--allow", noun="math-changing strategy"))
    return out

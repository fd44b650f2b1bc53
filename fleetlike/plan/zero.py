"""Sharding stage 3 and offload in the planner, predicted from the data-parallel trace.

Stage 2 runs on the bucket engine (stage 1's, its gradient buckets transient): the planner traces
it through that engine as it does stage 1 (`fleetlike.plan.planner`), and this module's stage 2
figures describe stage 2 on FSDP2 (a model built as shards, or offload on a GPU) only.
Stage 3 runs on torch's FSDP2 over torch's own process group, which the planner's dry
communicators cannot stand in for, so it is not traced: it is derived from the traced
data-parallel step of the same model and the model's own layout (which modules FSDP2 shards as
units, `fleetlike.strategies.zero.shard_blocks`). With ``N`` ranks, ``P`` the parameter bytes,
``G`` the gradient bytes, ``S`` the optimizer state's bytes (all three of the whole model, from
the trace), ``A`` the activations of one forward, ``B`` the largest unit's parameter bytes and
``R`` the root's own (the parameters in no block, gathered for the whole step):

========================  =================================  ======================================
candidate                 kept between steps                 held from the forward to the end of
                                                             the backward (``gathered``)
========================  =================================  ======================================
``sharding_stage2``       ``(P + G + S) / N``                ``P + 2B + B/N``
``sharding_stage3``       ``(P + G + S) / N``                ``R + 2B + B/N``
``sharding_stage3_        on the device: nothing; in host    on the device: ``R + 2B + B/N``
offload``                 memory ``(P + G + S) / N``
========================  =================================  ======================================

The peak is the kept bytes plus the larger of ``gathered + A`` (the forward and backward) and
the update's temporaries on the shards (`fleetlike.plan.temporaries`: the data-parallel
figure over ``N``, since each parameter is stepped as its ``1/N`` dim-0 shard). At stage 2 the
gradient shards ``G / N`` count with the update only, not with ``gathered``: they are None from
the clear before the forward, and each unit's backward frees its gathered parameters (``B``)
before the next adds ``B / N`` of shard, so the sum falls through the backward. At stage 3 every
unit is gathered again for its backward, so the shards made so far sit beside the last units'
gathers: they count with both. ``gathered``
is derived from how FSDP2 runs on one stream (CPU, torch 2.13), not fitted:

* stage 2 keeps every unit's parameters gathered from its forward to its backward (``P``);
  beside them, at worst, two of the largest unit: while a unit is gathered, its all-gather
  buffer beside the parameters copied out of it, and in its backward, its unsharded gradients
  beside the reduce input they are copied into; plus the reduced shard or the shard sent
  (``B/N``): ``P + 2B + B/N``;
* stage 3 holds the root's parameters (``R``) for the whole step and, at worst, two of the
  largest unit: the one computing and the next, prefetched, or in the backward the gradients of
  the one just computed beside its reduce input, its parameters already freed; plus ``B/N``:
  ``R + 2B + B/N``. The reduce input is released as soon as this rank's chunk is copied out
  (`fleetlike.strategies.zero.AllReduceScatter`); FSDP2 alone holds it until the next unit's
  reduce, one ``B`` more.

Measured per phase on 2 gloo ranks (the RSS's peak of each forward, backward and update): the
rise over the level before it is two of the largest unit at both stages (6 x Linear(1024):
1.3 bytes per parameter, units of 0.67; 12 x Linear(1024) before the reduce input was released:
three at stage 3).

Step time: the traced compute with the update cut to ``1/N`` (each rank steps its shard), plus,
not overlapped (on the CPU FSDP2's collectives block the compute: docs/large_models.md), each
unit's gradients reduce-scattered (priced as the cheaper of the link's reduce-scatter and
allreduce: on gloo fleetlike runs it as an allreduce) and its parameters all-gathered (twice at
stage 3: for the forward and again for the backward). Offload adds, over the host link
(``host_link``, a ``(latency s, bytes/s)`` pair), the parameter shards moved in for each gather
and the gradient shards moved out, and its update (the optimizer on the shards) runs on the
host's CPU: priced at the traced seconds (the planner traces on a CPU), not scaled by the
device's compute scale; without a host link it is not predicted (a CPU-only job has
nothing to move: offload changes nothing there).

Example:
    >>> t = trace(spec, DistributedStrategy(), Cluster(1, 2))      # the data-parallel step
    >>> zero_memory(t.memory, layout_of(spec), 2, stage=3, offload=False).peak
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fleetlike.plan.cost import Links, StepCost, group_kind
from fleetlike.plan.memory import MemoryBreakdown
from fleetlike.plan.spec import Cluster, ModelSpec
from fleetlike.plan.trace import Trace
from fleetlike.strategies.zero import shard_blocks

__all__ = ["ZERO_CANDIDATES", "gathered_bytes", "ZeroLayout", "host_bytes", "layout_of", "options", "zero_memory",
           "zero_step"]

#: the ZeRO candidates beyond stage 1: name -> (stage, offload); stage 2 is traced, the others derived
ZERO_CANDIDATES: dict[str, tuple[int, bool]] = {
    "sharding_stage2": (2, False),
    "sharding_stage3": (3, False),
    "sharding_stage3_offload": (3, True),
}


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """The model as FSDP2 shards it: each unit's parameter bytes (blocks, then the root's own)."""

    blocks: tuple[int, ...]
    root: int

    @property
    def largest(self) -> int:
        return max((*self.blocks, self.root))


def layout_of(spec: ModelSpec) -> ZeroLayout:
    """Build the model once and measure its units (no communication)."""
    model = spec.builder(spec.batch_size)[0]
    modules = dict(model.named_modules())

    def nbytes(m: Any) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    blocks = tuple(nbytes(modules[b]) for b in shard_blocks(model))
    return ZeroLayout(blocks, nbytes(model) - sum(blocks))


def options(stage: int, offload: bool) -> dict[str, Any]:
    """The strategy options of a derived candidate."""
    cfg: dict[str, Any] = {"sharding_degree": 0, "stage": stage}
    if offload:
        cfg.update(optimize_offload=True, offload_params=True)
    return {"sharding": True, "sharding_configs": cfg}


def zero_memory(base: MemoryBreakdown, layout: ZeroLayout, world: int, stage: int, offload: bool) -> MemoryBreakdown:
    """Per-rank bytes of a stage 2 / 3 (offload) step, from the data-parallel breakdown ``base``
    (see the module docstring). The device's share is what is returned; under offload the kept
    shards are in host memory (`host_bytes`)."""
    kept_p, kept_g, kept_s = (0, 0, 0) if offload else (-(-base.params // world), -(-base.grads // world),
                                                        -(-base.optimizer // world))
    update = 0 if offload else -(-base.update // world)  # offload steps the shards in host memory
    # stage 2: the gradient shards are None from the clear before the forward (fleetlike's
    # clear sets them to None at stages 2 and 3) and each unit's backward frees more gathered
    # parameters (its whole unit) than it adds of gradient shard (``1/N`` of it), so the shards
    # never meet the gathered peak; they meet the update's temporaries. Stage 3 gathers each
    # unit again for its backward: by the last ones almost every shard exists beside them.
    return MemoryBreakdown(kept_p, kept_g, kept_s, 0, base.activations, base.amp_copies, 0, stage == 2, update,
                           gathered_bytes(base.params, layout, world, stage))


def gathered_bytes(params: int, layout: ZeroLayout, world: int, stage: int) -> int:
    """Bytes a stage 2 / 3 rank holds from the forward to the end of the backward beyond what it
    keeps: the parameters gathered and the collectives' buffers (see the module docstring)."""
    b = layout.largest
    return (params if stage == 2 else layout.root) + 2 * b + -(-b // world)


def host_bytes(base: MemoryBreakdown, world: int) -> int:
    """Host memory per rank under offload: the parameter and gradient shards and the optimizer state."""
    return -(-(base.params + base.grads + base.optimizer) // world)


def zero_step(trace: Trace, cost: StepCost, layout: ZeroLayout, links: Links, stage: int,
              host_link: tuple[float, float] | None) -> StepCost:
    """Predicted seconds of a stage 2 / 3 step from the data-parallel ``trace`` and its ``cost``."""
    cluster: Cluster = trace.cluster
    world = cluster.world_size
    scale = trace.compute_scale if trace.compute_scale is not None else links.compute_scale
    times = [dict(s.times) for s in trace.steps]
    traced_update = sum(t.get("optimizer_update", 0.0) for t in times) / len(times)
    update = traced_update * scale
    # each rank steps its shard; under offload on the host's CPU, priced at the traced (CPU) speed
    # rather than the device's: the device's compute scale does not apply to it
    compute = cost.compute - update + (traced_update if host_link is not None else update) / world
    kind = group_kind(tuple(range(world)), cluster)
    units = [*layout.blocks, layout.root] if layout.root else list(layout.blocks)
    comm = 0.0
    for nbytes in units:
        reduce = min(links.cost(kind, "reduce_scatter", nbytes), links.cost(kind, "all_reduce", nbytes))
        comm += reduce + (2 if stage == 3 else 1) * links.cost(kind, "all_gather", nbytes)
    if host_link is not None:
        lat, rate = host_link
        shard = sum(units) / world
        moves = (2 if stage == 3 else 1) * len(units) + len(units)  # shards in per gather, gradients out
        comm += moves * lat + ((2 if stage == 3 else 1) * shard + shard) / rate
    per_rank = sum(units) * (world - 1) / world  # what each rank sends of one gather (ring)
    gathers = 2 if stage == 3 else 1
    sent = per_rank * (gathers + 1)
    intra, inter = (sent, 0.0) if kind == "intra" else (0.0, sent)
    seconds = compute + comm
    return StepCost(seconds, compute, comm, comm, intra, inter, [seconds], {})

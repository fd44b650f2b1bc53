"""Memory per rank: what a strategy keeps (parameters, gradients, optimizer state, its own
buffers) and what a step holds at its peak (the forward's saved activations).

Counted on the traced rank's real engine (`fleetlike.plan.trace`), each storage once:

- parameters and model buffers;
- gradients: the bucket buffers under data parallel and sharding (gradients are views into
  them), else each ``.grad``;
- optimizer state: the user's optimizer after a few steps; under sharding it holds state for
  this rank's partition only, so this is the sharded figure;
- strategy state: tensors the units keep (local SGD's anchors and flat buffers, the loss scale,
  sharding's gather rows, ...), found by walking the units, and those the gradient collective
  keeps (gossip's error-feedback residuals, one per bucket);
- activations: bytes of the tensors autograd saves during one forward (a saved-tensors hook),
  which under recompute are only the checkpointed blocks' inputs, and under AMP include the
  low-precision copies of the weights (``amp_copies`` is that part);
- transient buffers: a compressed wire copy of the largest bucket;
- the update's temporaries (`fleetlike.plan.temporaries`: what ``optimizer.step()`` allocates
  while it runs, from the optimizer's implementation and the parameters it steps), which exist
  only after the backward, when the activations are gone;
- gathered: bytes that exist from the forward to the end of the backward only (stage 3: the
  parameters gathered and the collectives' buffers, `fleetlike.plan.zero`; stage 2: the
  transient gradient buckets being reduced and the one filling,
  `fleetlike.collectives.transient`).

The peak is their sum: gradients live in persistent buckets, so the end of the forward (all
activations saved, buckets allocated) is the high-water mark of a step. Without buckets (local
SGD) gradients appear during backward as activations are freed: the larger of the two counts.
The wire copies exist only while a bucket communicates, at the end of backward when the
activations are gone: the larger of the two counts too; so do the update's temporaries.

Example:
    >>> t = trace(spec, strategy, cluster); t.memory.peak / 2**20
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from fleetlike.config import DistributedStrategy
from fleetlike.plan.temporaries import update_temporaries
from fleetlike.strategies.engine import Engine

__all__ = ["MemoryBreakdown", "activation_bytes", "measure_state", "optimizer_state_bytes", "storage_key"]


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank by kind (see the module docstring); ``peak`` is the sum."""

    params: int
    grads: int
    optimizer: int
    strategy_state: int
    activations: int
    amp_copies: int
    buffers: int
    #: gradients exist only from backward to the end of the step (no persistent buckets: local
    #: SGD), so they never coexist with the whole forward's activations
    transient_grads: bool = False
    #: the optimizer update's temporaries (after the backward: never with the activations)
    update: int = 0
    #: bytes held from the forward to the end of the backward only (stages 2 and 3)
    gathered: int = 0

    @property
    def peak(self) -> int:
        kept = self.params + self.optimizer + self.strategy_state
        if self.transient_grads:
            return kept + max(self.grads + self.update, self.gathered + self.activations, self.buffers)
        return kept + self.grads + max(self.gathered + self.activations, self.buffers, self.update)

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "peak": self.peak}


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


class _Counter:
    def __init__(self, skip: set[tuple[int, int]]) -> None:
        self.seen = set(skip)
        self.total = 0
        self.half = 0
        self.param_shapes: set[tuple[int, ...]] = set()

    def add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
            return
        key = storage_key(t)
        if key in self.seen:
            return
        self.seen.add(key)
        self.total += key[1]
        if t.dtype in (torch.float16, torch.bfloat16) and tuple(t.shape) in self.param_shapes:
            self.half += key[1]


@contextlib.contextmanager
def activation_bytes(model: torch.nn.Module, skip: tuple[torch.Tensor, ...] = ()) -> Iterator[_Counter]:
    """Count the bytes autograd saves in the ``with`` block (each storage once, parameters not,
    nor the tensors of ``skip``: ones held anyway, such as the caller's own batch)."""
    counter = _Counter({storage_key(p) for p in model.parameters()} | {storage_key(t) for t in skip})
    counter.param_shapes = {tuple(p.shape) for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        counter.add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter


def _tensors(obj: Any, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v, depth - 1, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth - 1, seen)
    elif type(obj).__module__.startswith("fleetlike.") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            if k in ("ctx", "groups", "model", "optimizer", "reducer", "fabric"):
                continue
            yield from _tensors(v, depth - 1, seen)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors ``optimizer`` keeps per parameter (Adam's moments, momentum buffers),
    its 0-dim step counters aside: what sharding divides among the ranks. A wrapper that keeps
    the optimizer of its shard as ``optim`` (torch's ``ZeroRedundancyOptimizer``) is read there.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(10)); opt = torch.optim.Adam([p])
        >>> p.grad = torch.ones(10); opt.step(); optimizer_state_bytes(opt)   # exp_avg, exp_avg_sq
        80
    """
    optimizer = getattr(optimizer, "optim", optimizer)
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def measure_state(engine: Engine, activations: int, strategy: DistributedStrategy) -> MemoryBreakdown:
    """The breakdown for the traced rank's ``engine`` (after its steps) and the counted
    forward's ``activations`` (see the module docstring)."""
    ctx = engine.ctx
    model = ctx.model
    c = _Counter(set())
    for t in [*model.parameters(), *model.buffers()]:
        c.add(t)
    params = c.total
    transient = ctx.reducer is None
    if not transient:
        for g in ctx.reducer.grad_buffers():  # stage 2: only this rank's kept shards
            c.add(g)
        grads = c.total - params
    else:  # one gradient per trainable parameter, set to None again by each step's clear
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    opt = ctx.optimizer
    before = c.total
    if opt is not None:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    c.add(v)
    optimizer = c.total - before
    before = c.total
    seen: set[int] = set()
    for unit in engine.units:
        for t in _tensors(unit, 6, seen):
            c.add(t)
    if ctx.reducer is not None:  # the collective's own state (gossip's residuals)
        for t in _tensors(ctx.reducer.collective, 6, seen):
            c.add(t)
    strategy_state = c.total - before
    buffers = 0
    if strategy.fp16_allreduce and ctx.reducer is not None and ctx.reducer.buckets:
        buffers = max(b.numel for b in ctx.reducer.buckets) * 2
    act, half = activations if isinstance(activations, tuple) else (activations, 0)
    update = 0
    if opt is not None:  # the parameters it holds state for are the ones it steps (stage 1: its partition)
        stepped = [p for p in opt.state if isinstance(p, torch.Tensor)] or None
        update = update_temporaries(opt, stepped, groups=max(1, int(strategy.num_apply_group))).bytes
    # stage 2's transient buckets: those being reduced and the one filling, during the backward
    gathered = ctx.reducer.transient_bytes() if ctx.reducer is not None and hasattr(ctx.reducer, "transient_bytes") else 0
    return MemoryBreakdown(params, grads, optimizer, strategy_state, act, half, buffers, transient, update, gathered)

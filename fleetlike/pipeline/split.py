"""Where a model splits into stages: at named split points, or balanced over its blocks.

A pipelined model is a sequence of blocks run one after another, as Paddle's ``PipelineLayer``
(a list of layers) and EPL's stages are: an ``nn.Sequential``, whose children are the blocks.
A split point may also name a module inside a child that is itself an ``nn.Sequential``
(``"blocks.4"``): that child is opened into its own children. A stage begins at each split
point; stage 1 begins at the first block.

Without split points the blocks are balanced: the contiguous division into ``p`` stages whose
largest stage holds the fewest parameters (a block without parameters, an activation, weighs
as much as one parameter, so it still goes somewhere sensible).

Where blocks of equal size cost different time (an attention block beside an embedding, a
block without parameters that still computes), ``pipeline_configs.balance = "time"`` balances
the measured time instead: `agreed_block_seconds` times each block's forward and backward on an
example micro-batch on rank 0 and broadcasts the times, so every rank divides the model the same
way. `split_points_by_time` gives the same split points in one process, to pass as
``pipeline_configs.split_points``.

Example:
    >>> plan = plan_stages(nn.Sequential(*blocks), 2, split_points=["4"])
    >>> plan.stages[1][0][0]
    '4'
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StagePlan", "agreed_block_seconds", "balance", "block_seconds", "plan_stages", "sequence_blocks",
           "split_points_by_time"]

Block = tuple[str, torch.nn.Module]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """The blocks of each stage, as ``(name in the unsplit model, module)`` pairs."""

    stages: tuple[tuple[Block, ...], ...]
    how: str

    def names(self, stage: int) -> list[str]:
        return [name for name, _ in self.stages[stage]]

    def param_counts(self) -> list[int]:
        return [sum(p.numel() for _, m in blocks for p in m.parameters()) for blocks in self.stages]


def _children(module: torch.nn.Module, prefix: str) -> list[Block]:
    return [(f"{prefix}{name}", child) for name, child in module.named_children()]


def sequence_blocks(model: torch.nn.Module, split_points: tuple[str, ...] | list[str] = ()) -> list[Block]:
    """The model's blocks in forward order, opening nested ``nn.Sequential`` children where a
    split point lies inside them. ValueError names a split point that is no module of the
    model, or one that lies inside a block that is not an ``nn.Sequential``."""
    if not isinstance(model, torch.nn.Sequential):
        raise TypeError(
            f"a pipelined model is a sequence of blocks run in order (as Paddle's PipelineLayer), so "
            f"fleetlike splits an nn.Sequential; got {type(model).__name__}, whose forward may use its "
            "modules in any order. Fix: express the model as torch.nn.Sequential(embedding, *blocks, "
            "head) (a block may be any module taking the previous block's output)")
    blocks = _children(model, "")
    modules = dict(model.named_modules())
    for point in split_points:
        if point not in modules or point == "":
            near = [n for n, _ in blocks][:12]
            raise ValueError(
                f"pipeline_configs.split_points: {point!r} is not a module of the model. Fix: name "
                f"modules as model.named_modules() gives them, e.g. among the blocks {near}")
        while point not in {n for n, _ in blocks}:
            owner = next((i for i, (n, _) in enumerate(blocks) if point.startswith(n + ".")), None)
            assert owner is not None  # a module of the model lies inside some block
            name, block = blocks[owner]
            if not isinstance(block, torch.nn.Sequential):
                raise ValueError(
                    f"pipeline_configs.split_points: {point!r} lies inside {name!r} "
                    f"({type(block).__name__}), which is not an nn.Sequential, so no stage can begin "
                    f"there (its forward is one call). Fix: split at {name!r} or at a later block")
            blocks[owner:owner + 1] = _children(block, name + ".")
    return blocks


def balance(weights: list[int], parts: int) -> list[int]:
    """Start index of each of ``parts`` contiguous groups of ``weights`` minimising the
    heaviest group (exact, by dynamic programming; ties go to earlier cuts)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest heaviest group splitting the first i weights into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def plan_stages(model: torch.nn.Module, num_stages: int, split_points: tuple[str, ...] | list[str] = (),
                seconds: Sequence[float] | None = None) -> StagePlan:
    """Divide ``model`` into ``num_stages`` stages; ValueError for split points of the wrong
    count or out of forward order, or fewer blocks than stages. Without split points the blocks
    are balanced by parameter count, or by ``seconds`` (each block's measured time, in
    forward order) when given."""
    points = list(split_points)
    if points and seconds is not None:
        raise ValueError(
            f"pipeline_configs.split_points {points} and pipeline_configs.balance='time' both choose the "
            "split. Fix: give split points (balance='params'), or none to balance by measured time")
    blocks = sequence_blocks(model, points)
    names = [n for n, _ in blocks]
    if points:
        if len(points) != num_stages - 1:
            raise ValueError(
                f"pipeline_configs.split_points has {len(points)} name(s) {points}, but "
                f"{num_stages} stages need {num_stages - 1} (each names the block that begins stage "
                "2, 3, ...). Fix: give pp_degree - 1 names, or none to balance automatically")
        starts = [0] + [names.index(p) for p in points]
        for a, b, p in zip(starts, starts[1:], points):
            if b <= a:
                raise ValueError(
                    f"pipeline_configs.split_points: {p!r} (block {b} of the forward order) does not "
                    f"come after the previous stage's start (block {a}); got {points}. Fix: list the "
                    f"split points in forward order, each after the last, the first after {names[0]!r}")
        how = f"split points {points}"
    else:
        if len(blocks) < num_stages:
            raise ValueError(
                f"the model has {len(blocks)} block(s) {names}, fewer than the {num_stages} pipeline "
                "stages. Fix: lower hybrid_configs.pp_degree, or give the model more blocks (an "
                "nn.Sequential of its layers)")
        if seconds is not None:
            if len(seconds) != len(blocks):
                raise ValueError(f"{len(seconds)} block times for the model's {len(blocks)} blocks {names}")
            weights = [max(1, round(t * 1e6)) for t in seconds]  # microseconds
            starts = balance(weights, num_stages)
            bounds = [*starts, len(blocks)]
            per_stage = [sum(seconds[a:b]) * 1e3 for a, b in zip(bounds, bounds[1:])]
            for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
                if not any(True for _, m in blocks[a:b] for _ in m.parameters()):
                    raise ValueError(
                        f"pipeline_configs.balance='time' gives stage {s} only the blocks {names[a:b]}, which "
                        "have no parameters, so its rank's optimizer would have nothing to update. Fix: "
                        "split points that give every stage a block with parameters, or balance='params'")
            how = ("balanced by measured time (forward + backward of each block on the example micro-batch, "
                   f"rank 0's; ms per stage {[round(t, 2) for t in per_stage]})")
        else:
            weights = [max(1, sum(p.numel() for p in m.parameters())) for _, m in blocks]
            starts = balance(weights, num_stages)
            how = "balanced by parameter count"
    bounds = [*starts, len(blocks)]
    stages = tuple(tuple(blocks[a:b]) for a, b in zip(bounds, bounds[1:]))
    return StagePlan(stages, how)


def block_seconds(model: torch.nn.Module, example: Any, reps: int = 3) -> list[tuple[str, float]]:
    """Each block's forward + backward seconds on ``example`` (one micro-batch of the model's
    input), the median of ``reps`` after one untimed call, in forward order; each block gets the
    previous block's output, needing its gradient as in the pipeline (the first block's input
    needs none: its backward computes no input gradient). The model's buffers (running
    statistics) and the random state are as they were before."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    try:
        return _timed_blocks(model, example, reps)
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _timed_blocks(model: torch.nn.Module, example: Any, reps: int) -> list[tuple[str, float]]:
    out = []
    x = example
    for i, (name, block) in enumerate(sequence_blocks(model)):
        src = x
        if i > 0 and isinstance(x, torch.Tensor):
            src = x.detach().clone().requires_grad_(x.is_floating_point())
        times = []
        on_gpu = isinstance(src, torch.Tensor) and src.is_cuda
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            y = block(src)
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.float().sum().backward()
            if on_gpu:  # the kernels, not their launch
                torch.cuda.synchronize(src.device)
            if rep:  # the first call allocates
                times.append(time.perf_counter() - t0)
        block.zero_grad(set_to_none=True)
        out.append((name, statistics.median(times)))
        with torch.no_grad():
            x = block(src.detach() if isinstance(src, torch.Tensor) else src)
    return out


def split_points_by_time(model: torch.nn.Module, example: Any, num_stages: int, reps: int = 3) -> list[str]:
    """The ``num_stages - 1`` split points whose stages take the most equal measured time
    (`block_seconds` on ``example``), for ``pipeline_configs.split_points``."""
    plan = plan_stages(model, num_stages, seconds=[t for _, t in block_seconds(model, example, reps)])
    return [blocks[0][0] for blocks in plan.stages[1:]]


def agreed_block_seconds(comm: Any, model: torch.nn.Module, example: Any, reps: int = 3) -> list[float]:
    """Each block's forward + backward seconds (`block_seconds`), measured on rank 0 of ``comm``
    and broadcast: timings differ from rank to rank, and ranks that balanced their own would
    split the model differently (collective: every rank of ``comm`` calls it)."""
    if example is None:
        raise ValueError(
            "pipeline_configs.balance='time' times each block on one micro-batch, and no micro-batch was given. "
            "Fix: fleet.distributed_model(model, loss_fn=..., example_input=x[:micro_batch_rows]), or "
            "balance='params'")
    n = len(sequence_blocks(model))
    times = torch.zeros(n, dtype=torch.float64)
    if comm.rank == 0:
        times = torch.tensor([seconds for _, seconds in block_seconds(model, example, reps)], dtype=torch.float64)
    shared = times.to(comm.device)
    comm.broadcast(shared, root=0)
    return shared.cpu().tolist()

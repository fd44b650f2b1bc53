"""Model, data and references shared by the pipeline tests.

The model is an ``nn.Sequential`` of 8 blocks (Linear + Tanh, the last a classifier head); a
step's global batch is 16 rows, cut into 4 micro-batches per pipeline. References:

* `single_process`: the unsplit model trained on the whole global batch in one process (the
  mean loss of the global batch, one optimizer step per step);
* `torch_schedule`: torch's own `PipelineStage` + schedule on the same split and the same
  pipeline process groups, with the gradients of each stage averaged over the pipelines by
  ``torch.distributed.all_reduce`` (run on the same ranks, in the same test).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

IN, CLASSES, BLOCKS, GLOBAL = 12, 5, 8, 16
STEPS, MICRO = 5, 4


def make_net(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = [torch.nn.Sequential(torch.nn.Linear(IN, IN), torch.nn.Tanh())
                                     for _ in range(BLOCKS - 1)]
    blocks.append(torch.nn.Linear(IN, CLASSES))
    return torch.nn.Sequential(*blocks)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL, IN, generator=g), torch.randint(0, CLASSES, (GLOBAL,), generator=g)


def my_batch(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    n = GLOBAL // dp
    return x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(name)


def single_process(opt_name: str, steps: int = STEPS, amp: bool = False, pipelines: int = 1) -> dict[str, torch.Tensor]:
    """The unsplit model trained on each step's global batch. ``amp``: the loss of each of the
    micro-batches of every pipeline under bfloat16 autocast, averaged (what the pipeline runs)."""
    net = make_net()
    opt = make_opt(opt_name, net.parameters())
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        if amp:
            parts = list(zip(x.chunk(pipelines * MICRO), y.chunk(pipelines * MICRO)))
            for xm, ym in parts:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = net(xm)
                (F.cross_entropy(out.float(), ym) / len(parts)).backward()
        else:
            F.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest per-parameter max|got - want| / max|want|; KeyError on different names."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(float((got[k].float() - want[k].float()).abs().max() / want[k].float().abs().max().clamp_min(1e-12))
               for k in want)


def torch_schedule(hcg: Any, mode: str, opt_name: str, dp_groups: list[Any], steps: int = STEPS) -> dict[str, torch.Tensor]:
    """torch's own pipeline (same split, same pipe group) with dist.all_reduce across pipelines;
    the whole model's state gathered over the pipeline."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fleetlike.pipeline import plan_stages

    net = make_net()
    plan = plan_stages(net, hcg.pp_degree)
    names = plan.names(hcg.stage_id)
    mod = torch.nn.Sequential(*[m for _, m in plan.stages[hcg.stage_id]])
    group = hcg.get_pipe_parallel_process_group()
    stage = PipelineStage(mod, hcg.stage_id, hcg.pp_degree, torch.device("cpu"), group=group)
    cls = Schedule1F1B if mode == "1F1B" else ScheduleGPipe
    sched = cls(stage, MICRO, loss_fn=F.cross_entropy, scale_grads=True)
    opt = make_opt(opt_name, mod.parameters())
    dp_group = dp_groups[hcg.stage_id]
    for step in range(steps):
        x, y = my_batch(step, hcg.dp_rank, hcg.dp_degree)
        opt.zero_grad()
        if hcg.is_first_stage():
            sched.step(x)
        elif hcg.is_last_stage():
            sched.step(target=y, losses=[])
        else:
            sched.step()
        if hcg.dp_degree > 1:
            for p in mod.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= hcg.dp_degree
        opt.step()
    mine = {f"{n}.{k}": v.detach().clone() for n, m in zip(names, mod) for k, v in m.state_dict().items()}
    parts: list[Any] = [None] * hcg.pp_degree
    dist.all_gather_object(parts, mine, group=group)
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part)
    return full


def torch_dp_groups(hcg: Any) -> list[Any]:
    """One torch group per stage over its data-parallel ranks (every rank creates all)."""
    return [dist.new_group(hcg.data_ranks(s)) for s in range(hcg.pp_degree)]


def strategy(mode: str, pp: int, dp: int = -1, **extra: Any) -> Any:
    from fleetlike import DistributedStrategy

    return DistributedStrategy(pipeline=True, pipeline_configs={"accumulate_steps": MICRO, "schedule_mode": mode},
                               hybrid_configs={"pp_degree": pp, "dp_degree": dp}, **extra)


def train_pipeline(s: Any, opt_name: str, steps: int = STEPS, net: torch.nn.Module | None = None) -> tuple[Any, Any, list[float]]:
    """Wrap a fresh net under ``s`` (fleet already initialised) and train ``steps`` steps; the
    model, optimizer and losses."""
    from fleetlike import fleet

    model = fleet.distributed_model(net if net is not None else make_net(), strategy=s, loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(make_opt(opt_name, model.parameters()))
    hcg = fleet.get_hybrid_communicate_group()
    losses = []
    for step in range(steps):
        losses.append(float(model.train_batch(my_batch(step, hcg.get_data_parallel_rank(),
                                                       hcg.get_data_parallel_world_size()), opt)))
    return model, opt, losses


def deep(net: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(net)

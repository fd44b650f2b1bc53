"""ZeRO stage 2 on the bucket engine: the same buckets, owners and collectives as stage 1, each
gradient bucket transient. On 3 real gloo ranks, with buckets small enough that the six-block
model is cut into many (segmented ones of several owners and one-owner ones), stage 2 trains
exactly as stage 1 (bitwise: the same floating-point operations in the same order), which
equals the single-process reference: SGD with momentum and AdamW, gradient merge, ``no_sync``,
recompute, clipping by the global norm, fp16 AMP with loss scaling, bf16 AMP, ``num_apply_group``,
the 16-bit wire, the program style. Each rank keeps only the gradients of the parameters it owns
(the others are None between steps), and during the backward no more than ``IN_FLIGHT + 1``
transient buckets exist at once. A backward stopped on every rank (``check_nan_inf``, an error in
the model) and caught leaves nothing behind: the next steps train as stage 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fleetlike import DistributedStrategy, fleet
from fleetlike.collectives import IN_FLIGHT, TransientBucket
from fleetlike.testing import run_ranks
from zero_common import STEPS, TinyLM, batch, loss_fn, make_opt, program, reference, rel_diff, state

#: about 50 floats per bucket: TinyLM (2,700 parameters) cut into some 40 buckets
SMALL = {"fuse_grad_size_in_MB": 0.0002}


def options(stage: int, **extra: Any) -> dict:
    cfg = {"sharding_degree": 0, "stage": stage, **extra.pop("sharding_configs", {})}
    return {"sharding": True, "sharding_configs": cfg, **SMALL, **extra}


CASES: dict[str, tuple[dict, str, int]] = {
    # name: (options beyond the stage, optimizer, micro-steps per update)
    "momentum": ({}, "momentum", 1),
    "adamw": ({}, "adamw", 1),
    "merge": ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": True}}, "momentum", 2),
    "recompute": ({"recompute": True, "recompute_configs": {"checkpoints": "auto"}}, "momentum", 1),
    "clip": ({"sharding_configs": {"clip_norm": 0.05, "clip_after_allreduce": True}}, "momentum", 1),
    "fp16": ({"amp": True, "amp_configs": {"dtype": "float16", "init_loss_scaling": 1024.0, "incr_every_n_steps": 2}},
             "momentum", 1),
    "bf16": ({"amp": True, "amp_configs": {"dtype": "bfloat16"}}, "adamw", 1),
    "groups": ({"num_apply_group": 3}, "adamw", 1),
    "wire16": ({"fp16_allreduce": True}, "momentum", 1),
}


def _eager(role, opts: dict, opt_name: str, merge: int, no_sync: bool = False) -> dict:
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(make_opt(opt_name, model.parameters()), DistributedStrategy.from_dict(opts))
    live: list[int] = []
    reducer = model.engine.ctx.reducer
    transient = [b for b in reducer.buckets if isinstance(b, TransientBucket) and not b.resident]

    def count(_: torch.Tensor) -> None:  # after the reducer's own hook on the same gradient
        live.append(sum(b.live for b in transient))

    hooks = [p.register_post_accumulate_grad_hook(count) for p in model.parameters()]
    for step in range(STEPS):
        opt.zero_grad()
        if no_sync:  # DDP's no_sync: the first micro-batch local, the second communicates the sum
            with model.no_sync():
                (loss_fn(model, batch(2 * step, role.rank, role.world_size)) / 2).backward()
            (loss_fn(model, batch(2 * step + 1, role.rank, role.world_size)) / 2).backward()
            opt.step()
            continue
        for micro in range(merge):
            opt.zero_grad()
            loss_fn(model, batch(step * merge + micro, role.rank, role.world_size)).backward()
            opt.step()
    for h in hooks:
        h.remove()
    grads = {n: p.grad is not None for n, p in model.module.named_parameters()}
    held = sum(p.grad.numel() for p in model.module.parameters() if p.grad is not None)
    return {"state": state(fleet.full_state_dict(model)), "live": max(live, default=0), "grads": grads,
            "held": held, "buckets": (len(reducer.buckets), len(transient)),
            "applied": [str(a) for a in model.engine.applied]}


#: the cases every run of the suite checks; the others run with the slow tests (each case is a
#: fresh 3-rank training per stage, about 2 s on two cores)
QUICK = ("momentum", "merge", "fp16")


def _ranks(role, names: tuple[str, ...]) -> dict:
    out: dict = {}
    with fleet.session(role, timeout=60):
        for stage in (1, 2):
            for name in names:
                if name == "no_sync":
                    out[(name, stage)] = _eager(role, options(stage), "momentum", 1, no_sync=True)
                elif name == "program":
                    out[(name, stage)] = program(role, options(stage), "adamw")
                else:
                    extra, opt_name, merge = CASES[name]
                    out[(name, stage)] = _eager(role, options(stage, **dict(extra)), opt_name, merge)
    return out


@pytest.mark.parametrize("names", [
    QUICK,
    pytest.param((*(c for c in CASES if c not in QUICK), "no_sync", "program"), marks=pytest.mark.slow),
], ids=["quick", "rest"])
@pytest.mark.timeout(300)
def test_stage2_trains_exactly_as_stage1_and_keeps_only_its_gradient_shard(names: tuple[str, ...]):
    world = 3
    ranks = run_ranks(_ranks, world, names, timeout=280)
    refs = {"momentum": reference("momentum"), "merge": reference("momentum", merge=2),
            "no_sync": reference("momentum", merge=2)}  # no_sync: the same two batches per update
    n = sum(p.numel() for p in TinyLM().parameters())
    for r, res in enumerate(ranks):
        for name in names:
            if name == "program":
                assert rel_diff(res[(name, 2)][0], res[(name, 1)][0]) == 0, r
                assert "c_allgather_params" in res[(name, 2)][1]
                continue
            one, two = res[(name, 1)], res[(name, 2)]
            assert rel_diff(two["state"], one["state"]) == 0, (r, name)  # bitwise
            assert two["live"] <= IN_FLIGHT + 1, (r, name, two["live"])
            assert all(one["grads"].values()), name  # stage 1: every gradient a view of a kept bucket
            if name in refs:
                assert rel_diff(two["state"], refs[name]) <= 1e-5, (r, name)
        if "momentum" in names:
            buckets, transient = res[("momentum", 2)]["buckets"]
            assert buckets >= 20 and transient >= 10, (buckets, transient)
            assert res[("momentum", 2)]["live"] >= 1
            applied = "\n".join(res[("momentum", 2)]["applied"])
            assert "sharding: applied (stage 2 on the bucket engine" in applied, applied
    # every parameter's gradient is kept by exactly one rank (its owner), the others hold None
    for name in set(names) & {"momentum", "adamw", "fp16"}:
        owners = [sum(ranks[q][(name, 2)]["grads"][k] for q in range(world)) for k in ranks[0][(name, 2)]["grads"]]
        assert owners == [1] * len(owners), name
        assert sum(ranks[q][(name, 2)]["held"] for q in range(world)) == n


TWO_LEVEL = {"hierarchical": {"use_hierarchical_allreduce": True},
             "hierarchical+fp16_mixed": {"use_hierarchical_allreduce": True, "fp16_allreduce": True,
                                         "fp16_allreduce_configs": {"mode": "mixed"}}}


def _two_level(role) -> dict:
    with fleet.session(role, timeout=60):
        return {(name, stage): _eager(role, options(stage, **extra), "adamw", 1)
                for name, extra in TWO_LEVEL.items() for stage in (1, 2)}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stage2_two_level_reduce_equals_stage1():
    """2 nodes of 2 ranks: the two-level reduce-scatter (and its 16-bit hop across nodes) under
    transient buckets trains bit for bit as under stage 1's."""
    ranks = run_ranks(_two_level, 4, nodes=2, timeout=220)
    for r, res in enumerate(ranks):
        for name in TWO_LEVEL:
            assert rel_diff(res[(name, 2)]["state"], res[(name, 1)]["state"]) == 0, (r, name)
            assert res[(name, 2)]["live"] <= IN_FLIGHT + 1
        assert "two-level reduce-scatter" in "\n".join(res[("hierarchical", 2)]["applied"])


class _Stop(RuntimeError):
    """An error raised inside the backward by the model's own gradient hook."""


#: the step whose backward stops, on every rank
STOPPED = 1


def _stopped(role, stage: int, how: str) -> dict:
    """Four steps; the backward of step `STOPPED` stops on every rank at the first block's MLP
    weight (its gradient turned NaN, which ``check_nan_inf`` refuses, or an error raised by a
    gradient hook), the script catches the error and goes on with the next step."""
    # stage 0: data parallel, whose buckets stop the same way
    opts = options(stage, check_nan_inf=True) if stage else {**SMALL, "check_nan_inf": True}
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(make_opt("momentum", model.parameters()), DistributedStrategy.from_dict(opts))
    reducer = model.engine.ctx.reducer
    weight = model.module.blocks[0].up.weight  # its bucket is launched late in the backward
    spoil = [False]

    def hook(g: torch.Tensor) -> torch.Tensor:
        if spoil[0] and how == "error":
            raise _Stop("stopped by the model")
        return g * float("nan") if spoil[0] else g

    weight.register_hook(hook)
    stopped, live = 0, []
    for step in range(4):
        opt.zero_grad()
        live.append(sum(isinstance(b, TransientBucket) and b.live and not b.resident for b in reducer.buckets))
        spoil[0] = step == STOPPED
        try:
            loss_fn(model, batch(step, role.rank, role.world_size)).backward()
        except (FloatingPointError, _Stop):
            stopped += 1
            continue
        opt.step()
    bucket = reducer._where[id(weight)][0]
    full = fleet.full_state_dict(model) if stage else model.module.state_dict()
    return {"state": state(full), "stopped": stopped, "live": live,
            "transient": isinstance(bucket, TransientBucket) and not bucket.resident}


def _stopped_ranks(role) -> dict:
    with fleet.session(role, timeout=60):
        return {(how, stage): _stopped(role, stage, how) for how in ("nan", "error") for stage in (0, 1, 2)}


@pytest.mark.timeout(120)
def test_a_backward_stopped_on_every_rank_then_two_steps_train_as_stage1():
    """The error is caught on every rank; the next two steps' collectives pair across ranks (no
    bucket of the stopped backward is left allocated or in flight) and train exactly as stage 1,
    which equals the single-process run that skips the stopped step's update (as data
    parallel's does)."""
    ranks = run_ranks(_stopped_ranks, 2, timeout=100)
    ref_model = TinyLM()
    ref_opt = make_opt("momentum", ref_model.parameters())
    reference("momentum", STOPPED, model=ref_model, opt=ref_opt)
    ref = reference("momentum", 4, model=ref_model, opt=ref_opt, start=STOPPED + 1)
    for r, res in enumerate(ranks):
        for how in ("nan", "error"):
            dp, one, two = res[(how, 0)], res[(how, 1)], res[(how, 2)]
            assert dp["stopped"] == one["stopped"] == two["stopped"] == 1, (r, how)
            assert rel_diff(two["state"], one["state"]) == 0, (r, how)  # bitwise
            assert rel_diff(two["state"], ref) <= 1e-5, (r, how)
            assert rel_diff(dp["state"], ref) <= 1e-5, (r, how)
            assert two["live"][STOPPED + 1] == 0, (r, how, two["live"])
    # the stopped gradient's bucket is transient on the rank that does not own it
    assert any(ranks[q][("nan", 2)]["transient"] for q in range(2))

"""``check_nan_inf`` when only one rank's gradients are non-finite: every rank raises the same
`FloatingPointError` at the same step, promptly (not at the collective timeout), naming that
rank and the parameter; nothing of the step is applied, and the next steps train on every rank
as the single-process run without that step's update. Plain data parallel and sharding stages
1 and 2 (checked before each bucket's reduction: the error names the rank where it began), and
stage 3 on FSDP2 (its reduced shards checked before the update: NaN summed into every rank's
shard, the error names the ranks holding it), two ranks over gloo (`fleetlike.collectives.finite`)."""

from __future__ import annotations

import time

import pytest
import torch

from fleetlike import DistributedStrategy, fleet
from fleetlike.testing import run_ranks
from zero_common import TinyLM, batch, loss_fn, make_opt, reference, rel_diff, state

#: about 50 floats per bucket: the bad gradient's bucket is one of many, launched mid-backward
SMALL = {"fuse_grad_size_in_MB": 0.0002}
CASES = {
    "data parallel": {**SMALL, "check_nan_inf": True},
    "stage 1": {**SMALL, "check_nan_inf": True, "sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 1}},
    "stage 2": {**SMALL, "check_nan_inf": True, "sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 2}},
    "stage 3": {"check_nan_inf": True, "sharding": True, "sharding_configs": {"sharding_degree": 0, "stage": 3}},
}
#: how each case's error begins: the rank where the NaN began, or (stage 3, whose parameters are
#: FSDP2's shards, so rank 1's loss is made NaN instead of one gradient) every rank's reduced shard
BEGINS = {name: "the gradients of rank 1 (blocks.0.up.weight)" for name in CASES}
BEGINS["stage 3"] = "the reduced gradient shards of rank 0 (pos and 75 more), rank 1 (pos and 75 more)"  # all 76
BAD_RANK, BAD_STEP, STEPS = 1, 1, 3  # (BEGINS names rank 1)
#: the collective timeout: a rank left waiting for the bad one would fail only after it
TIMEOUT = 20.0


def _case(role, name: str, opts: dict) -> dict:
    sharded = "sharding" in opts
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(make_opt("momentum", model.parameters()), DistributedStrategy.from_dict(opts))
    weight = model.module.blocks[0].up.weight
    spoil = [False]
    weight.register_hook(lambda g: g * float("nan") if spoil[0] else g)

    def now() -> dict:
        return state(fleet.full_state_dict(model) if sharded else model.module.state_dict())

    caught: list[tuple[int, str, float]] = []
    before = after = None
    for step in range(STEPS):
        opt.zero_grad()
        spoil[0] = step == BAD_STEP and role.rank == BAD_RANK
        if step == BAD_STEP:
            before = now()
        started = time.monotonic()
        try:  # stages 1 and 2, data parallel: at the end of the backward; stage 3: in step()
            loss = loss_fn(model, batch(step, role.rank, role.world_size))
            (loss * float("nan") if spoil[0] and name == "stage 3" else loss).backward()
            opt.step()
        except FloatingPointError as exc:
            caught.append((step, str(exc), time.monotonic() - started))
            after = now()
    return {"caught": caught, "before": before, "after": after, "final": now()}


def _ranks(role) -> dict:
    with fleet.session(role, timeout=TIMEOUT):
        return {name: _case(role, name, opts) for name, opts in CASES.items()}


@pytest.mark.timeout(120)
def test_one_rank_non_finite_every_rank_raises_the_same_error_and_goes_on():
    ranks = run_ranks(_ranks, 2, timeout=100)
    ref_model = TinyLM()
    ref_opt = make_opt("momentum", ref_model.parameters())
    reference("momentum", BAD_STEP, model=ref_model, opt=ref_opt)
    ref = reference("momentum", STEPS, model=ref_model, opt=ref_opt, start=BAD_STEP + 1)
    for name in CASES:
        messages = set()
        for r, res in enumerate(ranks):
            res = res[name]
            ((step, msg, seconds),) = res["caught"]
            assert step == BAD_STEP, (name, r)
            assert seconds < TIMEOUT / 2, (name, r, seconds)  # at the end of that backward, not a timeout
            assert msg.startswith(BEGINS[name] + " held NaN or Inf"), (name, r, msg)
            assert "NaN or Inf" in msg and "every rank stops" in msg, (name, r, msg)
            assert rel_diff(res["after"], res["before"]) == 0, (name, r)  # nothing applied
            assert rel_diff(res["final"], ref) <= 1e-5, (name, r)
            messages.add(msg)
        assert len(messages) == 1, (name, messages)  # the same error on every rank
        assert rel_diff(ranks[0][name]["final"], ranks[1][name]["final"]) == 0, name

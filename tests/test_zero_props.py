"""ZeRO stages 2 and 3, offload and num_apply_group: the keys (Paddle's and EPL's spellings),
what ``fleet.applied_strategy()`` says, every refusal before the first step (the field, the
value, the fix), the grouped update's equality with one update, and offload's CPU path."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from fleetlike import DistributedStrategy, fleet
from fleetlike.config import rules
from fleetlike.strategies.apply_groups import ApplyGroups, split_groups
from fleetlike.strategies.zero import ShardMismatchError, _offload_policy, shard_blocks
from fleetlike.testing import run_ranks
from zero_common import STEPS, TinyLM, batch, loss_fn, make_opt, reference, rel_diff, state


def test_keys_in_paddle_and_epl_spelling():
    s = DistributedStrategy.from_dict({"zero.level": "v1"})
    assert s.sharding and s.sharding_configs["stage"] == 2 and s.sharding_configs["sharding_degree"] == 0
    s = DistributedStrategy.from_dict({"offload.level": "v0", "optimizer.num_apply_group": 4})
    assert s.sharding_configs["stage"] == 3 and s.num_apply_group == 4
    assert s.sharding_configs["optimize_offload"] and s.sharding_configs["offload_params"]
    assert s.to_dict(flat=True)["num_apply_group"] == 4
    s = DistributedStrategy(sharding=True, sharding_configs={"stage": 3, "optimize_offload": True})
    shown = str(s)
    assert "sharding_configs.stage                         * 3" in shown
    assert "sharding_configs.optimize_offload              * True" in shown and "num_apply_group" in shown
    assert DistributedStrategy.from_dict({"offload.level": ""}).sharding_configs["offload_params"] is False


@pytest.mark.parametrize("bad, match", [
    ({"sharding_configs": {"stage": 4}}, r"sharding_configs.stage must be an int in \[1, 3\], got 4"),
    ({"sharding_configs": {"stage": 0}}, r"sharding_configs.stage must be an int in \[1, 3\], got 0"),
    ({"num_apply_group": 0}, r"num_apply_group must be an int >= 1, got 0"),
    ({"offload.level": "v1"}, r"offload.level must be one of '', 'v0', got 'v1'"),
])
def test_bad_values_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        DistributedStrategy.from_dict(bad)


@pytest.mark.parametrize("opts, match", [
    ({"sharding": True, "localsgd": True, "sharding_configs": {"stage": 3}},
     "strategy.sharding and strategy.localsgd cannot both be True"),
    ({"sharding": True, "sharding_configs": {"stage": 2, "clip_norm": 1.0}},
     r"stage >= 2 and clip_after_allreduce=False.*Fix: set sharding_configs.clip_after_allreduce = True"),
    ({"sharding": True, "fp16_allreduce": True, "sharding_configs": {"stage": 3}}, "stage 3 and fp16_allreduce"),
    ({"sharding": True, "sharding_configs": {"stage": 2, "offload_params": True}},
     "offload_params without stage 3.*set sharding_configs.stage = 3"),
    ({"sharding": True, "sharding_configs": {"optimize_offload": True}}, "optimize_offload at stage 1"),
])
def test_combinations_refused(opts, match):
    with pytest.raises(ValueError, match=match):
        rules.check(DistributedStrategy.from_dict(opts))


def test_blocks_and_tied_weights():
    assert shard_blocks(TinyLM()) == [f"blocks.{i}" for i in range(6)]

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
            self.out = torch.nn.Linear(3, 3)
            self.out.weight = self.layers[1].weight  # reaches into layers.1: it stays with the root

    assert shard_blocks(Tied()) == ["layers.0"]
    assert shard_blocks(torch.nn.Linear(2, 2)) == []


def test_grouped_update_splits_and_equals_one_update():
    assert [list(r) for r in split_groups([5, 1, 1, 5, 1, 1], 2)] == [[0, 1, 2], [3, 4, 5]]
    assert [len(r) for r in split_groups([1] * 7, 7)] == [1] * 7
    models = [TinyLM(), TinyLM()]
    opts = [make_opt("adamw", m.parameters()) for m in models]
    grouped = ApplyGroups(opts[1], 5)
    for step in range(3):
        for m in models:
            m.zero_grad()
            loss_fn(m, batch(step, 0, 1)).backward()
        opts[0].step()
        grouped.run(opts[1].step)
    assert rel_diff(state(models[1].state_dict()), state(models[0].state_dict())) == 0
    assert grouped.calls == 15
    n = len(list(models[0].parameters()))
    with pytest.raises(ValueError, match=rf"num_apply_group={n + 1} .* holds {n} parameter\(s\).*at most {n}"):
        ApplyGroups(opts[0], n + 1)
    with pytest.raises(ValueError, match="num_apply_group=2 cannot split this update: LBFGS"):
        ApplyGroups(torch.optim.LBFGS(models[0].parameters()), 2)


def test_offload_policy_on_gpu_and_cpu():
    cfg = {"optimize_offload": True, "offload_params": False}
    policy, why = _offload_policy(cfg, torch.device("cuda", 0))
    assert isinstance(policy, CPUOffloadPolicy) and why is None
    policy, why = _offload_policy(cfg, torch.device("cpu"))
    assert not isinstance(policy, CPUOffloadPolicy) and "already live in host memory" in why
    assert _offload_policy({"optimize_offload": False, "offload_params": False}, torch.device("cuda", 0))[1] == "off"


def _mismatch(role) -> str:
    with fleet.session(role, timeout=30):
        model = fleet.distributed_model(TinyLM())
        if role.rank == 1:
            model.module.blocks[2].up = torch.nn.Linear(6, 19)  # a wider layer on one rank
            model.module.blocks[2].down = torch.nn.Linear(19, 6)
        opt = fleet.distributed_optimizer(make_opt("momentum", model.parameters()),
                                          DistributedStrategy.from_dict({"zero.level": "v1"}))
        try:
            loss_fn(model, batch(0, role.rank, 2)).backward()
            opt.step()
        except ShardMismatchError as exc:
            return str(exc)
    return "no error"


def _grouped_and_offload(role, caplog_level: int) -> dict:
    logging.getLogger("fleetlike").setLevel(caplog_level)
    out: dict = {}
    with fleet.session(role, timeout=60):
        for name, opts in {"dp": {"optimizer.num_apply_group": 3},
                           "stage1": {"sharding": True, "sharding_configs": {"sharding_degree": 0},
                                      "num_apply_group": 4},
                           "stage3": {"offload.level": "v0", "optimizer.num_apply_group": 2}}.items():
            model = fleet.distributed_model(TinyLM())
            opt = fleet.distributed_optimizer(make_opt("momentum", model.parameters()),
                                              DistributedStrategy.from_dict(opts))
            for step in range(STEPS):
                opt.zero_grad()
                loss_fn(model, batch(step, role.rank, role.world_size)).backward()
                opt.step()
            out[name] = state(fleet.full_state_dict(model))
            out[name + "_applied"] = [str(a) for a in model.engine.applied]
        # too many groups: refused when the optimizer meets the model, before any step
        model = fleet.distributed_model(torch.nn.Linear(3, 2))
        try:
            fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        DistributedStrategy(num_apply_group=3))
            model(torch.zeros(1, 3))
            out["too_many"] = "no error"
        except ValueError as exc:
            out["too_many"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_differing_models_refused_before_the_first_step():
    msgs = run_ranks(_mismatch, 2, timeout=100)
    for r, msg in enumerate(msgs):
        assert f"rank {r}: parameter" in msg and "differs between the ranks" in msg, msg
        assert "build the same model" in msg
    assert "blocks.2.up.weight:(18, 6)" in msgs[0] and "blocks.2.up.weight:(19, 6)" in msgs[1]


@pytest.mark.timeout(150)
def test_grouped_update_and_offload_on_ranks():
    ranks = run_ranks(_grouped_and_offload, 2, logging.WARNING, timeout=130)
    res = ranks[0]
    ref = reference("momentum")
    for name in ("dp", "stage1", "stage3"):
        assert rel_diff(res[name], ref) <= 1e-5, name
        assert rel_diff(ranks[1][name], res[name]) == 0, name
    assert "num_apply_group: applied (the update runs in 3 groups of" in "\n".join(res["dp_applied"])
    assert "num_apply_group: applied (this rank's partition updated in chunks" in "\n".join(res["stage1_applied"])
    stage3 = "\n".join(res["stage3_applied"])
    assert "sharding: applied (stage 3" in stage3 and "num_apply_group: applied (each rank's shard updated in 2 groups" in stage3
    assert "sharding_configs.optimize_offload: NOT applied (this job runs on the cpu" in stage3
    assert "num_apply_group=3" in res["too_many"] and "holds 2 parameter(s)" in res["too_many"]


def _alone(role) -> dict:
    with fleet.session(role, timeout=30):
        model = fleet.distributed_model(TinyLM())
        opt = fleet.distributed_optimizer(make_opt("momentum", model.parameters()),
                                          DistributedStrategy.from_dict({"zero.level": "v1"}))
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(model, batch(step, 0, 1)).backward()
            opt.step()
        return {"backend": fleet.context().world.backend, "state": state(fleet.full_state_dict(model))}


@pytest.mark.timeout(60)
def test_a_world_of_one_runs_stage_2():
    res = run_ranks(_alone, 1, timeout=50)[0]
    assert res["backend"] == "single"
    assert rel_diff(res["state"], reference("momentum")) <= 1e-5


def _gradient_shards(role) -> dict:
    """One backward of the same batch: stage 3 averaging and summing (on gloo its reduce is an
    allreduce of which each rank keeps its chunk, the average divided as the chunk is copied
    out), and torch's FSDP2 with its own reduce-scatter, as the reference."""
    from torch.distributed.fsdp import fully_shard

    from fleetlike.strategies.zero import local

    out: dict = {}
    with fleet.session(role, timeout=60):
        feed = batch(0, role.rank, role.world_size)
        for name, method in (("avg", "mean"), ("sum", "sum")):
            model = fleet.distributed_model(TinyLM())
            fleet.distributed_optimizer(make_opt("momentum", model.parameters()), DistributedStrategy(
                sharding=True, sharding_configs={"sharding_degree": 0, "stage": 3, "gradients_reduce_method": method}))
            loss_fn(model, feed).backward()
            out[name] = {n: local(p.grad).clone() for n, p in model.module.named_parameters()}
        ref = TinyLM()  # on the default group stage 3 formed
        for block in ref.blocks:
            fully_shard(block)
        fully_shard(ref)
        loss_fn(ref, feed).backward()
        out["fsdp2"] = {n: local(p.grad).clone() for n, p in ref.named_parameters()}
    return out


@pytest.mark.timeout(120)
def test_stage3_gradient_shards_equal_fsdp2s_reduce_scatter():
    for res in run_ranks(_gradient_shards, 2, timeout=100):
        assert res["avg"].keys() == res["fsdp2"].keys() and len(res["avg"]) > 10
        for n, ref in res["fsdp2"].items():
            torch.testing.assert_close(res["avg"][n], ref, rtol=1e-6, atol=1e-9, msg=n)
            torch.testing.assert_close(res["sum"][n], 2 * ref, rtol=1e-6, atol=1e-9, msg=n)

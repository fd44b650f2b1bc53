"""Pipeline parallelism (``strategy.pipeline``): real ranks over gloo, compared with the unsplit
model trained in one process and with torch's own pipeline schedule on the same split.

Equality: 5 optimizer steps of 4 micro-batches, GPipe (FThenB) and 1F1B, 2 and 4 stages and
2 pipelines x 2 stages. SGD with momentum is compared with the single-process run (1e-5
relative, every parameter, gathered with ``fleet.full_state_dict``); AdamW with torch's own
schedule run in the same job (Adam magnifies last-bit differences of near-zero gradients, so
the single-process run is no fair reference for it).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import pipeline_common as pc
from fleetlike import DistributedStrategy
from fleetlike.config.fields import StrategyValueError
from fleetlike.pipeline import balance, plan_stages, resolve_degrees
from fleetlike.testing import run_ranks

# its jobs fill both cores by themselves (see conftest)
pytestmark = pytest.mark.alone

TOL = 1e-5


def _equality(role, cases):
    from fleetlike import fleet

    out = {}
    for mode, pp, dp in cases:
        s = pc.strategy(mode, pp, dp)
        fleet.init(role, strategy=s)
        try:
            model, _, losses = pc.train_pipeline(s, "momentum")
            got = fleet.full_state_dict(model)
            sgd = pc.relative_error(got, pc.single_process("momentum"))
            applied = [str(e) for e in fleet.applied_strategy()]
            model, _, _ = pc.train_pipeline(s, "adamw")
            got = fleet.full_state_dict(model)
            hcg = fleet.get_hybrid_communicate_group()
            want = pc.torch_schedule(hcg, mode, "adamw", pc.torch_dp_groups(hcg))
            adam = pc.relative_error(got, want)
            adam_single = pc.relative_error(got, pc.single_process("adamw"))
            out[(mode, pp, dp)] = (sgd, adam, adam_single, losses, applied)
        finally:
            fleet.shutdown()
    return out


def _check_equal(results, cases):
    for case in cases:
        per_rank = [r[case] for r in results]
        for sgd, adam, _, losses, _ in per_rank:
            assert sgd < TOL, (case, "momentum vs single process", sgd)
            assert adam < TOL, (case, "adamw vs torch's schedule", adam)
        # the loss is returned on every rank of a pipeline (each pipeline's own batch)
        pp = case[1]
        for first in range(0, len(results), pp):
            assert len({tuple(r[3]) for r in per_rank[first:first + pp]}) == 1, case


def test_two_stages_gpipe_and_1f1b_equal_the_references():
    cases = [("FThenB", 2, 1), ("1F1B", 2, 1)]
    results = run_ranks(_equality, 2, cases, timeout=120)
    _check_equal(results, cases)
    applied = results[0][("1F1B", 2, 1)][4]
    assert any("pipeline: applied" in a and "2 stages" in a and "1F1B" in a for a in applied), applied


def test_four_stages_and_two_pipelines_of_two_equal_the_references():
    cases = [("FThenB", 4, 1), ("1F1B", 4, 1), ("FThenB", 2, 2), ("1F1B", 2, 2)]
    results = run_ranks(_equality, 4, cases, timeout=200)
    _check_equal(results, cases)
    applied = results[0][("1F1B", 2, 2)][4]
    assert any("data_parallel" in a or "buckets" in a or "allreduce" in a for a in applied[1:]), applied


def _compressed(role):
    from fleetlike import fleet

    s = pc.strategy("1F1B", 2, 2, fp16_allreduce=True, fp16_allreduce_configs={"dtype": "bfloat16"})
    fleet.init(role, strategy=s)
    model, _, _ = pc.train_pipeline(s, "momentum")
    got = fleet.full_state_dict(model)
    applied = [str(e) for e in fleet.applied_strategy()]
    fleet.shutdown()
    return pc.relative_error(got, pc.single_process("momentum")), applied


def test_pipelines_average_their_gradients_with_16_bit_compression():
    for err, applied in run_ranks(_compressed, 4, timeout=90):
        assert 1e-7 < err < 2e-2, err  # bfloat16 on the wire: close, not equal
        assert any(a.startswith("fp16_allreduce: applied") for a in applied), applied


# ---------------------------------------------------------------------------- the groups


def _groups(role):
    from fleetlike import fleet

    fleet.init(role, strategy=pc.strategy("1F1B", 2, 2))
    hcg = fleet.get_hybrid_communicate_group()
    got = (hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size(), hcg.get_stage_id(),
           hcg.get_pipe_parallel_world_size(), hcg.get_model_parallel_world_size(), hcg.is_first_stage(),
           hcg.is_last_stage(), hcg.get_rank_from_stage(1), hcg.get_data_parallel_group().size,
           hcg.get_pipe_parallel_group().size)
    model = fleet.distributed_model(pc.make_net(), loss_fn=F.cross_entropy)
    same = fleet.get_hybrid_communicate_group() is hcg and model.hcg is hcg
    fleet.shutdown()
    return got, same


def test_hybrid_communicate_group_answers_as_paddle():
    """Paddle's layout: rank = dp_rank * pp_degree + stage_id."""
    results = run_ranks(_groups, 4, timeout=90)
    for rank, (got, same) in enumerate(results):
        dp_rank, stage = divmod(rank, 2)
        assert got == (dp_rank, 2, stage, 2, 1, stage == 0, stage == 1, dp_rank * 2 + 1, 2, 2), (rank, got)
        assert same


# ---------------------------------------------------------------------------- keys and errors


def test_epl_and_paddle_keys_set_the_same_options():
    epl = DistributedStrategy.from_dict({"pipeline.num_micro_batch": 8, "pipeline.num_stages": 4,
                                         "pipeline.strategy": "PreferForward"})
    paddle = DistributedStrategy(pipeline=True, pipeline_configs={"accumulate_steps": 8, "schedule_mode": "FThenB"},
                                 hybrid_configs={"pp_degree": 4})
    assert epl == paddle
    assert getattr(epl, "pipeline.strategy") == "PreferForward" and getattr(epl, "pipeline.num_stages") == 4
    back = DistributedStrategy.from_dict({"pipeline.strategy": "PreferBackward"})
    assert str(back.pipeline_configs["schedule_mode"]) == "1F1B"
    assert DistributedStrategy.from_dict(paddle.to_dict()) == paddle
    assert "pipeline_configs.accumulate_steps" in str(paddle) and "hybrid_configs.pp_degree" in str(paddle)


def test_tensor_parallel_and_mp_degree_are_refused_with_the_reason():
    with pytest.raises(StrategyValueError, match="mp_degree=2: tensor .model. parallelism is not offered"):
        DistributedStrategy(hybrid_configs={"mp_degree": 2})
    with pytest.raises(StrategyValueError, match="tensor_parallel=True: tensor .model. parallelism is not offered"):
        DistributedStrategy(tensor_parallel=True).validate_combination()
    with pytest.raises(StrategyValueError, match="pp_degree=2 asks for 2 pipeline stages but strategy.pipeline is False"):
        DistributedStrategy(hybrid_configs={"pp_degree": 2}).validate_combination()
    with pytest.raises(ValueError, match="pipelined model .* applies only"):
        from fleetlike.config import rules

        rules.refuse_unhonoured(DistributedStrategy(pipeline=True, sharding=True), "pipeline")


def test_degrees_whose_product_is_not_the_world_size_are_refused():
    assert resolve_degrees(8, -1, 2) == (4, 2)
    with pytest.raises(ValueError, match=r"dp_degree=2 x pp_degree=2 = 4 ranks, but the job has 2"):
        resolve_degrees(2, 2, 2)
    with pytest.raises(ValueError, match=r"pp_degree=3 does not divide the world size 4"):
        resolve_degrees(4, -1, 3)


def test_split_points_name_blocks_in_forward_order():
    net = pc.make_net()
    plan = plan_stages(net, 3, ["2", "5"])
    assert [plan.names(s) for s in range(3)] == [["0", "1"], ["2", "3", "4"], ["5", "6", "7"]]
    inner = plan_stages(net, 2, ["3.1"])  # inside block 3, an nn.Sequential: opened
    assert inner.names(0)[-1] == "3.0" and inner.names(1)[0] == "3.1"
    with pytest.raises(ValueError, match=r"'9' is not a module of the model"):
        plan_stages(net, 2, ["9"])
    with pytest.raises(ValueError, match=r"'2' .* does not come after the previous stage's start"):
        plan_stages(net, 3, ["5", "2"])
    with pytest.raises(ValueError, match=r"has 1 name\(s\) \['4'\], but 3 stages need 2"):
        plan_stages(net, 3, ["4"])
    with pytest.raises(ValueError, match=r"'7.weight' is not a module"):
        plan_stages(net, 2, ["7.weight"])
    deep = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.TransformerEncoderLayer(4, 2))
    with pytest.raises(ValueError, match=r"lies inside '1' \(TransformerEncoderLayer\), which is not an nn.Sequential"):
        plan_stages(deep, 2, ["1.linear1"])
    with pytest.raises(TypeError, match="splits an nn.Sequential"):
        plan_stages(torch.nn.MultiheadAttention(8, 2), 2)


def test_automatic_balance_minimises_the_heaviest_stage():
    assert balance([1, 1, 1, 1, 1, 1, 1, 1], 4) == [0, 2, 4, 6]
    assert balance([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1]
    uneven = torch.nn.Sequential(torch.nn.Linear(40, 40), *[torch.nn.Linear(8, 8) for _ in range(6)])
    plan = plan_stages(uneven, 2)
    assert plan.names(0) == ["0"] and plan.param_counts() == [1640, 432]


def _sized():
    s = pc.strategy("1F1B", 2)
    s.pipeline_configs["micro_batch_size"] = 3
    return s


class _Repeat(torch.nn.Module):
    """One layer applied ``times`` times: one block's parameters, ``times`` blocks' compute."""

    def __init__(self, layer: torch.nn.Module, times: int) -> None:
        super().__init__()
        self.layer, self.times = layer, times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.layer(x))
        return x


def test_split_points_by_measured_time_balance_unequal_blocks():
    from fleetlike.pipeline import split_points_by_time

    torch.manual_seed(0)
    net = torch.nn.Sequential(_Repeat(torch.nn.Linear(512, 512), 12),
                              *[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh()) for _ in range(4)])
    assert plan_stages(net, 2).names(1)[0] == "2"  # equal parameters: 2 and 3 blocks
    points = split_points_by_time(net, torch.randn(32, 512), 2, reps=3)
    assert points == ["1"], points  # the first block computes three times what the four others do


class _Heavy(torch.nn.Module):
    """No parameters, yet the most compute of the model: ``times`` products with a fixed matrix
    (a buffer, as a positional table or a frozen projection is)."""

    def __init__(self, width: int, times: int) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(width, width) / width ** 0.5)
        self.times = times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(x @ self.w)
        return x


WIDE, ROWS = 256, 64


def _heavy_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDE, WIDE), torch.nn.Tanh()) for _ in range(7)]
    blocks.insert(1, _Heavy(WIDE, 10))
    return torch.nn.Sequential(*blocks)


def _heavy_batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(pc.MICRO * ROWS, WIDE, generator=g), torch.randn(pc.MICRO * ROWS, WIDE, generator=g)


def _by_time(role):
    from fleetlike import fleet

    found = {}
    fleet.init(role)
    x, y = _heavy_batch()
    timed = pc.strategy("1F1B", 2)
    timed.pipeline_configs["balance"] = "time"
    pointed = pc.strategy("1F1B", 2)
    pointed.pipeline_configs["balance"], pointed.pipeline_configs["split_points"] = "time", ["3"]
    for name, call in (
        ("no_example", lambda: fleet.distributed_model(_heavy_net(), timed, loss_fn=F.mse_loss)),
        ("with_points", lambda: fleet.distributed_model(_heavy_net(), pointed, loss_fn=F.mse_loss,
                                                        example_input=x[:ROWS])),
        ("params", lambda: fleet.distributed_model(_heavy_net(), pc.strategy("1F1B", 2), loss_fn=F.mse_loss,
                                                   example_input=x[:ROWS])),
    ):
        try:
            call()
        except ValueError as exc:
            found[name] = str(exc)
    model = fleet.distributed_model(_heavy_net(), timed, loss_fn=F.mse_loss, example_input=x[:ROWS])
    found["plan"] = [model.plan.names(s) for s in range(2)]
    found["applied"] = " ".join(str(e) for e in fleet.applied_strategy())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    found["loss"] = float(model.train_batch((x, y), opt))
    fleet.shutdown()
    return found


def test_balance_by_time_minimises_the_slowest_stage_of_the_given_times():
    """The split by time is the one whose slowest stage is least, over every way to cut the blocks."""
    import itertools

    net = _heavy_net()  # 8 blocks; block 1 has no parameters
    for seconds in ([1, 10, 1, 1, 1, 1, 1, 1], [3, 1, 1, 1, 1, 1, 1, 6], [1, 2, 3, 4, 5, 6, 7, 8]):
        for stages in (2, 3):
            cuts = list(itertools.combinations(range(1, 8), stages - 1))
            worst = {cut: max(sum(seconds[a:b]) for a, b in zip((0, *cut), (*cut, 8))) for cut in cuts}
            best = min(worst.values())
            try:
                got = plan_stages(net, stages, seconds=[t / 1e3 for t in seconds])
            except ValueError as exc:  # the least slowest stage holds block 1 alone: refused, named
                assert "only the blocks ['1']" in str(exc), exc
                assert any(worst[cut] == best and (1, 2) in zip((0, *cut), (*cut, 8)) for cut in cuts)
                continue
            sizes = [len(got.names(s)) for s in range(stages)]
            bounds = list(itertools.accumulate([0, *sizes]))
            assert max(sum(seconds[a:b]) for a, b in zip(bounds, bounds[1:])) == best, (seconds, stages, sizes)


def test_balance_by_time_splits_where_rank_0_measured_and_every_rank_agrees():
    results = run_ranks(_by_time, 2, timeout=120)
    plans = [r["plan"] for r in results]
    assert plans[0] == plans[1], plans  # rank 0's times, broadcast: one split
    by_params = [plan_stages(_heavy_net(), 2).names(s) for s in range(2)]
    assert by_params[1][0] == "4"  # the parameter-free block weighs nothing: 3 and 4 Linear blocks
    assert plans[0][1][0] != "4", plans  # the block's time moves the split forward
    x, y = _heavy_batch()
    net = _heavy_net()
    with torch.no_grad():
        want = F.mse_loss(net(x), y).item()  # the unsplit model's loss on the batch
    for r in results:
        assert r["loss"] == pytest.approx(want, rel=1e-5), (r["loss"], want)
        assert "balanced by measured time" in r["applied"], r["applied"]
        assert "no micro-batch was given" in r["no_example"] and "example_input=" in r["no_example"], r
        assert "split_points ['3'] and pipeline_configs.balance='time' both choose" in r["with_points"], r
        assert "example_input=...) is read only to time the blocks" in r["params"], r


def _errors(role):
    from fleetlike import fleet
    from fleetlike.pipeline import PipelineStageError

    found = {}

    def catch(name, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test reads the messages
            found[name] = f"{type(exc).__name__}: {exc}"

    fleet.init(role)
    hcg = fleet.get_hybrid_communicate_group()  # plain data parallel: every rank its own slice
    import torch.distributed as dist

    found["plain_hcg"] = (hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size(), hcg.get_stage_id(),
                          hcg.get_pipe_parallel_world_size(), dist.is_initialized())
    catch("degrees", lambda: fleet.distributed_model(pc.make_net(), pc.strategy("1F1B", 2, 2), loss_fn=F.cross_entropy))
    catch("micro", lambda: fleet.distributed_model(
        pc.make_net(), DistributedStrategy(pipeline=True, hybrid_configs={"pp_degree": 2},
                                           pipeline_configs={"accumulate_steps": 1}), loss_fn=F.cross_entropy))
    bad = pc.strategy("1F1B", 2)
    bad.pipeline_configs["split_points"] = ["8"]
    catch("split", lambda: fleet.distributed_model(pc.make_net(), bad, loss_fn=F.cross_entropy))
    plain = fleet.distributed_model(pc.make_net())
    catch("not_pipelined", lambda: plain.train_batch(pc.my_batch(0, 0, 1), torch.optim.SGD(plain.parameters(), lr=0.1)))
    model = fleet.distributed_model(pc.make_net(), pc.strategy("1F1B", 2), loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(pc.make_opt("momentum", model.parameters()))
    x, y = pc.my_batch(0, 0, 1)
    catch("rows", lambda: model.train_batch((x[:7], y[:7]), opt))
    catch("after", lambda: model.train_batch((x, y), opt))
    fleet.shutdown()
    fleet.init(role)  # a failed step cut the job's pipeline links: a new job
    sized = fleet.distributed_model(pc.make_net(), _sized(), loss_fn=F.cross_entropy)
    sized_opt = fleet.distributed_optimizer(pc.make_opt("momentum", sized.parameters()))
    catch("mbs", lambda: sized.train_batch((x, y), sized_opt))
    fleet.shutdown()
    found["after_is_stage_error"] = isinstance(PipelineStageError("x"), RuntimeError)
    return found


def test_bad_input_is_refused_before_the_first_step_on_every_rank():
    for rank, found in enumerate(run_ranks(_errors, 2, timeout=90)):
        assert found["plain_hcg"] == (rank, 2, 0, 1, False), found  # torch's world left to the script
        assert "dp_degree=2 x pp_degree=2 = 4 ranks, but the job has 2" in found["degrees"], found
        assert "accumulate_steps=1 micro-batches is fewer than the 2 stages" in found["micro"], found
        assert "'8' is not a module of the model" in found["split"], found
        assert "model.train_batch trains a pipelined model" in found["not_pipelined"], found
        assert "the batch has 16 rows, but pipeline_configs.micro_batch_size=3 x accumulate_steps=4 = 12" in found["mbs"], found
        assert "a batch of 7 rows cannot be cut into pipeline_configs.accumulate_steps=4" in found["rows"], (rank, found)
        assert "stopped at an earlier error" in found["after"], found


class _Boom(torch.nn.Module):
    """Raises in its forward on one rank, from the given step on."""

    def __init__(self, rank: int, step: int) -> None:
        super().__init__()
        self.rank, self.step, self.calls = rank, step, 0
        self.lin = torch.nn.Linear(pc.IN, pc.IN)

    def forward(self, x):
        self.calls += 1
        import torch.distributed as dist

        if dist.get_rank() == self.rank and self.calls > self.step * pc.MICRO:
            raise FloatingPointError(f"boom in rank {self.rank}")
        return self.lin(x)


def _stage_raises(role, mode):
    from fleetlike import fleet

    fleet.init(role, strategy=pc.strategy(mode, 2, 2))
    net = pc.make_net()
    net[5] = _Boom(rank=1, step=2)  # stage 1 of pipeline 0, at the third step
    model = fleet.distributed_model(net, loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(pc.make_opt("momentum", model.parameters()))
    hcg = fleet.get_hybrid_communicate_group()
    start = time.monotonic()
    try:
        for step in range(5):
            model.train_batch(pc.my_batch(step, hcg.get_data_parallel_rank(), 2), opt)
        return "no error", 0.0
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    finally:
        fleet.shutdown()


@pytest.mark.parametrize("mode", ["1F1B", "FThenB"])
def test_a_stage_that_raises_ends_every_rank_with_its_error(mode):
    results = run_ranks(_stage_raises, 4, mode, timeout=90)
    for rank, (message, took) in enumerate(results):
        assert "boom in rank 1" in message, (rank, message)
        assert took < 30, (rank, took)
    assert results[1][0].startswith("FloatingPointError")  # the origin: its own exception
    assert all(m.startswith("PipelineStageError") for r, (m, _) in enumerate(results) if r != 1), results

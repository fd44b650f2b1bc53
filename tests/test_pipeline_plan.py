"""The pipeline planner (`fleetlike.plan.pipeline`): its step-time formula, and per-stage
memory that matches what a pipelined rank really holds (tests/test_pipeline_state.py measures
the same model on real ranks: 624 and 533 parameters, AdamW's two moments each)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipeline_common as pc
from fleetlike.plan import Cluster, Links
from fleetlike.plan.memory import optimizer_state_bytes
from fleetlike.plan.pipeline import format_pipeline_table, pipeline_step_seconds, predict_pipeline, rank_shapes


def test_the_step_formula_is_the_bubble_for_equal_stages_and_the_slowest_stage_otherwise():
    for p, m in ((2, 4), (4, 8), (4, 16)):
        step = pipeline_step_seconds([1.0] * p, m)
        assert step == m + p - 1
        assert 1 - m / step == pytest.approx((p - 1) / (m + p - 1))  # idle share of each stage
    assert pipeline_step_seconds([1.0, 3.0], 4) == 1 + 3 + 3 * 3


def test_memory_per_stage_is_its_share_and_the_schedules_activations():
    x, y = pc.global_batch(0)
    pred = {mode: predict_pipeline(pc.make_net(), x, y, F.cross_entropy, pp=2, micro_batches=4, schedule=mode)
            for mode in ("1F1B", "FThenB")}
    for p in pred.values():
        assert [s.params for s in p.stages] == [624, 533]  # as the ranks hold them
        assert [s.param_bytes for s in p.stages] == [4 * 624, 4 * 533]
        assert [s.optimizer_bytes for s in p.stages] == [8 * 624, 8 * 533]  # AdamW: two moments
        assert all(s.activation_bytes > 0 and s.forward_s > 0 and s.backward_s > 0 for s in p.stages)
        assert p.bubble == pytest.approx(1 / 5)
    assert [s.held_micro_batches for s in pred["1F1B"].stages] == [2, 1]
    assert [s.held_micro_batches for s in pred["FThenB"].stages] == [4, 4]
    assert pred["FThenB"].peak_bytes > pred["1F1B"].peak_bytes


def test_shapes_are_ranked_with_link_costs():
    x, y = pc.global_batch(0)
    cluster = Cluster(1, 4)
    links = Links.from_rates(intra=(50e-6, 1e9), inter=(50e-6, 1e8), cluster=cluster)
    rows = rank_shapes(pc.make_net(), torch.cat([x, x]), torch.cat([y, y]), F.cross_entropy, world=4,
                       micro_batches=4, links=links, cluster=cluster)
    shapes = {(r.dp, r.pp, r.schedule) for r in rows}
    assert shapes == {(4, 1, "FThenB"), (2, 2, "1F1B"), (2, 2, "FThenB"), (1, 4, "1F1B"), (1, 4, "FThenB")}
    assert [r.step_s for r in rows] == sorted(r.step_s for r in rows)
    assert all(r.average_s > 0 for r in rows if r.dp > 1) and all(s.send_s > 0 for r in rows if r.pp > 1 for s in r.stages)
    table = format_pipeline_table(rows)
    assert "dp1 x pp4 1F1B m=4" in table and "bubble" in table
    small = rank_shapes(pc.make_net(), torch.cat([x, x]), torch.cat([y, y]), F.cross_entropy, world=4,
                        micro_batches=4, memory_limit=min(r.peak_bytes for r in rows))
    assert all(r.peak_bytes == min(q.peak_bytes for q in rows) for r in small)


def test_shapes_are_listed_for_each_micro_batch_count_with_their_bubble():
    x, y = pc.global_batch(0)
    rows = rank_shapes(pc.make_net(), x, y, F.cross_entropy, world=2, micro_batches=(2, 4, 8), reps=1)
    got = {(r.dp, r.pp, r.schedule, r.micro_batches) for r in rows}
    assert got == {(2, 1, "FThenB", 2), *((1, 2, mode, m) for m in (2, 4, 8) for mode in ("1F1B", "FThenB"))}
    for r in rows:
        assert r.bubble == pytest.approx((r.pp - 1) / (r.micro_batches + r.pp - 1))
    table = format_pipeline_table(rows)
    assert "dp1 x pp2 1F1B m=8" in table and "dp1 x pp2 FThenB m=2" in table


def _held(role):
    """Per schedule: this rank's stage, its parameter, gradient and optimizer-state bytes after
    a step, and the peak bytes autograd kept saved during one step (each block metered)."""
    from fleetlike import fleet
    from fleetlike.plan.saved import Metered, SavedBytesMeter

    def nbytes(t):
        return 0 if t is None else t.numel() * t.element_size()

    out = {}
    for mode in ("1F1B", "FThenB"):
        fleet.init(role, strategy=pc.strategy(mode, 2))
        meter = SavedBytesMeter()
        net = torch.nn.Sequential(*[Metered(block, meter) for block in pc.make_net()])
        model = fleet.distributed_model(net, loss_fn=F.cross_entropy)
        opt = fleet.distributed_optimizer(pc.make_opt("adamw", model.parameters()))
        x, y = pc.my_batch(0, 0, 1)
        model.train_batch((x, y), opt)
        params = list(model.parameters())
        # the parameters and the caller's batch are held anyway: no activations
        meter.params = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
        meter.enabled = True
        model.train_batch((x, y), opt)
        meter.enabled = False
        out[mode] = {"stage": model.hcg.stage_id, "params": sum(nbytes(p) for p in params),
                     "grads": sum(nbytes(p.grad) for p in params),
                     "optimizer": optimizer_state_bytes(opt),
                     "activations": meter.peak}
        fleet.shutdown()
    return out


def test_the_prediction_is_what_the_real_ranks_hold_under_each_schedule():
    """Tensor bytes, not time: each stage's parameters, gradients and optimizer state, and the
    activations its schedule keeps in flight (1F1B: ``p - s`` micro-batches, GPipe: all ``m``),
    as the planner predicts them, against a real 2-stage job; and the schedules ranked by peak
    memory as the real stages rank them."""
    from fleetlike.plan.pipeline import stage_memory
    from fleetlike.testing import run_ranks

    measured = run_ranks(_held, 2, timeout=90)
    x, y = pc.my_batch(0, 0, 1)
    pred = {mode: predict_pipeline(pc.make_net(), x, y, F.cross_entropy, pp=2, micro_batches=pc.MICRO,
                                   schedule=mode, optimizer=lambda ps: pc.make_opt("adamw", ps), reps=1)
            for mode in ("1F1B", "FThenB")}
    for rank_out in measured:
        for mode, got in rank_out.items():
            sp = pred[mode].stages[got["stage"]]
            assert got["params"] == sp.param_bytes and got["grads"] == sp.param_bytes, (mode, got, sp)
            assert got["optimizer"] == sp.optimizer_bytes, (mode, got, sp)
            assert got["activations"] == sp.held_micro_batches * sp.activation_bytes, (mode, got, sp)
        stage = rank_out["1F1B"]["stage"]
        by_pred = sorted(pred, key=lambda mode: stage_memory(pred[mode].stages[stage]).activations)
        by_real = sorted(rank_out, key=lambda mode: rank_out[mode]["activations"])
        assert by_pred == by_real == ["1F1B", "FThenB"], (stage, by_pred, by_real)
    assert [r["1F1B"]["stage"] for r in measured] == [0, 1]

"""The pipeline planner (`fleetlike.plan.pipeline`): its step-time formula, and per-stage
memory that matches what a pipelined rank really holds (tests/test_pipeline_state.py measures
the same model on real ranks: 624 and 533 parameters, AdamW's two moments each)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipeline_common as pc
from fleetlike.plan import Cluster, Links
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

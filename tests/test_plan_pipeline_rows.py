"""Pipeline candidates in the planner's table (`fleetlike.plan.pipeline_rows`): one row per
``pp`` degree dividing the world and micro-batch count, with the bubble, the memory of the
fullest stage and the strategy it saves; a model over one rank's memory but under it when
split is recommended a pipeline or sharding row, and data parallel says why not."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fleetlike import DistributedStrategy
from fleetlike.plan import Cluster, Links, ModelSpec, format_table, plan
from fleetlike.plan.cli import main as plan_main
from fleetlike.plan.pipeline import rank_shapes
from fleetlike.plan.pipeline_rows import pipeline_rows
from fleetlike.plan.spec import OptimizerKind

CLUSTER = Cluster(1, 4)
LINKS = Links.from_rates(intra=(50e-6, 1e9), inter=(100e-6, 1e8), cluster=CLUSTER)
BATCH = 4  # rows per rank: activations small beside the parameters


def build(batch_size: int):
    """Eight equal blocks of 256 x 256: the parameters (and momentum) dominate a rank's memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(7)],
                                torch.nn.Linear(256, 10))
    g = torch.Generator().manual_seed(1)
    feed = {"x": torch.randn(batch_size, 256, generator=g), "y": torch.randint(0, 10, (batch_size,), generator=g)}
    return model, lambda m, f: F.cross_entropy(m(f["x"]), f["y"]), feed


def build_unsplittable(batch_size: int):
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    return Net(), lambda m, f: m(f[0]).sum(), (torch.randn(batch_size, 8), torch.zeros(batch_size))


def _spec(builder=build) -> ModelSpec:
    return ModelSpec(builder, BATCH, OptimizerKind.MOMENTUM.factory(0.01))


def test_rows_for_each_degree_and_count_with_the_bubble_and_the_strategy_they_save():
    rows, skipped = pipeline_rows(_spec(), CLUSTER, LINKS, micro_batches=(2, 4, 8), reps=1)
    assert skipped == []
    got = {(r.prediction.dp, r.prediction.pp, r.prediction.micro_batches): r for r in rows}
    assert set(got) == {(2, 2, 2), (2, 2, 4), (2, 2, 8), (1, 4, 2), (1, 4, 4), (1, 4, 8)}
    for (dp, pp, m), r in got.items():
        pred = r.prediction
        assert pred.bubble == pytest.approx((pp - 1) / (m + pp - 1))
        assert pred.schedule == ("1F1B" if m >= pp else "FThenB")  # 1F1B wherever it applies
        assert r.cost.seconds == pytest.approx(pred.step_s) and r.cost.seconds > r.cost.compute > 0
        fullest = max(pred.stages, key=lambda s: s.peak_bytes)
        assert r.memory.peak - max(r.memory.update, r.memory.activations) == \
            fullest.peak_bytes - fullest.held_micro_batches * fullest.activation_bytes  # kept, as rank_shapes sizes it
        assert r.memory.update == 0  # SGD + momentum, single-tensor: no temporaries
        assert r.candidate.name == f"pipeline_pp{pp}_m{m}"
        s = DistributedStrategy.from_dict(dict(r.candidate.options)).to_dict(non_default_only=True)
        assert s["pipeline"] is True and s["hybrid_configs"] == {"dp_degree": dp, "pp_degree": pp}
        assert s["pipeline_configs"]["accumulate_steps"] == m
    # each stage holds its share: four stages' fullest holds about half of two stages' parameters
    p2, p4 = got[(2, 2, 4)].memory.params, got[(1, 4, 4)].memory.params
    assert p4 < 0.6 * p2
    # the same shapes as rank_shapes gives on the same batch (the row is its prediction, reused)
    model, loss, feed = build(CLUSTER.world_size * BATCH)
    direct = rank_shapes(model, feed["x"], feed["y"], F.cross_entropy, world=4, micro_batches=(2, 4, 8),
                         schedules=("1F1B",), reps=1,
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9))
    assert {(p.pp, p.micro_batches): p.peak_bytes for p in direct if p.pp > 1} == \
        {(pp, m): got[(dp, pp, m)].memory.peak for (dp, pp, m) in got if m >= pp}
    # AdamW's update makes two copies of the stage's largest parameter (fleetlike.plan.temporaries)
    adamw = ModelSpec(build, BATCH, OptimizerKind.ADAMW.factory(0.01))
    rows, _ = pipeline_rows(adamw, CLUSTER, LINKS, micro_batches=(4,), reps=1)
    assert all(r.memory.update == 2 * 256 * 256 * 4 for r in rows)


def test_rows_that_cannot_apply_say_why():
    rows, skipped = pipeline_rows(_spec(build_unsplittable), CLUSTER, LINKS)
    assert rows == [] and skipped[0][0] == "pipeline" and "not an nn.Sequential" in skipped[0][1]
    rows, skipped = pipeline_rows(_spec(), Cluster(1, 1), LINKS)
    assert rows == [] and "one rank" in skipped[0][1]
    rows, skipped = pipeline_rows(_spec(), Cluster(1, 4), LINKS, micro_batches=(3, 4), reps=1)
    assert {r.candidate.name for r in rows} == {"pipeline_pp2_m4", "pipeline_pp4_m4"}
    assert ("pipeline_pp2_m3", "3 micro-batches do not divide a pipeline's 8 rows (batch 4/rank x 2 stages)") in skipped
    result = plan(_spec(build_unsplittable), CLUSTER, LINKS, only=["dp", "pipeline"])
    assert "pipeline                 skipped: the model is a Net" in format_table(result)


def test_a_model_over_one_ranks_memory_is_recommended_a_split():
    result = plan(_spec(), CLUSTER, LINKS, only=["dp", "sharding", "pipeline"], micro_batches=(4,))
    rows = {r.name: r for r in result.rows}
    assert {"pipeline_pp2_m4", "pipeline_pp4_m4"} <= set(rows)
    dp_peak, pp_peak = rows["dp"].memory.peak, rows["pipeline_pp4_m4"].memory.peak
    assert pp_peak < dp_peak / 2
    limit = (dp_peak + pp_peak) // 2
    result = plan(_spec(), CLUSTER, LINKS, only=["dp", "sharding", "pipeline"], micro_batches=(4,), memory_limit=limit)
    best = result.recommended
    assert best is not None and best.name.startswith(("pipeline", "sharding")) and best.memory.peak <= limit
    table = format_table(result)
    assert "dp: does not fit: needs" in table and "bubble 0.43" in table  # pp4, m=4: 3/7
    assert f"recommended: {best.name}, the fastest that fits" in table


def test_cli_lists_pipeline_rows_and_saves_the_recommended_pipeline(capsys, tmp_path):
    out, js = tmp_path / "s.json", tmp_path / "t.json"
    args = ["--model", f"{__name__}:build", "--batch_size", str(BATCH), "--cluster", "1x4", "--intra", "50,1000",
            "--inter", "100,100", "--only", "dp,pipeline", "--micro_batches", "4", "--json", str(js)]
    assert plan_main(args) == 0
    table = json.loads(js.read_text())
    rows = {r["name"]: r for r in table["rows"]}
    assert {"pipeline_pp2_m4", "pipeline_pp4_m4"} <= set(rows)
    limit = max(r["memory"]["peak"] for n, r in rows.items() if n.startswith("pipeline"))
    assert limit < rows["dp"]["memory"]["peak"]
    assert plan_main([*args, "--memory", str(limit), "--save", str(out), "--show"]) == 0
    text = capsys.readouterr().out
    assert "pipeline_pp2_m4" in text and "no program listing to annotate" in text
    saved = DistributedStrategy.load(out).to_dict(non_default_only=True)
    assert saved["pipeline"] is True and saved["hybrid_configs"]["pp_degree"] in (2, 4)
    assert plan_main([*args, "--micro_batches", "0,x"]) == 2
    assert "--micro_batches '0,x' does not parse" in capsys.readouterr().err

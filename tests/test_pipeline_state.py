"""Pipelined models beyond the eager step: the program style, checkpoints (per stage, consolidated,
into plain models and back, a resume that continues exactly), recompute and bfloat16 AMP inside
a stage, and what each rank holds. Real ranks over gloo; references as in test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipeline_common as pc
from fleetlike.testing import run_ranks

TOL = 1e-5


def _program_style(role):
    import fleetlike
    from fleetlike import fleet

    s = pc.strategy("1F1B", 2)
    fleet.init(role, strategy=s)
    model = fleet.distributed_model(pc.make_net())
    opt = fleet.distributed_optimizer(pc.make_opt("momentum", model.parameters()))
    opt.minimize(F.cross_entropy, model)
    exe = fleetlike.Executor(fleet.device())
    exe.run(fleet.startup_program)
    losses = []
    for step in range(pc.STEPS):
        x, y = pc.my_batch(step, 0, 1)
        losses.append(exe.run(fleet.main_program, feed={"x": x, "y": y}, fetch_list=["loss"])[0])
    err = pc.relative_error(fleet.full_state_dict(model), pc.single_process("momentum"))
    text = str(fleet.main_program)
    try:
        exe.run(fleet._origin_program, feed={"x": x, "y": y})
        origin = "ran"
    except RuntimeError as exc:
        origin = str(exc)
    fleet.shutdown()
    return err, losses, text, origin


def test_program_style_runs_one_pipelined_step_per_run():
    results = run_ranks(_program_style, 2, timeout=90)
    for err, losses, text, origin in results:
        assert err < TOL, err
        assert "pipeline_train_batch" in text and "send_v2/recv_v2" in text, text
        assert "has no local step" in origin
    assert results[0][1] == results[1][1] and len(results[0][1]) == pc.STEPS


def _checkpoints(role, tmp):
    from fleetlike import fleet
    from fleetlike.pipeline.checkpoint import consolidated_state_dict, stage_files

    s = pc.strategy("1F1B", 2)
    fleet.init(role, strategy=s)
    model = fleet.distributed_model(pc.make_net(), loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(pc.make_opt("adamw", model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    fleet.register_state("sched", sched)
    for step in range(3):
        model.train_batch(pc.my_batch(step, 0, 1), opt, lr_scheduler=sched)
    fleet.save_persistables(None, tmp)
    at_save = fleet.full_state_dict(model)
    for step in range(3, pc.STEPS):
        model.train_batch(pc.my_batch(step, 0, 1), opt, lr_scheduler=sched)
    straight = fleet.full_state_dict(model)
    fleet.shutdown()
    out = {"files": sorted(p.name for p in stage_files(tmp))}

    # resume in a new job of the same shape: continues exactly
    fleet.init(role, strategy=s)
    model = fleet.distributed_model(pc.make_net(seed=7), loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(pc.make_opt("adamw", model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    fleet.register_state("sched", sched)
    fleet.load_persistables(None, tmp)
    out["loaded"] = pc.relative_error(fleet.full_state_dict(model), at_save)
    for step in range(3, pc.STEPS):
        model.train_batch(pc.my_batch(step, 0, 1), opt, lr_scheduler=sched)
    out["resumed"] = max(float((a - b).abs().max()) for a, b in
                         zip(fleet.full_state_dict(model).values(), (straight[k] for k in fleet.full_state_dict(model))))
    # a plain (single-process) model's state into the pipeline
    plain = pc.single_process("momentum", steps=2)
    model.load_state_dict(plain)
    out["plain_into_pipeline"] = max(float((fleet.full_state_dict(model)[k] - v).abs().max()) for k, v in plain.items())
    fleet.shutdown()

    # the stage files into one stage (dp over both ranks: plain data parallel's layout)
    fleet.init(role, strategy=pc.strategy("1F1B", 1))
    model = fleet.distributed_model(pc.make_net(seed=9), loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(pc.make_opt("adamw", model.parameters()))
    fleet.load_persistables(None, tmp)
    out["one_stage"] = pc.relative_error(fleet.full_state_dict(model), at_save)
    out["one_stage_adam_steps"] = sorted({int(st["step"]) for st in opt.state.values()})
    fleet.shutdown()

    # and into the plain model
    net = pc.make_net(seed=3)
    net.load_state_dict(consolidated_state_dict(tmp))
    out["consolidated"] = pc.relative_error(net.state_dict(), at_save)
    return out


def test_checkpoints_per_stage_resume_exactly_and_load_into_plain_models(tmp_path):
    for out in run_ranks(_checkpoints, 2, str(tmp_path), timeout=120):
        assert out["files"] == ["stage-0-of-2.pt", "stage-1-of-2.pt"], out
        assert out["loaded"] == 0.0 and out["resumed"] == 0.0, out
        assert out["plain_into_pipeline"] == 0.0, out
        assert out["one_stage"] == 0.0 and out["one_stage_adam_steps"] == [3], out
        assert out["consolidated"] == 0.0, out


def _recompute_amp(role):
    from fleetlike import fleet

    out = {}
    for name, extra, want in (
        ("recompute", {"recompute": True, "recompute_configs": {"checkpoints": ["1", "2", "5"]}},
         lambda: pc.single_process("momentum")),
        ("amp", {"amp": True, "amp_configs": {"dtype": "bfloat16"}},
         lambda: pc.single_process("momentum", amp=True)),
    ):
        s = pc.strategy("FThenB", 2, **extra)
        fleet.init(role, strategy=s)
        model, _, _ = pc.train_pipeline(s, "momentum")
        got = fleet.full_state_dict(model)
        out[name] = (pc.relative_error(got, want()), pc.relative_error(got, pc.single_process("momentum")),
                     [str(e) for e in fleet.applied_strategy()])
        fleet.shutdown()
    return out


def test_recompute_and_bf16_amp_inside_a_stage():
    for out in run_ranks(_recompute_amp, 2, timeout=120):
        err, _, applied = out["recompute"]
        assert err < TOL, err
        assert any("recompute: applied" in a for a in applied), applied
        err, off_fp32, applied = out["amp"]
        assert err < 1e-3, err  # the same bf16 math in one process
        assert off_fp32 > 1e-4  # really ran in bfloat16
        assert any("amp: applied" in a for a in applied), applied


def _holds(role):
    from fleetlike import fleet

    s = pc.strategy("1F1B", 2)
    fleet.init(role, strategy=s)
    net = pc.make_net()
    total = sum(p.numel() for p in net.parameters())
    model = fleet.distributed_model(net, loss_fn=F.cross_entropy)
    opt = fleet.distributed_optimizer(pc.make_opt("adamw", model.parameters()))
    model.train_batch(pc.my_batch(0, 0, 1), opt)
    # eval_batch: the mean micro-batch loss and the last stage's output, on every rank
    x, y = pc.my_batch(1, 0, 1)
    loss = float(model.eval_batch((x, y)))
    out = model.eval_batch((x, y), compute_loss=False)
    plain = pc.make_net(seed=5)
    plain.load_state_dict(fleet.full_state_dict(model))
    with torch.no_grad():
        want_out = plain(x)
        want_loss = float(torch.stack([F.cross_entropy(plain(a), b) for a, b in zip(x.chunk(pc.MICRO), y.chunk(pc.MICRO))]).mean())
    evals = (abs(loss - want_loss), float((out - want_out).abs().max()))
    share = model.plan.param_counts()[model.hcg.stage_id]
    held = sum(p.numel() for p in net.parameters() if not p.is_meta)  # the user's model object
    mine = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    fleet.shutdown()
    return total, share, held, mine, state, evals


def test_each_rank_holds_only_its_stage_and_its_optimizer_state():
    results = run_ranks(_holds, 2, timeout=90)
    assert sum(r[1] for r in results) == results[0][0]
    for total, share, held, mine, state, _ in results:
        assert held == mine == share < total
        assert state == 2 * share  # AdamW's two moments of this stage's parameters only


def test_eval_batch_gives_the_loss_and_the_output_on_every_rank():
    for *_, (loss_err, out_err) in run_ranks(_holds, 2, timeout=90):
        assert loss_err < 1e-6 and out_err < 1e-6, (loss_err, out_err)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_pipeline_example_runs_under_the_launcher(tmp_path):
    import sys
    from pathlib import Path

    from examples_common import clean_env
    from helpers import run_job

    root = Path(__file__).resolve().parent.parent
    proc = run_job([sys.executable, "-m", "fleetlike.launch", "--nproc_per_node=2", "--started_port=auto",
                    "--log_dir", str(tmp_path / "log"), str(root / "examples/pipeline/train.py")], cwd=root,
                   env=clean_env(STEPS="6", MODEL_PATH=str(tmp_path / "ckpt")), timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:]
    logs = [(tmp_path / "log" / f"workerlog.{r}").read_text() for r in range(2)]
    for rank, log in enumerate(logs):
        assert f"stage {rank} of 2" in log and "step 5 loss" in log, log[-2000:]
        assert "['stage-0-of-2.pt', 'stage-1-of-2.pt']" in log, log[-2000:]
    last = [[line for line in log.splitlines() if line.startswith("step 5 loss")] for log in logs]
    assert last[0] == last[1]  # the loss is returned on every stage

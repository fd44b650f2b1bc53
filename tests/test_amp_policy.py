"""TI-ACC's adaptive mixed precision: the policy object against an independent
implementation of its three rules on generated epoch / lr / loss traces, and
``amp_configs.policy`` switching AMP on and off between steps on real ranks in both styles
without losing the loss scaler's state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_common import batch, loss_fn, make_model
from fleetlike import DistributedStrategy
from fleetlike.strategies.amp_policy import AdaptiveAmpPolicy, MixedPrecision_TrainingPolicy
from fleetlike.testing import run_ranks


def reference(kind: str, p: dict[str, Any], lrs: list[float], losses: list[float]) -> list[bool]:
    """The rules as the module docstring states them, computed from the whole trace at once."""
    changes = [t for t in range(1, len(lrs)) if lrs[t] != lrs[t - 1]]
    out = []
    for t in range(len(lrs)):
        window = p["start_time"] <= t and (p["end_time"] is None or t <= p["end_time"])
        if kind == "time":
            out.append(window)
        elif kind == "time_lr":
            last = max((c for c in changes if c <= t), default=None)
            out.append(window and not (last is not None and t < last + p["hold_time"]))
        else:
            j = t // p["interval_time"]
            checking = j >= 1 and t < j * p["interval_time"] + p["interval_hold_time"]
            if not checking or t == 0:
                out.append(True)
            else:
                d = (losses[t - 1] - losses[t]) / abs(losses[t - 1])
                out.append(p["loss_slow"] <= d <= p["loss_fast"])
    return out


@st.composite
def traces(draw: st.DrawFn) -> tuple[str, dict[str, Any], list[float], list[float]]:
    n = draw(st.integers(1, 80))
    kind = draw(st.sampled_from(["time", "time_lr", "loss"]))
    start = draw(st.integers(0, 30))
    end = draw(st.one_of(st.none(), st.integers(start, 90)))
    params = {
        "start_time": start, "end_time": end, "hold_time": draw(st.integers(0, 10)),
        "interval_time": draw(st.integers(1, 25)), "interval_hold_time": draw(st.integers(0, 12)),
        "loss_fast": draw(st.sampled_from([0.05, 0.3, 0.5])), "loss_slow": draw(st.sampled_from([-0.1, 0.0, 0.01])),
    }
    decays = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=4)))
    lrs = [0.1 * 0.5 ** sum(1 for d in decays if d <= t) for t in range(n)]
    losses = draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n))
    return kind, params, lrs, losses


@settings(max_examples=300, deadline=None)
@given(traces())
def test_policy_equals_the_reference_rules(case: tuple[str, dict[str, Any], list[float], list[float]]) -> None:
    kind, params, lrs, losses = case
    policy = AdaptiveAmpPolicy(kind, **params)
    got = [policy.enable_mixed_precision(t, lr=lrs[t], loss=losses[t]) for t in range(len(lrs))]
    assert got == reference(kind, params, lrs, losses)
    # every change of answer is logged once, with its time
    flips = [t for t in range(len(got)) if t == 0 or got[t] != got[t - 1]]
    assert [s[0] for s in policy.switches] == flips and [s[1] for s in policy.switches] == [got[t] for t in flips]
    # the state resumes: a fresh policy loaded halfway gives the same second half
    half = len(lrs) // 2
    first = AdaptiveAmpPolicy(kind, **params)
    for t in range(half):
        first.decide(t, lrs[t], losses[t])
    second = AdaptiveAmpPolicy(kind, **params)
    second.load_state_dict(first.state_dict())
    assert [second.decide(t, lrs[t], losses[t])[0] for t in range(half, len(lrs))] == got[half:]


def test_ti_acc_names_and_bad_input() -> None:
    p = MixedPrecision_TrainingPolicy(0, start_time=2, end_time=3)
    assert [p.enable_mixed_precision(e, scaler=object()) for e in range(5)] == [False, False, True, True, False]
    assert AdaptiveAmpPolicy(2).policy == "loss" and AdaptiveAmpPolicy("always").decide(0)[0]
    with pytest.raises(TypeError):
        MixedPrecision_TrainingPolicy(0, 2, 3, 4, 5, 6, 7)  # more values than TI-ACC has
    with pytest.raises(ValueError, match="not one of TI-ACC's 0"):
        AdaptiveAmpPolicy(3)
    with pytest.raises(ValueError, match="'tim' is not one of"):
        AdaptiveAmpPolicy("tim")
    with pytest.raises(ValueError, match="needs hold_time"):
        AdaptiveAmpPolicy("time_lr")
    with pytest.raises(ValueError, match="end_time=1 is before start_time=5"):
        AdaptiveAmpPolicy("time", start_time=5, end_time=1)
    with pytest.raises(ValueError, match="needs the learning rate"):
        AdaptiveAmpPolicy("time_lr", hold_time=2).decide(0)
    with pytest.raises(TypeError, match="start_time='10'"):
        AdaptiveAmpPolicy("time", start_time="10")  # type: ignore[arg-type]
    s = DistributedStrategy(amp=True)
    with pytest.raises(ValueError, match="policy_end_time=2 is before amp_configs.policy_start_time=10"):
        s.amp_configs = {"policy": "time", "policy_end_time": 2}
    assert s.amp_configs["policy"] == "always"  # the failed update changed nothing


# ---------------------------------------------------------------------- real ranks


def _run(role: Any, style: str, cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    from fleetlike import Executor, fleet

    s = DistributedStrategy(amp=True)
    s.amp_configs = {"init_loss_scaling": 8.0, "incr_every_n_steps": 1, "dtype": "float16", **cfg}
    on, scales, dtypes = [], [], []
    with fleet.session(role):
        if style == "eager":
            model = fleet.distributed_model(make_model(0))
            opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), s)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            for step in range(steps):
                feed = batch(step, role.rank)
                opt.zero_grad()
                out = model(feed["x"])
                dtypes.append(str(out.dtype))
                loss = torch.nn.functional.cross_entropy(out.float(), feed["y"])
                loss.backward()
                opt.step(loss=loss)
                sched.step()
                on.append(opt.step_info["amp_enabled"])
                scales.append(opt.step_info["loss_scale"])
            state = opt.state_dict()["fleetlike"]
        else:
            model = make_model(0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            fleet.distributed_optimizer(opt, s).minimize(loss_fn, model)
            exe = Executor()
            exe.run(fleet.startup_program)
            for step in range(steps):
                enabled, scale = exe.run(fleet.main_program, feed=batch(step, role.rank),
                                         fetch_list=["amp_enabled", "loss_scale"])
                on.append(enabled)
                scales.append(scale)
            state = None
            dtypes = [str(fleet.main_program)]
        applied = [str(e) for e in fleet.applied_strategy()]
    return {"on": on, "scales": scales, "dtypes": dtypes, "applied": applied, "state": state}


def _both(role: Any) -> list[dict[str, Any]]:
    return [
        _run(role, "program", {"policy": "time", "policy_start_time": 3, "policy_end_time": 5}, 7),
        _run(role, "eager", {"policy": "time", "policy_start_time": 3, "policy_end_time": 5}, 7),
        # StepLR halves the lr after steps 3 and 6 (seen at steps 4 and 7): off for 2 steps each time
        _run(role, "eager", {"policy": "time_lr", "policy_start_time": 1, "policy_hold_time": 2}, 9),
    ]


@pytest.mark.timeout(120)
def test_policy_switches_amp_between_steps_in_both_styles() -> None:
    results = run_ranks(_both, 2, timeout=100)
    for rank in range(2):
        program, eager, time_lr = results[rank]
        expected = [False, False, True, True, True, False, False]
        assert program["on"] == expected and eager["on"] == expected
        # the scale doubles at each enabled finite step (incr_every_n_steps=1) and waits while off
        assert program["scales"] == [8.0, 8.0, 16.0, 32.0, 64.0, 64.0, 64.0] == eager["scales"]
        assert eager["dtypes"] == ["torch.float32"] * 2 + ["torch.float16"] * 3 + ["torch.float32"] * 2
        assert "amp_policy policy=time" in program["dtypes"][0]
        line = [a for a in eager["applied"] if a.startswith("amp_configs.policy")]
        assert line == ["amp_configs.policy: applied (time: AMP off since step 6 (outside the AMP window); 3 switch(es))"]
        assert time_lr["on"] == [True, True, True, False, False, True, False, False, True]
        assert eager["state"][0]["amp"]["policy"]["steps"] == 7 and eager["state"][0]["amp"]["scale"] == 64.0

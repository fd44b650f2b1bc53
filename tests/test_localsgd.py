"""Local SGD and adaptive local SGD on real gloo ranks, against an in-process simulation of N
ranks, torch's PeriodicModelAverager, the adaptive-k formula and an interrupted run."""

from __future__ import annotations

import math
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fleetlike.strategies import DistributedStrategy, adaptive_local_step, get_local_sgd_steps
from fleetlike.strategies.localsgd import K_MAX, K_MIN, adaptive_k
from fleetlike.testing import run_ranks
from helpers import max_diff, params, regression_batch
from helpers import mse as loss_fn

IN, HID, OUT, BATCH = 5, 7, 2, 6
TOL = 1e-6


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return regression_batch(step * 7919 + rank, BATCH, IN, OUT, 1.0 + rank)


def lr_at(step: int) -> float:
    """A decaying learning rate, set into param_groups as a scheduler would."""
    return 0.2 * 0.75 ** (step // 4)


def strategy(cfg: dict) -> DistributedStrategy:
    s = DistributedStrategy()
    if cfg.get("adaptive"):
        s.adaptive_localsgd = True
        s.adaptive_localsgd_configs = {"init_k_steps": cfg["k"], "begin_step": cfg["begin"]}
    else:
        s.localsgd = True
        s.localsgd_configs = {"k_steps": cfg["k"], "begin_step": cfg["begin"]}
    s.nccl_comm_num = cfg.get("rings", 1)
    s.fuse_all_reduce_ops = cfg.get("fuse", True)
    return s


def uses_main(cfg: dict, step: int) -> bool:
    """The manual recipe of seed 003 (step counted from 0 here, as in the seed's loop)."""
    return cfg.get("recipe_k") is None or step % cfg["recipe_k"] == 0


INFO = ["loss", "localsgd_k", "localsgd_averaged", "localsgd_averages", "bytes_communicated"]


# ---------------------------------------------------------------------- rank functions


def eager_step(model, opt, feed: dict[str, torch.Tensor], lr: float | None = None) -> float:
    """The user's loop, one step: (a scheduler's lr,) zero_grad, forward, backward, step(loss=)."""
    if lr is not None:
        for g in opt.param_groups:
            g["lr"] = lr
    opt.zero_grad()
    loss = loss_fn(model, feed)
    loss.backward()
    opt.step(loss=loss)  # adaptive k needs the loss; the fixed schedule ignores it
    return float(loss.detach())


def _train(role, cfg):
    from fleetlike import fleet

    with fleet.session(role):
        if cfg.get("style") == "eager":
            trace, text, errors = _eager_trace(role, cfg), None, {}
        else:
            trace, text, errors = _program_trace(role, cfg)
        applied = [str(e) for e in fleet.applied_strategy()]
    return {"trace": trace, "program": text, "applied": applied, "errors": errors}


def _program_trace(role, cfg):
    from fleetlike import Executor, fleet

    model = make_model(role.rank)  # the startup program makes it rank 0's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = {}
    if cfg.get("adaptive"):
        for name, candidate in [("adam", torch.optim.Adam(model.parameters())),
                                ("momentum", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))]:
            try:
                fleet.distributed_optimizer(candidate, strategy(cfg)).minimize(loss_fn, model)
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
    fleet.distributed_optimizer(opt, strategy(cfg)).minimize(loss_fn, model)
    exe = Executor()
    exe.run(fleet.startup_program)
    if cfg.get("load"):
        fleet.load_persistables(exe, f"{cfg['load']}/{role.rank}")
    trace = []
    for step in range(cfg.get("start", 0), cfg["steps"]):
        if cfg.get("adaptive"):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
        if uses_main(cfg, step):
            values = dict(zip(INFO, exe.run(fleet.main_program, feed=batch(step, role.rank), fetch_list=INFO)))
        else:
            loss, = exe.run(fleet._origin_program, feed=batch(step, role.rank), fetch_list=["loss"])
            values = {"loss": loss, "localsgd_averaged": False}
        trace.append({**values, "step": step, "lr": opt.param_groups[0]["lr"], "params": params(model)})
        if cfg.get("save_at") == step + 1:
            fleet.save_persistables(exe, f"{cfg['save']}/{role.rank}")
    return trace, str(fleet.main_program), errors


def _eager_trace(role, cfg):
    """The same run as a plain PyTorch loop; step_info holds what fetch_list gives."""
    from fleetlike import fleet

    model = fleet.distributed_model(make_model(role.rank))  # broadcasts rank 0's parameters
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy(cfg))
    trace = []
    for step in range(cfg["steps"]):
        loss = eager_step(model, opt, batch(step, role.rank), lr_at(step) if cfg.get("adaptive") else None)
        values = {name: opt.step_info[name] for name in INFO[1:]}
        trace.append({**values, "loss": loss, "step": step, "lr": opt.param_groups[0]["lr"],
                      "params": params(model.module)})
    return trace


def _vs_torch(role, rendezvous, cases, style):
    """Fleet's local SGD next to torch's PeriodicModelAverager on the same ranks and data."""
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from dp_common import torch_group
    from fleetlike import Executor, fleet

    out = []
    with torch_group(role, rendezvous), fleet.session(role):
        for k, begin, steps in cases:
            ours = make_model(role.rank)
            if style == "eager":
                model = fleet.distributed_model(ours)
                opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  strategy({"k": k, "begin": begin}))

                def run_step(step, model=model, opt=opt):
                    eager_step(model, opt, batch(step, role.rank))
            else:
                opt = torch.optim.SGD(ours.parameters(), lr=0.1)
                fleet.distributed_optimizer(opt, strategy({"k": k, "begin": begin})).minimize(loss_fn, ours)
                exe = Executor()
                exe.run(fleet.startup_program)

                def run_step(step, exe=exe):
                    exe.run(fleet.main_program, feed=batch(step, role.rank))
            theirs = make_model(0)
            topt = torch.optim.SGD(theirs.parameters(), lr=0.1)
            averager = PeriodicModelAverager(period=k, warmup_steps=begin - 1)
            worst = 0.0
            for step in range(steps):
                run_step(step)
                loss_fn(theirs, batch(step, role.rank)).backward()
                if step < begin - 1:  # torch's warm-up: DDP's gradient allreduce (PostLocalSGD)
                    for p in theirs.parameters():
                        dist.all_reduce(p.grad)
                        p.grad /= role.world_size
                topt.step()
                # before zero_grad: torch's averager skips parameters whose .grad is None
                averager.average_parameters(theirs.parameters())
                topt.zero_grad()
                worst = max(worst, max_diff(params(ours), params(theirs)))
            out.append(worst)
    return out


# ---------------------------------------------------------------------- the reference


def simulate(world: int, cfg: dict) -> tuple[list[list[list[np.ndarray]]], list[bool], list[list[np.ndarray]]]:
    """N ranks in one process: per step, every rank's parameters, whether it averaged, and the
    mean of the ranks' parameters before averaging (the fixed-k schedule, plain SGD lr 0.1)."""
    models = [make_model(0) for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    counter, last = 1, 0
    per_step, averaged, means = [], [], []
    for step in range(cfg["steps"]):
        for r, (m, o) in enumerate(zip(models, opts)):
            loss_fn(m, batch(step, r)).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        mean = [np.mean(ps, axis=0) for ps in zip(*[params(m) for m in models])]
        did = False
        if uses_main(cfg, step):
            did = counter <= cfg["begin"] or counter - last == cfg["k"]
            if did:
                for m in models:
                    with torch.no_grad():
                        for p, v in zip(m.parameters(), mean):
                            p.copy_(torch.from_numpy(v))
                last = counter
            counter += 1
        per_step.append([params(m) for m in models])
        averaged.append(did)
        means.append(mean)
    return per_step, averaged, means


def expected_steps(begin: int, k: int, steps: int) -> set[int]:
    """Counter values (from 1) that average: {1..begin} ∪ {begin + j*k}."""
    return {c for c in range(1, steps + 1) if c <= begin or (c - begin) % k == 0}


def check_against_simulation(results: list[dict], cfg: dict) -> None:
    world = len(results)
    per_step, averaged, means = simulate(world, cfg)
    for step in range(cfg["steps"]):
        ranks = [res["trace"][step] for res in results]
        assert all(r["localsgd_averaged"] == averaged[step] for r in ranks), step
        for r in range(world):
            assert max_diff(ranks[r]["params"], per_step[step][r]) <= TOL, (step, r)
        if averaged[step]:
            for r in range(world):
                assert max_diff(ranks[r]["params"], means[step]) <= TOL, (step, r)
                assert max_diff(ranks[r]["params"], ranks[0]["params"]) <= TOL
        else:
            assert max_diff(ranks[1]["params"], ranks[0]["params"]) > 1e-4, step


# ---------------------------------------------------------------------- fixed k


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", ["program", "eager"])
@pytest.mark.parametrize("world,cfg", [
    (2, {"k": 3, "begin": 3, "steps": 13}),
    (4, {"k": 2, "begin": 1, "steps": 8, "rings": 2, "fuse": False}),
])
@pytest.mark.slow
def test_fixed_k_averages_to_the_mean_on_schedule(world, cfg, style):
    results = run_ranks(_train, world, {**cfg, "style": style}, timeout=100)
    check_against_simulation(results, cfg)
    want = expected_steps(cfg["begin"], cfg["k"], cfg["steps"])
    got = {t["step"] + 1 for t in results[0]["trace"] if t["localsgd_averaged"]}
    assert got == want
    last = results[0]["trace"][-1]
    assert last["localsgd_averages"] == len(want) and last["localsgd_k"] == cfg["k"]
    nbytes = sum(p.size * 4 for p in last["params"])
    sent = [t["bytes_communicated"] for t in results[0]["trace"]]
    assert sent == [nbytes if t["localsgd_averaged"] else 0 for t in results[0]["trace"]]
    assert any(a.startswith("localsgd: applied") for a in results[0]["applied"])
    if style == "eager":  # no program to print; the rest is the program's listing
        return
    text = results[0]["program"]
    assert f"k={cfg['k']}" in text and f"averages={len(want)}" in text
    assert f"bytes_communicated={nbytes * len(want)}" in text and "c_localsgd_average" in text
    assert "c_allreduce_avg" in text and "optimizer_update" in text
    if not cfg.get("fuse", True):
        assert text.count("comm=ring 1") == 2  # 4 parameters round-robin over 2 communicators


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_manual_recipe_averages_where_main_program_runs():
    cfg = {"k": 1, "begin": 1, "steps": 12, "recipe_k": 3}
    results = run_ranks(_train, 2, cfg, timeout=100)
    check_against_simulation(results, cfg)
    for res in results:
        assert [t["localsgd_averaged"] for t in res["trace"]] == [s % 3 == 0 for s in range(12)]
        assert res["trace"][9]["localsgd_averages"] == 4  # origin runs never advance the counter


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", [pytest.param("program", marks=pytest.mark.slow), "eager"])
def test_matches_torch_periodic_model_averager(style, tmp_path):
    # begin_step 1: PeriodicModelAverager(period=k, warmup_steps=0) exactly; begin_step 3:
    # warmup_steps=2 with gradient allreduce during torch's warm-up (see the module docstring)
    worst = run_ranks(_vs_torch, 2, str(tmp_path / "torch_rendezvous"), [(3, 1, 10), (2, 3, 9)], style, timeout=100)
    assert max(max(w) for w in worst) <= TOL


# ---------------------------------------------------------------------- adaptive k


@given(st.floats(0.01, 100), st.floats(1e-4, 1), st.floats(0.01, 100), st.floats(1e-4, 1), st.integers(1, 8))
def test_adaptive_k_is_the_formula_clipped(loss0, lr0, loss, lr, init):
    k = adaptive_k(loss0, lr0, loss, lr, init)
    assert K_MIN <= k <= K_MAX
    assert k == min(max(math.ceil(math.sqrt(lr0 * loss / (lr * loss0) * init)), 1), 16)


def test_adaptive_k_direction():
    # the learning rate falls faster than the loss: parameters settle, k grows
    assert adaptive_k(2.0, 0.1, 1.8, 0.01, 2) > 2
    # the loss falls faster than the learning rate: k shrinks
    assert adaptive_k(2.0, 0.1, 0.2, 0.08, 4) < 4
    assert adaptive_k(1.0, 0.1, 1.0, 0.1, 4) == 2  # ceil(sqrt(4))
    assert adaptive_k(1.0, 0.1, 1e9, 1e-9, 1) == 16 and adaptive_k(1.0, 0.1, 0.0, 0.1, 1) == 1
    assert adaptive_k(0.0, 0.1, 1.0, 0.1, 1) == 16 and adaptive_k(1.0, 0.1, 1.0, 0.0, 1) == 16


@pytest.mark.timeout(120)
@pytest.mark.parametrize("style", [pytest.param("program", marks=pytest.mark.slow), "eager"])
def test_adaptive_k_follows_loss_and_lr_on_two_ranks(style):
    cfg = {"adaptive": True, "k": 1, "begin": 2, "steps": 40, "style": style}
    results = run_ranks(_train, 2, cfg, timeout=100)
    traces = [r["trace"] for r in results]
    loss0 = (traces[0][0]["loss"] + traces[1][0]["loss"]) / 2
    lr0 = traces[0][0]["lr"]
    k, last, ks = 1, 0, []
    for step in range(cfg["steps"]):
        counter = step + 1
        due = counter <= cfg["begin"] or counter - last == k
        assert all(t[step]["localsgd_averaged"] == due for t in traces), step
        if due:
            if counter > cfg["begin"]:
                loss = (traces[0][step]["loss"] + traces[1][step]["loss"]) / 2
                k = adaptive_k(loss0, lr0, loss, traces[0][step]["lr"], 1)
                ks.append(k)
            last = counter
            assert max_diff(traces[0][step]["params"], traces[1][step]["params"]) <= TOL
        assert all(t[step]["localsgd_k"] == k for t in traces), step
    assert all(1 <= x <= 16 for x in ks) and max(ks) > 1  # lr decays faster than the loss
    assert any(a.startswith("adaptive_localsgd: applied") for a in results[0]["applied"]), results[0]["applied"]
    if style == "eager":
        return
    assert "adaptive_localsgd init_k_steps=1" in results[0]["program"]
    errors = results[0]["errors"]
    assert "Adam" in errors["adam"] and "meaningless" in errors["adam"]
    assert errors["momentum"] is None  # SGD with momentum has one global lr: accepted


# ---------------------------------------------------------------------- save / load


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_from_checkpoint_is_exact():
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"adaptive": True, "k": 2, "begin": 1, "steps": 24, "save_at": 11, "save": tmp}
        full = run_ranks(_train, 2, cfg, timeout=100)
        resumed = run_ranks(_train, 2, {**cfg, "save_at": None, "start": 11, "load": tmp}, timeout=100)
    for a, b in zip(full, resumed):
        tail = a["trace"][11:]
        assert len(tail) == len(b["trace"])
        for x, y in zip(tail, b["trace"]):
            assert max_diff(x["params"], y["params"]) == 0.0, x["step"]
            assert (x["localsgd_k"], x["localsgd_averages"]) == (y["localsgd_k"], y["localsgd_averages"])
    assert full[0]["program"] == resumed[0]["program"]


# ---------------------------------------------------------------------- the manual recipe helpers


def test_seed_recipe_helpers():
    assert [get_local_sgd_steps(p, 4, 2) for p in range(7)] == [1, 1, 1, 2, 4, 4, 4]
    assert [get_local_sgd_steps(p, 6, 0) for p in range(5)] == [1, 2, 4, 6, 6]
    assert adaptive_local_step(2.6, 0.1, 2.6, 0.1, 4, 4) == 4
    assert adaptive_local_step(2.6, 0.1, 1.1, 0.01, 2, 2) == int(2 * math.sqrt(0.1 * 0.5 / (0.01 * 2.0)))
    assert adaptive_local_step(2.6, 0.1, 0.5, 0.1, 4, 4) == 1  # below the assumed floor 0.6
    assert adaptive_local_step(2.6, 1.0, 2.6, 1e-6, 1, 3) == 3  # a jump above pre_step + 20

"""One engine, two faces: the eager style (a plain PyTorch loop) gives the program style's
parameters for every strategy and pair of strategies, on 2 and 4 real gloo ranks; and the
eager-only promises: a real torch Optimizer, two models, no_sync, checkpoints, re-init."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.testing import run_ranks
from helpers import cross_entropy as loss_fn
from helpers import labelled_batch, max_diff

IN, HID, OUT, BATCH = 12, 16, 3, 8


class Net(torch.nn.Module):
    """Small, but with what the strategies act on: a named block (recompute), BatchNorm (sync BN)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.BatchNorm1d(HID), torch.nn.Tanh())
        self.head = torch.nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return labelled_batch(step * 7919 + rank * 31, BATCH, IN, OUT)


def state(model: torch.nn.Module) -> list[np.ndarray]:
    """Parameters and buffers (running statistics included), as float64 arrays."""
    return [t.detach().double().numpy().copy() for t in model.state_dict().values()]


def weights(model: torch.nn.Module) -> list[np.ndarray]:
    """Parameters only (running statistics are each rank's own without sync BN)."""
    return [p.detach().double().numpy().copy() for p in model.parameters()]


STRATEGIES: dict[str, dict] = {
    "data_parallel": {},
    "localsgd": {"localsgd": True, "localsgd_configs": {"k_steps": 2, "begin_step": 1}},
    "adaptive_localsgd": {"adaptive_localsgd": True, "adaptive_localsgd_configs": {"init_k_steps": 2, "begin_step": 2}},
    "gradient_merge": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": True}},
    "amp_bf16": {"amp": True, "amp_configs": {"dtype": "bfloat16"}},
    "amp_fp16": {"amp": True, "amp_configs": {"dtype": "float16", "init_loss_scaling": 1024.0,
                                              "incr_every_n_steps": 2}},
    "recompute": {"recompute": True, "recompute_configs": {"checkpoints": ["body"]}},
    "sync_batch_norm": {"sync_batch_norm": True},
    "fp16_allreduce": {"fp16_allreduce": True},
    "nan_check_and_slow_rank": {"check_nan_inf": True, "slow_rank_check": True,
                                "slow_rank_check_configs": {"every_n_steps": 3, "factor": 1000.0}},
    # pairs
    "merge+amp_fp16": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2},
                       "amp": True, "amp_configs": {"dtype": "float16", "init_loss_scaling": 1024.0}},
    "localsgd+merge": {"localsgd": True, "localsgd_configs": {"k_steps": 2},
                       "gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
    "recompute+sync_bn": {"recompute": True, "recompute_configs": {"checkpoints": ["body"]}, "sync_batch_norm": True},
    "localsgd+amp_bf16": {"localsgd": True, "localsgd_configs": {"k_steps": 3}, "amp": True,
                          "amp_configs": {"dtype": "bfloat16"}},
    "merge+fp16_allreduce": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 3},
                             "fp16_allreduce": True},
    "hierarchical+fp16": {"use_hierarchical_allreduce": True, "fp16_allreduce": True},
}
#: parameters within this of each other (bf16/fp16 runs differ by where the casts round)
TOL = {"amp_bf16": 2e-2, "localsgd+amp_bf16": 2e-2, "amp_fp16": 2e-3, "merge+amp_fp16": 2e-3,
       "fp16_allreduce": 1e-3, "merge+fp16_allreduce": 1e-3, "hierarchical+fp16": 1e-3}
STEPS = 6


def _strategy(name: str) -> DistributedStrategy:
    return DistributedStrategy.from_dict(STRATEGIES[name])


def _program(role, name: str) -> dict:
    fleet.init(role, timeout=60)
    model = Net(100 + role.rank)  # ranks start apart: the startup program makes them rank 0's
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), _strategy(name))
    opt.minimize(loss_fn, model)
    exe = Executor()
    exe.run(fleet.startup_program)
    losses = [exe.run(fleet.main_program, feed=batch(step, role.rank), fetch_list=["loss"])[0] for step in range(STEPS)]
    applied = [str(a) for a in fleet.applied_strategy()]
    fleet.shutdown()
    return {"state": state(model), "params": weights(model), "losses": losses, "applied": applied}


def _eager(role, name: str, explicit: bool = False) -> dict:
    """The user's plain loop: zero_grad, forward, loss.backward(), step (``explicit``: Horovod's
    and Paddle's ``opt.backward(loss)`` instead, which scales the loss itself under AMP)."""
    fleet.init(role, timeout=60)
    model = fleet.distributed_model(Net(100 + role.rank))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), _strategy(name))
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, batch(step, role.rank))
        if explicit:
            opt.backward(loss)
            opt.step()
        else:
            loss.backward()
            opt.step(loss=loss)
        losses.append(float(loss.detach()))
    applied = [str(a) for a in fleet.applied_strategy()]
    fleet.shutdown()
    return {"state": state(model.module), "params": weights(model), "losses": losses, "applied": applied}


def _both(role, names: list[str]) -> dict[str, dict]:
    """Each strategy in turn in the same ranks (one job, not one per strategy: the ranks' start
    and the gloo rendezvous cost more than 6 steps of training); each run is its own
    ``fleet.init`` ... ``fleet.shutdown`` with a fresh model, as in separate jobs."""
    return {name: {"program": _program(role, name), "eager": _eager(role, name)} for name in names}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,nodes,names", [
    (2, 1, [n for n in STRATEGIES if n != "hierarchical+fp16"]),
    pytest.param(4, 2, ["data_parallel", "localsgd", "gradient_merge", "amp_fp16", "sync_batch_norm",
                        "hierarchical+fp16", "merge+amp_fp16"], marks=pytest.mark.slow),
])
def test_eager_loop_gives_the_program_styles_parameters(world, nodes, names):
    by_rank = run_ranks(_both, world, names, nodes=nodes, timeout=200)
    for name in names:
        results = [ranks[name] for ranks in by_rank]
        tol = TOL.get(name, 1e-6)
        for rank, res in enumerate(results):
            prog, eager = res["program"], res["eager"]
            assert max_diff(prog["state"], eager["state"]) <= tol, (name, rank)
            assert prog["applied"] == eager["applied"], name
            np.testing.assert_allclose(prog["losses"], eager["losses"], atol=max(tol, 1e-5) * 10, err_msg=name)
        if not name.startswith(("localsgd", "adaptive")):  # synchronous: every rank holds the same model
            assert max_diff(results[0]["eager"]["params"], results[-1]["eager"]["params"]) <= tol, name


def _explicit_vs_plain(role, name: str) -> tuple[dict, dict]:
    return _eager(role, name, explicit=True), _eager(role, name)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["amp_fp16", "adaptive_localsgd"])
def test_opt_backward_scales_once_and_records_the_loss(name):
    """``opt.backward(loss)`` scales the loss itself, so the output hook must not scale again;
    it also hands adaptive local SGD its loss (no ``step(loss=...)`` needed)."""
    for explicit, plain in run_ranks(_explicit_vs_plain, 2, name, timeout=60):
        assert max_diff(explicit["state"], plain["state"]) <= TOL.get(name, 1e-6)


def _autocast(role) -> tuple[str, str, str]:
    with fleet.session(role, strategy=_strategy("amp_bf16")):
        a = torch.randn(4, 4)
        with fleet.autocast():
            inside = (a @ a).dtype
        outside = (a @ a).dtype
    with fleet.session(role):
        with fleet.autocast():
            off = (a @ a).dtype
    return str(inside), str(outside), str(off)


@pytest.mark.timeout(60)
def test_fleet_autocast_follows_the_strategy():
    assert run_ranks(_autocast, 1, timeout=45) == [("torch.bfloat16", "torch.float32", "torch.float32")]


def _plain(role, names: list[str]) -> dict[str, list[np.ndarray]]:
    return {name: _eager(role, name)["state"] for name in names}  # in turn, one job


@pytest.mark.timeout(120)
def test_strategies_change_the_eager_result():
    """A fault once seen: in the eager style local SGD, gradient merge and AMP left the result
    bit-identical to data parallel. Each must now move it."""
    names = ("localsgd", "gradient_merge", "amp_bf16", "adaptive_localsgd")
    states = run_ranks(_plain, 2, ["data_parallel", *names], timeout=100)[0]
    for name in names:
        assert max_diff(states[name], states["data_parallel"]) > 1e-4, name


def _from_env(role) -> list[str]:
    os.environ["FLEETLIKE_STRATEGY"] = json.dumps(STRATEGIES["gradient_merge"])
    try:
        return _eager(role, "data_parallel")["applied"]
    finally:
        del os.environ["FLEETLIKE_STRATEGY"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fleetlike_strategy_from_the_environment_applies_in_the_eager_style():
    applied = run_ranks(_from_env, 2, timeout=45)[0]
    assert any(a.startswith("gradient_merge: applied") for a in applied), applied


# ---------------------------------------------------------------------- a real torch Optimizer


def _scheduled(role, use_fleet: bool) -> tuple[list[float], list[np.ndarray], bool]:
    fleet.init(role, timeout=30)
    torch.manual_seed(100)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
    inner = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.5)
    if use_fleet:
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(inner)
    else:
        opt = inner
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    for step in range(5):
        opt.zero_grad()
        if use_fleet:
            loss_fn(model, batch(step, role.rank)).backward()
        else:  # the single-process reference: both ranks' batches at once
            parts = [batch(step, r) for r in range(2)]
            loss_fn(model, {k: torch.cat([p[k] for p in parts]) for k in parts[0]}).backward()
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    is_opt = isinstance(opt, torch.optim.Optimizer)
    fleet.shutdown()
    return lrs, state(model.module if use_fleet else model), is_opt


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lr_scheduler_works_on_the_distributed_optimizer():
    ranks = run_ranks(_scheduled, 2, True, timeout=45)
    ref_lrs, ref_state, _ = run_ranks(_scheduled, 1, False, timeout=45)[0]
    for lrs, st, is_opt in ranks:
        assert is_opt and lrs == ref_lrs == [0.4, 0.2, 0.2, 0.1, 0.1]
        assert max_diff(st, ref_state) <= 1e-6


def _grad_scaler(role) -> tuple[list[np.ndarray], list[np.ndarray]]:
    out = []
    for use_scaler in (False, True):
        fleet.init(role, timeout=30)
        model = fleet.distributed_model(Net(7))
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.3))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if use_scaler else None
        for step in range(4):
            opt.zero_grad()
            loss = loss_fn(model, batch(step, role.rank))
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        out.append(state(model.module))
        fleet.shutdown()
    return out[0], out[1]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_torch_grad_scaler_drives_the_distributed_optimizer():
    for plain, scaled in run_ranks(_grad_scaler, 2, timeout=45):
        assert max_diff(plain, scaled) <= 1e-6  # a power-of-two scale is exact in float32


# ---------------------------------------------------------------------- eager-style regressions


def _gan(role) -> dict:
    """Two wrapped models with their own optimizers (a GAN's generator and discriminator)."""
    fleet.init(role, timeout=30)
    gen = fleet.distributed_model(torch.nn.Linear(IN, IN))
    disc = fleet.distributed_model(Net(3 + role.rank))
    g_opt = fleet.distributed_optimizer(torch.optim.SGD(gen.parameters(), lr=0.1))
    d_opt = fleet.distributed_optimizer(torch.optim.SGD(disc.parameters(), lr=0.1))
    for step in range(4):
        feed = batch(step, role.rank)
        d_opt.zero_grad()
        loss_fn(disc, {"x": gen(feed["x"]).detach(), "y": feed["y"]}).backward()
        d_opt.step()
        g_opt.zero_grad()
        (-loss_fn(disc, {"x": gen(feed["x"]), "y": feed["y"]})).backward()
        g_opt.step()
    out = {"gen": state(gen.module), "disc": state(disc.module)}
    fleet.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_wrapped_models_both_stay_averaged():
    """A second distributed_model unhooked the first and the ranks drifted."""
    a, b = run_ranks(_gan, 2, timeout=45)
    weights = slice(0, 2)  # Linear weight and bias: equal on every rank when gradients are averaged
    assert max_diff(a["gen"][weights], b["gen"][weights]) <= 1e-6
    assert max_diff(a["disc"][-2:], b["disc"][-2:]) <= 1e-6


def _recompute_bn(role, recompute: bool, style: str) -> list[np.ndarray]:
    name = "recompute" if recompute else "data_parallel"
    return (_eager if style == "eager" else _program)(role, name)["state"]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("style", ["eager", pytest.param("program", marks=pytest.mark.slow)])
def test_recompute_leaves_batchnorm_statistics_as_without_it(style):
    """The recomputed forward updated BatchNorm's running statistics twice."""
    plain = run_ranks(_recompute_bn, 2, False, style, timeout=60)[0]
    checkpointed = run_ranks(_recompute_bn, 2, True, style, timeout=60)[0]
    assert max_diff(plain, checkpointed) <= 1e-6  # running_mean/var and num_batches_tracked too
    names = list(Net(0).state_dict())
    assert int(checkpointed[names.index("body.1.num_batches_tracked")]) == STEPS


def _reinit(role) -> tuple[str, float]:
    fleet.init(role, timeout=30)
    fleet.distributed_model(Net(1))
    try:
        fleet.init(role, timeout=30)
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    fleet.shutdown()
    with fleet.session(role, timeout=30):  # init again after shutdown, and shut down by the block
        total = fleet.util.all_reduce(np.array([1.0]), mode="sum")
    return message, float(np.asarray(total).ravel()[0])


@pytest.mark.timeout(60)
def test_init_twice_says_shutdown_first_and_init_after_shutdown_works():
    """A second init failed with 'Address already in use'."""
    for message, total in run_ranks(_reinit, 2, timeout=45):
        assert "fleet.shutdown() first" in message
        assert total == 2.0


# ---------------------------------------------------------------------- DDP's no_sync, plain optimizers


def _no_sync(role, how: str) -> list[np.ndarray]:
    fleet.init(role, timeout=30)
    model = fleet.distributed_model(torch.nn.Linear(IN, OUT))
    if how == "fleet_optimizer":
        opt: torch.optim.Optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    else:  # DDP-style: only the model is wrapped; backward's end waits for the averaged grads
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        with model.no_sync():
            loss_fn(model, batch(2 * step, role.rank)).backward()
        loss_fn(model, batch(2 * step + 1, role.rank)).backward()
        opt.step()
    out = state(model.module)
    fleet.shutdown()
    return out


def _no_sync_reference() -> list[np.ndarray]:
    """Single process: the sum over both micro-batches of the mean over the ranks."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(IN, OUT)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        for micro in (2 * step, 2 * step + 1):
            parts = [batch(micro, r) for r in range(2)]
            loss_fn(ref, {k: torch.cat([p[k] for p in parts]) for k in parts[0]}).backward()
        opt.step()
    return state(ref)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["fleet_optimizer", pytest.param("torch_optimizer", marks=pytest.mark.slow)])
def test_no_sync_accumulates_locally_then_averages_the_sum(how):
    torch.manual_seed(0)
    results = run_ranks(_seeded_no_sync, 2, how, timeout=60)
    ref = _no_sync_reference()
    for st in results:
        assert max_diff(st, ref) <= 1e-5


def _seeded_no_sync(role, how: str) -> list[np.ndarray]:
    torch.manual_seed(0)  # the same Linear as the reference (rank 0's is broadcast anyway)
    return _no_sync(role, how)


# ---------------------------------------------------------------------- checkpoints, eager style


def _ckpt(role, root: str, phase: str) -> list[np.ndarray]:
    fleet.init(role, timeout=30)
    model = fleet.distributed_model(Net(5))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                      _strategy("amp_fp16"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    fleet.register_state("sched", sched)
    steps = range(8)
    if phase == "second_half":
        loss_fn(model, batch(0, role.rank))  # build the engine (first forward), as a resumed loop would
        fleet.load_persistables(None, f"{root}/{role.rank}")
        steps = range(4, 8)
    for step in steps:
        opt.zero_grad()
        loss_fn(model, batch(step, role.rank)).backward()
        opt.step()
        sched.step()
        if phase == "first_half" and step == 3:
            fleet.save_persistables(None, f"{root}/{role.rank}")
            break
    out = state(model.module) + [np.array([fleet.get_loss_scaling(), sched.last_epoch])]
    fleet.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_eager_checkpoint_resumes_exactly(tmp_path):
    """save/load_persistables once needed minimize; now the wrapped model, the
    optimizer (with the loss scale) and a registered scheduler come back exactly."""
    straight = run_ranks(_ckpt, 2, str(tmp_path), "straight", timeout=60)
    run_ranks(_ckpt, 2, str(tmp_path), "first_half", timeout=60)
    resumed = run_ranks(_ckpt, 2, str(tmp_path), "second_half", timeout=60)
    for a, b in zip(straight, resumed):
        assert max_diff(a, b) == 0.0


# ---------------------------------------------------------------------- clear errors


def _missing_loss(role) -> str:
    fleet.init(role, timeout=30)
    model = fleet.distributed_model(Net(1))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy("adaptive_localsgd"))
    try:
        loss_fn(model, batch(0, role.rank)).backward()
        opt.step()  # no loss given
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        fleet.shutdown()


def _no_fleet_optimizer(role) -> str:
    fleet.init(role, timeout=30, strategy=_strategy("gradient_merge"))
    model = fleet.distributed_model(Net(1))
    try:
        model(batch(0, role.rank)["x"])
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        fleet.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_strategy_that_cannot_act_says_why():
    for msg in run_ranks(_missing_loss, 2, timeout=45):
        assert "optimizer.step(loss=loss)" in msg
    for msg in run_ranks(_no_fleet_optimizer, 2, timeout=45):
        assert "strategy.gradient_merge" in msg and "fleet.distributed_optimizer" in msg


def _one_optimizer_two_models(role, world: int) -> list[np.ndarray]:
    """An encoder and a head wrapped separately, one optimizer over both (and, at world 1 with
    both ranks' batches, the single-process reference)."""
    fleet.init(role, timeout=30)
    torch.manual_seed(11)
    enc, head = torch.nn.Linear(IN, HID), torch.nn.Linear(HID, OUT)
    if world > 1:
        enc, head = fleet.distributed_model(enc), fleet.distributed_model(head)
    params = [*enc.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.3)
    opt = fleet.distributed_optimizer(opt, _strategy("amp_fp16")) if world > 1 else opt
    for step in range(4):
        opt.zero_grad()
        parts = [batch(step, r) for r in range(2)] if world == 1 else [batch(step, role.rank)]
        feed = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        F.cross_entropy(head(torch.tanh(enc(feed["x"]))).float(), feed["y"]).backward()
        opt.step()
    out = [p.detach().double().numpy().copy() for p in params]
    fleet.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_one_optimizer_over_two_wrapped_models():
    ref = run_ranks(_one_optimizer_two_models, 1, 1, timeout=45)[0]
    for got in run_ranks(_one_optimizer_two_models, 2, 2, timeout=45):
        assert max_diff(got, ref) <= 2e-3  # fp16 autocast in both wrapped forwards

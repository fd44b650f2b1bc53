"""Data parallel equals single-process training on the concatenated batch, and PyTorch DDP.

Real gloo ranks; SGD, Momentum and Adam; fusion on and off; 1 and 3 communicators; program and
eager style; 8 steps (the equality is exact at any length: 8 take every optimizer past its
first step and the eager loop through both backward calls); max abs difference <= 1e-6.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dp_common import batch, loss_fn, make_model, make_opt, max_diff, params, single_process, torch_group
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.testing import run_ranks

STEPS = 8
OPTS = ("sgd", "momentum", "adam")
CONFIGS = list(itertools.product(OPTS, (True, False), (1, 3), ("program", "eager")))


def _strategy(fuse: bool, comms: int) -> DistributedStrategy:
    s = DistributedStrategy()
    s.fuse_all_reduce_ops = fuse
    s.fuse_grad_size_in_MB = 0.001  # ~1 KiB buckets: several buckets even for this small model
    s.nccl_comm_num = comms
    return s


def _train_fleet(role, opt_name, fuse, comms, style):
    model = make_model(100 + role.rank)  # ranks start different: startup / distributed_model fix it
    opt = make_opt(opt_name, model)
    s = _strategy(fuse, comms)
    if style == "program":
        fleet.distributed_optimizer(opt, s).minimize(loss_fn, model)
        exe = Executor()
        exe.run(fleet.startup_program)
        for step in range(STEPS):
            exe.run(fleet.main_program, feed=batch(step, role.rank), fetch_list=["loss"])
    else:
        model = fleet.distributed_model(model, strategy=s)
        dopt = fleet.distributed_optimizer(opt, s)
        for step in range(STEPS):
            loss = loss_fn(model, batch(step, role.rank))
            if step % 2:
                dopt.backward(loss)
            else:
                loss.backward()  # no loss scaling on: plain backward works too
            dopt.step()
            dopt.zero_grad()
    return params(model)


def _train_ddp(role, opt_name):
    model = torch.nn.parallel.DistributedDataParallel(make_model(100 + role.rank))
    opt = make_opt(opt_name, model)
    for step in range(STEPS):
        loss_fn(model, batch(step, role.rank)).backward()
        opt.step()
        opt.zero_grad()
    return params(model.module)


def _all_configs(role, ddp_rendezvous):
    with fleet.session(role, timeout=60):
        out = {cfg: _train_fleet(role, *cfg) for cfg in CONFIGS}
        with torch_group(role, ddp_rendezvous):
            ddp = {name: _train_ddp(role, name) for name in OPTS}
    return out, ddp


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_equals_single_process_and_ddp(world, tmp_path):
    """Every configuration, program and eager style, against DDP on the same ranks and data."""
    results = run_ranks(_all_configs, world, str(tmp_path / "ddp_rendezvous"), timeout=200)
    refs = {name: single_process(name, world, STEPS) for name in OPTS}
    for rank, (ours, ddp) in enumerate(results):
        for cfg, got in ours.items():
            assert max_diff(got, refs[cfg[0]]) <= 1e-6, (rank, cfg, max_diff(got, refs[cfg[0]]))
            assert max_diff(got, ddp[cfg[0]]) <= 1e-6, (rank, cfg, "ddp")
        for name in OPTS:
            assert max_diff(ddp[name], refs[name]) <= 1e-5  # the reference itself is sound


class _Branchy(torch.nn.Module):
    """A head that only some steps use: its parameters get no gradient then."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model(100)
        self.extra = torch.nn.Linear(3, 3)

    def forward(self, x, use_extra):
        out = self.body(x)
        return self.extra(out) if use_extra else out


def _unused(role, find_unused):
    s = DistributedStrategy()
    s.find_unused_parameters = find_unused
    s.fuse_grad_size_in_MB = 0.0005

    def lf(m, feed):
        return torch.nn.functional.cross_entropy(m(feed["x"], feed["step"] % 3 == 0), feed["y"])

    out = {}
    for style in ("program", "eager"):
        torch.manual_seed(7)
        model = _Branchy()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with fleet.session(role, timeout=30):
            if style == "program":
                fleet.distributed_optimizer(opt, s).minimize(lf, model)
                exe = Executor()
                exe.run(fleet.startup_program)
                for step in range(6):
                    exe.run(fleet.main_program, feed={**batch(step, role.rank), "step": step})
            else:
                wrapped = fleet.distributed_model(model)
                dopt = fleet.distributed_optimizer(opt, s)
                for step in range(6):
                    dopt.zero_grad()
                    lf(wrapped, {**batch(step, role.rank), "step": step}).backward()
                    dopt.step()
            out[style] = params(model)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("find_unused", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_unused_parameters_never_hang(find_unused):
    got = [g for rank in run_ranks(_unused, 2, find_unused, timeout=60) for g in rank.values()]
    torch.manual_seed(7)
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        parts = [batch(step, r) for r in range(2)]
        x = torch.cat([p["x"] for p in parts])
        y = torch.cat([p["y"] for p in parts])
        torch.nn.functional.cross_entropy(model(x, step % 3 == 0), y).backward()
        opt.step()
        opt.zero_grad()
    for g in got:
        assert max_diff(g, params(model)) <= 1e-6


def test_reducer_keeps_views_and_folds_replaced_gradients():
    """The per-step path relies on autograd accumulating into each bucket view in place (the
    same tensor object stays ``.grad``); a gradient the user replaced is still folded into its
    bucket, and the reduced values equal plain single-process gradients (world of one)."""
    from fleetlike.collectives import FlatAllReduce, make_reducer
    from fleetlike.comm.single import SingleCommunicator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref.load_state_dict(model.state_dict())
    reducer = make_reducer(model, FlatAllReduce([SingleCommunicator()]), cap_bytes=40)  # several buckets
    assert len(reducer.buckets) > 1
    views = {id(p): b.views[j] for b in reducer.buckets for j, p in enumerate(b.params)}
    x = torch.randn(5, 4)
    for step in range(3):
        reducer.zero_grad()
        ref.zero_grad()
        if step == 2:  # a user's own gradient tensor in place of the view: folded in, not lost
            first = next(model.parameters())
            first.grad = torch.full_like(first, 0.5)
            next(ref.parameters()).grad = torch.full_like(first, 0.5)
        reducer.prepare()
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad is views[id(p)]  # the bucket's own view object
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)

"""Sync BatchNorm over fleetlike communicators equals torch's synchronized BatchNorm semantics
(gloo), globally and per node; the sync_batch_norm strategy trains like one process on the
concatenated batch.

``torch.nn.SyncBatchNorm`` refuses CPU tensors in torch 2.x (its kernels batch_norm_stats /
batch_norm_gather_stats are CUDA-only), so the reference is what it computes, built from torch
pieces: a plain ``BatchNorm2d`` over the batch all-gathered with
``torch.distributed.nn.all_gather`` (autograd flows back to each rank's slice) on a
torch.distributed gloo group over all ranks (global) or over the node's ranks (local).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dp_common import torch_group
from fleetlike import DistributedStrategy, Executor, fleet
from fleetlike.comm import CommGroups
from fleetlike.strategies.sync_bn import SyncBatchNorm, convert_sync_batchnorm
from fleetlike.testing import make_world, run_ranks

C = 3


def _inputs(rank, shape):
    g = torch.Generator().manual_seed(17 + rank)
    return torch.randn(shape, generator=g) * (1 + rank) + rank, torch.randn(shape, generator=g)


class _GatheredBN(torch.nn.Module):
    """BatchNorm over the all-gathered batch of a torch.distributed group; returns own slice."""

    def __init__(self, bn, group):
        super().__init__()
        self.bn, self.group = bn, group
        self.weight, self.bias = bn.weight, bn.bias

    @property
    def running_mean(self):
        return self.bn.running_mean

    @property
    def running_var(self):
        return self.bn.running_var

    def forward(self, x):
        group = self.group if self.group is not None else dist.group.WORLD
        return self.bn(_Gather.apply(x, group)).split(x.shape[0])[dist.get_rank(group)]


class _Gather(torch.autograd.Function):
    """all_gather + cat; backward sums the gradient over the group and keeps the own slice."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.n = group, x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g.split(ctx.n)[dist.get_rank(ctx.group)], None


def _run_layer(bn, x, gy, steps=2):
    outs = []
    for _ in range(steps):
        xi = x.clone().requires_grad_(True)
        y = bn(xi)
        y.backward(gy)
        outs.append((y.detach().numpy(), xi.grad.numpy()))
    return outs, bn.running_mean.numpy().copy(), bn.running_var.numpy().copy(), bn.weight.grad.numpy(), bn.bias.grad.numpy()


def _compare(role, rendezvous, shape):
    world = make_world(role)
    groups = CommGroups(world, role)
    try:
        with torch_group(role, rendezvous):
            return _compare_layers(role, world, groups, shape)
    finally:
        groups.close()


def _compare_layers(role, world, groups, shape):
    node_groups = [dist.new_group(role.node_ranks(i)) for i in range(role.node_num)]
    x, gy = _inputs(role.rank, shape)
    res = {}
    for scope in ("global", "local"):
        comm = world if scope == "global" else groups.intra
        pg = None if scope == "global" else node_groups[role.node_index]
        torch.manual_seed(0)
        ours = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(C, momentum=0.3)), comm, scope)
        assert isinstance(ours[0], SyncBatchNorm)
        torch.manual_seed(0)
        ref = torch.nn.Sequential(_GatheredBN(torch.nn.BatchNorm2d(C, momentum=0.3), pg))
        with torch.no_grad():
            for m in (ours[0], ref[0]):
                m.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
                m.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
        res[scope] = (_run_layer(ours[0], x, gy), _run_layer(ref[0], x, gy))
    return res


def _assert_close(a, b, tol=1e-6):
    if isinstance(a, (list, tuple)):
        for u, v in zip(a, b):
            _assert_close(u, v, tol)
    else:
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shape", [(4, C, 5, 3), pytest.param((3, C, 2, 2), marks=pytest.mark.slow)])
def test_equals_torch_sync_batchnorm_global_and_local(shape, tmp_path):
    results = run_ranks(_compare, 4, str(tmp_path / "torch_rendezvous"), shape, nodes=2, timeout=60)
    for res in results:
        for scope in ("global", "local"):
            ours, ref = res[scope]
            _assert_close(ours, ref)
    # local really differs from global (the nodes' data differ)
    assert not np.allclose(results[0]["global"][0][1], results[0]["local"][0][1])


# ---------------------------------------------------------------------------- training

def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _feed(step, rank):
    g = torch.Generator().manual_seed(step * 31 + rank)
    return {"x": torch.randn(5, 6, generator=g) * 2 + rank, "y": torch.randn(5, 2, generator=g)}


def _loss(model, feed):
    return F.mse_loss(model(feed["x"]), feed["y"])


def _strategy(scope):
    return DistributedStrategy.from_dict({"sync_batch_norm": True, "sync_batch_norm_configs.scope": scope})


def _eager_steps(model, opt, rank, steps=5):
    """The user's loop: zero_grad, forward, loss.backward(), step."""
    for step in range(steps):
        opt.zero_grad()
        _loss(model, _feed(step, rank)).backward()
        opt.step()


def _train(role, scope):
    """Five steps in each style; per style the state, the listing (program) and applied."""
    out = {}
    for style in ("program", "eager"):
        with fleet.session(role, timeout=30):
            model = _model(1 + role.rank)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if style == "program":
                fleet.distributed_optimizer(opt, _strategy(scope)).minimize(_loss, model)
                exe = Executor()
                exe.run(fleet.startup_program)
                for step in range(5):
                    exe.run(fleet.main_program, feed=_feed(step, role.rank))
                listing = str(fleet.main_program)
            else:
                wrapped = fleet.distributed_model(model)
                _eager_steps(wrapped, fleet.distributed_optimizer(opt, _strategy(scope)), role.rank)
                listing = None
            state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
            out[style] = state, listing, [str(a) for a in fleet.applied_strategy()]
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_global_sync_bn_training_equals_single_process():
    res = run_ranks(_train, 4, "global", nodes=2, timeout=60)
    model = _model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        parts = [_feed(step, r) for r in range(4)]
        feed = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        _loss(model, feed).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for by_style in res:
        for style, (state, listing, applied) in by_style.items():
            for k, v in ref.items():
                np.testing.assert_allclose(state[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{style} {k}")
            assert any(a.startswith("sync_batch_norm: applied") for a in applied), style
        listing = by_style["program"][1]
        assert "c_sync_batch_norm" in listing and "sync_bn[world]" in listing


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_local_scope_listing_and_one_rank_per_node():
    res = run_ranks(_train, 4, "local", nodes=2, timeout=60)
    assert "sync_bn[node 0]" in res[0]["program"][1] and "sync_bn[node 1]" in res[2]["program"][1]
    res = run_ranks(_train, 2, "local", nodes=2, timeout=60)
    for style in ("program", "eager"):
        assert any("sync_batch_norm: NOT applied" in a for a in res[0][style][2]), style


def _bn_model_state(model, bn):
    return [p.detach().numpy().copy() for p in model.parameters()] + [
        bn.running_mean.numpy().copy(), bn.running_var.numpy().copy()]


def _train_vs_torch(role, rendezvous):
    """Eager style, global and per node: the user's loop under strategy.sync_batch_norm next to
    the torch reference (BatchNorm over the batch gathered in the same torch.distributed group,
    gradients averaged over the world as DDP does) on the same ranks and data."""
    out = {}
    with torch_group(role, rendezvous):
        node_groups = [dist.new_group(role.node_ranks(i)) for i in range(role.node_num)]
        for scope in ("global", "local"):
            ref = _model(1)  # rank 0's start, which distributed_model broadcasts
            ref[1] = _GatheredBN(ref[1], None if scope == "global" else node_groups[role.node_index])
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            for step in range(5):
                ref_opt.zero_grad()
                _loss(ref, _feed(step, role.rank)).backward()
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= role.world_size
                ref_opt.step()
            with fleet.session(role, timeout=30):
                model = fleet.distributed_model(_model(1 + role.rank))
                opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(scope))
                _eager_steps(model, opt, role.rank)
                assert isinstance(model.module[1], SyncBatchNorm)
                out[scope] = (_bn_model_state(model.module, model.module[1]), _bn_model_state(ref, ref[1]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_eager_sync_bn_training_equals_torch_reference_global_and_local(tmp_path):
    results = run_ranks(_train_vs_torch, 4, str(tmp_path / "torch_rendezvous"), nodes=2, timeout=60)
    for res in results:
        for scope in ("global", "local"):
            ours, ref = res[scope]
            _assert_close(ours, ref, tol=1e-5)
    # the nodes' data differ: per-node statistics really differ from the global ones
    assert not np.allclose(results[0]["global"][0][-2], results[0]["local"][0][-2])

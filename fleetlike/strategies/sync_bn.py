"""Synchronized BatchNorm over fleetlike communicators: statistics of the global (or node) batch.

`convert_sync_batchnorm` swaps every ``BatchNorm{1,2,3}d`` of a model for `SyncBatchNorm`,
keeping the same parameter and buffer objects (so an optimizer built before still holds them).
In training, a layer's forward all-reduces per-channel ``[sum, sum of squares, count]`` (float64,
one call) over its communicator; backward all-reduces ``[sum dy, sum dy*(x-mean)]``: the same
arithmetic as ``torch.nn.SyncBatchNorm`` (which all-gathers mean / invstd / count instead), so
forward, running statistics and input gradients agree with it; weight and bias gradients stay
local and the data-parallel allreduce averages them, as under DDP.

Scope (``sync_batch_norm_configs.scope``): "global" uses a communicator over all ranks;
"local" one per node (AIACC's comm_scope), cheaper on slow networks. The communicator is a
dedicated split, so its collectives never interleave with the gradient buckets'.

Example:
    >>> model = convert_sync_batchnorm(model, groups.extra("sync_bn", 0))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fleetlike.comm import Communicator
from fleetlike.program import Op
from fleetlike.strategies.step import StepContext, Unit

__all__ = ["SyncBatchNorm", "SyncBatchNormUnit", "convert_sync_batchnorm"]


class _SyncBNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                eps: float, momentum: float, comm: Communicator) -> torch.Tensor:
        c = x.shape[1]
        xc = x.detach().transpose(0, 1).reshape(c, -1).double()
        stats = torch.cat([xc.sum(1), (xc * xc).sum(1), xc.new_full((1,), float(xc.shape[1]))])
        comm.all_reduce(stats, "sum", agreed=True)
        count = stats[-1]
        mean = stats[:c] / count
        var = (stats[c : 2 * c] / count - mean * mean).clamp_(min=0)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / (count - 1).clamp(min=1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + eps)
        mean_t, invstd_t = mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)
        y = (x - mean_t) * invstd_t
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_t, invstd_t)
        ctx.count = float(count)
        ctx.comm = comm
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        gy = gy.contiguous()
        xmu = x - mean
        sum_dy = gy.sum(dims)
        sum_dy_xmu = (gy * xmu).sum(dims)
        grad_w = (sum_dy_xmu * invstd.view(-1)) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.clone() if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xmu]).double()
            ctx.comm.all_reduce(both, "sum", agreed=True)
            shape = mean.shape
            mean_dy = (both[:c] / ctx.count).to(x.dtype).view(shape)
            mean_dy_xmu = (both[c:] / ctx.count).to(x.dtype).view(shape)
            scale = invstd if weight is None else invstd * weight.view(shape)
            grad_x = (gy - mean_dy - xmu * invstd * invstd * mean_dy_xmu) * scale
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics span the ranks of ``comm`` (see the module doc)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 comm: Communicator | None = None, scope: str = "global") -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.comm = comm
        self.scope = scope

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dims (N, C, ...), got {x.dim()}D")

    def extra_repr(self) -> str:
        where = self.comm.name if self.comm is not None else "no comm"
        return f"{super().extra_repr()}, scope={self.scope}, comm={where}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running = not self.training or self.track_running_stats
        rm = self.running_mean if running else None
        rv = self.running_var if running else None
        if not bn_training or self.comm is None or self.comm.size == 1:
            return F.batch_norm(x, rm, rv, self.weight, self.bias, bn_training, factor, self.eps)
        return _SyncBNFunction.apply(x, self.weight, self.bias, rm, rv, self.eps, factor, self.comm)


def convert_sync_batchnorm(module: torch.nn.Module, comm: Communicator, scope: str = "global") -> torch.nn.Module:
    """Replace every BatchNorm layer of ``module`` (recursively) by `SyncBatchNorm` on ``comm``.

    Returns the converted module (a new object only when ``module`` itself is a BatchNorm)."""
    out = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, comm=comm, scope=scope)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, comm, scope)
        if new is not child:
            out.add_module(name, new)
    return out


class SyncBatchNormUnit(Unit):
    """Converts the model's BatchNorm layers when the engine is built (before any forward)."""

    name = "sync_batch_norm"

    def __init__(self, facts: dict[str, Any]) -> None:
        self.facts = facts

    @classmethod
    def create(cls, ctx: StepContext) -> SyncBatchNormUnit | None:
        """Convert ``ctx.model`` in place and record it; None when there is nothing to sync."""
        s, groups, role = ctx.strategy, ctx.groups, ctx.role
        scope = str(s.sync_batch_norm_configs["scope"])
        if isinstance(ctx.model, torch.nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                "strategy.sync_batch_norm converts BatchNorm layers inside the model, but the model is "
                "itself a BatchNorm layer; wrap it in a torch.nn.Sequential"
            )
        n = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in ctx.model.modules())
        if n == 0:
            ctx.record("sync_batch_norm", False, "the model has no BatchNorm layer")
            return None
        if scope == "local":
            comm = groups.extra(f"sync_bn[node {role.node_index}]", role.node_index, role.local_rank)
            where = f"within node {role.node_index} ({comm.size} ranks)"
        else:
            comm = groups.extra("sync_bn[world]", 0, role.rank)
            where = f"over all {comm.size} ranks"
        if comm.size == 1:
            ctx.record("sync_batch_norm", False, f"scope {scope}: one rank {where.split('(')[0].strip()}, "
                       "statistics are the local ones")
            return None
        convert_sync_batchnorm(ctx.model, comm, scope)
        ctx.record("sync_batch_norm", True, f"{n} BatchNorm layer(s), scope {scope}: statistics {where} on {comm.name!r}")
        return cls({"layers": n, "comm": comm.name, "scope": f"{scope} ({comm.size} ranks)"})

    def described_ops(self) -> list[Op]:
        return [Op("c_sync_batch_norm", None, dict(self.facts), parent="forward")]

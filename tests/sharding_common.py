"""Model, data, optimizers and single-process references shared by the sharding tests.

The model has deliberately uneven parameter sizes (592, 407, 37, 33, 11, 3 elements, ...), so
partitions are never trivially equal; the optimizers have two parameter groups with different
hyper-parameters and a StepLR scheduler acts on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from helpers import cross_entropy as loss_fn
from helpers import labelled_batch, max_diff  # noqa: F401 - max_diff: re-exported to the tests

IN, OUT, GLOBAL_BATCH = 16, 3, 12
WIDTHS = (37, 11)
#: small buckets, so a model of a few KiB still has several (some of one owner)
SMALL = {"fuse_grad_size_in_MB": 0.002}


class Net(torch.nn.Module):
    """Linear layers of the given widths with tanh between them."""

    def __init__(self, seed: int, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        torch.manual_seed(seed)
        dims = (IN, *widths, OUT)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def global_batch(step: int) -> dict[str, torch.Tensor]:
    return labelled_batch(step * 7919 + 5, GLOBAL_BATCH, IN, OUT)


def batch(step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s equal slice of the step's global batch (so any world size sees the same
    global batch, and the mean of the ranks' mean losses is the global mean loss)."""
    full = global_batch(step)
    n = GLOBAL_BATCH // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in full.items()}


OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


def make_opt(name: str, model: torch.nn.Module, *, cls: Any = None) -> torch.optim.Optimizer | Any:
    """Two parameter groups with different hyper-parameters. ``cls`` (torch's ZeRO) takes the
    optimizer class as ``optimizer_class``."""
    first = list(model.layers[0].parameters())
    rest = [p for layer in model.layers[1:] for p in layer.parameters()]
    kind, kw = {
        "sgd": (torch.optim.SGD, {"lr": 0.1}),
        "momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        "adam": (torch.optim.Adam, {"lr": 0.01}),
        "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
    }[name]
    groups = [{"params": first, "lr": kw["lr"] * 0.5}, {"params": rest}]
    if cls is not None:  # ZeroRedundancyOptimizer: first group at construction, then add
        zero = cls(first, optimizer_class=kind, **{**kw, "lr": kw["lr"] * 0.5})
        zero.add_param_group({"params": rest, "lr": kw["lr"]})
        return zero
    return kind(groups, **kw)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def weights(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().double().numpy().copy() for p in model.parameters()]




def reference(opt_name: str, steps: int, *, world: int = 1, widths: tuple[int, ...] = WIDTHS,
              clip: float = 0.0, clip_local: bool = False, reduce_sum: bool = False,
              model: torch.nn.Module | None = None, opt: Any = None, sched: Any = None,
              start: int = 0) -> list[np.ndarray]:
    """One process, the global batch: what unsharded data parallel computes. ``clip``: clip by
    the global norm of the averaged gradient; ``clip_local``: each of ``world`` ranks clips its
    own gradient first (EPL's clip before allreduce); ``reduce_sum``: gradients summed over the
    ranks instead of averaged."""
    model = model if model is not None else Net(100, widths)
    opt = opt if opt is not None else make_opt(opt_name, model)
    sched = sched if sched is not None else scheduler(opt)
    for step in range(start, steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            loss_fn(model, batch(step, r, world)).backward()
            if clip_local:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            total = torch.stack([g[i] for g in grads]).sum(0)
            p.grad = total if reduce_sum else total / world
        if clip and not clip_local:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    return weights(model)

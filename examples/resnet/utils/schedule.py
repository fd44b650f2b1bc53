"""Learning rate: linear warm-up, then piecewise or cosine decay, stepped every iteration.

A `torch.optim.lr_scheduler.LambdaLR`, so it works on the plain optimizer and on
``fleet.distributed_optimizer``'s (a torch Optimizer), and its ``state_dict`` resumes it.

Example:
    >>> scheduler = build(optimizer, args, steps_per_epoch=len(loader))
"""
from __future__ import annotations

import bisect
import math

import torch

__all__ = ["build", "factor"]


def factor(step: int, steps_per_epoch: int, args) -> float:
    """The multiplier of ``args.lr`` at ``step`` (0-based, counted in iterations)."""
    epoch = step / steps_per_epoch
    if args.warm_up_epochs > 0 and epoch < args.warm_up_epochs:
        return (step + 1) / (args.warm_up_epochs * steps_per_epoch)
    if args.lr_strategy == "cosine_decay":
        done = (epoch - args.warm_up_epochs) / max(args.num_epochs - args.warm_up_epochs, 1e-12)
        return 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))
    return args.decay_rate ** bisect.bisect_right(list(args.decay_epochs), epoch)


def build(optimizer, args, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step, steps_per_epoch, args))

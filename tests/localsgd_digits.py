"""Synchronous SGD, local SGD and adaptive local SGD on scikit-learn's digits, one rank function.

Shared by ``tests/test_localsgd_convergence.py`` and ``bench/localsgd.py`` (which puts ``tests/``
on ``sys.path``). Every mode starts from the same model (rank 0's, broadcast by the startup
program), sees the same shards in the same order and follows the same learning-rate schedule, so
the only difference is how often the ranks communicate.
"""

from __future__ import annotations

from typing import Any

import torch

from amp_common import accuracy, digits_loss, digits_model, digits_split, shard_batch

__all__ = ["MODES", "STEPS", "lr_at", "digits_run"]

#: name -> strategy dict (``DistributedStrategy.from_dict``); sync is plain data parallel.
MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "localsgd_k4": {"localsgd": True, "localsgd_configs": {"k_steps": 4, "begin_step": 1}},
    "adaptive": {"adaptive_localsgd": True, "adaptive_localsgd_configs": {"init_k_steps": 16, "begin_step": 1}},
}
STEPS = 400
LR0, GAMMA, MOMENTUM, BATCH = 0.1, 0.985, 0.9, 32


def lr_at(step: int, steps: int = STEPS) -> float:
    """Exponential decay to ~1% of LR0 over the run (set into param_groups each step).

    Adaptive local SGD grows k when the learning rate falls faster than the loss; on digits the
    loss falls ~30x within a hundred steps, so the rate has to fall about as far for k to grow."""
    return LR0 * GAMMA ** (step * STEPS / steps)


def digits_run(role, mode: str, steps: int = STEPS, seed: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps in ``mode``; return the per-step trace, test accuracy, averages."""
    from fleetlike import DistributedStrategy, Executor, fleet

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    with fleet.session(role):
        (x, y), (xt, yt) = digits_split(seed)
        model = digits_model(seed + role.rank)  # startup broadcasts rank 0's
        opt = torch.optim.SGD(model.parameters(), lr=lr_at(0, steps), momentum=MOMENTUM)
        fleet.distributed_optimizer(opt, DistributedStrategy.from_dict(MODES[mode])).minimize(digits_loss, model)
        exe = Executor()
        exe.run(fleet.startup_program)
        trace = []
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps)
            st = fleet.main_program.run(shard_batch(x, y, step, role.rank, role.world_size, BATCH))
            info = st.info
            trace.append({
                "loss": float(st.loss.detach()),
                "k": info.get("localsgd_k"),
                "averaged": bool(info.get("localsgd_averaged", True)),
                "averages": info.get("localsgd_averages"),
                "bytes": info.get("bytes_communicated"),
            })
        out = {
            "trace": trace,
            "acc": accuracy(model, xt, yt),
            "nparams_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        }
    return out

#!/usr/bin/env python
"""Adaptive local SGD: k follows loss and learning rate (strategy.adaptive_localsgd).

The learning rate decays with a scheduler; k grows as it falls faster than the loss. The manual
alternative (seed 003) averages the loss with ``fleet.util.all_reduce(loss, "sum") /
fleet.worker_num()`` and calls ``fleetlike.strategies.adaptive_local_step``; it is shown at the end.

    python -m fleetlike.launch --nproc_per_node=2 examples/local_sgd/adaptive.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fleetlike  # noqa: E402
from _common import gen_data, loss_fn, mlp  # noqa: E402
from fleetlike import DistributedStrategy, fleet  # noqa: E402
from fleetlike.strategies import adaptive_local_step  # noqa: E402

fleet.init()
model = mlp()
strategy = DistributedStrategy()
strategy.adaptive_localsgd = True
strategy.adaptive_localsgd_configs = {"init_k_steps": 1, "begin_step": 4}
sgd = torch.optim.SGD(model.parameters(), lr=0.05)  # plain SGD: one global learning rate
opt = fleet.distributed_optimizer(sgd, strategy)
opt.minimize(loss_fn, model)
scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=10, gamma=0.5)
exe = fleetlike.Executor(fleet.device())
exe.run(fleet.startup_program)
first = None
for step in range(int(os.environ.get("STEPS", "60"))):
    loss, k, n = exe.run(fleet.main_program, feed=gen_data(fleet.worker_index(), step),
                         fetch_list=["loss", "localsgd_k", "localsgd_averages"])
    scheduler.step()
    avg_loss = fleet.util.all_reduce(loss, mode="sum") / fleet.worker_num()  # for the manual helper
    first = first or (avg_loss, sgd.param_groups[0]["lr"])
    manual_k = adaptive_local_step(first[0], first[1], avg_loss, sgd.param_groups[0]["lr"], 1, 1)
    if fleet.is_first_worker():
        print(f"step {step} loss {avg_loss:.4f} lr {sgd.param_groups[0]['lr']:.4f} k {k} averages {n} "
              f"(seed helper would say k={manual_k})")
if fleet.is_first_worker():
    print(fleet.main_program)

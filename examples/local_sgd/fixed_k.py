#!/usr/bin/env python
"""Local SGD with a fixed k: average parameters every 4 steps after 8 synchronous steps.

    python -m fleetlike.launch --nproc_per_node=2 examples/local_sgd/fixed_k.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fleetlike  # noqa: E402
from _common import gen_data, loss_fn, mlp  # noqa: E402
from fleetlike import DistributedStrategy, fleet  # noqa: E402

fleet.init()
model = mlp()
strategy = DistributedStrategy()
strategy.localsgd = True
strategy.localsgd_configs = {"k_steps": 4, "begin_step": 8}
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), strategy)
opt.minimize(loss_fn, model)
exe = fleetlike.Executor(fleet.device())
exe.run(fleet.startup_program)
for step in range(int(os.environ.get("STEPS", "40"))):
    loss, averaged, k = exe.run(fleet.main_program, feed=gen_data(fleet.worker_index(), step),
                                fetch_list=["loss", "localsgd_averaged", "localsgd_k"])
    print(f"worker {fleet.worker_index()} step {step} loss {loss:.4f} k {k} averaged {averaged}")
if fleet.is_first_worker():
    print(fleet.main_program)  # shows k, the number of averages and the bytes sent

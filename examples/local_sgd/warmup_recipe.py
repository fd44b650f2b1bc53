#!/usr/bin/env python
"""Seed 003's manual recipe: switch between main_program (averages) and _origin_program (local).

k grows 1, 2, 4 per pass after ``warmup`` passes (get_local_sgd_steps); with localsgd on and
k_steps=1, every main_program run averages, so averages happen exactly where it runs.

    python -m fleetlike.launch --nproc_per_node=2 examples/local_sgd/warmup_recipe.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fleetlike  # noqa: E402
from _common import gen_data, loss_fn, mlp  # noqa: E402
from fleetlike import DistributedStrategy, fleet  # noqa: E402
from fleetlike.strategies import get_local_sgd_steps  # noqa: E402

fleet.init()
model = mlp()
strategy = DistributedStrategy()
strategy.use_local_sgd = True  # Fleet 1.x name; k_steps=1: every main_program run averages
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), strategy)
opt.minimize(loss_fn, model)
exe = fleetlike.Executor(fleet.device())
exe.run(fleet.startup_program)
local_sgd_steps, local_sgd_warmup = 4, 1
step_cnt = 0
for pass_id in range(int(os.environ.get("PASSES", "5"))):
    cur_local_sgd = get_local_sgd_steps(pass_id, local_sgd_steps, local_sgd_warmup)
    for _ in range(8):
        current_prog = fleet.main_program if step_cnt % cur_local_sgd == 0 else fleet._origin_program
        loss, = exe.run(current_prog, feed=gen_data(fleet.worker_index(), step_cnt), fetch_list=["loss"])
        step_cnt += 1
    print(f"worker {fleet.worker_index()} pass {pass_id} k {cur_local_sgd} loss {loss:.4f}")

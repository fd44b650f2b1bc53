#!/usr/bin/env python
"""Seed 003's quick-start MLP in the eager style: a PyTorch-native loop on fleetlike's machinery.

`fleet.distributed_model` broadcasts rank 0's parameters and attaches the gradient hooks (the
same bucketed, overlapped reducer that `fleet.main_program` uses); `opt.backward` / `opt.step`
do the rest. `opt.synchronize()` then `with opt.skip_synchronize(): opt.step()` leaves room for
gradient clipping between communication and update.

Run on 2 CPU workers:
    python -m fleetlike.launch --nproc_per_node=2 examples/quick_start/train_eager.py
"""
import os

import numpy as np
import torch
import torch.nn.functional as F

from fleetlike import DistributedStrategy, fleet


def gen_data():
    """One batch of random training data."""
    return {"x": torch.from_numpy(np.random.random(size=(128, 32)).astype("float32")),
            "y": torch.from_numpy(np.random.randint(2, size=(128,)).astype("int64"))}


model = torch.nn.Sequential(
    torch.nn.Linear(32, 128), torch.nn.Tanh(),
    torch.nn.Linear(128, 128), torch.nn.Tanh(),
    torch.nn.Linear(128, 2),
)
strategy = DistributedStrategy()
fleet.init(strategy=strategy)
model = fleet.distributed_model(model)
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)

for step in range(int(os.environ.get("STEPS", "100"))):
    feed = gen_data()
    loss = F.cross_entropy(model(feed["x"]), feed["y"])
    opt.backward(loss)
    opt.synchronize()                                   # gradients averaged over the workers
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    print("worker_index: %d, step%d cost = %f" % (fleet.worker_index(), step, loss.item()))

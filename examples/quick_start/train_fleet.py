#!/usr/bin/env python
"""Seed 003's quick-start MLP: fc 128 tanh -> fc 128 tanh -> fc 2, softmax cross-entropy, SGD 0.01.

`train.py` is the plain single-process PyTorch script; `train_fleet.py` is the same script after
the four-step conversion (`diff train.py train_fleet.py` shows the four steps and nothing else).
Run the converted one on 2 CPU workers:
    python -m fleetlike.launch --nproc_per_node=2 examples/quick_start/train_fleet.py
"""
import os

import numpy as np
import torch
import torch.nn.functional as F

# Step 1: import
import fleetlike
from fleetlike import DistributedStrategy, fleet, role_maker


def gen_data():
    """One batch of random training data."""
    return {"x": np.random.random(size=(128, 32)).astype("float32"),
            "y": np.random.randint(2, size=(128, 1)).astype("int64")}


def mlp(hid_dim=128, label_dim=2):
    """The network: two tanh layers and a classifier."""
    return torch.nn.Sequential(
        torch.nn.Linear(32, hid_dim), torch.nn.Tanh(),
        torch.nn.Linear(hid_dim, hid_dim), torch.nn.Tanh(),
        torch.nn.Linear(hid_dim, label_dim),
    )


def loss_fn(model, feed):
    """Mean softmax cross-entropy of the batch."""
    return F.cross_entropy(model(feed["x"]), feed["y"].view(-1))


model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

# Step 2: strategy and cluster roles; wrap the optimizer and build the programs
dist_strategy = DistributedStrategy()
role = role_maker.PaddleCloudRoleMaker(is_collective=True)
fleet.init(role)
optimizer = fleet.distributed_optimizer(optimizer, strategy=dist_strategy)
optimizer.minimize(loss_fn, model)


# Step 3: train with fleet.main_program, starting from fleet.startup_program
exe = fleetlike.Executor(fleet.device())
exe.run(fleet.startup_program)
train_step = lambda feed: exe.run(fleet.main_program, feed=feed, fetch_list=["loss"])  # noqa: E731
worker_index = fleet.worker_index


step = int(os.environ.get("STEPS", "1001"))
for i in range(step):
    cost_val = train_step(gen_data())
    print("worker_index: %d, step%d cost = %f" % (worker_index(), i, cost_val[0]))

# model saving
model_path = os.environ.get("MODEL_PATH", "./pretrained_model")
# Step 4: save on rank 0 only
if fleet.worker_index() == 0 and os.path.exists(model_path):
    fleet.save_persistables(exe, model_path)

#!/usr/bin/env python
"""Gradient clipping in the eager style: clip the *averaged* gradients, then update.

`optimizer.synchronize()` waits until every gradient is averaged over the workers (under AMP it
also unscales them and checks that they are finite); `with optimizer.skip_synchronize():` makes
the following `step()` update without synchronizing again (as Horovod's API). Clipping before
`synchronize()` would clip each worker's local gradient instead.

    python -m fleetlike.launch --nproc_per_node=2 --started_port=auto examples/quick_start/train_eager_clip.py
"""
import os

import numpy as np
import torch
import torch.nn.functional as F

from fleetlike import fleet

fleet.init()
model = fleet.distributed_model(torch.nn.Sequential(
    torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 2)))
optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

rng = np.random.default_rng(fleet.worker_index())
for step in range(int(os.environ.get("STEPS", "100"))):
    x = torch.from_numpy(rng.random(size=(128, 32)).astype("float32"))
    y = (x[:, :16].sum(dim=1) > x[:, 16:].sum(dim=1)).long()
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.synchronize()                                   # gradients averaged over the workers
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    with optimizer.skip_synchronize():
        optimizer.step()
    print("worker_index: %d, step%d cost = %f grad_norm = %f" % (fleet.worker_index(), step, loss.item(), norm))

#!/usr/bin/env python
"""The quick-start MLP in the eager style: a plain PyTorch loop, every strategy underneath.

`fleet.distributed_model(model)` wraps the module (as DDP / paddle.DataParallel): its forward
runs the strategy (AMP autocast, sync batch norm, recompute, gradient buckets armed for the
coming backward) and a plain `loss.backward()` averages the gradients over the workers.
`fleet.distributed_optimizer(opt)` is a `torch.optim.Optimizer`, so `StepLR` works on it, and
its `step()` applies the rest (gradient merge, local SGD, AMP loss scaling, NaN check).

The strategy is the default (data parallel) unless FLEETLIKE_STRATEGY (JSON) overrides it,
so one script tries them all:

    python -m fleetlike.launch --nproc_per_node=2 --started_port=auto examples/quick_start/train_eager.py
    FLEETLIKE_STRATEGY='{"localsgd": true, "localsgd_configs": {"k_steps": 2}}' \\
        python -m fleetlike.launch --nproc_per_node=2 --started_port=auto examples/quick_start/train_eager.py
    FLEETLIKE_STRATEGY='{"recompute": true, "recompute_configs": {"checkpoints": ["block"]}}' ...
    FLEETLIKE_STRATEGY='{"amp": true, "amp_configs": {"dtype": "bfloat16"}}' ...

`optimizer.step(loss=loss)`: the loss is read only by adaptive local SGD, which picks its k
from it (every other strategy ignores it; a plain `optimizer.step()` is fine for them).
Gradient clipping between communication and update: see `train_eager_clip.py`.
"""
import os

import numpy as np
import torch
import torch.nn.functional as F

from fleetlike import DistributedStrategy, fleet


def gen_data(rng):
    """One batch: the class says which half of the features has the larger sum."""
    x = rng.random(size=(128, 32)).astype("float32")
    y = (x[:, :16].sum(axis=1) > x[:, 16:].sum(axis=1)).astype("int64")
    return torch.from_numpy(x), torch.from_numpy(y)


class MLP(torch.nn.Module):
    """fc -> batch norm -> tanh -> `block` (fc tanh) -> fc; `block` is what recompute checkpoints."""

    def __init__(self, hid_dim=128, label_dim=2):
        super().__init__()
        self.fc = torch.nn.Linear(32, hid_dim)
        self.bn = torch.nn.BatchNorm1d(hid_dim)     # synchronized across workers by sync_batch_norm
        self.block = torch.nn.Sequential(torch.nn.Linear(hid_dim, hid_dim), torch.nn.Tanh())
        self.head = torch.nn.Linear(hid_dim, label_dim)

    def forward(self, x):
        return self.head(self.block(torch.tanh(self.bn(self.fc(x)))))


torch.manual_seed(0)                                # rank 0's initial parameters are everyone's
fleet.init(strategy=DistributedStrategy())          # FLEETLIKE_STRATEGY, if set, overrides it
model = fleet.distributed_model(MLP())
optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)

rng = np.random.default_rng(fleet.worker_index())   # each worker its own data
for step in range(int(os.environ.get("STEPS", "100"))):
    x, y = gen_data(rng)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step(loss=loss)
    scheduler.step()
    print("worker_index: %d, step%d cost = %f" % (fleet.worker_index(), step, loss.item()))
    if step == 0 and fleet.worker_index() == 0:
        for entry in fleet.applied_strategy():
            print("applied_strategy:", entry)

# model saving
model_path = os.environ.get("MODEL_PATH", "./pretrained_model")
if fleet.worker_index() == 0 and os.path.exists(model_path):
    torch.save(model.state_dict(), os.path.join(model_path, "model.pt"))

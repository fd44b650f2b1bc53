"""A Horovod Elastic script in the shape of Horovod's examples/elastic/pytorch/pytorch_mnist_elastic.py
(hvd.init, hvd.DistributedOptimizer, hvd.elastic.TorchState, a reset callback, @hvd.elastic.run,
state.commit() after every batch), on random data that depends on (epoch, batch, rank) only.

Usage: hvd_elastic_train.py OUT EPOCHS BATCHES PAUSE
Every process writes OUT/pid.<pid> when it starts; rank 0 writes OUT/progress ("steps world")
after each batch; at the end every rank writes OUT/done.<pid>.json (pid, rank, world, resets,
the parameters as a flat list).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import fleetlike.horovod as hvd

out, epochs, batches, pause = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
(out / f"pid.{os.getpid()}").write_text(str(os.getpid()))

hvd.init()
torch.manual_seed(42)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 12)
        self.fc2 = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def data(epoch: int, batch: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * epoch + 10 * batch + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
resets = []


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    for state.epoch in range(state.epoch, epochs + 1):
        state.model.train()
        for batch in range(state.batch, batches):
            x, y = data(state.epoch, batch, hvd.rank())
            state.optimizer.zero_grad()
            loss = F.nll_loss(state.model(x), y)
            loss.backward()
            state.optimizer.step()
            state.batch = batch + 1
            state.commit()
            if hvd.rank() == 0:
                steps = (state.epoch - 1) * batches + state.batch
                (out / "progress.tmp").write_text(f"{steps} {hvd.size()}")
                os.replace(out / "progress.tmp", out / "progress")
            time.sleep(pause)
        state.batch = 0


optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def on_state_reset() -> None:
    resets.append(hvd.size())


state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
report = {"pid": os.getpid(), "rank": hvd.rank(), "world": hvd.size(), "resets": resets, "params": flat}
(out / f"done.{os.getpid()}.json").write_text(json.dumps(report))

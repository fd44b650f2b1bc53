"""Test worker: EPL's configuration form (``config = epl.Config({...}); epl.init(config)``) under a
launcher, once per Config of `CONFIGS`, training a model of repeated blocks with SGD.

Usage (under the launcher): epl_config.py OUT_DIR
Writes OUT_DIR/<label>.<rank>.pt: ``{"params": [...], "applied": [...]}``.
"""

import sys

import torch
import torch.nn.functional as F

import fleetlike.epl as epl
from fleetlike import fleet

#: the page's gradient-checkpoint example, and the communication keys with a clip before the sum
CONFIGS = {
    "gc_auto": {"gradient_checkpoint.type": "auto"},
    "sum_clip_before": {"communication.gradients_reduce_method": "sum", "communication.clip_after_allreduce": False,
                        "sharding_configs.clip_norm": 0.2, "communication.num_communicators": 2},
}
STEPS, LR, WIDTH = 3, 0.1, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(torch.nn.Module):
    """Repeated blocks (what EPL's auto gradient checkpointing picks) and a head; seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def feed(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(6, WIDTH, generator=g), "y": torch.randint(0, 3, (6,), generator=g)}


def loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def main() -> None:
    out = sys.argv[1]
    for label, keys in CONFIGS.items():
        config = epl.Config(keys)
        epl.init(config)
        try:
            model = Net()
            wrapped = fleet.distributed_model(model)
            opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
            rank = fleet.worker_index()
            for step in range(STEPS):
                loss(wrapped, feed(step, rank)).backward()
                opt.step()
                opt.zero_grad()
            applied = [str(e) for e in fleet.applied_strategy()]
            torch.save({"params": [p.detach().clone() for p in model.parameters()], "applied": applied},
                       f"{out}/{label}.{rank}.pt")
        finally:
            fleet.shutdown()


if __name__ == "__main__":
    main()

"""A Horovod training script exactly as Horovod's PyTorch guide writes it (``import horovod.torch
as hvd`` included): run by ``python -m fleetlike.launch --accelerate_horovod`` it must train on
fleetlike's Horovod face; without the flag ``import horovod`` must find no stand-in.

Usage: hvd_unchanged.py OUT NAME. Rank r trains on batch ``seed 10 + r`` (8 rows) for 3 SGD
steps and saves its parameters to OUT/NAME.r.pt; exit code 3 when ``import horovod`` fails.
"""

import os
import sys

try:
    import horovod.torch as hvd
except ImportError as exc:
    print(f"no horovod: {exc}", flush=True)
    sys.exit(3)

import torch

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
g = torch.Generator().manual_seed(10 + hvd.rank())
x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
for _ in range(3):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
print(f"rank {hvd.rank()} of {hvd.size()}: horovod is {hvd.__name__}", flush=True)
torch.save([p.detach().clone() for p in model.parameters()], os.path.join(sys.argv[1], f"{sys.argv[2]}.{hvd.rank()}.pt"))

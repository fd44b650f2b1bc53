"""A DDP script as the seed products' pages write it, with the vendor's lines swapped for fleetlike's.

Usage: seed_ddp.py OUT NAME VENDOR [SCENARIO] [ENABLE]

* plain: torch DDP as written: ``dist.init_process_group("gloo")`` (env://, under a launcher
  that exports torchrun's variables): the reference;
* light: Light's page: ``@light_init(params={"training_framework": "pytorch_ddp", ...})`` on
  ``main`` and the ``init_process_group`` call deleted (``from light import light_init`` became
  ``from fleetlike import light_init``); SCENARIO is ``application_scenario`` and ENABLE
  ``enable_optimizations`` (1 or 0);
* tiacc: TI-ACC's / AIACC's mpirun path: one init line at the top (``import
  tiacc_training.torch.distributed as tdist; tdist.init_tiacc_training()`` became ``import
  fleetlike; fleetlike.init_process_group()``), the script's own ``init_process_group`` kept.

Each rank saves its final parameters to OUT/NAME.RANK.pt and prints whether its DDP model
averages through fleetlike (a comm hook) and the settings the scenario touched.
"""

import sys

VENDOR = sys.argv[3]
if VENDOR == "tiacc":
    import fleetlike; fleetlike.init_process_group()  # noqa: E401,E702 - the one line the page adds

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if VENDOR == "light":
    from fleetlike import light_init
else:
    def light_init(params):  # noqa: ANN001,ANN202 - the plain script has no decorator
        return lambda f: f

SCENARIO = sys.argv[4] if len(sys.argv) > 4 else "default"
ENABLE = (sys.argv[5] if len(sys.argv) > 5 else "1") == "1"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def train(args=None, model=None, train_loader=None, optimizer=None, epoch=0):  # noqa: ANN001,ANN201
    for x, y in train_loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@light_init(params={"training_framework": "pytorch_ddp", "application_scenario": SCENARIO,
                    "enable_optimizations": ENABLE})
def main() -> None:
    if VENDOR in ("plain", "tiacc"):
        dist.init_process_group(backend="gloo", init_method="env://")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 3, 6, 6, generator=g), torch.randint(0, 4, (32,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        train(None, model, loader, optimizer, epoch)
    rank = dist.get_rank()
    print(f"rank {rank}: hook={bool(model._comm_hooks)} cudnn_benchmark={torch.backends.cudnn.benchmark} "
          f"bucket_bytes={model.bucket_bytes_cap} local_rank={os.environ.get('LOCAL_RANK')}", flush=True)
    torch.save([p.detach().clone() for p in model.module.parameters()],
               os.path.join(sys.argv[1], f"{sys.argv[2]}.{rank}.pt"))
    if VENDOR != "light":
        dist.destroy_process_group()
    time.sleep(0.05)  # gloo's workers finish before the interpreter's exit (tests/helpers.py says why)


if __name__ == "__main__":
    main()

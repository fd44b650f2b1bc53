"""A DDP training script in the shape of PyTorch's DDP tutorial and ImageNet example, on CPU.

A BatchNorm conv net on synthetic images, ``DistributedSampler``, SGD with momentum, two epochs
with a checkpoint in between (rank 0 saves, every rank loads it with ``map_location``, as the
tutorial's ``demo_checkpoint``), then every rank saves its final parameters. Nothing here knows
fleetlike, except that ``--auto`` imports ``fleetlike.auto`` first, as a user adds that line.

Usage: ddp_script.py OUT NAME --init {env,spawn,tcp,file,mpi,slurm} [--addr A --port P] [--auto]

* env: torchrun or a launcher exported RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT;
* spawn: ``mp.spawn`` of 2 processes, MASTER_ADDR / MASTER_PORT set by the script (tutorial);
* tcp / file: ``init_method="tcp://A:P"`` / ``"file://OUT/NAME.rdzv"`` with ``--rank`` and
  ``--world`` from the command line (as the ImageNet example's ``--rank`` / ``--world-size``);
* mpi / slurm: rank and size from PMI_RANK / PMI_SIZE or SLURM_PROCID / SLURM_NTASKS, then tcp.
"""

import sys

if "--auto" in sys.argv:
    import fleetlike.auto  # noqa: F401  (the one line a user adds)

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = os.path.join(args.out, f"{args.name}.ckpt")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if epoch == 0:
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
            dist.barrier()
            state = torch.load(ckpt, map_location="cpu")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
    torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()},
               os.path.join(args.out, f"{args.name}.{rank}.pt"))
    dist.destroy_process_group()
    time.sleep(0.05)  # gloo's workers finish before the interpreter's exit (tests/helpers.py says why)


def spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"] = args.addr
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train(rank, world, args)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("name")
    p.add_argument("--init", required=True, choices=["env", "spawn", "tcp", "file", "mpi", "slurm"])
    p.add_argument("--addr", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--auto", action="store_true")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--world", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.init == "spawn":
        mp.spawn(spawned, args=(2, args), nprocs=2, join=True)
        return
    if args.init == "env":
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), args)
        return
    if args.init in ("tcp", "file"):
        rank, world = args.rank, args.world
    else:
        rank_var, size_var = {"mpi": ("PMI_RANK", "PMI_SIZE"), "slurm": ("SLURM_PROCID", "SLURM_NTASKS")}[args.init]
        rank, world = int(os.environ[rank_var]), int(os.environ[size_var])
    method = (f"file://{os.path.join(args.out, args.name)}.rdzv" if args.init == "file"
              else f"tcp://{args.addr}:{args.port}")
    dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world)
    train(rank, world, args)


if __name__ == "__main__":
    main()

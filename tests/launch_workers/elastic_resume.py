"""A deterministic eager-style training job that resumes from `fleetlike.elastic`'s on-disk commit.

Usage: elastic_resume.py OUT MODE
  MODE none:     train to the end
  MODE kill:     at start 0, rank 1 SIGKILLs itself after step 10 (last commit: step 8)
  MODE killall:  rank 1 SIGKILLs itself after step 10 at every start (restarts run out)
  MODE raise:    rank 0 raises before its first step at every start (not retryable)
Writes OUT/final.pt (rank 0's parameters), OUT/pid.<gen>.<rank> and OUT/starts.<rank> lines.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fleetlike import elastic, fleet
from fleetlike.io import DistributedSampler

out, mode = Path(sys.argv[1]), sys.argv[2]
gen = int(os.environ["FLEETLIKE_RESTART_COUNT"])
fleet.init()
rank = fleet.worker_index()
(out / f"pid.{gen}.{rank}").write_text(str(os.getpid()))
g = torch.Generator().manual_seed(7)
x = torch.randn(96, 8, generator=g)
y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
dataset = torch.utils.data.TensorDataset(x, y)
sampler = DistributedSampler(dataset, shuffle=True, seed=3)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
model = fleet.distributed_model(net)
opt = fleet.distributed_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0,
                           directory=out / "ckpt", save_every=1)
resumed = state.load()
with open(out / f"starts.{rank}", "a") as fh:
    fh.write(f"gen {gen} resumed {resumed} at step {state.step}\n")
if mode == "raise" and rank == 0:
    raise RuntimeError("bad configuration found at step 0")
while state.epoch < 3:
    sampler.set_epoch(state.epoch)
    batch: list[int] = []
    for index in sampler:
        batch.append(index)
        if len(batch) < 8:
            continue
        xb, yb = dataset[batch]
        batch = []
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        state.step += 1
        if rank == 1 and state.step == 10 and (mode == "killall" or (mode == "kill" and gen == 0)):
            os.kill(os.getpid(), signal.SIGKILL)
        if state.step % 4 == 0:
            state.commit()
    state.epoch += 1
    state.commit()
if rank == 0:
    torch.save({k: v.clone() for k, v in net.state_dict().items()}, out / "final.pt")
fleet.shutdown()

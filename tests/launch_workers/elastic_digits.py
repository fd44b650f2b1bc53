"""An elastic job on the digits task (`fleetlike.elastic`), for the node-loss and join tests.

Usage: elastic_digits.py OUT EPOCHS PAUSE STYLE    (STYLE: eager | program)
Every process writes OUT/start.<pid> when it starts; rank 0 writes OUT/progress ("step world")
after every step; every rank writes OUT/done.<pid>.json at the end (its pid, the re-formations
it went through, the samples seen per epoch by the committed steps of every world, accuracy).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from amp_common import accuracy, digits_loss, digits_model, digits_split  # noqa: E402

import fleetlike  # noqa: E402
from fleetlike import elastic, fleet  # noqa: E402
from fleetlike.io import DistributedSampler  # noqa: E402

out, epochs, pause, style = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
(out / f"start.{os.getpid()}").write_text(os.environ.get("FLEETLIKE_NODE_IP", ""))
elastic.init(timeout=60.0)
(xtr, ytr), (xte, yte) = digits_split(0)
sampler = DistributedSampler(torch.utils.data.TensorDataset(xtr, ytr), seed=1)
net = digits_model(0)
opt = fleet.distributed_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
if style == "eager":
    model = fleet.distributed_model(net)
else:
    opt.minimize(digits_loss, net)
    exe = fleetlike.Executor(fleet.device())
    exe.run(fleet.startup_program)
state = elastic.TorchState(model=net, optimizer=opt, sampler=sampler, epoch=0, step=0,
                           seen=[[] for _ in range(epochs)])


def step(batch: list[int]) -> None:
    xb, yb = xtr[batch], ytr[batch]
    if style == "eager":
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    else:
        exe.run(fleet.main_program, feed={"x": xb, "y": yb})
    for part in fleet.util.all_gather(torch.tensor(batch)):
        state.seen[state.epoch].extend(int(i) for i in part)
    state.step += 1
    if fleet.worker_index() == 0:
        (out / "progress.tmp").write_text(f"{state.step} {fleet.worker_num()}")
        os.replace(out / "progress.tmp", out / "progress")
    if state.step % 5 == 0:
        state.commit()
    time.sleep(pause)


@elastic.run
def train(state: elastic.TorchState) -> None:
    while state.epoch < epochs:
        sampler.set_epoch(state.epoch)
        batch: list[int] = []
        for index in sampler:
            batch.append(index)
            if len(batch) == 8:
                step(batch)
                batch = []
        if batch:
            step(batch)
        state.epoch += 1
        state.commit()


train(state)
report = {"pid": os.getpid(), "rank": fleet.worker_index(), "world": fleet.worker_num(),
          "resets": elastic.RESET_LOG, "seen": state.seen, "accuracy": accuracy(net, xte, yte),
          "steps": state.step}
(out / f"done.{os.getpid()}.json").write_text(json.dumps(report))
elastic.shutdown()

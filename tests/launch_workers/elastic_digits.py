"""An elastic job on the digits task (`fleetlike.elastic`), for the node-loss and join tests.

Usage: elastic_digits.py OUT EPOCHS PAUSE STYLE [UNTIL]    (STYLE: eager | program | horovod)
PAUSE: seconds each step sleeps, so that the test's events (a node joining, a node lost) happen
mid-epoch; with UNTIL only until that event: ``lost``, until this process's world has re-formed
after a node was lost (its size fell); ``joined``, while its world is smaller than the launcher's
maximum (``--nnodes MIN:MAX``; a worker that joined a running world finds it full). After that,
the job runs at full speed.
horovod: hvd.init(), hvd.elastic.TorchState / @hvd.elastic.run, hvd.size() and hvd.allgather_object
for the bookkeeping; the gradients through fleet.distributed_optimizer (hvd.DistributedOptimizer in
an elastic job: test_horovod_elastic.py).
Every process writes OUT/pid.<pid> and OUT/node.<pid> (its node's IP) when it starts; rank 0
writes OUT/progress ("step world time")
after every step; every rank writes OUT/done.<pid>.json at the end (its pid, the re-formations
it went through, the samples seen per epoch by the committed steps of every world, accuracy).
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from amp_common import accuracy, digits_loss, digits_model, digits_split  # noqa: E402

import fleetlike  # noqa: E402
import fleetlike.horovod as hvd  # noqa: E402
from fleetlike import elastic, fleet  # noqa: E402
from fleetlike.elastic.membership import ENV, ElasticSettings  # noqa: E402
from fleetlike.io import DistributedSampler  # noqa: E402

out, epochs, pause, style = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
until = sys.argv[5] if len(sys.argv) > 5 else None
assert until in (None, "lost", "joined"), until
(out / f"pid.{os.getpid()}").write_text(str(os.getpid()))
(out / f"node.{os.getpid()}").write_text(os.environ.get("FLEETLIKE_NODE_IP", ""))
core = elastic  # fleetlike's module: its reset log and shutdown
if style == "horovod":
    hvd.init(timeout=60.0)  # an elastic launch: joins as elastic.init() does
    elastic = hvd.elastic  # noqa: F811 - Horovod's names over that module
else:
    elastic.init(timeout=60.0)
(xtr, ytr), (xte, yte) = digits_split(0)
sampler = DistributedSampler(torch.utils.data.TensorDataset(xtr, ytr), seed=1)
net = digits_model(0)
opt = fleet.distributed_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
if style in ("eager", "horovod"):
    model = fleet.distributed_model(net)
else:
    opt.minimize(digits_loss, net)
    exe = fleetlike.Executor(fleet.device())
    exe.run(fleet.startup_program)
state = elastic.TorchState(model=net, optimizer=opt, sampler=sampler, epoch=0, step=0,
                           seen=[[] for _ in range(epochs)])


def scale_lr() -> None:
    """Linear scaling: the global batch is 8 per rank, so the rate follows the world size; and a
    cosine decay over the samples seen, so that the final accuracy does not depend on the step
    at which the world changed (with a constant rate it moved by up to 2.5 points with the join
    and loss steps; with the decay over 3 epochs by at most 0.5 in a single-process simulation
    of 54 join/loss points)."""
    done = (state.epoch + len(state.seen[state.epoch]) / len(xtr)) / epochs if state.epoch < epochs else 1.0
    world = hvd.size() if style == "horovod" else fleet.worker_num()
    for group in opt.param_groups:
        group["lr"] = 0.05 * world * 0.5 * (1.0 + math.cos(math.pi * done))


state.register_reset_callbacks([scale_lr])


def step(batch: list[int]) -> None:
    scale_lr()
    xb, yb = xtr[batch], ytr[batch]
    if style in ("eager", "horovod"):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    else:
        exe.run(fleet.main_program, feed={"x": xb, "y": yb})
    parts = hvd.allgather_object(batch) if style == "horovod" else fleet.util.all_gather(torch.tensor(batch))
    for part in parts:
        state.seen[state.epoch].extend(int(i) for i in part)
    state.step += 1
    if fleet.worker_index() == 0:
        (out / "progress.tmp").write_text(f"{state.step} {fleet.worker_num()} {time.time()}")
        os.replace(out / "progress.tmp", out / "progress")
    if state.step % 5 == 0:
        state.commit()
    if not happened():
        time.sleep(pause)


def happened() -> bool:
    """Whether the event the pause waits for (`until`) has happened."""
    if until == "lost":
        return any(record["new_size"] < record["old_size"] for record in core.RESET_LOG)
    if until == "joined":
        return fleet.worker_num() >= int(os.environ[ENV["max"]])
    return False


@elastic.run
def train(state: elastic.TorchState) -> None:
    scale_lr()  # the first call: the world is formed now
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
          "resets": core.RESET_LOG, "seen": state.seen, "accuracy": accuracy(net, xte, yte),
          "steps": state.step, "heartbeat_timeout": ElasticSettings.from_env().heartbeat_timeout}
(out / f"done.{os.getpid()}.json").write_text(json.dumps(report))
core.shutdown()

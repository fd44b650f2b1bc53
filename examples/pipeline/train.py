#!/usr/bin/env python
"""A model split into pipeline stages: Paddle's `train_batch`, on 2 CPU workers.

The model is an `nn.Sequential` of 8 blocks; with `pp_degree=2` each worker holds 4 of them
(and only their optimizer state). Every `model.train_batch((x, y), opt)` cuts the batch into
`accumulate_steps` micro-batches, streams them through the two stages on the 1F1B schedule,
steps the optimizer once and returns the mean loss on both workers.

    python -m fleetlike.launch --nproc_per_node=2 --started_port=auto examples/pipeline/train.py

EPL's keys do the same: DistributedStrategy.from_dict({"pipeline.num_stages": 2,
"pipeline.num_micro_batch": 4, "pipeline.strategy": "PreferBackward"}). With 4 workers and
`dp_degree=2`, two pipelines train side by side, each on its own half of the data
(`hcg.get_data_parallel_rank()`). STEPS sets the number of steps, MODEL_PATH where the stage
checkpoints go (and are read back).
"""
import os

import torch
import torch.nn.functional as F

from fleetlike import DistributedStrategy, fleet

strategy = DistributedStrategy(
    pipeline=True,
    pipeline_configs={"accumulate_steps": 4, "schedule_mode": "1F1B"},
    hybrid_configs={"pp_degree": 2},          # dp_degree = world size / 2 (the default -1)
)
fleet.init(strategy=strategy)
hcg = fleet.get_hybrid_communicate_group()

torch.manual_seed(0)
blocks = [torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)) for _ in range(7)]
net = torch.nn.Sequential(*blocks, torch.nn.Linear(32, 2))
model = fleet.distributed_model(net, loss_fn=F.cross_entropy)      # this worker's stage only
opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
print(f"[rank {fleet.worker_index()}] stage {hcg.get_stage_id()} of {hcg.get_pipe_parallel_world_size()}, "
      f"pipeline {hcg.get_data_parallel_rank()} of {hcg.get_data_parallel_world_size()}: blocks {model.stage.names}, "
      f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)

g = torch.Generator().manual_seed(100 + hcg.get_data_parallel_rank())   # each pipeline its own data
steps = int(os.environ.get("STEPS", "60"))
for step in range(steps):
    x = torch.rand(64, 32, generator=g)
    y = (x[:, :16].sum(1) > x[:, 16:].sum(1)).long()     # which half of the features is larger
    loss = model.train_batch((x, y), opt)
    if step % 10 == 0 or step == steps - 1:
        print(f"step {step} loss {float(loss):.4f}", flush=True)

path = os.environ.get("MODEL_PATH")
if path:
    fleet.save_persistables(None, path)     # every worker calls it; each stage writes its own file
    fleet.load_persistables(None, path)
    print(f"saved and reloaded {sorted(os.listdir(path))}", flush=True)
fleet.shutdown()

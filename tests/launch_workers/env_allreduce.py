"""Test worker: dump the launcher-given environment and roles, then all_reduce rank + 1.

Usage (under the launcher): env_allreduce.py OUT_DIR [script args...]
The all_reduce runs on fleetlike's gloo world (the rendezvous at rank 0's endpoint); with
``--started_port=auto`` also on a plain ``torch.distributed`` ``env://`` group, which joins the
launcher's store as under torchrun. Writes OUT_DIR/pid.<rank>, OUT_DIR/env.<rank>.json and
OUT_DIR/sum.<rank> (and, on a GPU, OUT_DIR/cuda.<rank>: visible device count and a value
computed on the selected GPU).
"""

import datetime
import json
import os
import sys

from fleetlike import roles

KEYS = [
    "PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS",
    "PADDLE_CURRENT_ENDPOINT", "PADDLE_NODE_NUM", "FLAGS_selected_gpus", "RANK", "WORLD_SIZE",
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "FLEETLIKE_JOB_ID", "FLEETLIKE_NODE_IP", "CUDA_VISIBLE_DEVICES", "http_proxy", "https_proxy",
    "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "FLEETLIKE_TEST_MARKER",
    "TORCHELASTIC_USE_AGENT_STORE",
]


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    role = roles.PaddleCloudRoleMaker().role
    detected = roles.detect_role()
    dump = {
        "env": {k: os.environ[k] for k in KEYS if k in os.environ},
        "argv": sys.argv[2:],
        "cwd": os.getcwd(),
        "executable": sys.executable,
        "role": [role.rank, role.world_size, role.local_rank, role.local_size,
                 role.node_index, role.node_num, list(role.endpoints), role.job_id,
                 role.master_endpoint, role.master_hosted],
        "detected_same": detected == role,
    }
    with open(os.path.join(out, f"env.{rank}.json"), "w") as f:
        json.dump(dump, f)
    print(f"worker {rank} ready", flush=True)

    import torch
    import torch.distributed as dist

    from fleetlike.comm import create_world

    world = create_world(role, backend="gloo", timeout=30)
    x = torch.tensor([float(rank + 1)])
    world.all_reduce(x)
    world.close()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        y = torch.tensor([float(rank + 1)])
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=30),
        )
        dist.all_reduce(y)
        dist.destroy_process_group()
        assert y.item() == x.item(), (y.item(), x.item())
    gpu = os.environ.get("FLAGS_selected_gpus", "")
    if gpu:  # a GPU run: the selected device must be usable under the given numbering
        y = (x.to(f"cuda:{int(gpu)}") * 2).cpu()
        with open(os.path.join(out, f"cuda.{rank}"), "w") as f:
            f.write(f"{torch.cuda.device_count()} {y.item()}")
    with open(os.path.join(out, f"sum.{rank}"), "w") as f:
        f.write(str(x.item()))
    print(f"worker {rank} sum {x.item()}", flush=True)


if __name__ == "__main__":
    main()

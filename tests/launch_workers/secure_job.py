"""Test worker of a job a stranger tries to enter: rank 1 starts late (it waits for GO_FILE), then
every rank runs the Horovod face's object collectives and an allreduce and writes what it got.

Usage: secure_job.py OUT_DIR GO_FILE   ->   OUT_DIR/rank<r>.json
"""

import json
import os
import sys
import time

import torch


def main() -> None:
    out, go = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if rank == 1:  # the late rank: its seat stays open while the stranger tries to take it
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)
    import fleetlike.horovod as hvd

    hvd.init()
    gathered = hvd.allgather_object({"rank": hvd.rank(), "pid": os.getpid()})
    sent = hvd.broadcast_object({"from": hvd.rank(), "epoch": 7}, root_rank=0)
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"gathered": [g["rank"] for g in gathered], "broadcast": sent, "sum": total,
                   "size": hvd.size(), "job_id": os.environ["FLEETLIKE_JOB_ID"]}, fh)


if __name__ == "__main__":
    main()

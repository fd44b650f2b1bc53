"""Test worker: one member of an elastic rendezvous (the variables `fleetlike.elastic.membership.ENV`
and FLEETLIKE_JOB_SECRET set by the test): form a world, check a sync payload, allreduce.

Usage: elastic_member.py OUT_DIR   ->   OUT_DIR/member<pid>.json
"""

import json
import os
import sys

import torch

from fleetlike.comm.secret import dumps_signed, loads_signed
from fleetlike.elastic.membership import Membership


def main() -> None:
    members = Membership.from_env()
    role, world = members.form(timeout=60)
    total = world.all_reduce(torch.tensor([float(role.rank + 1)])).item()
    blob = dumps_signed({"state": "from rank 0"}, "elastic.sync", 0) if role.rank == 0 else b""
    size = world.broadcast(torch.tensor([len(blob)], dtype=torch.int64), 0)
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if role.rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8)
    got = loads_signed(world.broadcast(buf, 0).numpy().tobytes(), "elastic.sync", 0)
    members.close()
    with open(os.path.join(sys.argv[1], f"member{os.getpid()}.json"), "w") as fh:
        json.dump({"rank": role.rank, "size": role.world_size, "sum": total, "synced": got,
                   "endpoint": role.current_endpoint}, fh)


if __name__ == "__main__":
    main()

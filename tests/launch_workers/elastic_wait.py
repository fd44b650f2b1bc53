"""Test worker: one member of an elastic job started by the launcher, which waits for a go file
before joining the rendezvous, then forms a world, all-reduces and syncs a signed payload.

Usage: elastic_wait.py OUT_DIR GO_FILE [HOLD_FILE]   ->   OUT_DIR/member<pid>.json
With HOLD_FILE, the member writes OUT_DIR/formed<pid> once its world is formed and stays in the
rendezvous until HOLD_FILE exists (the job's store stays up meanwhile).
"""

import json
import os
import sys
import time

import torch

from fleetlike.comm.secret import dumps_signed, loads_signed
from fleetlike.elastic.membership import Membership


def main() -> None:
    out, go = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    members = Membership.from_env()
    role, world = members.form(timeout=60)
    if len(sys.argv) > 3:
        open(os.path.join(out, f"formed{os.getpid()}"), "w").close()
        while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
            time.sleep(0.05)
    total = world.all_reduce(torch.tensor([float(role.rank + 1)])).item()
    blob = dumps_signed({"state": "from rank 0"}, "elastic.sync", 0) if role.rank == 0 else b""
    size = world.broadcast(torch.tensor([len(blob)], dtype=torch.int64), 0)
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if role.rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8)
    got = loads_signed(world.broadcast(buf, 0).numpy().tobytes(), "elastic.sync", 0)
    members.close()
    with open(os.path.join(out, f"member{os.getpid()}.json"), "w") as fh:
        json.dump({"rank": role.rank, "size": role.world_size, "sum": total, "synced": got}, fh)


if __name__ == "__main__":
    main()

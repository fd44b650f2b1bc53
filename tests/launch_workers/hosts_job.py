"""Test worker of the ``-np/-H`` form: fleet.init() from whatever the launcher gave, then a sum.

Usage: hosts_job.py OUT_DIR [--fail RANK CODE]
Every worker writes OUT_DIR/pid.<rank> (its pid) and, after ``fleet.init()`` (the role detected
from the environment: ``PADDLE_*`` under --gloo, ``PMI_*`` + ``FLEETLIKE_*`` under --mpi) and a
``fleet.util.all_reduce`` of rank + 1, OUT_DIR/role.<rank>.json. With ``--fail RANK CODE`` that
rank exits with CODE once every pid file exists, while the others sleep: the launcher has to end
them.
"""

import json
import os
import sys
import time


def main() -> None:
    out, flags = sys.argv[1], sys.argv[2:]
    from fleetlike import fleet

    fleet.init()
    rank, world = fleet.worker_index(), fleet.worker_num()
    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    total = fleet.util.all_reduce(rank + 1, mode="sum")
    with open(os.path.join(out, f"role.{rank}.json"), "w") as f:
        json.dump({
            "rank": rank, "world": world, "local_rank": fleet.local_rank(), "node_num": fleet.node_num(),
            "endpoints": fleet.worker_endpoints(), "sum": float(total),
            "node_ip_env": os.environ.get("FLEETLIKE_NODE_IP"), "netns": _netns(),
        }, f)
    if "--fail" in flags:
        i = flags.index("--fail")
        bad, code = int(flags[i + 1]), int(flags[i + 2])
        pids = [os.path.join(out, f"pid.{r}") for r in range(world)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(os.path.exists(p) for p in pids):
            time.sleep(0.05)
        if rank == bad:
            print(f"rank {rank} fails on purpose", flush=True)
            os._exit(code)
        time.sleep(120)  # the launcher must end us
        return
    fleet.util.barrier()


def _netns() -> str:
    """The address of this process's network namespace's veth end (which simulated node we are)."""
    import subprocess

    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    return ",".join(sorted(w.split("/")[0] for w in out.split() if w.startswith("10.77.")))


if __name__ == "__main__":
    main()

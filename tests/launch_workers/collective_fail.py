"""A fleet worker that fails inside a collective, for the launcher-level failure tests.

Usage: collective_fail.py MODE   (MODE: sleep = rank 1 sleeps before an all_reduce; timeout 2 s;
                                        kill  = rank 1 SIGKILLs itself inside an all_reduce)
"""

import os
import signal
import sys
import time

import torch

from fleetlike import fleet

mode = sys.argv[1]
fleet.init(timeout=2.0 if mode == "sleep" else 60.0)
world = fleet._ctx.world
world.all_reduce(torch.ones(4))
print(f"rank {fleet.worker_index()} ready", flush=True)
if fleet.worker_index() == 1:
    if mode == "sleep":
        time.sleep(30)
    else:
        world.all_reduce_async(torch.ones(32 << 20))
        os.kill(os.getpid(), signal.SIGKILL)
world.all_reduce(torch.ones(32 << 20))
print("unreachable", flush=True)

"""Test worker: the chosen ranks print ~4 MiB (more than the test's log folder holds), then
every rank sleeps; a job whose log cannot be written must be ended by its launcher.

Usage: chatty.py OUT_DIR RANKS_CSV   ->   OUT_DIR/start.<rank> before printing
"""

import os
import sys
import time

rank = int(os.environ["PADDLE_TRAINER_ID"])
open(os.path.join(sys.argv[1], f"start.{rank}"), "w").close()
if str(rank) in sys.argv[2].split(","):
    line = "x" * 4095
    for _ in range(1024):
        print(line)
time.sleep(120)

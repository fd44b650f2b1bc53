"""Test worker: start a child of its own (in the worker's process group, as a DataLoader worker
is), write both pids to OUT_DIR/pids.<rank>, then sleep until killed.

Usage: with_child.py OUT_DIR
"""

import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(sys.argv[1], f"pids.{os.environ['RANK']}"), "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}\n")
time.sleep(120)

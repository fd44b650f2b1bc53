"""Test worker whose child leaves the worker's process group (``setsid``) and sleeps, as a
daemonising helper does; a grandchild of that child sleeps too.

Usage: setsid_child.py OUT_DIR ok|fail|sleep
Writes OUT_DIR/child.<rank> and OUT_DIR/grandchild.<rank> (the pids), then OUT_DIR/pid.<rank>;
then exits 0 (ok), exits 3 (fail) or sleeps until stopped (sleep).
"""

import os
import subprocess
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
code = (
    "import os, subprocess, sys, time\n"
    "os.setsid()\n"
    "grand = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "out, rank = sys.argv[1], sys.argv[2]\n"
    "for name, pid in (('grandchild', grand.pid), ('child', os.getpid())):\n"
    "    with open(os.path.join(out, f'{name}.{rank}.tmp'), 'w') as fh:\n"
    "        fh.write(str(pid))\n"
    "    os.rename(os.path.join(out, f'{name}.{rank}.tmp'), os.path.join(out, f'{name}.{rank}'))\n"
    "time.sleep(120)\n"
)
subprocess.Popen([sys.executable, "-c", code, out, rank])
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(out, f"child.{rank}")) and time.monotonic() < deadline:
    time.sleep(0.02)
with open(os.path.join(out, f"pid.{rank}.tmp"), "w") as fh:
    fh.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid.{rank}.tmp"), os.path.join(out, f"pid.{rank}"))
print(f"worker {rank} started its setsid child", flush=True)
if mode == "fail":
    sys.exit(3)
if mode == "sleep":
    time.sleep(120)

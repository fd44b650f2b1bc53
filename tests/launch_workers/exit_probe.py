"""Ends as ``sys.argv[1]`` says, leaving what an interpreter's exit must finish: a running
non-daemon thread, an ``atexit`` handler, a text file and a gzip file written but not closed.
Run plainly and forked from the preload server, the exit status, the output and the files
must agree."""

import atexit
import gzip
import os
import sys
import threading
import time

mode, out = sys.argv[1], sys.argv[2]
print(f"preloaded: {'torch' in sys.modules}")  # a forked child finds the server's imports
order = open(os.path.join(out, f"{mode}.order"), "w")  # noqa: SIM115 - closed by the exit, as tested


def late_thread():
    time.sleep(0.2)
    order.write("thread ended\n")


def at_exit():
    order.write("atexit ran\n")


atexit.register(at_exit)
threading.Thread(target=late_thread).start()
packed = gzip.open(os.path.join(out, f"{mode}.gz"), "wt")
packed.write(f"{mode} " * 1000)
print(f"{mode}: main done", flush=True)
if mode == "exit3":
    sys.exit(3)
if mode == "exit_text":
    sys.exit("leaving with a message")
if mode == "raise":
    raise ValueError("the script failed")
if mode == "ctrl_c":
    raise KeyboardInterrupt

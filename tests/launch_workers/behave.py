"""Test worker whose behaviour is chosen by flags, to exercise the launcher's failure handling.

Usage: behave.py OUT_DIR [--fail RANK CODE] [--sigkill RANK] [--child] [--ignore-term] [--ok]
Every worker writes OUT_DIR/pid.<rank>; with --child it first starts a sleeping child that
writes OUT_DIR/child.<rank>. The failing rank waits until every pid file exists, so the test
can check afterwards that each recorded process is gone.
"""

import os
import signal
import subprocess
import sys
import time


def wait_for(paths, seconds=15.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths):
        time.sleep(0.02)


def main() -> None:
    out, flags = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    node_base = rank - int(os.environ["LOCAL_RANK"])
    local_ranks = range(node_base, node_base + local_world)
    if "--ignore-term" in flags:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    expected = [os.path.join(out, f"pid.{r}") for r in local_ranks]
    if "--child" in flags:
        code = (
            "import os, signal, sys, time\n"
            f"{'signal.signal(signal.SIGTERM, signal.SIG_IGN)' if '--ignore-term' in flags else ''}\n"
            f"open(os.path.join(sys.argv[1], 'child.{rank}.tmp'), 'w').write(str(os.getpid()))\n"
            f"os.rename(os.path.join(sys.argv[1], 'child.{rank}.tmp'), "
            f"os.path.join(sys.argv[1], 'child.{rank}'))\n"
            "time.sleep(120)\n"
        )
        subprocess.Popen([sys.executable, "-c", code, out])
        wait_for([os.path.join(out, f"child.{rank}")])
        expected += [os.path.join(out, f"child.{r}") for r in local_ranks]
    tmp = os.path.join(out, f"pid.{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, os.path.join(out, f"pid.{rank}"))
    print(f"worker {rank} of {world} started", flush=True)
    if "--ok" in flags:
        return
    if "--fail" in flags:
        i = flags.index("--fail")
        if rank == int(flags[i + 1]):
            wait_for(expected)
            print(f"worker {rank} failing on purpose", flush=True)
            sys.exit(int(flags[i + 2]))
    if "--sigkill" in flags:
        i = flags.index("--sigkill")
        if rank == int(flags[i + 1]):
            wait_for(expected)
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


if __name__ == "__main__":
    main()

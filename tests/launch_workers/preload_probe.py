"""Records how this worker was started, then ends as its restart generation says: in generation
0 rank 1 raises, in 1 it is killed by SIGKILL, in 2 every rank waits for the launcher's SIGTERM.
Run plainly and preloaded (``--preload``), the records and the launcher's lines must agree."""

import json
import os
import signal
import sys
import time

preloaded = "torch" in sys.modules  # a preloaded worker finds torch imported already

import numpy as np  # noqa: E402
import torch  # noqa: E402

out = sys.argv[1]
rank = int(os.environ["RANK"])
gen = int(os.environ["FLEETLIKE_RESTART_COUNT"])
main = sys.modules["__main__"]
record = {
    "preloaded": preloaded,
    "argv": sys.argv, "orig_argv_tail": sys.orig_argv[-2:], "name": __name__, "file": __file__,
    "main_is_this": vars(main) is globals(), "spec": repr(globals().get("__spec__")),
    "path0": sys.path[0], "path_rest": sys.path[1:], "cwd": os.getcwd(),
    "own_group": os.getpgid(0) == os.getpid(), "own_session": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(), "stdout_tty": sys.stdout.isatty(),
    "line_buffering": [sys.stdout.line_buffering, sys.stderr.line_buffering],
    "flags": [sys.stdout.write_through, sys.flags.optimize, sys.flags.safe_path],
    "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
    "env": {k: v for k, v in os.environ.items() if k not in ("FLEETLIKE_JOB_SECRET",)},
    "torch_seed": torch.initial_seed(), "torch_draw": torch.rand(2).tolist(),
    "np_draw": float(np.random.rand()), "umask": os.umask(0o022),
    "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE)],
}
with open(os.path.join(out, f"gen{gen}-rank{rank}.tmp"), "w") as f:
    json.dump(record, f)
os.rename(os.path.join(out, f"gen{gen}-rank{rank}.tmp"), os.path.join(out, f"gen{gen}-rank{rank}.json"))
print(f"rank {rank} generation {gen} started", flush=True)
while rank == 1 and not os.path.exists(os.path.join(out, f"gen{gen}-rank0.json")):
    time.sleep(0.01)  # rank 0 has written its record before this generation ends
if gen == 0 and rank == 1:
    raise ValueError(f"generation {gen} fails")
if gen == 1 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if gen == 2:
    def on_term(signum, frame):
        with open(os.path.join(out, f"term-{rank}"), "w") as f:
            f.write(str(signum))
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(out, f"ready-{rank}"), "w").close()
time.sleep(60)

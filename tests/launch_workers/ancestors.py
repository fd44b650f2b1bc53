"""Test worker: report whether a variable's value reached this worker, and whether it appears on
the command line of any of its ancestors (readable by every user in /proc/PID/cmdline).

Usage: ancestors.py OUT_DIR NAME   ->   OUT_DIR/seen.<rank> (JSON)
"""

import json
import os
import sys

out, name = sys.argv[1], sys.argv[2]
value = os.environ.get(name, "")
lines, pid = [], os.getppid()
while pid > 1:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            lines.append(fh.read().replace(b"\0", b" ").decode(errors="replace"))
        with open(f"/proc/{pid}/stat") as fh:
            pid = int(fh.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        break
rank = os.environ.get("PADDLE_TRAINER_ID", "?")
with open(os.path.join(out, f"seen.{rank}"), "w") as fh:
    json.dump({"value": value, "on_a_command_line": any(value and value in ln for ln in lines),
               "ancestors": len(lines)}, fh)

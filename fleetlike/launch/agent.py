"""The node agent of the ``-np/-H`` form: fleetlike's launcher on one host, stopped by its caller.

`fleetlike.launch.hostrun` starts one agent per host (directly on this machine, through the
remote shell elsewhere). An agent is the ordinary launcher (`fleetlike.launch.main.main`) with
three additions that a process started over ``ssh`` needs:

* ``--chdir DIR`` and ``--env NAME=VALUE``: the caller's working directory and the variables it
  forwards (``ssh`` gives a login environment, not the caller's);
* ``--secret_stdin``: the first line of its standard input is the job's secret (never on a
  command line, where other users of the host could read it);
* ``--watch_stdin``: the agent stops its workers when its standard input reaches end of file.
  The caller holds the write end of that pipe and never writes to it; when the caller stops the
  agent's ``ssh`` client, or dies itself, ``ssh`` closes the remote command's input, and the
  agent ends its workers as if it had received SIGTERM. This is how the whole-job-stop
  guarantee crosses hosts without a second channel.

The pieces ``mpiexec`` runs (the remote-shell bridge, the rank guard) are in
`fleetlike.launch.mpiguard`, which imports nothing but the standard library.

Example (what `hostrun` runs through ``ssh host2``)::

    python -m fleetlike.launch.agent --chdir /job --env PYTHONPATH=/src --watch_stdin -- \\
        --cluster_node_ips=host1,host2 --node_ip=host2 --nproc_per_node=2 train.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence

from fleetlike.comm import SECRET_ENV
from fleetlike.launch.main import main as launch_main

__all__ = ["main"]


def _watch_stdin() -> None:
    """Block until stdin closes, then stop this process the way SIGTERM does."""
    try:  # os.read, not sys.stdin: a daemon thread inside a buffered read aborts the shutdown
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _first_line() -> str:
    """The first line of stdin, read byte by byte (nothing after it is consumed)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            break
        line += byte
    return line.decode(errors="replace").strip()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m fleetlike.launch.agent``; returns the launcher's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    own, rest = args[:split], args[split + 1 :]
    p = argparse.ArgumentParser(prog="python -m fleetlike.launch.agent", allow_abbrev=False)
    p.add_argument("--chdir", default=None)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--watch_stdin", action="store_true")
    p.add_argument("--secret_stdin", action="store_true")
    p.add_argument("--env_stdin", action="store_true")
    p.add_argument("--env_names", default="")
    opts = p.parse_args(own)
    if opts.secret_stdin:
        os.environ[SECRET_ENV] = _first_line()
    if opts.env_stdin:  # the values of the forwarded variables, never on a command line
        try:
            handed = json.loads(_first_line() or "{}")
        except ValueError:
            p.error("--env_stdin: the second line of input is not the JSON the launcher writes")
        os.environ.update({str(k): str(v) for k, v in handed.items()})
    if opts.chdir:
        os.chdir(opts.chdir)
    for item in opts.env:
        name, sep, value = item.partition("=")
        if not sep:
            p.error(f"--env {item!r}: write NAME=VALUE")
        os.environ[name] = value
    if opts.watch_stdin:
        threading.Thread(target=_watch_stdin, name="fleetlike-agent-stdin", daemon=True).start()
    return launch_main(rest)


if __name__ == "__main__":
    sys.exit(main())

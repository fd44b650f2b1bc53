"""Node agents started from this launcher: their argv, the environment they get, start and stop.

Shared by the ``-np/-H`` form (`fleetlike.launch.hostrun`, one agent per host) and by elastic
host discovery (`fleetlike.launch.discovery`, one agent per host the discovery script finds),
so an agent is started and ended the same way in both: through the ``--remote_shell`` template
(with ``{host}``) unless the host is this machine, in its own session so its whole group can be
signalled, dying with this process (``PR_SET_PDEATHSIG``), and with a pipe on its stdin that
this process never writes: closing it is a remote agent's cue to stop its workers
(`fleetlike.launch.agent`'s ``--watch_stdin``), which is how a whole-job stop crosses hosts.

Example::

    argv = agent_argv(["--node_ip=10.0.0.2", "--nproc_per_node=2", "train.py"], cwd="/job", env={})
    proc = start_agent(shell_argv("ssh -o BatchMode=yes {host}", "10.0.0.2") + [shlex.join(argv)])
    stop_agents([proc], grace=11)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from fleetlike.comm import SECRET_ENV
from fleetlike.launch.hosts import FORWARDED, FORWARDED_PREFIXES, shell_argv
from fleetlike.launch.workers import _die_with_launcher

__all__ = ["agent_argv", "agent_grace", "forwarded_env", "shell_argv", "start_agent", "stop_agents"]


def forwarded_env(forward: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables agents get from here: `FORWARDED`, ``FLEETLIKE_*`` and the ``forward`` names
    (``ssh`` gives a login environment, not this one)."""
    env = dict(os.environ if environ is None else environ)
    names = [n for n in env if n in FORWARDED or n.startswith(FORWARDED_PREFIXES) or n in forward]
    return {n: env[n] for n in sorted(names)}


def agent_argv(launcher_args: Sequence[str], *, cwd: str, env: Mapping[str, str]) -> list[str]:
    """``python -m fleetlike.launch.agent --chdir CWD --watch_stdin --secret_stdin --env ... --
    LAUNCHER_ARGS``: the agent reads the job's secret from the first line of its input
    (`start_agent` writes it), so it never appears on a command line; ``env`` never carries it."""
    argv = [sys.executable, "-m", "fleetlike.launch.agent", "--chdir", cwd, "--watch_stdin", "--secret_stdin",
            "--env_stdin"]
    # the variables' values come on stdin after the secret (`start_agent`'s ``handed``): a
    # command line is readable by every user of the node (/proc/PID/cmdline), and ``-x`` and
    # FLEETLIKE_* values may be credentials; only their names are shown here
    names = ",".join(name for name in env if name != SECRET_ENV)
    return argv + (["--env_names", names] if names else []) + ["--", *launcher_args]


def agent_grace(kill_grace: float) -> float:
    """How long an agent may take to stop its own workers before it is killed."""
    return 2 * kill_grace + 5


def start_agent(argv: Sequence[str], *, stdin: int | None = subprocess.PIPE,
                stderr: int | None = None, secret: str | None = None,
                env: Mapping[str, str] | None = None,
                handed: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A child in its own session (so its group can be signalled) that dies with this process.

    ``secret``: written as the first line of the child's input (an agent started with
    ``--secret_stdin``), ``handed`` (the variables of `agent_argv`'s ``env``) as the second, in
    JSON; the pipe then stays open, unwritten, as the stop cue."""
    proc = subprocess.Popen(list(argv), stdin=stdin, stderr=stderr, start_new_session=True,
                            preexec_fn=_die_with_launcher, env=None if env is None else dict(env))
    if secret is not None and proc.stdin is not None:
        try:
            given = {k: v for k, v in (handed or {}).items() if k != SECRET_ENV}
            proc.stdin.write(secret.encode() + b"\n" + json.dumps(given).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # the agent is gone already: its exit is reported by whoever watches it
    return proc


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_agents(procs: Sequence[subprocess.Popen[bytes]], grace: float, sig: int = signal.SIGTERM) -> None:
    """``sig`` to every child's group, SIGKILL after ``grace``; returns when all are reaped."""
    for p in procs:
        if p.stdin is not None and not p.stdin.closed:
            p.stdin.close()  # a remote agent's cue, through ssh
        _signal(p, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGKILL)
        p.wait()

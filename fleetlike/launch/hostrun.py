"""Running a checked `HostsJob`: one node agent per host (``--gloo``) or ``mpiexec`` (``--mpi``).

``--gloo``: every host runs one `fleetlike.launch.agent`, i.e. fleetlike's ordinary launcher
with ``--cluster_node_ips`` = the hosts, ``--node_ip`` = that host, ``--nproc_per_node`` = its
processes. This machine's agent is started directly, the others through the remote-shell
template (``ssh -o BatchMode=yes {host}`` by default). Each agent gives its workers the
environment of `fleetlike.launch.env.worker_env` (``PADDLE_*`` and torchrun's names), so
``fleet.init()``, ``hvd.init()`` and ``init_process_group("env://")`` work unchanged, and stops
its local workers when one fails. Across hosts this module watches the agents: the first agent
to end badly (its worker failed, or its host could not be reached) makes it stop every other
agent (SIGTERM to the agent's process group; a remote agent sees its ``ssh`` input close and
stops its workers), so a failed worker on one node ends the workers on all the others.

``--mpi``: one ``mpiexec`` (MPICH's hydra) starts everything. Remote hosts are reached through
the same template: hydra's ssh launcher is pointed (``-launcher-exec``) at a small script that
runs `fleetlike.launch.mpiguard`'s ``shell`` mode. Each host's ranks form one block (an
MPMD segment ``-n K -env FLEETLIKE_NODE_IP HOST``), each rank under mpiguard's ``guard``, and ``FLEETLIKE_NODE_IPS``,
``FLEETLIKE_MASTER_ADDR``/``_PORT`` and ``FLEETLIKE_JOB_ID`` go to every rank, which is what
`fleetlike.roles` reads under MPICH (``EnvRoleMaker``, ``MPIRoleMaker``). A failed rank's guard
dies by SIGKILL, on which hydra ends the whole job; this module reads the rank's own exit code
back from the guard's line on mpiexec's stderr and returns it.

Exit codes: as the ordinary launcher's (0, or the failed worker's code, or 128 + signal), with
2 for input errors found before anything started.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

from fleetlike.comm import SECRET_ENV, new_secret
from fleetlike.config import envvars
from fleetlike.launch.config import default_job_id
from fleetlike.launch.flags import LaunchInputError, _HelpExit
from fleetlike.launch.hosts import (
    HostsJob,
    Mode,
    is_hosts_form,
    parse_hosts,
    python_script,
)
from fleetlike.launch.main import _StopRequest
from fleetlike.launch.main import main as launch_main
from fleetlike.launch.mpiguard import GUARD_LINE
from fleetlike.launch.preload import ACCELERATE_SITE
from fleetlike.launch.remote import agent_argv, agent_grace, forwarded_env, start_agent, stop_agents
from fleetlike.launch.workers import describe_exit

__all__ = ["agent_command", "cli", "mpiexec_command", "run_hosts"]

_PREFIX = "fleetlike.launch:"
#: run by path under mpiexec: no ``import fleetlike`` (torch) per rank
_MPIGUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpiguard.py")
_POLL_SECONDS = 0.1


def _job_id(job: HostsJob) -> str:
    return job.job_id or default_job_id(job.node_names, job.started_port, job.per_node)


def agent_command(job: HostsJob, node: int, *, cwd: str, env: dict[str, str]) -> list[str]:
    """The argv of host ``node``'s agent (run as is here, or joined into one line for the shell)."""
    script, module, script_args = python_script(job.command)
    host = job.hosts[node]
    argv = [
        f"--cluster_node_ips={','.join(job.node_names)}",
        f"--node_ip={host.name}",
        f"--nproc_per_node={host.procs}",
        f"--started_port={job.started_port}",
        f"--log_dir={os.path.join(job.log_dir, f'node{node}')}",
        f"--job_id={_job_id(job)}",
        f"--kill_grace={job.kill_grace:g}",
    ]
    if job.accelerate_horovod:
        argv.append("--accelerate_horovod")
    if module:
        argv.append("-m")
    return agent_argv([*argv, script, *script_args], cwd=cwd, env=env)


def mpiexec_command(job: HostsJob, launcher_exec: str | None) -> list[str]:
    """The ``mpiexec`` argv of an ``--mpi`` job; ``launcher_exec``: the remote-shell script
    (None when every host is this machine)."""
    assert job.mpiexec is not None  # parse_hosts found it or refused --mpi
    argv = [job.mpiexec]
    if launcher_exec is not None:
        argv += ["-launcher", "ssh", "-launcher-exec", launcher_exec]
        local = job.local_host
        if local is not None:  # the address remote proxies connect back to
            argv += ["-localhost", local.name]
    argv += ["-hosts", ",".join(f"{h.name}:{h.procs}" for h in job.hosts)]
    for name, value in (
        (envvars.NODE_IPS, ",".join(job.node_names)),
        (envvars.MASTER_ADDR, job.hosts[0].name),
        (envvars.MASTER_PORT, str(job.started_port)),
        (envvars.JOB_ID, _job_id(job)),
    ):
        argv += ["-genv", name, value]
    if job.accelerate_horovod:  # what the ordinary launcher's --accelerate_horovod sets (fleetlike.launch.env)
        site = os.pathsep.join(p for p in (ACCELERATE_SITE, os.environ.get(envvars.PYTHONPATH)) if p)
        argv += ["-genv", envvars.ACCELERATE_HOROVOD, "1", "-genv", envvars.PYTHONPATH, site]
    argv += list(job.mpiexec_args)
    guard = [sys.executable, _MPIGUARD, "guard"]
    for k, host in enumerate(job.hosts):
        if k:
            argv.append(":")
        argv += ["-n", str(host.procs), "-env", envvars.NODE_IP, host.name, *guard, *job.command]
    return argv


def _watch(procs: Sequence[subprocess.Popen[bytes]], names: Sequence[str], job: HostsJob, stop: _StopRequest) -> int:
    """Wait for every child; the first to fail, or a signal to us, stops the others."""
    # agents need their own grace to stop their workers before we escalate
    grace = agent_grace(job.kill_grace)
    while True:
        if stop.signum is not None:
            stop_agents(procs, grace, stop.signum)
            print(f"{_PREFIX} received {signal.Signals(stop.signum).name}; stopped the job on "
                  f"{len(procs)} host(s)", file=sys.stderr, flush=True)
            return 128 + stop.signum
        codes = [p.poll() for p in procs]
        bad = next((k for k, c in enumerate(codes) if c not in (None, 0)), None)
        if bad is not None:
            others = [p for k, p in enumerate(procs) if k != bad]
            stop_agents(others, grace)
            code = procs[bad].returncode
            print(f"{_PREFIX} {names[bad]} {describe_exit(code)}; stopped the job on the other "
                  f"{len(others)} host(s)", file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        stop.event.wait(_POLL_SECONDS)


def _run_gloo(job: HostsJob, stop: _StopRequest, secret: str) -> int:
    cwd, env = os.getcwd(), forwarded_env(job.forward)
    procs: list[subprocess.Popen[bytes]] = []
    names = []
    try:
        for k, host in enumerate(job.hosts):
            argv = agent_command(job, k, cwd=cwd, env=env)
            if not host.local:
                argv = job.shell_argv(host.name) + [shlex.join(argv)]
            names.append(f"host {host.name} (node {k}, ranks {k * job.per_node}..{(k + 1) * job.per_node - 1})")
            try:
                procs.append(start_agent(argv, stdin=subprocess.PIPE, secret=secret, handed=env))
            except OSError as exc:
                print(f"{_PREFIX} cannot start the agent of host {host.name}: {exc}", file=sys.stderr, flush=True)
                stop_agents(procs, agent_grace(job.kill_grace))
                return 1
        return _watch(procs, names, job, stop)
    finally:
        if any(p.poll() is None for p in procs):
            stop_agents(procs, agent_grace(job.kill_grace))


def _run_mpi(job: HostsJob, stop: _StopRequest, secret: str) -> int:
    with tempfile.TemporaryDirectory(prefix="fleetlike-mpi-") as tmp:
        launcher_exec = None
        if any(not h.local for h in job.hosts):
            launcher_exec = os.path.join(tmp, "remote-shell")
            with open(launcher_exec, "w", encoding="utf-8") as fh:
                fh.write("#!/bin/sh\nexec " + shlex.join([sys.executable, _MPIGUARD, "shell", job.remote_shell])
                         + ' "$@"\n')
            os.chmod(launcher_exec, 0o755)
        # in mpiexec's environment (which it hands to every rank), not on its command line
        proc = start_agent(mpiexec_command(job, launcher_exec), stdin=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env={**os.environ, SECRET_ENV: secret})
        failed: list[int] = []
        tee = threading.Thread(target=_tee_stderr, args=(proc, failed), name="fleetlike-mpiexec-err", daemon=True)
        tee.start()
        try:
            code = _watch([proc], ["mpiexec"], job, stop)
        finally:
            if proc.poll() is None:
                stop_agents([proc], agent_grace(job.kill_grace))
            tee.join(timeout=5)
        # the failed rank's own code (hydra reports the guard's SIGKILL instead)
        return failed[0] if code != 0 and failed and stop.signum is None else code


_GUARD_RE = re.compile(re.escape(GUARD_LINE).replace(r"\{rank\}", r"(\d+)").replace(r"\{how\}", r"(.*)"))


def _tee_stderr(proc: subprocess.Popen[bytes], failed: list[int]) -> None:
    """Copy mpiexec's stderr here; note the exit code of the first rank `rank_guard` reports."""
    assert proc.stderr is not None
    for raw in iter(proc.stderr.readline, b""):
        line = raw.decode(errors="replace")
        match = _GUARD_RE.search(line)
        if match and not failed:
            how = match.group(2)
            number = int(how.rsplit(" ", 1)[1]) if how.startswith("exited") else None
            failed.append(number if number is not None else 128 + _signum(how))
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _signum(how: str) -> int:
    name = how.rsplit(" ", 1)[1]
    try:
        return int(signal.Signals[name])
    except KeyError:
        return int(name) if name.isdigit() else 1


def run_hosts(job: HostsJob) -> int:
    """Run ``job`` to the end and return the exit code (see module doc)."""
    secret = os.environ.get(SECRET_ENV, "").strip() or new_secret()
    # one id for every host's agent (a random default would differ per call)
    job = dataclasses.replace(job, job_id=job.job_id or default_job_id(
        job.node_names, job.started_port, job.per_node, {**os.environ, SECRET_ENV: secret}))
    stop = _StopRequest()
    stop.install()
    try:
        return _run_mpi(job, stop, secret) if job.mode is Mode.MPI else _run_gloo(job, stop, secret)
    finally:
        stop.restore()


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m fleetlike.launch``: the ``-np/-H`` form when its flags come first
    (`fleetlike.launch.hosts.is_hosts_form`), else the ordinary launcher (`main.main`).

    Example:
        >>> cli(["-np", "2", "-H", "localhost:2", "--", "python", "train.py"])  # doctest: +SKIP
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not is_hosts_form(args):
        return launch_main(args)
    try:
        job = parse_hosts(args)
    except _HelpExit as done:
        return done.status
    except LaunchInputError as exc:
        print(f"{_PREFIX} error: {exc}", file=sys.stderr, flush=True)
        return 2
    return run_hosts(job)

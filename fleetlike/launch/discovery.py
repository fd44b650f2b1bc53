"""``--host_discovery_script``: nodes of an elastic job found by a script, as Horovod Elastic does.

The launcher that hosts the rendezvous (``--nnodes MIN:MAX --rdzv_endpoint``, its own
``--node_ip``) runs the script every ``--discovery_interval`` seconds. The script is an
executable that prints one ``host:slots`` line per node that may run workers (Horovod's
contract; ``#`` comments and blank lines are skipped, a bare ``host`` is one slot, as with
``-H``). For every listed host that is not running workers yet (not this node, not a host whose
started launcher still runs) and while the job has fewer than MAX nodes, the launcher starts that
host's launcher through the ``--remote_shell`` template (`fleetlike.launch.remote`, the same
agent the ``-np/-H`` form starts) with this launcher's ``--nnodes``, ``--rdzv_endpoint``,
``--nproc_per_node`` and training command; the new node's workers wait at the rendezvous and are
admitted at the job's next commit (`fleetlike.elastic`).

What this does not do, on purpose: a host that vanishes from the script's output is not stopped
(its workers go on; if the node is really gone, the existing node-loss path re-forms the world
without it), and a host whose launcher ended is not started again (Horovod's blacklist), since
restarting a failing host would only repeat its failure.

Errors: ``slots`` must equal ``--nproc_per_node`` (fleetlike lays ranks out in equal blocks per
node). At start-up a script that cannot run, fails, or prints a bad line is an input error (exit
2, nothing started); later it is logged in the launcher's log and retried at the next interval.
The whole-job stop ends every launcher this one started (their ``ssh`` input closes).

Example::

    python -m fleetlike.launch --nnodes=1:4 --rdzv_endpoint=10.0.0.1:29400 --node_ip=10.0.0.1 \\
        --nproc_per_node=2 --host_discovery_script=./discover_hosts.sh train.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time

from fleetlike.launch.config import LaunchConfig
from fleetlike.launch.flags import AUTO_PORT, LaunchInputError
from fleetlike.launch.hosts import parse_host_list
from fleetlike.launch.remote import agent_argv, agent_grace, forwarded_env, shell_argv, start_agent, stop_agents
from fleetlike.launch.workers import describe_exit

__all__ = ["DiscoveryError", "HostDiscovery", "node_launcher_args", "parse_discovery_output", "run_script"]

_PREFIX = "fleetlike.launch:"


class DiscoveryError(RuntimeError):
    """The discovery script could not run, failed, or printed something unusable."""


def run_script(path: str, timeout: float) -> str:
    """The script's standard output; `DiscoveryError` names the reason when it has none."""
    program = os.path.abspath(path) if os.sep in path or os.path.exists(path) else path
    try:
        done = subprocess.run([program], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"--host_discovery_script={path} ran longer than {timeout:g} s; "
                             "make it print its hosts and exit") from None
    except OSError as exc:
        raise DiscoveryError(f"--host_discovery_script={path} cannot run ({exc.strerror}); give an "
                             "executable file (chmod +x, with a #! line)") from None
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or ["-"]
        raise DiscoveryError(f"--host_discovery_script={path} {describe_exit(done.returncode)} "
                             f"(last line of its stderr: {said[0]})")
    return done.stdout


def parse_discovery_output(text: str, path: str, nproc_per_node: int) -> dict[str, int]:
    """``host:slots`` lines -> ``{host: slots}`` in order; every host must have
    ``nproc_per_node`` slots (`DiscoveryError` otherwise)."""
    hosts: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--host_discovery_script={path} line {n}"
        if "," in line or len(line.split()) > 1:
            raise DiscoveryError(f"{where}: {line!r} is not one 'host:slots'; print one host a line")
        try:
            ((host, slots),) = parse_host_list(line, name=where)
        except LaunchInputError as exc:
            raise DiscoveryError(str(exc)) from None
        if host in hosts:
            raise DiscoveryError(f"{where}: {host} is listed twice; list each host once")
        if slots != nproc_per_node:
            raise DiscoveryError(
                f"{where}: {host} has {slots} slots, but every node runs --nproc_per_node="
                f"{nproc_per_node} workers (fleetlike lays ranks out in equal blocks per node); "
                f"print {host}:{nproc_per_node}")
        hosts[host] = slots
    return hosts


def node_launcher_args(config: LaunchConfig, host: str) -> list[str]:
    """The launcher flags and training command of a discovered ``host``'s node."""
    port = AUTO_PORT if config.auto_ports else str(config.started_port)
    args = [
        f"--nnodes={config.min_nodes}:{config.max_nodes}",
        f"--rdzv_endpoint={config.rdzv_endpoint}",
        f"--rdzv_last_call={config.rdzv_last_call:g}",
        f"--heartbeat_timeout={config.heartbeat_timeout:g}",
        f"--node_ip={host}",
        f"--nproc_per_node={config.nproc_per_node}",
        f"--started_port={port}",
        f"--log_dir={os.path.join(config.log_dir, f'node-{host}')}",
        f"--job_id={config.job_id}",
        f"--kill_grace={config.kill_grace:g}",
        f"--max_restarts={config.max_restarts}",
        f"--malloc_tuning={'on' if config.malloc_tuning else 'off'}",
        f"--preload={config.preload}",
    ]
    if config.module:
        args.append("-m")
    return args + [config.training_script, *config.training_script_args]


class HostDiscovery:
    """Runs the discovery script and starts the launchers of new hosts until `close`.

    `check` runs the script once (start-up: raises `LaunchInputError`); `start` polls in a thread.
    """

    def __init__(self, config: LaunchConfig) -> None:
        assert config.host_discovery_script is not None  # the launcher builds one only then
        self.config = config
        self.path = config.host_discovery_script
        self.timeout = max(10.0, 2 * config.discovery_interval)
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # guarded by _lock
        self._ended: set[str] = set()  # guarded by _lock
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error = ""
        self._cwd = os.getcwd()
        self._env = forwarded_env()

    def check(self) -> None:
        """The start-up run: its failure or a bad line is the user's input error (exit 2)."""
        try:
            self._poll()
        except DiscoveryError as exc:
            self.close(wait=0)
            raise LaunchInputError(str(exc)) from None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fleetlike-discovery", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._closing.wait(self.config.discovery_interval):
            try:
                self._poll()
                self._last_error = ""
            except DiscoveryError as exc:
                if str(exc) != self._last_error:  # said once until it changes
                    _say(f"{exc}; retrying every {self.config.discovery_interval:g} s")
                self._last_error = str(exc)
            except OSError as exc:
                _say(f"host discovery: {exc}; retrying every {self.config.discovery_interval:g} s")

    def _poll(self) -> None:
        listed = parse_discovery_output(run_script(self.path, self.timeout), self.path,
                                        self.config.nproc_per_node)
        with self._lock:
            self._reap()
            for host in listed:
                if self._closing.is_set() or 1 + len(self._running()) >= self.config.max_nodes:
                    return
                if host == self.config.node_ip or host in self._procs:
                    continue
                self._launch(host)

    def _running(self) -> list[str]:
        return [h for h, p in self._procs.items() if p.poll() is None]

    def _reap(self) -> None:
        for host, proc in self._procs.items():
            if proc.poll() is not None and host not in self._ended:
                self._ended.add(host)
                _say(f"host discovery: the launcher of {host} {describe_exit(proc.returncode)}; "
                     "it is not started again")

    def _launch(self, host: str) -> None:
        command = agent_argv(node_launcher_args(self.config, host), cwd=self._cwd, env=self._env)
        argv = shell_argv(self.config.remote_shell, host) + [shlex.join(command)]
        try:
            self._procs[host] = start_agent(argv, secret=self.config.job_secret, handed=self._env)
        except OSError as exc:
            raise DiscoveryError(f"--remote_shell={self.config.remote_shell!r}: cannot start the "
                                 f"launcher of {host} ({exc.strerror})") from None
        _say(f"host discovery: started the launcher of {host} ({self.config.nproc_per_node} "
             f"workers; they join at the next commit; log dir "
             f"{os.path.join(self.config.log_dir, f'node-{host}')})")

    def close(self, wait: float) -> None:
        """Stop polling; give the started launchers ``wait`` seconds to end on their own (a job
        that succeeded ends everywhere), then stop the rest (the whole-job stop)."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 5)
        with self._lock:
            procs = list(self._procs.values())
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        stop_agents(procs, agent_grace(self.config.kill_grace))


def _say(text: str) -> None:
    print(f"{_PREFIX} {text}", file=sys.stderr, flush=True)

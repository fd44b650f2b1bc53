"""The ``-np/-H`` command line (horovodrun's and perseusrun's ``-np N -H host:n,...`` form) -> a checked `HostsJob`.

``python -m fleetlike.launch -np 4 -H host1:2,host2:2 [--gloo|--mpi] -- python train.py`` starts
one job over several machines from one command. This module only reads and checks that command
line; `fleetlike.launch.hostrun` starts the job. Every check here runs before anything starts
and raises `LaunchInputError` (exit code 2), naming the flag, the value and the fix:

* ``-np`` must be a positive integer and fit the slots: hosts are filled in ``-H`` order (as
  horovodrun does), and the hosts that receive processes must receive the same number each,
  because fleetlike lays ranks out in equal blocks per node (``LOCAL_WORLD_SIZE`` is one number
  in `fleetlike.roles`);
* a host must resolve (an IP address, or a name the resolver knows), appear once, and a
  loopback name (``localhost``) cannot share a job with other hosts, whose workers could not
  reach it;
* ``--mpi`` needs ``mpiexec`` (next to this interpreter, else on ``PATH``); ``--gloo`` with a
  remote host needs the remote-shell program, and a template with ``{host}`` in it.

Example:
    >>> job = parse_hosts(["-np", "4", "-H", "10.0.0.1:2,10.0.0.2:2", "--", "python", "t.py"])
    >>> [(h.name, h.procs) for h in job.hosts]
    [('10.0.0.1', 2), ('10.0.0.2', 2)]
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import errno
import ipaddress
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Sequence

from fleetlike.launch.flags import DEFAULT_REMOTE_SHELL, DEFAULT_STARTED_PORT, LaunchInputError, _HelpExit, add_shared_flag
from fleetlike.roles import is_host

__all__ = [
    "DEFAULT_REMOTE_SHELL",
    "Host",
    "HostsJob",
    "Mode",
    "find_mpiexec",
    "is_hosts_form",
    "is_local_host",
    "parse_host_list",
    "parse_hosts",
    "python_script",
    "shell_argv",
]


#: The flags that select this form when they come before the training command.
_MARKERS = ("-np", "-H", "--hosts", "--hostfile", "--gloo", "--mpi")
#: Flags of either form that take no value (for `is_hosts_form`'s scan).
_SWITCHES = ("--gloo", "--mpi", "-m", "--module", "--print_config", "--use_paddlecloud", "-h", "--help",
             "--accelerate_ddp", "--accelerate_horovod", "--use_env", "--use-env", "--standalone")
#: Variables every remote node's workers get from the launcher's environment (with ``-x``
#: naming more): what finds the interpreter and fleetlike, and fleetlike's own knobs.
FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
FORWARDED_PREFIXES = ("FLEETLIKE_",)


class Mode(str, enum.Enum):
    """How processes are started: by fleetlike's own node agents, or by ``mpiexec``."""

    GLOO = "gloo"
    MPI = "mpi"


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine of the job: its name (as given in ``-H``), its slots and the processes it runs."""

    name: str
    slots: int
    procs: int
    local: bool


@dataclasses.dataclass(frozen=True)
class HostsJob:
    """A checked ``-np/-H`` command line. ``hosts`` holds only the hosts that run processes."""

    np: int
    hosts: tuple[Host, ...]
    command: tuple[str, ...]
    mode: Mode = Mode.GLOO
    remote_shell: str = DEFAULT_REMOTE_SHELL
    started_port: int = DEFAULT_STARTED_PORT
    log_dir: str = "log"
    job_id: str | None = None
    kill_grace: float = 3.0
    forward: tuple[str, ...] = ()
    mpiexec: str | None = None
    mpiexec_args: tuple[str, ...] = ()
    #: ``--accelerate_horovod``: the workers' ``import horovod.torch`` is fleetlike.horovod
    accelerate_horovod: bool = False

    @property
    def per_node(self) -> int:
        return self.hosts[0].procs

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hosts)

    @property
    def local_host(self) -> Host | None:
        """The host this launcher runs on, if one of the job's hosts is this machine."""
        return next((h for h in self.hosts if h.local), None)

    def shell_argv(self, host: str) -> list[str]:
        """The remote-shell template for ``host`` (`shell_argv`)."""
        return shell_argv(self.remote_shell, host)


def shell_argv(template: str, host: str) -> list[str]:
    """The remote-shell ``template`` for ``host``, split like a shell would; the command line to
    run there is appended as one more argument."""
    return [part.replace("{host}", host) for part in shlex.split(template)]


def is_hosts_form(argv: Sequence[str]) -> bool:
    """True when ``argv`` uses the ``-np/-H`` form: one of its flags comes before the command.

    The scan stops at ``--`` or at the first positional argument (the ordinary form's training
    script), so a script's own ``-H`` flag is never mistaken for the launcher's."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):
            return False
        if token in _MARKERS or token.split("=", 1)[0] in _MARKERS:
            return True
        if "=" not in token and token not in _SWITCHES:
            i += 1  # the flag's value
        i += 1
    return False


def parse_host_list(text: str, *, name: str = "-H") -> list[tuple[str, int]]:
    """``"h1:2,h2:2"`` (or ``"h1"``, one slot) -> ``[("h1", 2), ("h2", 2)]``; checked."""
    out: list[tuple[str, int]] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        host, sep, slots_text = item.rpartition(":")
        if not sep or host.endswith(":") or ("[" not in host and ":" in host):
            host, slots_text = item, "1"  # no slots given (or a bare IPv6 address)
        host = host.strip("[]")
        try:
            slots = int(slots_text)
        except ValueError:
            raise LaunchInputError(
                f"{name}={text}: {item!r} has slots {slots_text!r}, not an integer; write HOST:SLOTS, "
                "e.g. host1:2"
            ) from None
        if slots < 1:
            raise LaunchInputError(f"{name}={text}: {item!r} gives {slots} slots; give at least 1")
        if not host or not is_host(host):
            raise LaunchInputError(
                f"{name}={text}: {host!r} is neither an IP address nor a host name; write HOST:SLOTS"
            )
        if host in [h for h, _ in out]:
            raise LaunchInputError(f"{name}={text} lists {host} twice; give each host once with all its slots")
        out.append((host, slots))
    if not out:
        raise LaunchInputError(f"{name}={text!r} names no host; write e.g. -H host1:2,host2:2")
    return out


def _read_hostfile(path: str) -> str:
    """horovodrun's host file: one ``host slots=N`` (or ``host:N``, or ``host``) a line, ``#`` comments."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise LaunchInputError(f"--hostfile={path}: cannot read it ({exc.strerror}); give a readable file") from None
    items = []
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) == 2 and parts[1].startswith("slots="):
            items.append(f"{parts[0]}:{parts[1][len('slots='):]}")
        elif len(parts) == 1:
            items.append(parts[0])
        else:
            raise LaunchInputError(
                f"--hostfile={path} line {n}: {line!r} is not 'HOST slots=N' or 'HOST:N'"
            )
    return ",".join(items)


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine: a loopback name, or an address a socket here can
    bind (which is exactly "one of this machine's addresses", in this network namespace)."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        if ipaddress.ip_address(addr[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                return True  # bindable in principle (e.g. EACCES): the address is ours
    return False


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return True


def find_mpiexec() -> str | None:
    """``mpiexec`` next to this interpreter (the mpich wheel's), else on ``PATH``."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpiexec")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise LaunchInputError(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            self._print_message(message)
        raise _HelpExit(status)


_EXAMPLES = """\
examples:
  two machines, two processes each, started over ssh (fleetlike's own agents, gloo):
    python -m fleetlike.launch -np 4 -H host1:2,host2:2 -- python train.py --lr 0.1
  the same through mpiexec (MPICH's hydra; workers see PMI_RANK, ...):
    python -m fleetlike.launch -np 4 -H host1:2,host2:2 --mpi -- python train.py
  network namespaces as simulated nodes (host names are namespace names here):
    python -m fleetlike.launch -np 4 -H nsa:2,nsb:2 --remote_shell 'ip netns exec {host} sh -c' ...
"""


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m fleetlike.launch -np N -H HOSTS",
        description="Start one job of N processes over the hosts in -H (horovodrun's form).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("-np", "--num-proc", dest="np", required=True, help="number of processes in all")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", dest="hosts",
                       help="HOST:SLOTS,... in rank order (default: this machine, -np slots: one node, as "
                       "horovodrun and perseusrun read -np N alone)")
    where.add_argument("--hostfile", "--host-file", dest="hostfile",
                       help="a file of 'HOST slots=N' lines (horovodrun's / Open MPI's form)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gloo", dest="mode", action="store_const", const=Mode.GLOO,
                      help="fleetlike starts the processes: local slots itself, the others through "
                      "--remote_shell (default)")
    mode.add_argument("--mpi", dest="mode", action="store_const", const=Mode.MPI,
                      help="mpiexec (MPICH's hydra) starts the processes")
    add_shared_flag(p, "remote_shell", "hosts")
    add_shared_flag(p, "started_port", "hosts")
    add_shared_flag(p, "log_dir", "hosts")
    add_shared_flag(p, "job_id", "hosts")
    add_shared_flag(p, "kill_grace", "hosts")
    p.add_argument("-x", dest="forward", action="append", default=[], metavar="NAME",
                   help="also pass environment variable NAME to remote hosts (repeatable)")
    add_shared_flag(p, "accelerate_horovod", "hosts")
    p.add_argument("--mpiexec_args", "--mpi-args", default="",
                   help="--mpi: extra mpiexec arguments, one string")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run, e.g. python train.py")
    return p


def _positive(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise LaunchInputError(f"{name}={text!r} is not an integer") from None
    if value < 1:
        raise LaunchInputError(f"{name}={value} must be >= 1")
    return value


def _fill(np: int, slots: list[tuple[str, int]], where: str) -> list[tuple[str, int, int]]:
    """Hosts filled in order up to ``np``: ``(host, slots, procs)`` of those that get processes."""
    total = sum(s for _, s in slots)
    if np > total:
        raise LaunchInputError(
            f"-np={np} is more than the {total} slots of {where}; lower -np or add slots"
        )
    out, left = [], np
    for host, s in slots:
        if left == 0:
            break
        take = min(s, left)
        out.append((host, s, take))
        left -= take
    counts = sorted({p for _, _, p in out})
    if len(counts) > 1:
        layout = ",".join(f"{h}:{p}" for h, _, p in out)
        raise LaunchInputError(
            f"-np={np} over {where} puts {layout} processes on the hosts; fleetlike lays ranks out "
            "in equal blocks per node, so give every host the same number (e.g. "
            f"-np={counts[0] * len(out)} or equal slots)"
        )
    return out


def parse_hosts(
    argv: Sequence[str], *, local: Callable[[str], bool] = is_local_host,
    resolves: Callable[[str], bool] = _resolves, mpiexec: Callable[[], str | None] = find_mpiexec,
) -> HostsJob:
    """Parse and check the ``-np/-H`` command line (raises `LaunchInputError`)."""
    args = _parser().parse_args(list(argv))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchInputError("no command given; end the flags with -- and give it, e.g. -- python train.py")
    if command[0] in ("python", "python3"):
        # as in the ordinary launcher: a bare `python` is the interpreter running the launcher
        command[0] = sys.executable
    np = _positive("-np", args.np)
    if args.hosts is None and args.hostfile is None:
        where, slots = f"-np={np} (no -H: this machine)", [("localhost", np)]
    elif args.hosts is not None:
        where, slots = f"-H={args.hosts}", parse_host_list(args.hosts)
    else:
        where, slots = f"--hostfile={args.hostfile}", parse_host_list(_read_hostfile(args.hostfile), name=f"--hostfile={args.hostfile}")
    filled = _fill(np, slots, where)
    for host, _, _ in filled:
        if not resolves(host):
            raise LaunchInputError(
                f"{where}: host {host!r} is unknown (it does not resolve); give its IP address or a "
                "name in /etc/hosts or DNS"
            )
    hosts = tuple(Host(h, s, p, local(h)) for h, s, p in filled)
    loop = [h.name for h in hosts if h.name == "localhost" or _is_loopback(h.name)]
    if loop and len(hosts) > 1:
        raise LaunchInputError(
            f"{where}: {loop[0]} is a loopback name, which the other hosts' workers cannot reach; "
            "name this machine by an address the others can reach"
        )
    port = _positive("--started_port", args.started_port)
    if port + hosts[0].procs - 1 > 65535:
        raise LaunchInputError(f"--started_port={port} with {hosts[0].procs} processes per host passes 65535; lower it")
    try:
        grace = float(args.kill_grace)
    except ValueError:
        raise LaunchInputError(f"--kill_grace={args.kill_grace!r} is not a number of seconds") from None
    if not grace >= 0:
        raise LaunchInputError(f"--kill_grace={grace:g} must be >= 0 seconds")
    mode = args.mode or Mode.GLOO
    remote = [h for h in hosts if not h.local]
    if "{host}" not in args.remote_shell:
        raise LaunchInputError(
            f"--remote_shell={args.remote_shell!r} has no {{host}}; write where the host name goes, "
            f"e.g. {DEFAULT_REMOTE_SHELL!r}"
        )
    shell = shlex.split(args.remote_shell)
    if remote and shutil.which(shell[0]) is None:
        raise LaunchInputError(
            f"--remote_shell={args.remote_shell!r}: {shell[0]!r} is not an executable on PATH, and "
            f"host {remote[0].name} is not this machine; install it or give another template"
        )
    found = None
    if mode is Mode.MPI:
        found = mpiexec()
        if found is None:
            raise LaunchInputError(
                "--mpi: no mpiexec next to this Python or on PATH; pip install mpich (or put "
                "mpiexec on PATH), or use --gloo"
            )
    else:
        python_script(command)  # checked now, before anything starts
    for name in args.forward:
        if not name or "=" in name or name not in os.environ:
            raise LaunchInputError(
                f"-x {name!r}: not a variable set here; give the NAME of one set in this environment"
            )
    return HostsJob(
        np=np, hosts=hosts, command=tuple(command), mode=mode, remote_shell=args.remote_shell,
        started_port=port, log_dir=args.log_dir, job_id=args.job_id, kill_grace=grace,
        forward=tuple(args.forward), mpiexec=found, mpiexec_args=tuple(shlex.split(args.mpiexec_args)),
        accelerate_horovod=args.accelerate_horovod,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_python(program: str) -> bool:
    base = os.path.basename(program)
    return base.startswith("python") or os.path.realpath(program) == os.path.realpath(sys.executable)


#: interpreter options that change nothing the launcher's own ``python -u`` must know about
_PY_SWITCHES = ("-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-b", "-bb", "-q")


def python_script(command: Sequence[str]) -> tuple[str, bool, tuple[str, ...]]:
    """``python [-u] script.py args`` / ``python -m pkg args`` -> ``(script, is_module, args)``.

    ``--gloo`` starts workers through fleetlike's launcher on each host, which runs them with
    this interpreter (the same path on every host, as horovodrun assumes); other commands go
    through ``--mpi``. A script that is not here is an input error (hosts are assumed to share
    the working directory's contents, as with horovodrun)."""
    if not _is_python(command[0]):
        raise LaunchInputError(
            f"--gloo runs Python scripts through fleetlike's launcher on each host, but the command "
            f"starts with {command[0]!r}; write -- python script.py ... (or use --mpi)"
        )
    i = 1
    while i < len(command) and command[i] in _PY_SWITCHES:
        i += 1
    if i >= len(command):
        raise LaunchInputError(f"the command {shlex.join(command)!r} names no script; write -- python train.py ...")
    head = command[i]
    if head == "-m":
        if i + 1 >= len(command):
            raise LaunchInputError("the command ends with -m; give the module, e.g. -- python -m pkg.train")
        return command[i + 1], True, tuple(command[i + 2 :])
    if head.startswith("-"):
        raise LaunchInputError(
            f"--gloo: python option {head!r} is not supported in the command (fleetlike's launcher "
            "runs `python -u script`); drop it, or use --mpi"
        )
    if not os.path.isfile(head):
        raise LaunchInputError(
            f"training script {head!r} not found (from {os.getcwd()}); give its path"
        )
    return head, False, tuple(command[i + 1 :])

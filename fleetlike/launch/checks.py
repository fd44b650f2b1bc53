"""Checks against this machine, run before any worker starts.

A job that dies seconds in because port 6171 was taken, or because GPU 3 does not exist, wastes
every other node's start-up too; these checks turn such problems into one clear message and exit
code 2 instead.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from collections.abc import Sequence

from fleetlike.comm import JobSecret
from fleetlike.config import envvars
from fleetlike.launch.config import LaunchConfig
from fleetlike.launch.flags import AUTO_PORT, LaunchInputError
from fleetlike.launch.env import torch_master_port
from fleetlike.launch.ports import HostedEndpoints, hold_endpoints, host_endpoints

__all__ = [
    "cuda_device_count", "check_machine", "check_ports", "check_rendezvous_file", "check_worker_count",
    "host_ports", "worker_bound",
]

#: Workers per usable CPU a node may start without `envvars.MAX_NPROC_PER_NODE`: CPU jobs on a
#: few cores oversubscribe a little (gloo ranks mostly wait); a typo (``1000`` for ``10``) or a
#: flag copied from another machine starts hundreds of interpreters, each importing torch, and
#: the machine is lost to swap before the first worker fails.
WORKERS_PER_CPU = 4
#: The bound never goes below this, so a small machine still runs an 8-rank test job.
MIN_WORKER_BOUND = 8


def cuda_device_count() -> int:
    """CUDA devices torch can see (0 when torch has no CUDA).

    torch takes seconds to import, so a machine with no GPU driver device node at all (NVIDIA
    ``/dev/nvidiactl``, ROCm ``/dev/kfd``, WSL ``/dev/dxg``) answers 0 without importing it.
    """
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:  # a broken driver counts as no GPU; the worker will say more
        return 0


def check_torch_port(config: LaunchConfig) -> None:
    """Node 0 with fixed ports: torch's ``env://`` store port (`torch_master_port`) is free too."""
    port = torch_master_port(config)
    if port > 65535:
        raise LaunchInputError(
            f"--started_port={config.started_port} with --nproc_per_node={config.nproc_per_node}: "
            f"torch's MASTER_PORT would be {port}, outside 1..65535; choose a lower --started_port"
        )
    check_ports(config.node_ip, [port], what="torch.distributed's MASTER_PORT")


def check_ports(node_ip: str, ports: Sequence[int], what: str | None = None) -> None:
    """Bind each port on ``node_ip`` once, to prove it is free and that node_ip is local
    (``what`` names the port's use in messages; default: the local rank it is for)."""
    for local, port in enumerate(ports):
        use = what or f"local rank {local}"
        try:
            infos = socket.getaddrinfo(node_ip, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise LaunchInputError(f"--node_ip={node_ip} cannot be resolved ({exc})") from None
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # servers set SO_REUSEADDR, so a port lingering in TIME_WAIT is usable: ignore it too
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise LaunchInputError(
                        f"port {port} on {node_ip} (for {use}) is already in use; "
                        "free it or choose another --started_port"
                    ) from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise LaunchInputError(
                        f"--node_ip={node_ip} is not an address of this machine (cannot bind "
                        f"{node_ip}:{port}); run each node's launcher with its own IP"
                    ) from None
                raise LaunchInputError(
                    f"cannot bind {node_ip}:{port} (for {use}): {exc.strerror}; "
                    "choose another --started_port"
                ) from None


def worker_bound(environ: dict[str, str] | None = None) -> tuple[int, str]:
    """(the most workers one node starts, and where that number comes from).

    ``4 x`` the CPUs this process may run on (at least 8), or `envvars.MAX_NPROC_PER_NODE`.
    """
    env = os.environ if environ is None else environ
    given = env.get(envvars.MAX_NPROC_PER_NODE)
    if given is not None:
        text = given.strip()
        if not (text.isascii() and text.isdigit()) or int(text) < 1:
            raise LaunchInputError(
                f"{envvars.MAX_NPROC_PER_NODE}={given!r} is not a positive integer in ASCII digits; "
                "give the most workers this node may start, e.g. 64")
        return int(text), f"{envvars.MAX_NPROC_PER_NODE}={text}"
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    bound = max(MIN_WORKER_BOUND, WORKERS_PER_CPU * cpus)
    return bound, f"{WORKERS_PER_CPU} per usable CPU, {cpus} CPUs, at least {MIN_WORKER_BOUND}"


def check_worker_count(config: LaunchConfig, environ: dict[str, str] | None = None) -> None:
    """Refuse a ``--nproc_per_node`` beyond `worker_bound` (GPU jobs: one worker per selected
    GPU, which exist, is always allowed)."""
    bound, why = worker_bound(environ)
    bound = max(bound, len(config.selected_gpus))
    if config.nproc_per_node > bound:
        raise LaunchInputError(
            f"--nproc_per_node={config.nproc_per_node} would start {config.nproc_per_node} workers on "
            f"this node; the bound is {bound} ({why}); give at most {bound}, or set "
            f"{envvars.MAX_NPROC_PER_NODE}={config.nproc_per_node} to start them anyway")


def check_machine(config: LaunchConfig, *, visible_gpus: int | None = None) -> None:
    """Script present, GPUs visible, ports free on node_ip, log directory writable, the
    rendezvous file's directory present (several nodes with ``auto``)."""
    if not config.module and not os.path.isfile(config.training_script):
        where = os.path.abspath(config.training_script)
        raise LaunchInputError(
            f"training script {config.training_script!r} does not exist (looked for {where}); "
            "use -m to run a module"
        )
    if config.selected_gpus:
        count = cuda_device_count() if visible_gpus is None else visible_gpus
        missing = [g for g in config.selected_gpus if g >= count]
        if missing:
            gpus = ",".join(map(str, config.selected_gpus))
            raise LaunchInputError(
                f"--selected_gpus={gpus} but torch.cuda sees {count} CUDA device(s), so GPU "
                f"{missing[0]} does not exist; choose ids below {count}, or drop "
                "--selected_gpus and use --nproc_per_node to run on CPU"
            )
    if not config.auto_ports:
        check_ports(config.node_ip, config.local_ports)
        if config.node_index == 0:
            check_torch_port(config)
    if config.meets_through_file:
        check_rendezvous_file(config)
    try:
        os.makedirs(config.log_dir, exist_ok=True)
    except OSError as exc:
        raise LaunchInputError(
            f"--log_dir={config.log_dir} cannot be created ({exc.strerror}); choose a writable directory"
        ) from None
    if not os.access(config.log_dir, os.W_OK):
        raise LaunchInputError(f"--log_dir={config.log_dir} is not writable; choose another directory")


def check_rendezvous_file(config: LaunchConfig) -> None:
    """``--rendezvous_file``: its directory exists here (and is writable on node 0, which writes
    the file); the path itself is not a directory."""
    path = config.rendezvous_file or ""
    folder = os.path.dirname(os.path.abspath(path))
    shared = "give a path in a directory that exists on a filesystem every node shares"
    if os.path.isdir(path):
        raise LaunchInputError(
            f"--rendezvous_file={path} is a directory; {shared}, plus a file name"
        )
    if not os.path.isdir(folder):
        raise LaunchInputError(
            f"--rendezvous_file={path}: its directory {folder} does not exist on this node; "
            f"{shared}"
        )
    if config.node_index == 0 and not os.access(folder, os.W_OK | os.X_OK):
        raise LaunchInputError(
            f"--rendezvous_file={path}: this launcher (node 0, {config.node_ip}) writes it, but "
            f"its directory {folder} is not writable; {shared} and this user may write to"
        )


def host_ports(config: LaunchConfig) -> tuple[LaunchConfig, HostedEndpoints]:
    """``--started_port=auto``: bind this node's ports and, on the first node, host the store
    on rank 0's; the config with them.

    The returned `HostedEndpoints` must stay open until the workers are gone.
    """
    hosts = [config.node_ip] * config.nproc_per_node
    try:
        if config.node_index == 0:
            hosted = host_endpoints(hosts, config.job_id, secret=JobSecret(config.job_secret))
        else:
            hosted = hold_endpoints(hosts)
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
            raise LaunchInputError(
                f"--node_ip={config.node_ip} is not an address of this machine (cannot bind a "
                f"port on it for --started_port={AUTO_PORT}); give one of this machine's IPs"
            ) from None
        raise LaunchInputError(
            f"cannot bind a free port on --node_ip={config.node_ip} for "
            f"--started_port={AUTO_PORT}: {exc.strerror or exc}; give a number instead"
        ) from None
    return dataclasses.replace(config, ports=hosted.ports), hosted

"""Reading environment variables into checked values (private to the roles layer).

Every role maker reads the environment through these helpers so that a bad value always fails
the same way: a ``ValueError`` that names the variable, shows the value, states the constraint
and, where there is one, the fix. Empty strings count as unset, because schedulers and shell
scripts often export ``VAR=`` to mean "nothing".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from fleetlike.config import envvars
from fleetlike.roles.role import Role, is_host

__all__ = [
    "DEFAULT_PORT",
    "Environ",
    "environ_or_default",
    "get",
    "get_int",
    "require_int",
    "parse_gpu_list",
    "selected_gpus",
    "job_id",
    "master_addr",
    "agent_store",
    "base_port",
    "node_hosts",
    "block_endpoints",
]

#: Port of local rank 0 when nothing else says: the same default as Fleet's ``--started_port``.
DEFAULT_PORT = 6170

Environ = Mapping[str, str]


def environ_or_default(environ: Environ | None) -> Environ:
    """The mapping to read: the given one (tests pass dicts) or the live ``os.environ``."""
    return os.environ if environ is None else environ


def get(environ: Environ, name: str) -> str | None:
    """The stripped value of ``name``, or None when unset or empty."""
    value = environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def get_int(environ: Environ, name: str, *, minimum: int | None = None) -> int | None:
    """``name`` as an int, None when unset; ValueError naming the variable when not an int."""
    raw = get(environ, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def require_int(environ: Environ, name: str, *, minimum: int | None = None, why: str = "") -> int:
    """Like `get_int` but the variable must be present; ``why`` explains who needs it."""
    value = get_int(environ, name, minimum=minimum)
    if value is None:
        hint = f" ({why})" if why else ""
        raise ValueError(f"{name} is not set{hint}")
    return value


def parse_gpu_list(text: str, *, name: str) -> tuple[int, ...]:
    """Parse ``"0,1,3"`` into GPU ids; each must be a distinct non-negative integer."""
    ids: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit():
            raise ValueError(f"{name}={text!r}: {item!r} is not a GPU id (a non-negative integer)")
        gpu = int(item)
        if gpu in ids:
            raise ValueError(f"{name}={text!r} lists GPU {gpu} twice; each GPU may appear once")
        ids.append(gpu)
    return tuple(ids)


def selected_gpus(environ: Environ) -> tuple[int, ...]:
    """GPU ids from ``FLAGS_selected_gpus`` (the launcher's, Paddle's name); empty on CPU."""
    text = get(environ, envvars.SELECTED_GPUS)
    return parse_gpu_list(text, name=envvars.SELECTED_GPUS) if text else ()


def job_id(environ: Environ) -> str:
    """The job id: ``FLEETLIKE_JOB_ID`` (set by the launcher), else Slurm's or torchrun's."""
    for name in (envvars.JOB_ID, "SLURM_JOB_ID", envvars.TORCHELASTIC_RUN_ID):
        value = get(environ, name)
        if value is not None:
            return value
    return "default"


def master_addr(environ: Environ) -> str | None:
    """The rendezvous host the user named: ``FLEETLIKE_MASTER_ADDR``, else ``MASTER_ADDR``."""
    for name in (envvars.MASTER_ADDR, envvars.TORCH_MASTER_ADDR):
        value = get(environ, name)
        if value is not None:
            if not is_host(value.strip("[]")):
                raise ValueError(f"{name}={value!r} is neither an IP address nor a host name")
            return value
    return None


def agent_store(environ: Environ) -> bool:
    """``TORCHELASTIC_USE_AGENT_STORE=True``: the store at the master endpoint is hosted by the
    launcher (torch's name and spelling; ``fleetlike.launch --started_port=auto`` sets it), so
    rank 0 connects to it instead of hosting one."""
    return get(environ, envvars.AGENT_STORE) == str(True)


def agent_store_port(environ: Environ) -> int | None:
    """The port of the store torchrun's agent hosts, when the workers are to join it
    (`agent_store`, ``MASTER_PORT`` given, no ``FLEETLIKE_MASTER_PORT`` of the user's, and no
    ``FLEETLIKE_MASTER_ADDR`` naming a host other than ``MASTER_ADDR``, where the agent's store
    listens); else None: rank 0 hosts fleetlike's store where the user said.

    Joining it, rather than hosting a second store beside it, leaves no port to be chosen free
    and bound later: a port torchrun's agent picked and released can be taken in between by any
    process's outgoing connection (Linux gives ``connect`` even ports first, and the port after
    an odd ``MASTER_PORT`` is even), and the job would fail with "Address already in use".
    """
    if not agent_store(environ) or get(environ, envvars.MASTER_PORT) is not None:
        return None
    if get(environ, envvars.MASTER_ADDR) not in (None, get(environ, envvars.TORCH_MASTER_ADDR)):
        return None
    port = get_int(environ, envvars.TORCH_MASTER_PORT)
    if port is None or not 1 <= port <= 65535:
        return None
    return port


def base_port(environ: Environ, *, default: int = DEFAULT_PORT, offset: int = 0) -> int:
    """Port of local rank 0: ``FLEETLIKE_MASTER_PORT``, else ``MASTER_PORT + offset``, else default.

    ``offset`` exists for torchrun, whose own store already listens on ``MASTER_PORT``.
    """
    explicit = get_int(environ, envvars.MASTER_PORT)
    if explicit is not None:
        name, port = envvars.MASTER_PORT, explicit
    else:
        from_master = get_int(environ, envvars.TORCH_MASTER_PORT)
        if from_master is None:
            return default
        name, port = envvars.TORCH_MASTER_PORT, from_master + offset
    if not 1 <= port <= 65535:
        raise ValueError(f"{name} gives port {port}, outside 1..65535")
    return port


def node_hosts(environ: Environ, node_num: int, *, source: str) -> tuple[list[str], bool]:
    """Host of each node when the launcher did not name them: ``(hosts, real)``.

    ``FLEETLIKE_NODE_IPS`` (comma separated, node order) wins. One node: the master address or
    127.0.0.1. Several nodes with nothing named: stand-in names ``node0``, ``node1``, ... that
    identify the nodes (``real`` is False); the rendezvous then has to come from the master
    address, which the caller insists on.
    """
    listed = get(environ, envvars.NODE_IPS)
    if listed is not None:
        hosts = [h.strip() for h in listed.split(",") if h.strip()]
        if len(hosts) != node_num:
            raise ValueError(
                f"FLEETLIKE_NODE_IPS={listed!r} names {len(hosts)} nodes but the {source} "
                f"environment describes {node_num}; list one address per node, in node order"
            )
        for host in hosts:
            if not is_host(host):
                raise ValueError(
                    f"FLEETLIKE_NODE_IPS={listed!r}: {host!r} is neither an IP address nor a host name"
                )
        return hosts, True
    if node_num == 1:
        return [master_addr(environ) or "127.0.0.1"], True
    return [f"node{k}" for k in range(node_num)], False


def block_endpoints(hosts: Sequence[str], counts: Sequence[int], port: int) -> list[str]:
    """Endpoints of a block layout: node by node, local i of a node at ``host:(port + i)``."""
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"node hosts {list(hosts)} repeat a host; each node needs its own address")
    if port + max(counts) - 1 > 65535:
        raise ValueError(
            f"base port {port} with {max(counts)} ranks per node needs ports above 65535; "
            "set FLEETLIKE_MASTER_PORT lower"
        )
    out: list[str] = []
    for host, count in zip(hosts, counts):
        shown = f"[{host}]" if ":" in host else host
        out.extend(f"{shown}:{port + i}" for i in range(count))
    return out


def role_from_env(environ: Environ, rank: int, endpoints: Sequence[str], port: int, source: str,
                  *, hosted_port: int | None = None) -> Role:
    """The `Role` for launchers that give no endpoints: GPUs, job id and the rendezvous address
    (``FLEETLIKE_MASTER_ADDR`` / ``MASTER_ADDR`` at ``port``, else the first endpoint) from env.

    ``hosted_port``: the launcher already hosts the store there (`agent_store_port`); every rank,
    rank 0 included, joins it at the master address (``Role.master_hosted``), each start of the
    workers in its own key space (``Role.generation``: ``TORCHELASTIC_RESTART_COUNT``, since that
    store outlives them). A store rank 0 hosts is new at each start: generation 0."""
    addr = master_addr(environ)
    hosted = hosted_port is not None and addr is not None
    return Role.from_endpoints(
        rank,
        endpoints,
        selected_gpus=selected_gpus(environ),
        job_id=job_id(environ),
        master_endpoint=f"{addr}:{hosted_port if hosted else port}" if addr else endpoints[0],
        source=source,
        master_hosted=hosted,
        generation=(get_int(environ, envvars.TORCHELASTIC_RESTART_COUNT, minimum=0) or 0) if hosted else 0,
    )

"""Roles from a Slurm job step (``srun``): host lists, tasks per node, and the block layout.

Slurm writes node lists in a compressed form (``node[01-03,07],gpu5``) and task counts as
``2(x3),1``; both are expanded here without calling ``scontrol``, so detection works in
containers that lack the Slurm binaries.

Rendezvous: the first node of the step's node list hosts it, unless ``FLEETLIKE_MASTER_ADDR`` /
``MASTER_ADDR`` says otherwise. The port of local rank 0 is ``FLEETLIKE_MASTER_PORT`` /
``MASTER_PORT``, else ``20000 + SLURM_JOB_ID % 20000`` so that two jobs sharing a node do not
collide on one fixed port.

Example:
    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> parse_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import re

from fleetlike.roles import _env
from fleetlike.roles.role import Role

__all__ = ["expand_nodelist", "parse_tasks_per_node", "slurm_role", "is_slurm"]

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
_TASKS_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _split_top(text: str, name: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{name}={text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{name}={text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"{name}={text!r}: '[' is never closed")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, text: str, name: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']`` keeping zero padding."""
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{name}={text!r}: {item!r} is not a number or a range like 01-03")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"{name}={text!r}: range {item!r} runs backwards")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(text: str, *, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a Slurm host list; several bracket groups in one name form their product."""
    hosts: list[str] = []
    for part in _split_top(text, name):
        pieces = re.split(r"(\[[^\]]*\])", part)
        names = [""]
        for piece in pieces:
            if piece.startswith("["):
                options = _expand_range(piece[1:-1], text, name)
                names = [n + o for n in names for o in options]
            else:
                names = [n + piece for n in names]
        hosts.extend(names)
    return hosts


def parse_tasks_per_node(text: str, *, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand ``2(x3),1`` into one task count per node."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(f"{name}={text!r}: {item!r} is not 'N' or 'N(xM)'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def is_slurm(environ: _env.Environ) -> bool:
    """True inside a Slurm task (``srun``): both ``SLURM_PROCID`` and the task count are set."""
    has_count = _env.get(environ, "SLURM_NTASKS") or _env.get(environ, "SLURM_NPROCS")
    return _env.get(environ, "SLURM_PROCID") is not None and has_count is not None


def _first(environ: _env.Environ, names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = _env.get(environ, name)
        if value is not None:
            return name, value
    return None


def _default_port(environ: _env.Environ) -> int:
    job = _env.get(environ, "SLURM_JOB_ID")
    if job is not None and job.isdigit():
        return 20000 + int(job) % 20000
    return _env.DEFAULT_PORT


def slurm_role(environ: _env.Environ) -> Role:
    """The role of this Slurm task; ranks must be laid out node by node (``--distribution=block``)."""
    count_var = "SLURM_NTASKS" if _env.get(environ, "SLURM_NTASKS") else "SLURM_NPROCS"
    world = _env.require_int(environ, count_var, minimum=1)
    rank = _env.require_int(environ, "SLURM_PROCID", minimum=0)
    if rank >= world:
        raise ValueError(f"SLURM_PROCID={rank} is out of range 0..{world - 1} ({count_var}={world})")
    local_rank = _env.get_int(environ, "SLURM_LOCALID", minimum=0) or 0
    node_id = _env.get_int(environ, "SLURM_NODEID", minimum=0) or 0

    listed = _first(environ, _NODELIST_VARS)
    if listed is not None:
        hosts = expand_nodelist(listed[1], name=listed[0])
    else:
        nnodes = _env.get_int(environ, "SLURM_NNODES", minimum=1) or 1
        hosts = _env.node_hosts(environ, nnodes, source="Slurm")[0]
    if node_id >= len(hosts):
        where = listed[0] if listed else "SLURM_NNODES"
        raise ValueError(f"SLURM_NODEID={node_id} is out of range for {len(hosts)} nodes ({where})")

    tasks = _first(environ, _TASKS_VARS)
    if tasks is not None:
        counts = parse_tasks_per_node(tasks[1], name=tasks[0])
        if len(counts) != len(hosts) or sum(counts) != world:
            raise ValueError(
                f"{tasks[0]}={tasks[1]!r} gives {sum(counts)} tasks on {len(counts)} nodes, but "
                f"{count_var}={world} on {len(hosts)} nodes"
            )
    else:
        if world % len(hosts):
            raise ValueError(
                f"{count_var}={world} tasks do not divide evenly over {len(hosts)} nodes and "
                "SLURM_TASKS_PER_NODE is not set"
            )
        counts = [world // len(hosts)] * len(hosts)
    if local_rank >= counts[node_id]:
        raise ValueError(
            f"SLURM_LOCALID={local_rank} is out of range for {counts[node_id]} tasks on node {node_id}"
        )
    expected = sum(counts[:node_id]) + local_rank
    if expected != rank:
        raise ValueError(
            f"SLURM_PROCID={rank} is not task {local_rank} of node {node_id} in a block layout "
            f"(expected {expected}); launch with srun --distribution=block"
        )

    port = _env.base_port(environ, default=_default_port(environ))
    endpoints = _env.block_endpoints(hosts, counts, port)
    return _env.role_from_env(environ, rank, endpoints, port, "slurm")


"""``--use_paddlecloud``: the job's nodes, this node and its ports from PaddleCloud's environment.

On PaddleCloud (and clusters that copy its convention) the scheduler, not the user, knows where
the nodes are; every node runs the same start command and reads the job from its environment,
as Paddle's own launcher does (``paddle/distributed/cloud_utils.py``, ``get_cloud_cluster``):

==============================  ================================================================
``PADDLE_TRAINERS_NUM``          number of nodes; 1 is a single-node job, where the flags decide
                                 (as in Paddle)
``PADDLE_TRAINERS``              the nodes' IPs, comma-separated, in rank order
``POD_IP``                       this node's IP (one of them)
``PADDLE_TRAINER_ID``            this node's index in ``PADDLE_TRAINERS``
``TRAINER_PORTS_NUM``            ports the cloud reserved on each node (at least one per process)
``PADDLE_PORT``                  the first of them (several nodes; without it ``--started_port``)
``DISTRIBUTED_TRAINER_ENDPOINTS``  every reserved ``ip:port``, node by node, ``TRAINER_PORTS_NUM``
                                 per node (PaddleCloud >= 1.8.4); when set it fixes every port
==============================  ================================================================

Unlike Paddle, which asserts on a missing variable and only warns when a flag disagrees with the
cloud, a missing, malformed or contradictory variable here is a `CloudEnvError` naming it, which
the launcher reports as an input error (exit code 2, nothing started); so is a flag given beside
the cloud's value that differs from it (``--node_ip`` vs ``POD_IP``, ``--cluster_node_ips`` vs
``PADDLE_TRAINERS``, ``--started_port`` vs ``PADDLE_PORT``; `fleetlike.launch.config`). With
``--use_paddlecloud`` and no ``PADDLE_TRAINERS_NUM`` at all (Paddle would assume 1) the launcher
is not on a cloud node: that is an error too, rather than a silent single-node job.

Example:
    >>> cloud = read_cloud({"PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINERS": "10.0.0.1,10.0.0.2",
    ...                     "POD_IP": "10.0.0.2", "PADDLE_TRAINER_ID": "1", "TRAINER_PORTS_NUM": "8",
    ...                     "PADDLE_PORT": "6170"}, nproc_per_node=4)
    >>> cloud.node_ips, cloud.node_ip, cloud.started_port
    (('10.0.0.1', '10.0.0.2'), '10.0.0.2', 6170)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from fleetlike.roles import is_host, parse_endpoint

__all__ = ["CLOUD_VARIABLES", "CloudCluster", "CloudEnvError", "read_cloud"]

#: what ``--use_paddlecloud`` reads, in the order the module docstring explains them
CLOUD_VARIABLES = ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINERS", "POD_IP", "PADDLE_TRAINER_ID",
                   "TRAINER_PORTS_NUM", "PADDLE_PORT", "DISTRIBUTED_TRAINER_ENDPOINTS")



class CloudEnvError(ValueError):
    """A cloud variable is missing, malformed, or contradicts another (names it)."""


_WHERE = "--use_paddlecloud reads the job from PaddleCloud's environment"


@dataclasses.dataclass(frozen=True)
class CloudCluster:
    """A several-node job as the cloud describes it.

    ``endpoints`` (from ``DISTRIBUTED_TRAINER_ENDPOINTS``: the first ``nproc_per_node`` of each
    node's reserved ports, in rank order) or ``started_port`` (``PADDLE_PORT``; None: the
    ``--started_port`` flag decides)."""

    node_ips: tuple[str, ...]
    node_ip: str
    started_port: int | None
    endpoints: tuple[str, ...] = ()

    @property
    def node_index(self) -> int:
        return self.node_ips.index(self.node_ip)

    def local_ports(self, nproc_per_node: int) -> tuple[int, ...]:
        """This node's ports when ``endpoints`` fixes them (else ``()``)."""
        mine = self.endpoints[self.node_index * nproc_per_node:(self.node_index + 1) * nproc_per_node]
        return tuple(parse_endpoint(e, name="DISTRIBUTED_TRAINER_ENDPOINTS")[1] for e in mine)


def _need(env: Mapping[str, str], name: str, what: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise CloudEnvError(f"{name} is not set; {_WHERE} ({name}: {what}). Start the job on "
                               "PaddleCloud, set it, or drop --use_paddlecloud and give the node flags")
    return value


def _int(env: Mapping[str, str], name: str, what: str, low: int) -> int:
    text = _need(env, name, what)
    try:
        value = int(text)
    except ValueError:
        raise CloudEnvError(f"{name}={text!r} is not an integer ({what})") from None
    if value < low:
        raise CloudEnvError(f"{name}={value} must be >= {low} ({what})")
    return value


def read_cloud(env: Mapping[str, str], nproc_per_node: int) -> CloudCluster | None:
    """The cluster ``env`` describes, or None for a single-node job (``PADDLE_TRAINERS_NUM=1``:
    the flags decide, as in Paddle). Raises `CloudEnvError` naming the variable at fault."""
    nodes = _int(env, "PADDLE_TRAINERS_NUM", "the number of nodes", 1)
    if nodes == 1:
        return None
    ips_text = _need(env, "PADDLE_TRAINERS", "the nodes' IPs, comma-separated")
    ips = tuple(ip.strip() for ip in ips_text.split(","))
    for ip in ips:
        if not ip or not is_host(ip):
            raise CloudEnvError(f"PADDLE_TRAINERS={ips_text!r}: {ip!r} is not an IP address or host name")
    if len(set(ips)) != len(ips):
        raise CloudEnvError(f"PADDLE_TRAINERS={ips_text!r} lists a node twice; each node must appear once")
    if len(ips) != nodes:
        raise CloudEnvError(f"PADDLE_TRAINERS={ips_text!r} lists {len(ips)} node(s) but PADDLE_TRAINERS_NUM="
                               f"{nodes}; the two must agree")
    pod_ip = _need(env, "POD_IP", "this node's IP")
    if pod_ip not in ips:
        raise CloudEnvError(f"POD_IP={pod_ip} is not in PADDLE_TRAINERS={ips_text}; this node must be one of them")
    node_id = _int(env, "PADDLE_TRAINER_ID", "this node's index in PADDLE_TRAINERS", 0)
    if node_id != ips.index(pod_ip):
        raise CloudEnvError(f"PADDLE_TRAINER_ID={node_id} contradicts POD_IP={pod_ip}, which is node "
                               f"{ips.index(pod_ip)} of PADDLE_TRAINERS={ips_text}")
    ports_num = _int(env, "TRAINER_PORTS_NUM", "ports reserved on each node", 1)
    if ports_num < nproc_per_node:
        raise CloudEnvError(f"TRAINER_PORTS_NUM={ports_num} reserves fewer ports than the {nproc_per_node} "
                               "processes per node; start fewer processes (--selected_gpus / --nproc_per_node)")
    listed = env.get("DISTRIBUTED_TRAINER_ENDPOINTS", "").strip()
    if listed:
        return CloudCluster(ips, pod_ip, None, _cloud_endpoints(listed, ips, ports_num, nproc_per_node))
    port = _int(env, "PADDLE_PORT", "the first reserved port", 1) if env.get("PADDLE_PORT", "").strip() else None
    if port is not None and port + nproc_per_node - 1 > 65535:
        raise CloudEnvError(f"PADDLE_PORT={port} with {nproc_per_node} processes per node needs ports above 65535")
    return CloudCluster(ips, pod_ip, port)


def _cloud_endpoints(listed: str, ips: tuple[str, ...], ports_num: int, nproc: int) -> tuple[str, ...]:
    name = "DISTRIBUTED_TRAINER_ENDPOINTS"
    items = [e.strip() for e in listed.split(",")]
    if len(items) != len(ips) * ports_num:
        raise CloudEnvError(f"{name} lists {len(items)} endpoints but PADDLE_TRAINERS has {len(ips)} node(s) "
                               f"and TRAINER_PORTS_NUM={ports_num}: it must list {len(ips) * ports_num}")
    chosen = []
    for node, ip in enumerate(ips):
        block = items[node * ports_num:(node + 1) * ports_num]
        for item in block:
            try:
                host, _ = parse_endpoint(item, name=name)
            except ValueError as exc:
                raise CloudEnvError(str(exc)) from None
            if host != ip:
                raise CloudEnvError(f"{name}: {item} is in node {node}'s block but PADDLE_TRAINERS says node "
                                       f"{node} is {ip}; the endpoints must be listed node by node")
        chosen += block[:nproc]
    if len(set(chosen)) != len(chosen):
        raise CloudEnvError(f"{name} lists an endpoint twice; every process needs its own port")
    return tuple(chosen)

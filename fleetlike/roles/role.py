"""The frozen description of who a process is in a collective job.

Role makers read the environment (or explicit arguments, or MPI) and produce one `Role`.
Everything above this layer (comm, strategies, fleet) receives a `Role` and never looks at
environment variables itself: that keeps the configuration of a job in one place and makes every
layer above testable with plain values.

Example:
    >>> r = Role.from_endpoints(1, ["127.0.0.1:6170", "127.0.0.1:6171"])
    >>> (r.rank, r.world_size, r.local_rank, r.node_num)
    (1, 2, 1, 1)
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Sequence

__all__ = ["Role", "is_host", "parse_endpoint", "topology"]


def parse_endpoint(endpoint: str, *, name: str = "endpoint") -> tuple[str, int]:
    """Split ``"ip:port"`` (or ``"[v6]:port"``) and check both halves.

    Raises ValueError naming ``name`` and the value when the endpoint is malformed, so the user
    sees which variable or argument held the bad value.
    """
    if not isinstance(endpoint, str):
        raise TypeError(f"{name} must be a str 'ip:port', got {type(endpoint).__name__} {endpoint!r}")
    text = endpoint.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"{name}={endpoint!r} is not 'ip:port' (example: 127.0.0.1:6170)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(
            f"{name}={endpoint!r}: port {port_text!r} is not an integer (example: 127.0.0.1:6170)"
        ) from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={endpoint!r}: port {port} is outside 1..65535")
    if not is_host(host):
        raise ValueError(f"{name}={endpoint!r}: {host!r} is neither an IP address nor a host name")
    return host, port


def is_host(host: str) -> bool:
    """True for an IP address or a syntactically valid host name (no lookup: the name may only
    resolve on the nodes, not where the check runs)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.split(".")
    return all(
        label and len(label) <= 63 and label.replace("-", "").isalnum() and not label.startswith("-")
        for label in labels
    )


def topology(endpoints: Sequence[str], rank: int) -> tuple[int, int, int, int]:
    """Return ``(node_index, node_num, local_rank, local_size)`` for ``rank``.

    Nodes are the distinct hosts of the endpoints, in order of first appearance (the launcher
    numbers ranks node by node, so this is also the ``--cluster_node_ips`` order); the local
    rank is the position among the endpoints of the same host.
    """
    hosts = [parse_endpoint(e, name=f"endpoints[{i}]")[0] for i, e in enumerate(endpoints)]
    nodes: list[str] = []
    for host in hosts:
        if host not in nodes:
            nodes.append(host)
    mine = hosts[rank]
    same = [i for i, h in enumerate(hosts) if h == mine]
    return nodes.index(mine), len(nodes), same.index(rank), len(same)


@dataclasses.dataclass(frozen=True)
class Role:
    """Who this process is. Immutable; built by a role maker, read by everything else.

    Attributes:
        rank: global rank, 0..world_size-1.
        world_size: number of worker processes in the job.
        endpoints: ``ip:port`` of every rank, in rank order. Nodes are told apart by the IP part.
        local_rank / local_size: position among, and number of, ranks on this node.
        node_index / node_num: this node's position among, and number of, nodes.
        selected_gpus: the GPU ids this process may use (empty on CPU).
        job_id: identifies the job, so two jobs sharing a port never join each other.
        master_endpoint: where the rendezvous store listens (rank 0's endpoint by default).
        master_hosted: the store at ``master_endpoint`` is already hosted by another process (the
            launcher with ``--started_port=auto``, or `fleetlike.testing`), so rank 0 joins it as
            a client instead of binding the port: the host bound it on port 0 and never let it go,
            so no other process can take it between the choice of the port and its use.
        generation: which start of the job's workers this is (torchrun's
            ``TORCHELASTIC_RESTART_COUNT`` on one node where the ranks join its agent's store; 0
            for the first, and wherever each start has a new store). A launcher that keeps one
            store for every restart (torchrun's agent) leaves a dead generation's keys in it: each
            generation meets in its own key space.
        source: which role maker produced this (for the applied-strategy report and errors).
        secret: the job's secret (hex; `fleetlike.comm.secret`), when the role maker was given
            it; empty: the rendezvous reads ``FLEETLIKE_JOB_SECRET``. Never shown in ``repr``.
    """

    rank: int
    world_size: int
    endpoints: tuple[str, ...]
    local_rank: int
    local_size: int
    node_index: int
    node_num: int
    selected_gpus: tuple[int, ...] = ()
    job_id: str = "default"
    master_endpoint: str = ""
    source: str = "user"
    master_hosted: bool = False
    generation: int = 0
    secret: str = dataclasses.field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is out of range 0..{self.world_size - 1}")
        if len(self.endpoints) != self.world_size:
            raise ValueError(
                f"endpoints has {len(self.endpoints)} entries but world_size={self.world_size}"
            )
        if not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"local_rank={self.local_rank} is out of range 0..{self.local_size - 1}")
        if self.generation < 0:
            raise ValueError(f"generation={self.generation} must be >= 0")
        if not 0 <= self.node_index < self.node_num:
            raise ValueError(f"node_index={self.node_index} is out of range 0..{self.node_num - 1}")

    @classmethod
    def from_endpoints(
        cls,
        rank: int,
        endpoints: Sequence[str],
        *,
        selected_gpus: Sequence[int] = (),
        job_id: str = "default",
        master_endpoint: str | None = None,
        source: str = "user",
        master_hosted: bool = False,
        generation: int = 0,
        secret: str = "",
    ) -> Role:
        """Build a role from a rank and the endpoint list, deriving the node topology."""
        eps = tuple(endpoints)
        if not eps:
            raise ValueError("worker_endpoints is empty: give at least one 'ip:port'")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
        if not 0 <= rank < len(eps):
            raise ValueError(f"rank={rank} is out of range 0..{len(eps) - 1} for {len(eps)} endpoints")
        seen: dict[str, int] = {}
        for i, e in enumerate(eps):
            parse_endpoint(e, name=f"worker_endpoints[{i}]")
            if e in seen:
                raise ValueError(
                    f"worker_endpoints has {e!r} twice (positions {seen[e]} and {i}); "
                    "every rank needs its own ip:port"
                )
            seen[e] = i
        node_index, node_num, local_rank, local_size = topology(eps, rank)
        return cls(
            rank=rank,
            world_size=len(eps),
            endpoints=eps,
            local_rank=local_rank,
            local_size=local_size,
            node_index=node_index,
            node_num=node_num,
            selected_gpus=tuple(selected_gpus),
            job_id=job_id,
            master_endpoint=master_endpoint if master_endpoint else eps[0],
            source=source,
            master_hosted=master_hosted,
            generation=generation,
            secret=secret,
        )

    @property
    def current_endpoint(self) -> str:
        return self.endpoints[self.rank]

    @property
    def host(self) -> str:
        """This rank's IP: the address its sockets bind to."""
        return parse_endpoint(self.current_endpoint)[0]

    def node_ranks(self, node_index: int | None = None) -> list[int]:
        """Global ranks on a node (this one by default), in rank order."""
        hosts = [parse_endpoint(e)[0] for e in self.endpoints]
        nodes = list(dict.fromkeys(hosts))
        host = nodes[self.node_index if node_index is None else node_index]
        return [i for i, h in enumerate(hosts) if h == host]

    def uniform_nodes(self) -> bool:
        """True when every node has the same number of ranks (needed by hierarchical allreduce)."""
        hosts = [parse_endpoint(e)[0] for e in self.endpoints]
        counts = {hosts.count(h) for h in hosts}
        return len(counts) == 1

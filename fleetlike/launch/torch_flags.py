"""torch's launcher flags (``torch.distributed.launch`` / ``torchrun``) beside Paddle's, one meaning each.

TI-ACC's and AIACC's pages start jobs with torch's static multi-node line::

    python -m fleetlike.launch --nproc_per_node=8 --nnodes=2 --node_rank=0 \\
        --master_addr=10.0.0.1 --master_port=6007 [--use_env] main.py     # on every node, R = 0, 1

* ``--nnodes N`` (one number) with no ``--rdzv_endpoint``: a static job of N nodes; ``--nnodes
  MIN:MAX``, or ``N`` with ``--rdzv_endpoint``, stays the elastic job it was;
* ``--node_rank R``: this node's place (ranks ``R * nproc_per_node ...``); default 0;
* ``--master_addr A --master_port P``: node 0's launcher listens at ``A:P`` (on A only) and the
  other nodes' launchers meet it there before any worker starts: each tells its own address
  (``--node_ip``, else the address this machine reaches A from), checked behind the job's secret
  (`FLEETLIKE_JOB_SECRET`, else one derived from these flags, as Paddle's fixed-port form does,
  with the same warning). The workers' own ports follow, from ``P + 1`` on each node; torch's
  ``env://`` store is the next one after node 0's (``MASTER_ADDR`` / ``MASTER_PORT`` say where).
  On one node nothing meets: ``A`` is the node and the ports start at ``P + 1`` alike;
* ``--standalone``: one node, ports chosen by the launcher (``--started_port=auto``), as
  torchrun's; with more than one node it is refused (torchrun would wait forever);
* ``--use_env``: workers read ``LOCAL_RANK`` from the environment, which fleetlike's launcher always
  sets (it never appends ``--local_rank`` to the script's arguments); accepted for the old
  ``torch.distributed.launch`` lines that carry it.

Paddle's node flags (``--cluster_node_ips`` with several nodes, ``--started_port``,
``--use_paddlecloud``) describe the same thing another way: given with torch's, the launcher
refuses, naming both.

Example:
    >>> static = torch_nodes(build_parser().parse_args(["--nnodes=2", "--node_rank=1",
    ...     "--master_addr=10.0.0.1", "--master_port=6007", "--node_ip=10.0.0.2", "t.py"]))
    >>> static.ips, static.started_port
    (('10.0.0.1', '10.0.0.2'), 6008)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import socket
import threading
import time

import torch.distributed as dist

from fleetlike.comm import JobSecret, challenge_of, host_store, job_store
from fleetlike.launch.stop import StopFlag

__all__ = ["DEFAULT_MASTER_PORT", "NodeMeetingError", "TorchFlagError", "TorchNodes", "add_torch_flags", "meet_nodes", "torch_nodes"]

#: torch's default ``--master_port``
DEFAULT_MASTER_PORT = 29500
#: the placeholder address of a node this launcher has not met yet
_PENDING = "pending-node{k}.invalid"
_POLL_SECONDS = 0.1


class TorchFlagError(ValueError):
    """Flags that contradict each other (the launcher turns it into its input error, exit 2)."""


class NodeMeetingError(RuntimeError):
    """The launchers of a static torch-style job did not meet (exit code 1)."""


def add_torch_flags(p: argparse.ArgumentParser) -> None:
    """Declare torch's static-job flags on the launcher's parser (``--nnodes`` is declared
    with the elastic flags)."""
    p.add_argument("--node_rank", "--node-rank", default=None, metavar="R",
                   help="torch's form: this node's place among --nnodes N (default 0)")
    p.add_argument("--master_addr", "--master-addr", default=None, metavar="ADDR",
                   help="torch's form: node 0's address; its launcher meets the others' there")
    p.add_argument("--master_port", "--master-port", default=None, metavar="PORT",
                   help=f"torch's form: the port of that meeting (default {DEFAULT_MASTER_PORT}); the "
                   "workers' ports follow it")
    p.add_argument("--use_env", "--use-env", action="store_true",
                   help="torch's form: LOCAL_RANK in the environment, which workers always get here "
                   "(no --local_rank argument is ever appended)")
    p.add_argument("--standalone", action="store_true",
                   help="torch's form: one node, ports chosen by the launcher (as --started_port=auto)")


@dataclasses.dataclass(frozen=True)
class TorchNodes:
    """A torch-style static job, translated: the node layout the launcher starts from (other
    nodes' addresses are placeholders until `meet_nodes`)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    node_ip: str
    ips: tuple[str, ...]
    #: rank 0's port (None: chosen by the launcher, ``--standalone``)
    started_port: int | None
    #: the launchers have met: ``ips`` are every node's real addresses
    met: bool = False

    @property
    def pending(self) -> bool:
        """Other nodes' addresses are still to be learnt at the meeting."""
        return self.nnodes > 1 and not self.met


def _int(name: str, text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TorchFlagError(f"{name}={text!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise TorchFlagError(f"{name}={value} must be {span}")
    return value


def _route_address(master: str, port: int) -> str:
    """This machine's address on the way to ``master`` (a UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in master else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master, port))
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise TorchFlagError(f"--master_addr={master}: no route to it from here ({exc.strerror or exc}); "
                               "give a reachable address, or this node's own with --node_ip") from None


def torch_nodes(args: argparse.Namespace, *, paddle_port_given: bool = False) -> TorchNodes | None:
    """The static job torch's flags describe, or None where none of them is given (or the job is
    elastic). `TorchFlagError` for flags that contradict each other or Paddle's."""
    nnodes_text = args.nnodes
    static_nnodes = nnodes_text is not None and ":" not in str(nnodes_text) and args.rdzv_endpoint is None
    given = [f for f, v in (("--node_rank", args.node_rank), ("--master_addr", args.master_addr),
                            ("--master_port", args.master_port)) if v is not None]
    if not (static_nnodes or given or args.standalone):
        return None
    if args.rdzv_endpoint is not None or (nnodes_text is not None and ":" in str(nnodes_text)):
        raise TorchFlagError(
            f"{', '.join(given + (['--standalone'] if args.standalone else []))} describe a static job (torch's "
            f"form), but --nnodes={nnodes_text} --rdzv_endpoint={args.rdzv_endpoint} an elastic one; give one of them")
    nnodes = 1 if nnodes_text is None else _int("--nnodes", str(nnodes_text), 1)
    if args.use_paddlecloud:
        raise TorchFlagError("--use_paddlecloud takes the nodes from PaddleCloud's environment, and torch's "
                               f"{', '.join(given) or '--nnodes'} from the flags; give one of them")
    if args.cluster_node_ips != "127.0.0.1":
        raise TorchFlagError(f"--cluster_node_ips={args.cluster_node_ips} (Paddle's form) and torch's "
                               f"{', '.join(given) or '--nnodes'} both describe the nodes; give one of them")
    if paddle_port_given:
        raise TorchFlagError(f"--started_port={args.started_port} (Paddle's form) and torch's "
                               f"{', '.join(given) or '--nnodes'}: the ports follow --master_port in torch's form; "
                               "drop --started_port")
    if args.standalone:
        if nnodes > 1 or given:
            raise TorchFlagError(
                f"--standalone is one node whose launcher chooses its ports, but {', '.join(given) or f'--nnodes={nnodes}'}"
                " ask for a job across nodes; drop --standalone (torchrun would wait for nodes that never come)")
        return TorchNodes(1, 0, "127.0.0.1", None, args.node_ip or "127.0.0.1", (args.node_ip or "127.0.0.1",), None)
    rank = 0 if args.node_rank is None else _int("--node_rank", args.node_rank, 0, nnodes - 1)
    port = DEFAULT_MASTER_PORT if args.master_port is None else _int("--master_port", args.master_port, 1, 65534)
    if nnodes > 1 and args.master_addr is None:
        raise TorchFlagError(f"--nnodes={nnodes} (a static job, torch's form) needs --master_addr, node 0's "
                               "address, and --master_port, the same on every node (or --nnodes MIN:MAX "
                               "--rdzv_endpoint HOST:PORT for an elastic job)")
    master = (args.master_addr or args.node_ip or "127.0.0.1").strip()
    if rank == 0:
        node_ip = (args.node_ip or master).strip()
        if nnodes > 1 and node_ip != master:
            raise TorchFlagError(f"--node_rank=0 is the node at --master_addr={master}, but --node_ip={node_ip}; "
                                   "drop --node_ip on node 0 or make them agree")
    else:
        node_ip = (args.node_ip or _route_address(master, port)).strip()
        if node_ip == master:
            raise TorchFlagError(
                f"--node_rank={rank}: this node's address {node_ip} is --master_addr's (node 0's); on one machine "
                "give each node its own address with --node_ip (e.g. 127.0.0.2)")
    ips = tuple(node_ip if k == rank else (master if k == 0 else _PENDING.format(k=k)) for k in range(nnodes))
    return TorchNodes(nnodes, rank, master, port, node_ip, ips, port + 1)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def meet_nodes(static: TorchNodes, nproc: int, secret_text: str, job_id: str, timeout: float,
               stop: StopFlag | None = None) -> tuple[str, ...]:
    """Every node's address, node by node: node 0's launcher hosts a store at ``master_addr:
    master_port`` (closed once every node has read the list), the others join it; each claims
    its place, publishes its address and process count, and waits for all. Behind the job's
    secret: a store that does not greet with it is another job's, and refused."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout
    secret = JobSecret(secret_text)
    host, port = static.master_addr, int(static.master_port or 0)
    me = f"node {static.node_rank} ({static.node_ip})"
    server = None
    if static.node_rank == 0:
        try:
            server = raw = host_store(host, job_id, timeout, port=port, secret=secret)
        except Exception as exc:  # noqa: BLE001 - torch raises several types for bind errors
            raise NodeMeetingError(f"{me} cannot listen at --master_addr={host} --master_port={port}: {exc}; "
                                   "is another job using the port?") from None
    else:
        raw = _join(host, port, deadline, stop, me)
        if challenge_of(raw, secret) is None:
            raise NodeMeetingError(
                f"{me}: the launcher at {host}:{port} does not hold this job's secret (another job, or nodes "
                "started with different FLEETLIKE_JOB_SECRET or flags); give every node the same ones")
    store = dist.PrefixStore(f"launch-nodes/{job_id}/", job_store(raw, secret))
    try:
        if store.add(f"claim/{static.node_rank}", 1) != 1:
            raise NodeMeetingError(f"{me}: another launcher already joined as node {static.node_rank}; give each "
                                   "node its own --node_rank")
        store.set(f"node/{static.node_rank}", f"{static.node_ip} {nproc}")
        keys = [f"node/{k}" for k in range(static.nnodes)]
        _wait(store, keys, deadline, stop, me, f"node(s) to join at {host}:{port}", timeout)
        listed = [store.get(k).decode().split(" ") for k in keys]
        for k, (ip, count) in enumerate(listed):
            if int(count) != nproc:
                raise NodeMeetingError(f"{me}: node {k} ({ip}) runs {count} processes, this node {nproc}; give "
                                       "every node the same --nproc_per_node")
        ips = tuple(ip for ip, _ in listed)
        if len(set(ips)) != len(ips):
            raise NodeMeetingError(f"{me}: two nodes gave the same address ({', '.join(ips)}); give each its own --node_ip")
        store.add("read", 1)
        if server is not None:  # the list is read by all before the store goes
            _wait_count(store, "read", static.nnodes, deadline, stop, me)
        return ips
    finally:
        del server


def _join(host: str, port: int, deadline: float, stop: StopFlag, me: str) -> dist.Store:
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                pass
            return dist.TCPStore(host, port, None, False, _td(max(deadline - time.monotonic(), 1.0)))
        except Exception as exc:  # noqa: BLE001 - refused while node 0's launcher starts
            if stop.is_set() or time.monotonic() >= deadline:
                raise NodeMeetingError(f"{me}: nothing answered at --master_addr={host} --master_port={port} "
                                       f"({exc}); start node 0's launcher with the same flags") from None
        stop.wait(_POLL_SECONDS)


def _wait(store: dist.Store, keys: list[str], deadline: float, stop: StopFlag, me: str, what: str,
          timeout: float) -> None:
    while not all(store.check([k]) for k in keys):
        if stop.is_set():
            raise NodeMeetingError(f"{me}: stopped while waiting for the other {what}")
        if time.monotonic() >= deadline:
            missing = [k.split("/")[-1] for k in keys if not store.check([k])]
            raise NodeMeetingError(f"{me} waited {timeout:g}s (--rendezvous_timeout) for the other {what}; "
                                   f"node(s) {', '.join(missing)} did not come")
        stop.wait(_POLL_SECONDS)


def _wait_count(store: dist.Store, key: str, n: int, deadline: float, stop: StopFlag, me: str) -> None:
    while int(store.add(key, 0)) < n:
        if stop.is_set() or time.monotonic() >= deadline:
            raise NodeMeetingError(f"{me}: the other nodes did not read the list of nodes in time")
        stop.wait(_POLL_SECONDS)

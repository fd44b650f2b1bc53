"""Parsed flags -> frozen `LaunchConfig`: every flag defaulted and checked for consistency.

The flags themselves are declared in `fleetlike.launch.flags`; this module resolves what they
say (PaddleCloud's environment, the job id and secret, ports, process counts) into the one value
the launcher acts on, and prints it back (`format_config`). Only the checks that need nothing but
the flags live here (node_ip in the list, port ranges, process counts); the ones that look at the
machine (free ports, the script, visible GPUs) are in `fleetlike.launch.checks`. Both raise
`LaunchInputError`, which the launcher turns into exit code 2 before starting anything.

Example:
    >>> config = parse_config(["--nproc_per_node=2", "train.py"])
    >>> config.world_size
    2
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from collections.abc import Callable, Mapping, Sequence

from fleetlike.comm import SECRET_ENV, JobSecret, SecretError, new_secret
from fleetlike.config import envvars
from fleetlike.launch.cloud import CloudCluster, CloudEnvError, read_cloud
from fleetlike.launch.flags import (
    AUTO_PORT,
    DEFAULT_DISCOVERY_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_REMOTE_SHELL,
    DEFAULT_RENDEZVOUS_TIMEOUT,
    DEFAULT_STARTED_PORT,
    SHARED_FLAGS,
    LaunchInputError,
    build_parser,
)
from fleetlike.launch.preload import PRELOAD_ENV, preload_mode
from fleetlike.launch.torch_flags import TorchFlagError, TorchNodes, torch_nodes
from fleetlike.roles import is_host, parse_gpu_list

__all__ = [
    "LaunchConfig",
    "default_job_id",
    "format_config",
    "open_job_warning",
    "parse_config",
]


def default_job_id(
    cluster_node_ips: Sequence[str], started_port: int | None, nproc_per_node: int,
    environ: Mapping[str, str] | None = None,
) -> str:
    """``FLEETLIKE_JOB_ID`` from ``environ`` (default ``os.environ``), else one derived from the
    `SECRET_ENV` secret there (every node's launcher derives the same from the same secret, and
    nobody without it can), else random per run.

    Never a digest of the flags: anyone who knows them could compute it. The node layout
    arguments are kept for callers that pass them; they do not enter the id.
    """
    env = os.environ if environ is None else environ
    given = env.get(envvars.JOB_ID, "").strip()
    if given:
        return given
    text = env.get(SECRET_ENV, "").strip()
    if text:
        try:
            return JobSecret(text).job_id()
        except SecretError as exc:
            raise LaunchInputError(str(exc)) from None
    return uuid.uuid4().hex[:12]


def open_job_warning(config: LaunchConfig) -> str | None:
    """The line every launcher of several nodes prints when no `SECRET_ENV` was exported: the
    secret is made by the launcher that hosts the store and shared through this user's private
    directory (`fleetlike.launch.homesecret`); None for other jobs."""
    if not config.secret_at_home:
        return None
    return (f"note: no {SECRET_ENV} is set, so the launcher that hosts this job's store made a random "
            "secret and shares it through this user's private directory (~/.fleetlike/jobs, mode "
            f"0700): launchers on machines that do not share it are refused. To share a secret "
            f"instead, export {SECRET_ENV} with the same random value on every node (python -c "
            "'import secrets; print(secrets.token_hex(32))'), or use --started_port=auto with "
            "--rendezvous_file (docs/security.md)")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything the launcher needs, resolved. Endpoints and ranks are derived, not stored.

    ``started_port=None`` is ``--started_port=auto``: the ports are unknown until the launcher
    binds them (`fleetlike.launch.checks.host_ports`), which then fills ``ports`` with the
    port of each local rank. On several nodes the other nodes' ports differ and are learnt when
    the launchers meet (`fleetlike.launch.meeting.meet`), which fills ``cluster_endpoints``.
    """

    training_script: str
    training_script_args: tuple[str, ...] = ()
    cluster_node_ips: tuple[str, ...] = ("127.0.0.1",)
    node_ip: str = "127.0.0.1"
    started_port: int | None = DEFAULT_STARTED_PORT
    nproc_per_node: int = 1
    selected_gpus: tuple[int, ...] = ()
    log_dir: str = "log"
    job_id: str = "default"
    module: bool = False
    kill_grace: float = 3.0
    print_config: bool = False
    malloc_tuning: bool = True
    accelerate_ddp: bool = False
    #: ``--accelerate_horovod``: ``import horovod.torch`` in a worker is `fleetlike.horovod`
    accelerate_horovod: bool = False
    #: ``--preload`` (`fleetlike.launch.preload`): "off" or "torch"
    preload: str = "off"
    rendezvous_file: str | None = None
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
    ports: tuple[int, ...] = ()
    cluster_endpoints: tuple[str, ...] = ()
    use_paddlecloud: bool = False
    max_restarts: int = 0
    #: ``--nnodes MIN:MAX`` (0, 0: not an elastic job)
    min_nodes: int = 0
    max_nodes: int = 0
    rdzv_endpoint: str | None = None
    rdzv_last_call: float = 3.0
    #: ``--heartbeat_timeout``: seconds of silence after which a worker counts as gone
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    #: torch's static form (``--nnodes N --node_rank R --master_addr A --master_port P``,
    #: ``--standalone``), translated; other nodes' addresses are learnt when the launchers meet
    #: (`fleetlike.launch.torch_flags.meet_nodes`)
    static_nodes: TorchNodes | None = None
    #: ``--host_discovery_script`` (`fleetlike.launch.discovery`)
    host_discovery_script: str | None = None
    discovery_interval: float = DEFAULT_DISCOVERY_INTERVAL
    remote_shell: str = DEFAULT_REMOTE_SHELL
    #: the job's secret (hex, `fleetlike.comm.secret`): `SECRET_ENV` of the launcher's
    #: environment, else made here; the workers get it in `SECRET_ENV`. Never shown.
    job_secret: str = dataclasses.field(default_factory=new_secret, repr=False)
    #: no ``--job_id`` and not node 0 of a ``--rendezvous_file`` meeting: the id is node 0's
    job_id_from_file: bool = False
    #: several launchers and no ``SECRET_ENV``: the one that hosts the store makes the secret and
    #: the others read it from this user's private directory (`fleetlike.launch.homesecret`)
    secret_at_home: bool = False
    #: ``--job_id`` or ``FLEETLIKE_JOB_ID`` given (else, with `secret_at_home`, the id is the secret's)
    job_id_given: bool = False

    def __post_init__(self) -> None:
        ips = ",".join(self.cluster_node_ips)
        if not self.cluster_node_ips:
            raise LaunchInputError("--cluster_node_ips is empty; give at least this node's IP")
        for ip in self.cluster_node_ips:
            if not is_host(ip):
                raise LaunchInputError(
                    f"--cluster_node_ips={ips}: {ip!r} is neither an IP address nor a host name"
                )
        for i, ip in enumerate(self.cluster_node_ips):
            if ip in self.cluster_node_ips[:i]:
                raise LaunchInputError(
                    f"--cluster_node_ips={ips} lists {ip} twice; each node must appear once"
                )
        if self.node_ip not in self.cluster_node_ips:
            raise LaunchInputError(
                f"--node_ip={self.node_ip} is not in --cluster_node_ips={ips}; give this "
                "machine's address from that list"
            )
        if self.nproc_per_node < 1:
            raise LaunchInputError(f"--nproc_per_node={self.nproc_per_node} must be >= 1")
        if self.selected_gpus and len(self.selected_gpus) != self.nproc_per_node:
            gpus = ",".join(map(str, self.selected_gpus))
            raise LaunchInputError(
                f"--nproc_per_node={self.nproc_per_node} does not match --selected_gpus={gpus} "
                f"({len(self.selected_gpus)} GPUs, one process each); drop --nproc_per_node or "
                "make them agree"
            )
        if self.rendezvous_file is not None and not self.rendezvous_file.strip():
            raise LaunchInputError(
                "--rendezvous_file is empty; give a path on a filesystem every node shares"
            )
        if self.started_port is None:
            if self.node_num > 1 and not self.rendezvous_file:
                raise LaunchInputError(
                    f"--started_port={AUTO_PORT} with --cluster_node_ips={ips} ({self.node_num} "
                    "nodes) needs --rendezvous_file=PATH, where the first node's launcher writes "
                    "the address of the store it hosts for the others; add it, the same path on "
                    "every node, on a filesystem they all share (or give every node the same "
                    f"port number, e.g. --started_port={DEFAULT_STARTED_PORT})"
                )
        elif self.rendezvous_file is not None:
            raise LaunchInputError(
                f"--rendezvous_file={self.rendezvous_file} is used only with "
                f"--started_port={AUTO_PORT}, but --started_port={self.started_port} already fixes "
                f"every port; drop --rendezvous_file, or use --started_port={AUTO_PORT}"
            )
        elif not 1 <= self.started_port <= 65535:
            raise LaunchInputError(f"--started_port={self.started_port} is outside 1..65535")
        elif self.started_port + self.nproc_per_node - 1 > 65535:
            last = self.started_port + self.nproc_per_node - 1
            raise LaunchInputError(
                f"--started_port={self.started_port} with {self.nproc_per_node} processes per "
                f"node needs ports up to {last}, above 65535; choose a lower --started_port"
            )
        if self.ports and len(self.ports) != self.nproc_per_node:
            raise ValueError(
                f"ports={self.ports} has {len(self.ports)} entries for nproc_per_node="
                f"{self.nproc_per_node}; give one port per local rank"
            )
        if not 0 < self.rendezvous_timeout < math.inf:
            raise LaunchInputError(
                f"--rendezvous_timeout={self.rendezvous_timeout:g} must be a finite number of "
                "seconds > 0"
            )
        if self.cluster_endpoints and len(self.cluster_endpoints) != self.world_size:
            raise ValueError(
                f"cluster_endpoints has {len(self.cluster_endpoints)} entries for world_size="
                f"{self.world_size}; give one endpoint per rank"
            )
        if not 0 <= self.kill_grace < math.inf:
            raise LaunchInputError(
                f"--kill_grace={self.kill_grace} must be a finite number of seconds >= 0 (a "
                "worker that ignores SIGTERM would otherwise never be killed); e.g. --kill_grace=3")
        try:
            JobSecret(self.job_secret)
        except SecretError as exc:
            raise LaunchInputError(str(exc)) from None
        if not self.job_id:
            raise LaunchInputError("--job_id is empty; give a non-empty name or leave it out")
        if self.max_restarts < 0:
            raise LaunchInputError(f"--max_restarts={self.max_restarts} must be >= 0")
        if self.min_nodes and not 1 <= self.min_nodes <= self.max_nodes:
            raise LaunchInputError(
                f"--nnodes={self.min_nodes}:{self.max_nodes}: give 1 <= MIN <= MAX (or one number)")
        if self.min_nodes and not self.rdzv_endpoint:
            raise LaunchInputError(
                f"--nnodes={self.min_nodes}:{self.max_nodes} needs --rdzv_endpoint=HOST:PORT, where "
                "the launcher on HOST hosts the rendezvous store; give the same one to every node")
        if self.rdzv_endpoint and not self.min_nodes:
            raise LaunchInputError(
                f"--rdzv_endpoint={self.rdzv_endpoint} is used only by an elastic job; add --nnodes=MIN:MAX")
        if self.min_nodes and self.node_num > 1:
            raise LaunchInputError(
                f"--nnodes={self.min_nodes}:{self.max_nodes}: the nodes of an elastic job come from "
                f"the rendezvous, not from --cluster_node_ips={','.join(self.cluster_node_ips)}; "
                "give each launcher only its own --node_ip")
        if self.host_discovery_script is not None:
            self._check_discovery()
        if self.max_restarts and self.node_num > 1:
            raise LaunchInputError(
                f"--max_restarts={self.max_restarts} restarts the workers of one launcher; with "
                f"{self.node_num} nodes the other launchers would not restart theirs. Run the job's "
                "ranks under one launcher (one node), or drop --max_restarts"
            )

    def _check_discovery(self) -> None:
        flag = f"--host_discovery_script={self.host_discovery_script}"
        if not self.min_nodes:
            raise LaunchInputError(f"{flag} finds nodes for an elastic job; add --nnodes=MIN:MAX")
        if str(self.rdzv_endpoint).rpartition(":")[0].strip("[]") != self.node_ip:
            raise LaunchInputError(
                f"{flag}: run it on the launcher that hosts --rdzv_endpoint={self.rdzv_endpoint} "
                f"(--node_ip={self.node_ip} is another node), so one launcher starts the new nodes")
        if not self.discovery_interval > 0:
            raise LaunchInputError(f"--discovery_interval={self.discovery_interval:g} must be > 0 seconds")
        if "{host}" not in self.remote_shell:
            raise LaunchInputError(
                f"--remote_shell={self.remote_shell!r} has no {{host}}; write where the host name "
                f"goes, e.g. {DEFAULT_REMOTE_SHELL!r}")

    @property
    def node_index(self) -> int:
        return self.cluster_node_ips.index(self.node_ip)

    @property
    def node_num(self) -> int:
        return len(self.cluster_node_ips)

    @property
    def world_size(self) -> int:
        return self.node_num * self.nproc_per_node

    @property
    def auto_ports(self) -> bool:
        """``--started_port=auto``."""
        return self.started_port is None

    @property
    def meets_through_file(self) -> bool:
        """``--started_port=auto`` on several nodes: the launchers meet through
        ``--rendezvous_file`` before starting workers (`fleetlike.launch.meeting`)."""
        return self.auto_ports and self.node_num > 1

    @property
    def ports_settled(self) -> bool:
        """Every rank's endpoint is known (always, unless ``auto`` has not bound or met yet)."""
        if not self.auto_ports:
            return True
        return bool(self.cluster_endpoints) if self.meets_through_file else bool(self.ports)

    @property
    def local_ports(self) -> tuple[int, ...]:
        """The port of each local rank: ``ports`` once chosen, else ``started_port + i``."""
        if self.ports:
            return self.ports
        if self.started_port is None:
            raise ValueError(
                f"--started_port={AUTO_PORT}: the ports are chosen when the launcher binds them; "
                "ask a config returned by fleetlike.launch.ports.host_endpoints"
            )
        return tuple(range(self.started_port, self.started_port + self.nproc_per_node))

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every rank's ``ip:port``, node by node in ``cluster_node_ips`` order."""
        if self.cluster_endpoints:
            return self.cluster_endpoints
        if self.meets_through_file:
            raise ValueError(
                f"--started_port={AUTO_PORT} on {self.node_num} nodes: the other nodes' ports are "
                "known once the launchers have met; ask a config returned by "
                "fleetlike.launch.meeting.meet"
            )
        return tuple(f"{ip}:{port}" for ip in self.cluster_node_ips for port in self.local_ports)

    @property
    def master_endpoint(self) -> str:
        """Rank 0's endpoint, where the fleetlike rendezvous store is hosted."""
        return self.endpoints[0]

    def rank(self, local_rank: int) -> int:
        return self.node_index * self.nproc_per_node + local_rank

    def log_path(self, local_rank: int) -> str:
        return f"{self.log_dir.rstrip('/') or '/'}/workerlog.{local_rank}"


def _nnodes(text: str | None) -> tuple[int, int]:
    """``--nnodes``: ``MIN:MAX`` or ``N`` -> (MIN, MAX); (0, 0) when not given."""
    if text is None:
        return 0, 0
    parts = text.split(":")
    if len(parts) not in (1, 2):
        raise LaunchInputError(f"--nnodes={text!r}: give MIN:MAX (e.g. 1:2) or one number")
    low = _int_flag("--nnodes", parts[0])
    high = _int_flag("--nnodes", parts[-1])
    if low < 1 or high < low:
        raise LaunchInputError(f"--nnodes={text}: give 1 <= MIN <= MAX (e.g. 1:2)")
    return low, high


def _preload(flag: str | None, env: Mapping[str, str]) -> str:
    try:
        return preload_mode(flag if flag is not None else env.get(PRELOAD_ENV, ""))
    except ValueError as exc:
        raise LaunchInputError(str(exc).replace("--preload", PRELOAD_ENV if flag is None else "--preload")) from None


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise LaunchInputError(f"{name}={text!r} is not a number of seconds") from None
    if not 0 <= value < math.inf:
        raise LaunchInputError(f"{name}={text} must be a finite number of seconds >= 0")
    return value


def _heartbeat_timeout(text: str | None, *, elastic: bool) -> float:
    """``--heartbeat_timeout``: only an elastic job's workers heartbeat, and a silence of 0 s
    would lose every worker at once."""
    if text is None:
        return DEFAULT_HEARTBEAT_TIMEOUT
    if not elastic:
        raise LaunchInputError(
            f"--heartbeat_timeout={text} applies to elastic jobs only (their workers heartbeat); "
            "add --nnodes MIN:MAX --rdzv_endpoint HOST:PORT, or drop the flag")
    value = _seconds("--heartbeat_timeout", text)
    if value <= 0:
        raise LaunchInputError(f"--heartbeat_timeout={text} must be more than 0 seconds (default: "
                               f"{DEFAULT_HEARTBEAT_TIMEOUT:g})")
    return value


def _int_flag(name: str, text: str) -> int:
    digits = text.strip().lstrip("+-")
    if not digits.isascii() and digits.isdigit():  # int() takes full-width digits ("６１７０") too
        raise LaunchInputError(f"{name}={text!r} is not an integer in ASCII digits 0-9")
    try:
        return int(text)
    except ValueError:
        raise LaunchInputError(f"{name}={text!r} is not an integer") from None


def _with_cloud(
    cloud: CloudCluster, ips: tuple[str, ...], node_ip: str, given_node_ip: bool, port: int | None,
    nproc: int,
) -> tuple[tuple[str, ...], str, int | None, tuple[int, ...], tuple[str, ...]]:
    """The flags' node layout replaced by the cloud's: ``(ips, node_ip, port, ports, endpoints)``.

    A flag that was given and says otherwise than the cloud is an error (it is the user's
    mistake either way, and Paddle's silent preference for the cloud hides it)."""
    cloud_ips = ",".join(cloud.node_ips)
    if ips != ("127.0.0.1",) and ips != cloud.node_ips:
        raise LaunchInputError(
            f"--cluster_node_ips={','.join(ips)} contradicts PADDLE_TRAINERS={cloud_ips} "
            "(--use_paddlecloud); drop the flag, the cloud knows the nodes"
        )
    if given_node_ip and node_ip != cloud.node_ip:
        raise LaunchInputError(
            f"--node_ip={node_ip} contradicts POD_IP={cloud.node_ip} (--use_paddlecloud); drop the flag"
        )
    ports: tuple[int, ...] = ()
    if cloud.endpoints:
        ports = cloud.local_ports(nproc)
        cloud_port: int | None = ports[0]
        what = "DISTRIBUTED_TRAINER_ENDPOINTS"
    else:
        cloud_port, what = cloud.started_port, "PADDLE_PORT"
    if cloud_port is not None and port != DEFAULT_STARTED_PORT and port != cloud_port:
        given = AUTO_PORT if port is None else port
        raise LaunchInputError(
            f"--started_port={given} contradicts {what} (the cloud reserved port {cloud_port} "
            "for local process 0; --use_paddlecloud); drop --started_port"
        )
    return cloud.node_ips, cloud.node_ip, port if cloud_port is None else cloud_port, ports, cloud.endpoints


def parse_config(
    argv: Sequence[str], *, device_count: Callable[[], int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchConfig:
    """Parse the command line into a `LaunchConfig` (raises `LaunchInputError`).

    ``device_count`` reports visible CUDA devices; it is asked only without ``--selected_gpus``.
    Then all visible GPUs are used, or with ``--nproc_per_node=N`` GPUs 0..N-1 when at least N
    are visible, else CPU. ``environ`` (default ``os.environ``) is read with ``--use_paddlecloud``
    (`fleetlike.launch.cloud`), and for the job's secret (`SECRET_ENV`: required when several
    launchers must share it and no ``--rendezvous_file`` carries it) and ``FLEETLIKE_JOB_ID``.
    """
    args = build_parser().parse_args(list(argv))
    ips = tuple(ip.strip() for ip in args.cluster_node_ips.split(",") if ip.strip())
    node_ip = args.node_ip.strip() if args.node_ip else (ips[0] if len(ips) == 1 else "127.0.0.1")
    port = None if args.started_port.strip() == AUTO_PORT else _int_flag("--started_port", args.started_port)
    nproc = None if args.nproc_per_node is None else _int_flag("--nproc_per_node", args.nproc_per_node)
    if args.selected_gpus is not None:
        try:
            gpus = parse_gpu_list(args.selected_gpus, name="--selected_gpus")
        except ValueError as exc:
            raise LaunchInputError(str(exc)) from None
        if not gpus:
            raise LaunchInputError(
                f"--selected_gpus={args.selected_gpus!r} names no GPU; drop it to run on CPU"
            )
    elif device_count is not None:
        visible = device_count()
        # all GPUs by default; with --nproc_per_node, GPUs only when there are enough
        if nproc is None:
            gpus = tuple(range(visible))
        else:
            gpus = tuple(range(nproc)) if 0 < nproc <= visible else ()
    else:
        gpus = ()
    if nproc is None:
        nproc = len(gpus) or 1
    try:
        grace = float(args.kill_grace)
    except ValueError:
        raise LaunchInputError(f"--kill_grace={args.kill_grace!r} is not a number") from None
    try:
        rdzv_timeout = float(args.rendezvous_timeout)
    except ValueError:
        raise LaunchInputError(
            f"--rendezvous_timeout={args.rendezvous_timeout!r} is not a number of seconds"
        ) from None
    ports: tuple[int, ...] = ()
    endpoints: tuple[str, ...] = ()
    if args.use_paddlecloud:
        try:
            cloud = read_cloud(os.environ if environ is None else environ, nproc)
        except CloudEnvError as exc:
            raise LaunchInputError(str(exc)) from None
        if cloud is not None:
            ips, node_ip, port, ports, endpoints = _with_cloud(
                cloud, ips, node_ip, args.node_ip is not None, port, nproc)
    try:
        static = torch_nodes(args, paddle_port_given=args.started_port != SHARED_FLAGS["started_port"].default)
    except TorchFlagError as exc:
        raise LaunchInputError(str(exc)) from None
    if static is not None:
        ips, node_ip, port = static.ips, static.node_ip, static.started_port
    nodes = _nnodes(None if static is not None else args.nnodes)
    last_call = _seconds("--rdzv_last_call", args.rdzv_last_call)
    heartbeat = _heartbeat_timeout(args.heartbeat_timeout, elastic=bool(nodes[0]))
    if nodes[0]:
        node_ip = args.node_ip.strip() if args.node_ip else "127.0.0.1"
        if args.cluster_node_ips == "127.0.0.1":
            ips = (node_ip,)
    env = os.environ if environ is None else environ
    secret_text = env.get(SECRET_ENV, "").strip()
    through_file = port is None and len(ips) > 1
    job_id = args.job_id if args.job_id is not None else default_job_id(ips, port, nproc, env)
    from_file = through_file and args.job_id is None and node_ip != ips[0] and not env.get(envvars.JOB_ID)
    config = LaunchConfig(
        training_script=args.training_script,
        training_script_args=tuple(args.training_script_args),
        cluster_node_ips=ips,
        node_ip=node_ip,
        started_port=port,
        nproc_per_node=nproc,
        selected_gpus=gpus,
        log_dir=args.log_dir,
        job_id=job_id,
        module=args.module,
        kill_grace=grace,
        print_config=args.print_config,
        malloc_tuning=args.malloc_tuning == "on",
        accelerate_ddp=args.accelerate_ddp,
        accelerate_horovod=args.accelerate_horovod,
        preload=_preload(args.preload, env),
        rendezvous_file=args.rendezvous_file,
        rendezvous_timeout=rdzv_timeout,
        ports=ports,
        cluster_endpoints=endpoints,
        use_paddlecloud=args.use_paddlecloud,
        max_restarts=_int_flag("--max_restarts", args.max_restarts),
        min_nodes=nodes[0],
        max_nodes=nodes[1],
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_last_call=last_call,
        heartbeat_timeout=heartbeat,
        host_discovery_script=args.host_discovery_script,
        discovery_interval=_seconds("--discovery_interval", args.discovery_interval),
        remote_shell=args.remote_shell,
        job_secret=secret_text or new_secret(),
        job_id_from_file=bool(from_file),
        static_nodes=static,
    )
    several = config.node_num > 1 or (config.max_nodes > 1 and config.host_discovery_script is None)
    if several and not config.meets_through_file and not secret_text:
        # Paddle's launch form starts each node's launcher on its own, and nothing but the flags is
        # shared between them; anything derived from the flags anyone could derive, so the store's
        # host makes the secret and the others read it from a private file (`homesecret.settle`)
        given_id = args.job_id is not None or bool(env.get(envvars.JOB_ID, "").strip())
        config = dataclasses.replace(config, secret_at_home=True, job_id_given=given_id,
                                     job_id=config.job_id if given_id else JobSecret(config.job_secret).job_id())
    return config


def _port_text(config: LaunchConfig) -> str:
    if not config.auto_ports:
        return str(config.started_port)
    chosen = ",".join(map(str, config.ports)) if config.ports else "not yet chosen"
    if not config.meets_through_file:
        return f"{AUTO_PORT} ({chosen}; store hosted by the launcher)"
    host = "this launcher" if config.node_index == 0 else "node 0's launcher"
    return f"{AUTO_PORT} ({chosen} here; store hosted by {host})"


def format_config(config: LaunchConfig) -> str:
    """The resolved configuration as a two-column table (``--print_config``)."""
    script = ("-m " if config.module else "") + config.training_script
    rows = [
        ("training_script", " ".join([script, *config.training_script_args])),
        ("cluster_node_ips", ",".join(config.cluster_node_ips)),
        ("node_ip", config.node_ip),
        ("node_index", f"{config.node_index} of {config.node_num}"),
        ("started_port", _port_text(config)),
        ("nproc_per_node", str(config.nproc_per_node)),
        ("device", "gpu " + ",".join(map(str, config.selected_gpus)) if config.selected_gpus else "cpu"),
        ("world_size", str(config.world_size)),
        ("ranks on this node", f"{config.rank(0)}..{config.rank(config.nproc_per_node - 1)}"),
        ("master_endpoint", config.master_endpoint if config.ports_settled else "chosen at start"),
        ("log_dir", config.log_dir),
        ("job_id", config.job_id),
        ("kill_grace", f"{config.kill_grace:g} s"),
        ("max_restarts", str(config.max_restarts)),
        ("nnodes", f"{config.min_nodes}:{config.max_nodes} (elastic, rendezvous at "
                   f"{config.rdzv_endpoint}, last call {config.rdzv_last_call:g} s, heartbeat timeout "
                   f"{config.heartbeat_timeout:g} s)"
                   if config.min_nodes else "fixed"),
        ("host_discovery", f"{config.host_discovery_script} every {config.discovery_interval:g} s, "
                           f"through {config.remote_shell!r}" if config.host_discovery_script else "off"),
        ("malloc_tuning", "on (glibc tcache off for workers)" if config.malloc_tuning else "off"),
        ("preload", config.preload),
    ]
    if config.use_paddlecloud:
        rows.insert(2, ("use_paddlecloud", "yes (nodes and ports from the cloud's environment)"))
    if config.meets_through_file:
        rows.insert(5, ("rendezvous_file",
                        f"{config.rendezvous_file} (timeout {config.rendezvous_timeout:g} s)"))
    width = max(len(k) for k, _ in rows)
    lines = ["fleetlike.launch configuration", "-" * (width + 24)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)

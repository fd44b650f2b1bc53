"""The launcher's command line: every flag declared once, with its default and its help.

Why a module of its own: the flags are the launcher's face, read by two parsers (this one for
one node or Fleet's form, and `fleetlike.launch.hosts` for the ``-np/-H`` form, which share
`SHARED_FLAGS`) and by the docs' checks; turning the parsed flags into a checked
`LaunchConfig` is `fleetlike.launch.config`'s job. `LaunchInputError` is here because argparse
raises it first (a bad flag), before any value is resolved.

Example:
    >>> args = build_parser().parse_args(["--nproc_per_node=2", "train.py", "--lr", "0.1"])
    >>> args.nproc_per_node, args.training_script_args
    ('2', ['--lr', '0.1'])
"""

from __future__ import annotations

import argparse
import dataclasses

from fleetlike.launch.preload import PRELOAD_CHOICES, PRELOAD_ENV
from fleetlike.launch.torch_flags import add_torch_flags

__all__ = [
    "AUTO_PORT",
    "DEFAULT_DISCOVERY_INTERVAL",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_REMOTE_SHELL",
    "DEFAULT_RENDEZVOUS_TIMEOUT",
    "DEFAULT_STARTED_PORT",
    "LaunchInputError",
    "SHARED_FLAGS",
    "SharedFlag",
    "add_shared_flag",
    "build_parser",
]

DEFAULT_STARTED_PORT = 6170

#: ``--started_port=auto``: the launcher lets the OS choose free ports and holds them; on several
#: nodes the launchers meet through ``--rendezvous_file`` (`fleetlike.launch.meeting`).
AUTO_PORT = "auto"

#: ``--remote_shell`` default: the template is followed by one argument, a shell command line,
#: exactly as ``ssh HOST 'command'`` takes it (the ``-np/-H`` form and host discovery).
DEFAULT_REMOTE_SHELL = "ssh -o BatchMode=yes {host}"

#: ``--discovery_interval``: seconds between two runs of ``--host_discovery_script``.
DEFAULT_DISCOVERY_INTERVAL = 5.0
#: ``--heartbeat_timeout``'s default (`fleetlike.elastic.membership.DEFAULT_HEARTBEAT_TIMEOUT`
#: reads the same number where no launcher set it; a test checks the two agree)
DEFAULT_HEARTBEAT_TIMEOUT = 3.0

#: ``--rendezvous_timeout``: seconds the launchers of several nodes wait for each other.
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0

_EXAMPLES = """\
examples:
  one machine, CPU, 2 processes:
    python -m fleetlike.launch --nproc_per_node=2 train.py --lr 0.1

  one machine, 4 GPUs (one process per GPU):
    python -m fleetlike.launch --selected_gpus=0,1,2,3 train.py

  two machines, 4 GPUs each; run on 192.168.1.2:
    python -m fleetlike.launch \\
        --cluster_node_ips=192.168.1.2,192.168.1.3 \\
        --node_ip=192.168.1.2 \\
        --started_port=6170 \\
        --selected_gpus=0,1,2,3 \\
        train_with_fleet.py --model=ResNet50 --data_dir=./ImageNet
  and the same with --node_ip=192.168.1.3 on 192.168.1.3.

  on PaddleCloud (every node runs the same command; nodes, this node and ports come from
  PADDLE_TRAINERS_NUM, PADDLE_TRAINERS, POD_IP, PADDLE_TRAINER_ID, TRAINER_PORTS_NUM,
  PADDLE_PORT or DISTRIBUTED_TRAINER_ENDPOINTS):
    python -m fleetlike.launch --use_paddlecloud --selected_gpus=0,1,2,3,4,5,6,7 \
        train_with_fleet.py --model=ResNet50 --data_dir=./ImageNet

  one machine, ports chosen by the launcher (several jobs or test runs side by side):
    python -m fleetlike.launch --nproc_per_node=2 --started_port=auto train.py

  two machines, ports chosen by the launchers, meeting through a file on a filesystem both
  machines share (NFS, ...); run on each with its own --node_ip:
    python -m fleetlike.launch --cluster_node_ips=192.168.1.2,192.168.1.3 \\
        --node_ip=192.168.1.2 --started_port=auto \\
        --rendezvous_file=/shared/jobs/resnet.rdzv --selected_gpus=0,1,2,3 train.py

Ranks are numbered node by node in --cluster_node_ips order; local process i listens at
node_ip:(started_port + i), or with auto at a port its launcher chose. Worker i logs to
LOG_DIR/workerlog.i; local rank 0 is also echoed here.
"""


class LaunchInputError(ValueError):
    """A bad flag or machine state found before any worker starts (exit code 2)."""


class _HelpExit(Exception):
    """argparse asked to exit (``--help``); carries the status instead of calling sys.exit."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so `main` can be called in-process."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "required: training_script" in message:
            message = (
                "no training script given; usage: python -m fleetlike.launch [flags] train.py "
                "[script args] (see --help)"
            )
        raise LaunchInputError(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            self._print_message(message)
        raise _HelpExit(status)



@dataclasses.dataclass(frozen=True)
class SharedFlag:
    """A flag both forms of the launcher take (one node / Fleet's form and the ``-np/-H`` form):
    its names and default once; ``help`` says what it means in each form."""

    names: tuple[str, ...]
    default: str | bool | None
    help: dict[str, str]
    #: argparse's action ("store_true" for a switch); None: a flag with a value
    action: str | None = None


#: the flags the two parsers share, by their first name without the dashes
SHARED_FLAGS: dict[str, SharedFlag] = {
    "started_port": SharedFlag(("--started_port", "--start_port"), str(DEFAULT_STARTED_PORT), {
        "node": "port of local process 0; process i uses started_port+i (default: 6170). "
                "'auto': the launcher binds free ports chosen by the OS and holds them, and "
                "the first node's launcher hosts the rendezvous store on rank 0's itself, so no "
                "other process can take a port between its choice and its use (several nodes "
                "also need --rendezvous_file)",
        "hosts": f"port of local rank 0 on every host (default: {DEFAULT_STARTED_PORT})"}),
    "log_dir": SharedFlag(("--log_dir",), "log", {
        "node": "directory of workerlog.N files (default: log)",
        "hosts": "worker logs: LOG_DIR/nodeK/workerlog.i (default: log)"}),
    "job_id": SharedFlag(("--job_id",), None, {
        "node": "job identifier given to workers as FLEETLIKE_JOB_ID (default: "
                "FLEETLIKE_JOB_ID from the environment, else derived from the FLEETLIKE_JOB_SECRET "
                "every node was given, else random; with --rendezvous_file the other nodes take "
                "node 0's from the file)",
        "hosts": "job id (default: derived from hosts and port)"}),
    "kill_grace": SharedFlag(("--kill_grace",), "3", {
        "node": "seconds between SIGTERM and SIGKILL when stopping workers (default: 3)",
        "hosts": "seconds between SIGTERM and SIGKILL (default: 3)"}),
    "remote_shell": SharedFlag(("--remote_shell", "--remote-shell"), DEFAULT_REMOTE_SHELL, {
        "node": "with --host_discovery_script: the command that runs a shell command line "
                f"on {{host}}; the line is appended as one argument (default: {DEFAULT_REMOTE_SHELL!r})",
        "hosts": "command that runs a shell command line on {host}; the line is appended as "
                 f"one argument (default: {DEFAULT_REMOTE_SHELL!r})"}),
    "accelerate_horovod": SharedFlag(("--accelerate_horovod",), False, {
        "node": "workers' `import horovod.torch` imports fleetlike.horovod: a Horovod script runs unchanged "
                "(nothing is shadowed without this flag)",
        "hosts": "the workers' `import horovod.torch` imports fleetlike.horovod: a Horovod script runs "
                 "unchanged, as under horovodrun (nothing is shadowed without this flag)"}, "store_true"),
}


def add_shared_flag(p: argparse.ArgumentParser, name: str, form: str) -> None:
    """Declare `SHARED_FLAGS` ``name`` on ``p`` with the help of ``form`` ("node" or "hosts")."""
    flag = SHARED_FLAGS[name]
    if flag.action is not None:
        p.add_argument(*flag.names, action=flag.action, default=flag.default, help=flag.help[form])
        return
    p.add_argument(*flag.names, default=flag.default, help=flag.help[form])

def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags, with Paddle 2.x spellings as aliases."""
    p = _Parser(
        prog="python -m fleetlike.launch",
        description="Start one fleetlike worker process per GPU (or --nproc_per_node on CPU) on "
        "this node, watch them, and stop the whole job when one fails.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--cluster_node_ips", "--ips", default="127.0.0.1",
                   help="comma-separated IPs of all nodes, in rank order (default: 127.0.0.1)")
    p.add_argument("--node_ip", default=None,
                   help="this node's IP, one of --cluster_node_ips (default: the only one, "
                   "else 127.0.0.1)")
    add_shared_flag(p, "started_port", "node")
    p.add_argument("--rendezvous_file", default=None, metavar="PATH",
                   help="--started_port=auto on several nodes: a file on a filesystem every node "
                   "shares (NFS, ...), the same path on every node. The first node's launcher "
                   "writes the address of the store it hosts there (atomically, replacing any "
                   "earlier file); the others wait for it, check its job id and join. Not needed "
                   "on one node")
    p.add_argument("--rendezvous_timeout", default=str(DEFAULT_RENDEZVOUS_TIMEOUT),
                   metavar="SECONDS",
                   help="with --rendezvous_file: how long a launcher waits for the file and for "
                   f"every node to join before giving up (default: {DEFAULT_RENDEZVOUS_TIMEOUT:g})")
    p.add_argument("--selected_gpus", "--gpus", default=None,
                   help="comma-separated GPU ids, one process each (default: all visible GPUs; "
                   "with --nproc_per_node=N, GPUs 0..N-1 if at least N are visible, else CPU)")
    p.add_argument("--use_paddlecloud", action="store_true",
                   help="take the nodes, this node and the ports from PaddleCloud's environment, "
                   "as Paddle's launcher does (see docs/launching.md); a missing or contradictory "
                   "variable is an input error naming it")
    p.add_argument("--nproc_per_node", default=None,
                   help="processes on this node (default: one per selected GPU, else 1)")
    add_shared_flag(p, "log_dir", "node")
    add_shared_flag(p, "job_id", "node")
    add_shared_flag(p, "kill_grace", "node")
    p.add_argument("--accelerate_ddp", action="store_true",
                   help="workers import fleetlike.auto first: their torch DDP models average through fleetlike")
    add_shared_flag(p, "accelerate_horovod", "node")
    p.add_argument("--malloc_tuning", default="on", choices=("on", "off"),
                   help="on (default): workers start with glibc's per-thread malloc cache off "
                   "(GLIBC_TUNABLES=glibc.malloc.tcache_count=0), so freed gradient-sized blocks "
                   "coalesce and are reused instead of growing the heap; a GLIBC_TUNABLES that "
                   "already sets tcache_count is kept. off: the environment is left as it is")
    p.add_argument("--preload", default=None, choices=PRELOAD_CHOICES,
                   help=f"torch: start (and restart) workers by forking an interpreter that has "
                   f"imported torch already, seconds faster each; off: a fresh interpreter each "
                   f"(default: {PRELOAD_ENV} from the environment, else off; see docs/launching.md)")
    p.add_argument("--max_restarts", default="0", metavar="N",
                   help="restart all local workers up to N times after a worker fails, each start "
                   "a new rendezvous generation (default: 0, a failure ends the job); with --nnodes "
                   "only the failed worker is started again, and nodes lost or joining use none of "
                   "the N; see docs/launching.md, 'Elastic jobs'")
    p.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                   help="an elastic job of MIN to MAX nodes (or exactly N with --rdzv_endpoint): the "
                   "workers meet through --rdzv_endpoint and must use fleetlike.elastic (elastic.init, "
                   "@elastic.run); a node that is lost or joins changes the world without restarting the "
                   "others. One number N without --rdzv_endpoint: a static job of N nodes, torch's form "
                   "(--node_rank, --master_addr, --master_port)")
    add_torch_flags(p)
    p.add_argument("--rdzv_endpoint", default=None, metavar="HOST:PORT",
                   help="with --nnodes: the rendezvous store; the launcher whose --node_ip is HOST "
                   "hosts it (start it first; the job lives as long as it does)")
    p.add_argument("--rdzv_last_call", default="3", metavar="SECONDS",
                   help="with --nnodes: once MIN nodes' workers are there, how long a rendezvous "
                   "round waits for more before it closes (default: 3)")
    p.add_argument("--heartbeat_timeout", default=None, metavar="SECONDS",
                   help="with --nnodes: a worker whose heartbeats (one every third of this) stop "
                   "for this long counts as gone and the world re-forms without it (default: "
                   f"{DEFAULT_HEARTBEAT_TIMEOUT:g}); longer tolerates workers starved of CPU on a "
                   "shared machine, shorter finds a lost node sooner")
    p.add_argument("--host_discovery_script", default=None, metavar="PATH",
                   help="with --nnodes, on the launcher hosting --rdzv_endpoint: an executable "
                   "printing 'host:slots' lines (Horovod's contract); each listed host not yet "
                   "running workers is started through --remote_shell and joins at the next commit")
    p.add_argument("--discovery_interval", default=f"{DEFAULT_DISCOVERY_INTERVAL:g}", metavar="SECONDS",
                   help="seconds between two runs of --host_discovery_script "
                   f"(default: {DEFAULT_DISCOVERY_INTERVAL:g})")
    add_shared_flag(p, "remote_shell", "node")
    p.add_argument("--print_config", action="store_true",
                   help="print the resolved configuration before starting")
    p.add_argument("-m", "--module", action="store_true",
                   help="run training_script as a module (python -m) instead of a file")
    p.add_argument("training_script", help="the training script (or module with -m)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER,
                   help="arguments passed to the training script")
    return p

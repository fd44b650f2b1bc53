"""The module launcher: ``python -m fleetlike.launch [flags] train.py [script args]``.

Starts one worker per selected GPU (or ``--nproc_per_node`` on CPU) on this node, gives each the
environment of `worker_env`, logs worker i to ``log_dir/workerlog.i`` (local rank 0 also to the
console), and stops the whole job when one worker fails. With ``--started_port=auto`` the ports
are chosen by the OS and held by the launchers; on several nodes the launchers meet through
``--rendezvous_file`` (`fleetlike.launch.meeting`). See ``docs/launching.md``.

Example (in-process, returns the exit code)::

    from fleetlike.launch import main
    code = main(["--nproc_per_node=2", "train.py", "--lr", "0.1"])
"""

from fleetlike.launch.cloud import CLOUD_VARIABLES, CloudCluster, CloudEnvError, read_cloud
from fleetlike.launch.config import LaunchConfig, default_job_id, format_config, open_job_warning, parse_config
from fleetlike.launch.flags import AUTO_PORT, DEFAULT_RENDEZVOUS_TIMEOUT, DEFAULT_STARTED_PORT, LaunchInputError, build_parser
from fleetlike.launch.env import AGENT_STORE, MALLOC_TUNABLE, PROXY_VARIABLES, tuned_glibc_tunables, worker_env
from fleetlike.launch.main import launch, main, worker_command
from fleetlike.launch.meeting import MeetingError, meet
from fleetlike.launch.ports import HostedEndpoints, hold_endpoints, host_endpoints

__all__ = [
    "AGENT_STORE",
    "AUTO_PORT",
    "CLOUD_VARIABLES",
    "CloudCluster",
    "CloudEnvError",
    "DEFAULT_RENDEZVOUS_TIMEOUT",
    "DEFAULT_STARTED_PORT",
    "HostedEndpoints",
    "LaunchConfig",
    "LaunchInputError",
    "MALLOC_TUNABLE",
    "MeetingError",
    "PROXY_VARIABLES",
    "build_parser",
    "default_job_id",
    "open_job_warning",
    "format_config",
    "hold_endpoints",
    "host_endpoints",
    "launch",
    "main",
    "meet",
    "parse_config",
    "read_cloud",
    "tuned_glibc_tunables",
    "worker_command",
    "worker_env",
]

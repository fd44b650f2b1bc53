"""The environment each worker starts with: the one place the launcher's contract is written.

Workers get both the Paddle names (read by `PaddleCloudRoleMaker`) and torchrun's (so plain
``torch.distributed.init_process_group("gloo", init_method="env://")`` code also works); both
describe the same job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fleetlike.config import envvars
from fleetlike.launch.config import LaunchConfig
from fleetlike.launch.preload import ACCELERATE_SITE
from fleetlike.roles import parse_endpoint

__all__ = [
    "ACCELERATE_SITE", "AGENT_STORE", "MALLOC_TUNABLE", "OMP_NOTE", "PROXY_VARIABLES", "omp_note", "torch_master_port",
    "tuned_glibc_tunables", "worker_env",
]

#: torch's (and torchrun's) name for "the store at MASTER_ADDR:MASTER_PORT is hosted by the
#: launcher": set to ``True`` with ``--started_port=auto``, read by `PaddleCloudRoleMaker`
#: (``Role.master_hosted``) and by torch's own ``env://`` / ``tcp://`` initialization.
AGENT_STORE = envvars.AGENT_STORE

#: Removed from workers: a proxy would swallow the workers' connections to each other.
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")

#: What ``--malloc_tuning on`` adds to the workers' ``GLIBC_TUNABLES``. torch allocates CPU
#: tensors with ``posix_memalign``; glibc splits a small remainder off each aligned block and
#: parks it in the per-thread cache, where it never coalesces, so a freed gradient-sized block
#: is a few bytes too small for the next identical request and the heap grows instead. With the
#: cache off the remainders merge back and the block is reused: on the 50 MB benchmark model a
#: worker's peak RSS drops by 30-50 MB and stops varying between runs, at the same steps/s
#: (docs/BENCHMARKS.md, "Data parallel vs PyTorch DDP"). glibc reads tunables only at process
#: start, which is why the launcher, not ``fleet.init``, sets it.
MALLOC_TUNABLE = "glibc.malloc.tcache_count=0"


#: What the launcher says once when it sets ``OMP_NUM_THREADS=1`` for the workers (`omp_note`).
OMP_NOTE = ("OMP_NUM_THREADS is unset: every worker gets OMP_NUM_THREADS=1 (as torchrun does), so "
            "{n} workers do not each start one thread per core and overload the machine; set "
            "OMP_NUM_THREADS yourself to tune it")


def omp_note(config: LaunchConfig, base: Mapping[str, str] | None = None) -> str | None:
    """The line to print when `worker_env` sets ``OMP_NUM_THREADS`` (unset, several workers)."""
    env = os.environ if base is None else base
    if config.nproc_per_node > 1 and envvars.OMP_NUM_THREADS not in env:
        return OMP_NOTE.format(n=config.nproc_per_node)
    return None


def torch_master_port(config: LaunchConfig) -> int:
    """The workers' ``MASTER_PORT``, where ``torch.distributed``'s ``env://`` store listens.

    With fixed ports, fleetlike's rendezvous store listens on rank 0's endpoint
    (``started_port``), so torch's gets the port after node 0's last endpoint,
    ``started_port + nproc_per_node``: a script calling both ``fleet.init()`` and
    ``init_process_group()`` never binds one port twice (under torchrun on one node both join the
    store torchrun's agent hosts at ``MASTER_PORT``; on several nodes fleetlike's rank 0 hosts
    its own at ``MASTER_PORT + 1``). With ``auto`` the first
    node's launcher hosts one store at rank 0's endpoint and both join it
    (``TORCHELASTIC_USE_AGENT_STORE``)."""
    port = parse_endpoint(config.master_endpoint, name="master endpoint")[1]
    if config.auto_ports:
        return port
    return port + config.nproc_per_node


def tuned_glibc_tunables(current: str | None) -> str:
    """``current`` (a ``GLIBC_TUNABLES`` value, or None) with `MALLOC_TUNABLE` added.

    A value that already sets ``glibc.malloc.tcache_count`` is the user's choice and comes back
    unchanged; other tunables are kept (the list is colon-separated)."""
    current = (current or "").strip(":")
    # as glibc parses it: ``name=value`` items, names compared exactly (no whitespace stripping)
    names = [item.split("=", 1)[0] for item in current.split(":") if "=" in item]
    if "glibc.malloc.tcache_count" in names:
        return current
    return f"{current}:{MALLOC_TUNABLE}" if current else MALLOC_TUNABLE


def worker_env(
    config: LaunchConfig, local_rank: int, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of local worker ``local_rank``: ``base`` (default ``os.environ``) plus:

    ====================  =============================================================
    PADDLE_TRAINER_ID     global rank (node_index * nproc_per_node + local_rank)
    PADDLE_TRAINERS_NUM   world size (nodes * nproc_per_node)
    PADDLE_TRAINER_ENDPOINTS  every rank's ip:port, comma separated, in rank order
    PADDLE_CURRENT_ENDPOINT   this worker's node_ip:(started_port + local_rank), or with
                          ``--started_port=auto`` node_ip and the port its launcher chose
                          (on several nodes the nodes' ports differ; every node's
                          launcher learnt the others' through ``--rendezvous_file``)
    PADDLE_NODE_NUM       number of nodes
    FLAGS_selected_gpus   this worker's GPU id ("" on CPU)
    RANK                  = PADDLE_TRAINER_ID (torchrun name)
    WORLD_SIZE            = PADDLE_TRAINERS_NUM
    LOCAL_RANK            position on this node
    LOCAL_WORLD_SIZE      nproc_per_node
    GROUP_RANK            node index (torchrun name)
    MASTER_ADDR           rank 0's IP: the fleetlike rendezvous store is hosted there
    MASTER_PORT           torch's ``env://`` store: ``started_port + nproc_per_node`` (the
                          port after node 0's endpoints: fleetlike's own rendezvous is on
                          rank 0's), or with ``auto`` the port node 0's launcher hosts
                          (`torch_master_port`)
    OMP_NUM_THREADS       ``1`` where unset and nproc_per_node > 1, as torchrun sets it
                          (`omp_note`); a value already set is kept
    TORCHELASTIC_USE_AGENT_STORE  ``--started_port=auto`` only: ``True``, as under torchrun:
                          the store at MASTER_ADDR:MASTER_PORT is hosted by the (first
                          node's) launcher, so rank 0 (fleetlike, or torch's ``env://``)
                          joins it instead of binding the port; removed otherwise
    FLEETLIKE_JOB_ID      the job id (--job_id, see `default_job_id`)
    FLEETLIKE_JOB_SECRET  the job's secret (`fleetlike.comm.secret`): the rendezvous admits
                          only processes that hold it
    FLEETLIKE_NODE_IP     this node's IP (--node_ip)
    CUDA_VISIBLE_DEVICES  GPU runs only: the launcher's own visible devices, unchanged in
                          order, so FLAGS_selected_gpus indexes the same devices it validated
    GLIBC_TUNABLES        ``--malloc_tuning on`` only: `MALLOC_TUNABLE` added
                          (`tuned_glibc_tunables`)
    FLEETLIKE_ACCELERATE_DDP  ``--accelerate_ddp`` only: ``1`` (workers import fleetlike.auto)
    FLEETLIKE_ACCELERATE_HOROVOD  ``--accelerate_horovod`` only: ``1`` (``import horovod.torch``
                          is fleetlike.horovod, `fleetlike.horovod.alias`)
    PYTHONPATH            ``--accelerate_ddp`` / ``--accelerate_horovod`` only: `ACCELERATE_SITE`
                          first, whose ``sitecustomize`` acts on the two variables above
    ====================  =============================================================

    and without ``http_proxy``/``https_proxy``/``all_proxy`` in either case (`PROXY_VARIABLES`).
    """
    if not 0 <= local_rank < config.nproc_per_node:
        raise ValueError(
            f"local_rank={local_rank} is out of range 0..{config.nproc_per_node - 1} "
            f"(nproc_per_node={config.nproc_per_node})"
        )
    env = dict(os.environ if base is None else base)
    for name in PROXY_VARIABLES:
        env.pop(name, None)
    rank = config.rank(local_rank)
    endpoints = config.endpoints
    master_host = parse_endpoint(config.master_endpoint, name="master endpoint")[0]
    gpu = str(config.selected_gpus[local_rank]) if config.selected_gpus else ""
    env.update(
        {
            envvars.PADDLE_TRAINER_ID: str(rank),
            envvars.PADDLE_TRAINERS_NUM: str(config.world_size),
            envvars.PADDLE_TRAINER_ENDPOINTS: ",".join(endpoints),
            envvars.PADDLE_CURRENT_ENDPOINT: endpoints[rank],
            envvars.PADDLE_NODE_NUM: str(config.node_num),
            envvars.SELECTED_GPUS: gpu,
            envvars.RANK: str(rank),
            envvars.WORLD_SIZE: str(config.world_size),
            envvars.LOCAL_RANK: str(local_rank),
            envvars.LOCAL_WORLD_SIZE: str(config.nproc_per_node),
            envvars.GROUP_RANK: str(config.node_index),
            envvars.TORCH_MASTER_ADDR: master_host,
            envvars.TORCH_MASTER_PORT: str(torch_master_port(config)),
            envvars.JOB_ID: config.job_id,
            envvars.JOB_SECRET: config.job_secret,
            envvars.NODE_IP: config.node_ip,
        }
    )
    if omp_note(config, env) is not None:
        env[envvars.OMP_NUM_THREADS] = "1"
    if config.auto_ports:
        env[AGENT_STORE] = str(True)
    else:
        env.pop(AGENT_STORE, None)
    if config.selected_gpus:
        visible = env.get(envvars.CUDA_VISIBLE_DEVICES, "").strip()
        if not visible:
            visible = ",".join(str(i) for i in range(max(config.selected_gpus) + 1))
        env[envvars.CUDA_VISIBLE_DEVICES] = visible
    if config.malloc_tuning:
        env[envvars.GLIBC_TUNABLES] = tuned_glibc_tunables(env.get(envvars.GLIBC_TUNABLES))
    if config.accelerate_ddp:
        env[envvars.ACCELERATE_DDP] = "1"
    if config.accelerate_horovod:
        env[envvars.ACCELERATE_HOROVOD] = "1"
    if config.accelerate_ddp or config.accelerate_horovod:
        env[envvars.PYTHONPATH] = os.pathsep.join(p for p in (ACCELERATE_SITE, env.get(envvars.PYTHONPATH)) if p)
    return env

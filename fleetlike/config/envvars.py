"""The environment contract: every variable fleetlike writes or reads, in one table.

Each `EnvVar` says who writes it (the launcher, the user, a scheduler), who reads it and what it
means. The launcher (`fleetlike.launch.env`, its elastic agent, the ``-np/-H`` form), the role
readers (`fleetlike.roles`), elastic membership, the secret, the divergence guard and the DDP
knobs (`fleetlike.ddp.knobs`) take the names from here instead of spelling them, so a name is
written once and the table is the documentation (``python -m fleetlike.config.envvars``
prints it). Other launchers' own variables that the role makers merely recognise (Open MPI's,
MPICH's, Slurm's) stay with the role maker that reads them.

This module only names variables; it never reads the environment (the config layer does not).

Example:
    >>> BY_NAME[JOB_ID].reader
    'roles, launch.config'
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "ACCELERATE_DDP", "ACCELERATE_HOROVOD", "ACCUMULATE_N_STEPS", "AGENT_STORE", "ALLREDUCE_DTYPE", "ALLREDUCE_MODE",
    "AUTOTUNE", "AUTOTUNE_LOG",
    "ALLREDUCE_STREAMS", "BACKEND", "BY_NAME", "CHECK_COLLECTIVES", "CUDA_VISIBLE_DEVICES", "DIVERGENCE_CHECK_N_STEPS",
    "DOWNSAMPLE_N_ELEMENTS", "ELASTIC_HEARTBEAT_TIMEOUT", "ELASTIC_LAST_CALL", "ELASTIC_MAX_WORKERS", "ELASTIC_MIN_WORKERS",
    "ELASTIC_RUN_ID", "ELASTIC_STORE", "ENV_VARS", "EnvVar", "FILE_CACHE_DIR", "FUSION_MB", "GLIBC_TUNABLES", "GRADIENT_SCALE", "GROUP_RANK",
    "JOB_ID", "JOB_SECRET", "KNOB_NAMES", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MAX_NPROC_PER_NODE",
    "NAN_CHECK", "NODE_IP", "NODE_IPS", "OMP_NUM_THREADS", "PADDLE_CURRENT_ENDPOINT", "PADDLE_NODE_NUM",
    "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINER_ID", "PERF_CHECK_N_STEPS",
    "PRELOAD", "PRELOAD_SOCKET", "PROCESS_TAG", "PROGRESS_DIR", "PYTHONPATH", "RANK", "RESTART_COUNT", "SECRET_DIR", "SELECTED_GPUS", "STORE_SERVER", "STRATEGY",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCH_MASTER_ADDR",
    "TORCH_MASTER_PORT", "WORLD_SIZE", "by_writer", "fleetlike_names", "table",
]


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One variable of the contract: ``writer`` sets it, ``reader`` reads it (module paths or
    "user" / "tests"), ``meaning`` is what a value says."""

    name: str
    writer: str
    reader: str
    meaning: str


# --------------------------------------------------------------------- fleetlike's own names
STRATEGY = "FLEETLIKE_STRATEGY"
BACKEND = "FLEETLIKE_BACKEND"
CHECK_COLLECTIVES = "FLEETLIKE_CHECK_COLLECTIVES"
DIVERGENCE_CHECK_N_STEPS = "FLEETLIKE_DIVERGENCE_CHECK_N_STEPS"
ACCELERATE_DDP = "FLEETLIKE_ACCELERATE_DDP"
ACCELERATE_HOROVOD = "FLEETLIKE_ACCELERATE_HOROVOD"
JOB_ID = "FLEETLIKE_JOB_ID"
JOB_SECRET = "FLEETLIKE_JOB_SECRET"
SECRET_DIR = "FLEETLIKE_SECRET_DIR"
STORE_SERVER = "FLEETLIKE_STORE_SERVER"
FILE_CACHE_DIR = "FLEETLIKE_FILE_CACHE_DIR"
NODE_IP = "FLEETLIKE_NODE_IP"
NODE_IPS = "FLEETLIKE_NODE_IPS"
MASTER_ADDR = "FLEETLIKE_MASTER_ADDR"
MASTER_PORT = "FLEETLIKE_MASTER_PORT"
PROGRESS_DIR = "FLEETLIKE_PROGRESS_DIR"
PROCESS_TAG = "FLEETLIKE_PROCESS_TAG"
MAX_NPROC_PER_NODE = "FLEETLIKE_MAX_NPROC_PER_NODE"
PRELOAD = "FLEETLIKE_PRELOAD"
PRELOAD_SOCKET = "FLEETLIKE_PRELOAD_SOCKET"
RESTART_COUNT = "FLEETLIKE_RESTART_COUNT"
ELASTIC_STORE = "FLEETLIKE_ELASTIC_STORE"
ELASTIC_MIN_WORKERS = "FLEETLIKE_ELASTIC_MIN_WORKERS"
ELASTIC_MAX_WORKERS = "FLEETLIKE_ELASTIC_MAX_WORKERS"
ELASTIC_LAST_CALL = "FLEETLIKE_ELASTIC_LAST_CALL"
ELASTIC_HEARTBEAT_TIMEOUT = "FLEETLIKE_ELASTIC_HEARTBEAT_TIMEOUT"
ELASTIC_RUN_ID = "FLEETLIKE_ELASTIC_RUN_ID"
# the DDP face's knobs
ALLREDUCE_DTYPE = "FLEETLIKE_ALLREDUCE_DTYPE"
ALLREDUCE_MODE = "FLEETLIKE_ALLREDUCE_MODE"
ALLREDUCE_STREAMS = "FLEETLIKE_ALLREDUCE_STREAMS"
FUSION_MB = "FLEETLIKE_FUSION_MB"
GRADIENT_SCALE = "FLEETLIKE_GRADIENT_SCALE"
ACCUMULATE_N_STEPS = "FLEETLIKE_ACCUMULATE_N_STEPS"
NAN_CHECK = "FLEETLIKE_NAN_CHECK"
PERF_CHECK_N_STEPS = "FLEETLIKE_PERF_CHECK_N_STEPS"
DOWNSAMPLE_N_ELEMENTS = "FLEETLIKE_DOWNSAMPLE_N_ELEMENTS"
# the online tuner (every face)
AUTOTUNE = "FLEETLIKE_AUTOTUNE"
AUTOTUNE_LOG = "FLEETLIKE_AUTOTUNE_LOG"

# ------------------------------------------------------- Paddle's and torchrun's names (written
# by the launcher so both kinds of script meet the same job)
PADDLE_TRAINER_ID = "PADDLE_TRAINER_ID"
PADDLE_TRAINERS_NUM = "PADDLE_TRAINERS_NUM"
PADDLE_TRAINER_ENDPOINTS = "PADDLE_TRAINER_ENDPOINTS"
PADDLE_CURRENT_ENDPOINT = "PADDLE_CURRENT_ENDPOINT"
PADDLE_NODE_NUM = "PADDLE_NODE_NUM"
SELECTED_GPUS = "FLAGS_selected_gpus"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
TORCH_MASTER_ADDR = "MASTER_ADDR"
TORCH_MASTER_PORT = "MASTER_PORT"
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
GLIBC_TUNABLES = "GLIBC_TUNABLES"
PYTHONPATH = "PYTHONPATH"

_LAUNCH = "launch.env"
_ROLES = "roles"
_KNOBS = "ddp.knobs (fleetlike.auto)"

#: the DDP face's knobs: each one sets `DistributedStrategy` fields (`fleetlike.ddp.knobs.KNOBS`
#: holds the values and the fields)
_KNOB_MEANINGS = (
    (ALLREDUCE_DTYPE, "fp32, fp16, bf16 or mixed: the gradients' dtype on the wire"),
    (ALLREDUCE_MODE, "flat, hierarchical or auto: one ring, or two levels by node"),
    (ALLREDUCE_STREAMS, "communicators used in turn (nccl_comm_num)"),
    (FUSION_MB, "DDP's bucket_cap_mb / fuse_grad_size_in_MB"),
    (GRADIENT_SCALE, "scale around a 16-bit gradient cast"),
    (ACCUMULATE_N_STEPS, "communicate every k-th backward (gradient_merge)"),
    (NAN_CHECK, "1: check averaged buckets for NaN/Inf (check_nan_inf)"),
    (PERF_CHECK_N_STEPS, "slow-rank report every N steps (slow_rank_check)"),
    (DOWNSAMPLE_N_ELEMENTS, "gossip: average every n-th element per step"),
)
#: the names of the DDP knobs, in `fleetlike.ddp.knobs.KNOBS` order
KNOB_NAMES: tuple[str, ...] = tuple(name for name, _ in _KNOB_MEANINGS)

ENV_VARS: tuple[EnvVar, ...] = (
    # process-wide settings
    EnvVar(STRATEGY, "user", "roles.settings, ddp.knobs, horovod",
           "JSON text or a JSON file's path applied over the script's DistributedStrategy"),
    EnvVar(BACKEND, "user", "roles.settings", "force a backend: gloo, mpi, nccl or single"),
    EnvVar(CHECK_COLLECTIVES, "user", "roles.settings", "1: check that every rank issues the same collectives"),
    EnvVar(DIVERGENCE_CHECK_N_STEPS, "user", "roles.settings",
           "steps between two parameter checksums across ranks (0: only after the starting broadcast)"),
    EnvVar(ACCELERATE_DDP, "launch.env (--accelerate_ddp)", "_site.sitecustomize",
           "1: every worker imports fleetlike.auto before the script"),
    EnvVar(ACCELERATE_HOROVOD, "launch.env (--accelerate_horovod)", "_site.sitecustomize",
           "1: `import horovod.torch` in a worker imports fleetlike.horovod"),
    *(EnvVar(name, "user", _KNOBS, meaning) for name, meaning in _KNOB_MEANINGS),
    EnvVar(AUTOTUNE, "user", "tune.request (every face)",
           "1: strategy.auto_tune, the online tuner of the gradient communication"),
    EnvVar(AUTOTUNE_LOG, "user", "tune.request", "the tuner's trial log (csv, Horovod's autotune columns first), rank 0"),
    # the job
    EnvVar(JOB_ID, "launch.env, launch.hostrun (-np/-H)", "roles, launch.config", "the job's id (--job_id)"),
    EnvVar(JOB_SECRET, "launch.env, user", "comm.secret, launch.config",
           "the job's secret: the rendezvous admits only processes holding it"),
    EnvVar(SECRET_DIR, "user", "comm.secret", "where rank 0 hands a made-up secret to local ranks (0700)"),
    EnvVar(STORE_SERVER, "user", "comm.rendezvous",
           "the hosted store's server: 'bounded' (default, fleetlike's, with limits) or 'torch' (torch's own)"),
    EnvVar(FILE_CACHE_DIR, "user", "io.file_cache", "where get_file's disk cache of a dataset's files_path_list lives"),
    EnvVar(NODE_IP, "launch.env, launch.hostrun (-np/-H)", "roles.mpi, elastic.membership", "this node's address"),
    EnvVar(NODE_IPS, "launch.hostrun (-np/-H)", "roles", "every node's address, in node order"),
    EnvVar(MASTER_ADDR, "launch.hostrun (-np/-H) or user", "roles", "the rendezvous host (before MASTER_ADDR)"),
    EnvVar(MASTER_PORT, "launch.hostrun (-np/-H) or user", "roles", "port of local rank 0 (before MASTER_PORT)"),
    # restarts and elastic jobs
    EnvVar(PRELOAD, "user, tests", "launch.config", "--preload's default: torch forks workers from a preloaded interpreter, off starts each plainly"),
    EnvVar(PRELOAD_SOCKET, "user, testing", "launch.preload", "a shared preload server's unix socket (same user, mode 0600)"),
    EnvVar(MAX_NPROC_PER_NODE, "user", "launch.checks",
           "the most workers one node starts (default: 4 per usable CPU, at least 8; GPU jobs: the GPUs)"),
    EnvVar(PROCESS_TAG, "launch.workers", "launch.family",
           "a random value per worker start: the launcher stops every process carrying it (setsid children too)"),
    EnvVar(PROGRESS_DIR, "launch.elastic_agent", "elastic.state", "where a worker marks its first progress"),
    EnvVar(RESTART_COUNT, "launch.elastic_agent", "user", "the worker's generation (0 at the first start)"),
    EnvVar(ELASTIC_STORE, "launch.elastic_agent", "elastic.membership", "host:port of the elastic rendezvous store"),
    EnvVar(ELASTIC_MIN_WORKERS, "launch.elastic_agent", "elastic.membership", "MIN nodes x nproc_per_node"),
    EnvVar(ELASTIC_MAX_WORKERS, "launch.elastic_agent", "elastic.membership", "MAX nodes x nproc_per_node"),
    EnvVar(ELASTIC_LAST_CALL, "launch.elastic_agent", "elastic.membership",
           "seconds a round waits for more workers after MIN"),
    EnvVar(ELASTIC_RUN_ID, "launch.elastic_agent", "elastic.membership", "the elastic job's id"),
    EnvVar(ELASTIC_HEARTBEAT_TIMEOUT, "launch.elastic_agent", "elastic.membership",
           "seconds of silent heartbeats after which a worker counts as gone (--heartbeat_timeout)"),
    # Paddle's names
    EnvVar(PADDLE_TRAINER_ID, _LAUNCH, _ROLES, "global rank"),
    EnvVar(PADDLE_TRAINERS_NUM, _LAUNCH, _ROLES, "world size"),
    EnvVar(PADDLE_TRAINER_ENDPOINTS, _LAUNCH, _ROLES, "every rank's ip:port, in rank order"),
    EnvVar(PADDLE_CURRENT_ENDPOINT, _LAUNCH, _ROLES, "this worker's ip:port"),
    EnvVar(PADDLE_NODE_NUM, _LAUNCH, "user scripts (Paddle's name)", "number of nodes"),
    EnvVar(SELECTED_GPUS, _LAUNCH, _ROLES, "this worker's GPU id ('' on CPU)"),
    # torchrun's names
    EnvVar(RANK, f"{_LAUNCH}, torchrun", _ROLES, "global rank"),
    EnvVar(WORLD_SIZE, f"{_LAUNCH}, torchrun", _ROLES, "world size"),
    EnvVar(LOCAL_RANK, f"{_LAUNCH}, torchrun", _ROLES, "position on this node"),
    EnvVar(LOCAL_WORLD_SIZE, f"{_LAUNCH}, torchrun", _ROLES, "ranks on this node"),
    EnvVar(GROUP_RANK, f"{_LAUNCH}, torchrun", _ROLES, "node index"),
    EnvVar(TORCH_MASTER_ADDR, f"{_LAUNCH}, torchrun", f"{_ROLES}, torch", "rank 0's address"),
    EnvVar(TORCH_MASTER_PORT, f"{_LAUNCH}, torchrun", f"{_ROLES}, torch", "torch's env:// store port"),
    EnvVar(AGENT_STORE, f"{_LAUNCH} (--started_port=auto), torchrun", f"{_ROLES}, torch",
           "True: the launcher hosts the store at MASTER_ADDR:MASTER_PORT"),
    EnvVar(TORCHELASTIC_RESTART_COUNT, "launch.elastic_agent, torchrun", f"{_ROLES} (Role.generation), user",
           "the worker's generation"),
    EnvVar(TORCHELASTIC_MAX_RESTARTS, "launch.elastic_agent, torchrun", "user", "--max_restarts"),
    EnvVar(TORCHELASTIC_RUN_ID, "torchrun", _ROLES, "torchrun's job id"),
    EnvVar(OMP_NUM_THREADS, f"{_LAUNCH} (1 where unset, several workers), user", "torch",
           "threads per worker"),
    EnvVar(CUDA_VISIBLE_DEVICES, f"{_LAUNCH} (GPU runs: kept in order), user", "roles.settings",
           "the GPUs a worker sees; set: it trains on a GPU even without FLAGS_selected_gpus"),
    EnvVar(GLIBC_TUNABLES, f"{_LAUNCH} (--malloc_tuning on)", "glibc", "the malloc tunables (tcache off)"),
    EnvVar(PYTHONPATH, f"{_LAUNCH} (--accelerate_ddp, --accelerate_horovod)", "python", "the folder whose sitecustomize imports fleetlike.auto (or maps horovod.torch), first"),
    # test helpers' own variables, recognised so fleetlike.auto does not call them misspelt knobs
    EnvVar("FLEETLIKE_NCCL_BENCH", "tests", "tests", "file for the NCCL overhead figures"),
    EnvVar("FLEETLIKE_TEST_MARKER", "tests", "tests", "a variable the launcher must pass through"),
)

#: name -> its entry
BY_NAME: dict[str, EnvVar] = {v.name: v for v in ENV_VARS}
if len(BY_NAME) != len(ENV_VARS):  # pragma: no cover - a duplicated row is a typo in this file
    raise AssertionError("a variable is listed twice in ENV_VARS")


def fleetlike_names() -> frozenset[str]:
    """Every ``FLEETLIKE_*`` name of the table."""
    return frozenset(n for n in BY_NAME if n.startswith("FLEETLIKE_"))


def by_writer(word: str) -> tuple[str, ...]:
    """The names whose writer mentions ``word`` (``"launch.env"``, ``"elastic_agent"``, ...)."""
    return tuple(v.name for v in ENV_VARS if word in v.writer)


def table() -> str:
    """The table as reStructuredText-like text, for docs and ``python -m``."""
    width = max(len(v.name) for v in ENV_VARS) + 2
    lines = [f"{'variable':<{width}}{'writer':<48}{'reader':<36}meaning"]
    for v in ENV_VARS:
        lines.append(f"{v.name:<{width}}{v.writer:<48}{v.reader:<36}{v.meaning}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    print(table())

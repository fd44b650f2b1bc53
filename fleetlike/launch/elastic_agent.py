"""``--max_restarts N``: restart the local workers after a failure, as torchrun's agent does.

A worker that fails ends its start ("generation"): every local worker is stopped, and unless
the failure is final the workers start again as generation ``g + 1``, which is a new rendezvous:
the job id the workers see is ``<job_id>-g<g>`` (so no key of the failed generation's store can
answer the new one; with ``--started_port=auto`` the store the launcher hosts is re-labelled
for it), their logs go to ``<log_dir>/restart<g>/`` and they are told their generation
(``FLEETLIKE_RESTART_COUNT``, and torchrun's ``TORCHELASTIC_RESTART_COUNT`` /
``TORCHELASTIC_MAX_RESTARTS``). Resuming is the script's part: it loads its last checkpoint
(``fleet.load_persistables``, the resumable sampler's state, or `fleetlike.elastic`'s on-disk
commit).

A failure is final when:

- it is the ``N + 1``-th (``--max_restarts`` exhausted), or
- it is not retryable: two starts in a row failed before any worker reported progress, with the
  same last line in the failing worker's log (an exception at step 0, say). Progress is a marker
  file a worker writes under ``FLEETLIKE_PROGRESS_DIR`` at its first ``State.commit()``
  (`fleetlike.elastic`) or by calling ``fleetlike.elastic.mark_progress()`` itself; restarting
  a script that fails identically before doing any work would only repeat the failure N times.

In an elastic job (``--nnodes MIN:MAX``) the workers re-form their world in place, so a failed
worker is started again alone (`_elastic_job`) and joins at the next commit; the budget counts
worker failures only: nodes lost or joining use none of it (torchrun's accounting).

The final line is a ``summary:`` of the worker failures (and restarts used) and, in an elastic
job, of the nodes lost and joined with the reason (`fleetlike.launch.nodewatch`); the exit code
is the last failed worker's, as without restarts.

Example::

    python -m fleetlike.launch --nproc_per_node=4 --max_restarts=3 train.py
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

from fleetlike.comm import host_store
from fleetlike.config import envvars
from fleetlike.comm import job_store
from fleetlike.comm import JobSecret
from fleetlike.launch.config import LaunchConfig
from fleetlike.launch.flags import LaunchInputError
from fleetlike.launch.discovery import HostDiscovery
from fleetlike.launch.nodewatch import NodeWatch
from fleetlike.launch.remote import agent_grace
from fleetlike.launch.workers import Worker, describe_exit, last_line
from fleetlike.roles import parse_endpoint

__all__ = [
    "ELASTIC_ENV", "HEARTBEAT_ENV", "PROGRESS_DIR_VAR", "RESTART_COUNT_VAR", "Attempt", "elastic_env", "generation_config",
    "host_rendezvous", "restart_loop",
]

#: The directory where a worker marks its first progress (read by `restart_loop`); the same
#: name is read by ``fleetlike.elastic.mark_progress`` (a test checks the two agree).
PROGRESS_DIR_VAR = envvars.PROGRESS_DIR
#: The worker's generation (0 for the first start).
RESTART_COUNT_VAR = envvars.RESTART_COUNT

#: What an elastic job's workers are told (``--nnodes``); the same names as
#: ``fleetlike.elastic.membership.ENV``, which reads them (a test checks the two agree).
ELASTIC_ENV = {
    "store": envvars.ELASTIC_STORE,
    "min": envvars.ELASTIC_MIN_WORKERS,
    "max": envvars.ELASTIC_MAX_WORKERS,
    "last_call": envvars.ELASTIC_LAST_CALL,
    "run_id": envvars.ELASTIC_RUN_ID,
}
#: ``--heartbeat_timeout`` for the workers (optional for them: ``fleetlike.elastic.membership``
#: reads it as ``HEARTBEAT_ENV``, with the same default)
HEARTBEAT_ENV = envvars.ELASTIC_HEARTBEAT_TIMEOUT

_PREFIX = "fleetlike.launch:"

RunOnce = Callable[..., int]


@dataclasses.dataclass(frozen=True)
class Attempt:
    """How one start (generation) ended."""

    generation: int
    code: int
    rank: int | None
    how: str
    last_line: str
    progressed: bool
    who: str = ""

    def same_failure(self, other: Attempt) -> bool:
        """The same rank failing the same way with the same last words, both before progress."""
        return (not self.progressed and not other.progressed and self.code == other.code
                and self.last_line == other.last_line)


def generation_config(config: LaunchConfig, generation: int) -> LaunchConfig:
    """The config of start ``generation``: its own job id and (after the first) log folder."""
    if generation == 0:
        return dataclasses.replace(config, job_id=f"{config.job_id}-g0")
    logs = os.path.join(config.log_dir, f"restart{generation}")
    return dataclasses.replace(config, job_id=f"{config.job_id}-g{generation}", log_dir=logs)


def elastic_env(config: LaunchConfig) -> dict[str, str]:
    """The variables an elastic job's workers read (`ELASTIC_ENV`); empty for other jobs."""
    if not config.min_nodes:
        return {}
    return {
        ELASTIC_ENV["store"]: str(config.rdzv_endpoint),
        ELASTIC_ENV["min"]: str(config.min_nodes * config.nproc_per_node),
        ELASTIC_ENV["max"]: str(config.max_nodes * config.nproc_per_node),
        ELASTIC_ENV["last_call"]: f"{config.rdzv_last_call:g}",
        ELASTIC_ENV["run_id"]: config.job_id,
        HEARTBEAT_ENV: f"{config.heartbeat_timeout:g}",
    }


def host_rendezvous(config: LaunchConfig) -> Any | None:
    """The elastic job's rendezvous store, when this launcher's node is ``--rdzv_endpoint``'s
    host (held for the launcher's life: the job ends with it, as with torchrun's c10d backend);
    None on the other nodes."""
    if not config.min_nodes or config.rdzv_endpoint is None:
        return None
    try:
        host, port = parse_endpoint(config.rdzv_endpoint, name="--rdzv_endpoint")
    except ValueError as exc:
        raise LaunchInputError(str(exc)) from None
    if host != config.node_ip:
        return None
    try:
        return host_store(host, config.job_id, port=port, secret=JobSecret(config.job_secret))
    except Exception as exc:  # noqa: BLE001 - torch raises several types for bind errors
        raise LaunchInputError(
            f"--rdzv_endpoint={config.rdzv_endpoint}: cannot host the rendezvous store there "
            f"({exc}); choose a free port on this node") from None


def _progress_dir(config: LaunchConfig, generation: int) -> str:
    return os.path.join(config.log_dir, ".progress", f"g{generation}")


def _progressed(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def restart_loop(config: LaunchConfig, stop: Any, run_once: RunOnce, store: Any | None) -> int:
    """Run ``config``'s workers, restarting failed ones, until they succeed or a failure is final.

    ``run_once(config, stop, extra_env, failed_out, replace)`` is the launcher's own
    start-watch-stop (`fleetlike.launch.main`); ``store`` the store the launcher hosts
    (``--started_port=auto``) or None. ``stop`` is the launcher's signal record: a signal ends
    the loop at once. Without ``--nnodes`` a failure restarts every local worker as a new
    generation; with it, only the failed worker is started again (`_elastic_job`). With
    ``--host_discovery_script`` the hosts it finds are started meanwhile
    (`fleetlike.launch.discovery`) and stopped with the job. The last line is the summary:
    the worker failures, and (elastic jobs) the nodes lost and joined (`NodeWatch`)."""
    rendezvous = host_rendezvous(config)
    watch = (NodeWatch(str(config.rdzv_endpoint), config.node_ip, store=rendezvous,
                       secret=JobSecret(config.job_secret)) if config.min_nodes else None)
    discovery = HostDiscovery(config) if config.host_discovery_script is not None else None
    if discovery is not None:  # after the store is up: the nodes it starts meet there
        discovery.check()  # a bad script raises here, before any thread of the job has started
    if watch is not None:
        watch.start()
    if discovery is not None:
        discovery.start()
    code = 1
    attempts: list[Attempt] = []
    try:
        if config.min_nodes:
            code = _elastic_job(config, stop, run_once, attempts)
        else:
            code = _generations(config, stop, run_once, store, attempts)
        return code
    finally:
        if discovery is not None:  # a job that succeeded ends on every node by itself
            discovery.close(wait=agent_grace(config.kill_grace) if code == 0 else 0)
        if watch is not None:
            watch.finish(code)
        if stop.signum is None:
            _say(_summary(config, code, attempts, watch))


def _summary(config: LaunchConfig, code: int, attempts: list[Attempt], watch: NodeWatch | None) -> str:
    """``summary: job succeeded; worker failures: ...; nodes lost: ...; nodes joined: ...``."""
    head = "job succeeded" if code == 0 else f"job ended with code {code}"
    restarted = len(attempts) if code == 0 else len(attempts) - 1
    failures = ", ".join(
        f"{a.who} {a.how} at start {a.generation + 1}" if not config.min_nodes else f"{a.who} {a.how}"
        for a in attempts)
    if attempts:
        failures += f"; restarted {max(restarted, 0)}/{config.max_restarts}"
    nodes = f"; {watch.summary()}" if watch is not None else ""
    return f"summary: {head}; worker failures: {failures or '-'}{nodes}"


def _elastic_job(config: LaunchConfig, stop: Any, run_once: RunOnce, attempts: list[Attempt]) -> int:
    """``--nnodes MIN:MAX``: the workers re-form their world by themselves when a peer goes, so a
    failed worker is started again alone (its local peers and the other nodes keep running); it
    rejoins the rendezvous and is admitted at the next commit, as a joining node is. Each such
    restart uses one of ``--max_restarts``; nodes lost or joining use none (they are no failure
    of this launcher's workers). Past the budget, or for a failure that is not retryable, every
    local worker is stopped and the launcher ends with the failed worker's code."""
    gen = generation_config(config, 0)
    progress = _progress_dir(config, 0)
    shutil.rmtree(progress, ignore_errors=True)
    os.makedirs(progress)
    base = {**elastic_env(config), **_restart_env(config, 0), PROGRESS_DIR_VAR: os.path.abspath(progress)}

    def replace(failed: Worker, respawn: Callable[[int, str, dict[str, str]], Worker]) -> Worker | None:
        attempt = Attempt(len(attempts), failed.process.returncode, failed.rank,
                          describe_exit(failed.process.returncode), last_line(failed.log_path),
                          os.path.exists(os.path.join(progress, f"pid{failed.process.pid}")),
                          f"local rank {failed.local_rank}")
        attempts.append(attempt)
        if len(attempts) >= 2 and attempt.same_failure(attempts[-2]):
            _say(f"not retryable: two workers failed the same way before reporting progress (no "
                 f"State.commit() / mark_progress()): {attempt.how}; last line: "
                 f"{attempt.last_line or '-'}; stopping the local workers")
            return None
        if len(attempts) > config.max_restarts:
            if config.max_restarts:
                _say(f"--max_restarts={config.max_restarts} exhausted: {len(attempts)} worker failures "
                     f"({'; '.join(f'{a.who} {a.how}' for a in attempts)}); the job is stopped on this node")
            return None
        n = len(attempts)
        logs = os.path.join(config.log_dir, f"restart{n}")
        os.makedirs(logs, exist_ok=True)
        log_path = os.path.join(logs, os.path.basename(config.log_path(failed.local_rank)))
        _say(f"worker failure: {attempt.who} {attempt.how}; starting it again alone (restart {n} of "
             f"--max_restarts={config.max_restarts}; it rejoins at the next commit; log: {log_path})")
        try:
            return respawn(failed.local_rank, log_path, {**base, **_restart_env(config, n)})
        except OSError as exc:
            _say(f"cannot start {attempt.who} again: {exc}")
            return None

    return run_once(gen, stop, base, [], replace)


def _restart_env(config: LaunchConfig, generation: int) -> dict[str, str]:
    return {RESTART_COUNT_VAR: str(generation), envvars.TORCHELASTIC_RESTART_COUNT: str(generation),
            envvars.TORCHELASTIC_MAX_RESTARTS: str(config.max_restarts)}


def _generations(config: LaunchConfig, stop: Any, run_once: RunOnce, store: Any | None,
                 attempts: list[Attempt]) -> int:
    for generation in range(config.max_restarts + 1):
        gen = generation_config(config, generation)
        os.makedirs(gen.log_dir, exist_ok=True)
        progress = _progress_dir(config, generation)
        shutil.rmtree(progress, ignore_errors=True)
        os.makedirs(progress)
        if store is not None:
            job_store(store, JobSecret(config.job_secret)).set("job_id", gen.job_id)  # its workers check it
        env = {**_restart_env(config, generation), PROGRESS_DIR_VAR: os.path.abspath(progress)}
        failed: list[Worker] = []
        code = run_once(gen, stop, env, failed)
        if stop.signum is not None or code == 0 or not failed:
            if code == 0 and attempts:
                _say(f"job succeeded at start {generation + 1} after {len(attempts)} worker "
                     f"failure(s) ({_history(attempts)})")
            return code
        worker = failed[0]
        attempt = Attempt(generation, code, worker.rank, describe_exit(worker.process.returncode),
                          last_line(worker.log_path), _progressed(progress), f"rank {worker.rank}")
        attempts.append(attempt)
        if len(attempts) >= 2 and attempt.same_failure(attempts[-2]):
            _say(
                f"not retryable: starts {generation} and {generation + 1} both failed before any "
                f"worker reported progress (no State.commit() / mark_progress()), rank "
                f"{attempt.rank} the same way ({attempt.how}; last line: {attempt.last_line or '-'}); "
                f"stopping after {len(attempts)} worker failure(s) ({_history(attempts)})"
            )
            return code
        if generation == config.max_restarts:
            break
        _say(f"worker failure at start {generation + 1} (rank {attempt.rank} {attempt.how}); "
             f"restarting all {config.nproc_per_node} workers as generation {generation + 1} "
             f"(restart {generation + 1} of --max_restarts={config.max_restarts}; logs in "
             f"{generation_config(config, generation + 1).log_dir})")
    last = attempts[-1]
    if not config.max_restarts:
        return last.code  # the launcher's own line named the failure; nothing was restarted
    _say(f"--max_restarts={config.max_restarts} exhausted: {len(attempts)} worker failures "
         f"({_history(attempts)}); the job is stopped")
    return last.code


def _history(attempts: list[Attempt]) -> str:
    return "; ".join(f"start {a.generation + 1}: {a.who} {a.how}" for a in attempts)


def _say(text: str) -> None:
    print(f"{_PREFIX} {text}", file=sys.stderr, flush=True)

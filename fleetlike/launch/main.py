"""``python -m fleetlike.launch``: parse, check, start, watch, stop.

Shaped like torchrun's agent, reduced to one node's worth of work: each node runs its own
launcher, which owns only its local workers. The first local worker to fail (non-zero exit or a
signal) ends the local job: the others are stopped with their children, one summary line names
the rank, how it ended and its log, and the launcher returns non-zero. Workers on other nodes
then lose their peers and fail, which ends their launchers the same way.

Exit codes: 0 all workers succeeded; 2 bad input (nothing was started); the failed worker's exit
code, or 128 + signal number when it was killed; 128 + signal number when the launcher itself
was stopped by SIGINT/SIGTERM; 1 when a worker could not be started, or when the launchers of a
several-node ``--started_port=auto`` job did not meet (`fleetlike.launch.meeting`).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from fleetlike.launch.checks import check_machine, check_worker_count, cuda_device_count, host_ports
from fleetlike.launch.config import LaunchConfig, format_config, open_job_warning, parse_config
from fleetlike.launch.elastic_agent import restart_loop
from fleetlike.launch.homesecret import forget, settle
from fleetlike.launch.env import omp_note, worker_env
from fleetlike.launch.flags import LaunchInputError, _HelpExit
from fleetlike.launch.meeting import MeetingError, meet
from fleetlike.launch.ports import HostedEndpoints
from fleetlike.launch.stop import SignalFlag
from fleetlike.launch.torch_flags import NodeMeetingError, TorchNodes, meet_nodes
from fleetlike.launch.workers import (
    Worker,
    close_logs,
    describe_exit,
    last_line,
    log_problem,
    start_worker,
    stop_workers,
)

__all__ = ["launch", "main", "worker_command"]

_POLL_SECONDS = 0.1

#: ``replace(failed_worker, respawn)`` of an elastic job (`fleetlike.launch.elastic_agent`).
Replace = Callable[[Worker, Callable[[int, str, dict[str, str]], Worker]], "Worker | None"]
_PREFIX = "fleetlike.launch:"


def worker_command(config: LaunchConfig) -> list[str]:
    """``python -u script args...`` (or ``python -u -m module args...``) with this interpreter."""
    head = [sys.executable, "-u"] + (["-m"] if config.module else [])
    return head + [config.training_script, *config.training_script_args]


class _StopRequest:
    """Records SIGINT/SIGTERM sent to the launcher so the watch loop can end the job."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.event = SignalFlag()
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


def _first_failure(workers: Sequence[Worker]) -> tuple[Worker | None, bool]:
    """(the first worker found failed, whether every worker has exited)."""
    all_done = True
    for worker in workers:
        code = worker.process.poll()
        if code is None:
            all_done = False
        elif code != 0:
            return worker, False
    return None, all_done


def _greets_before_workers(config: LaunchConfig) -> bool:
    """Several fixed-port nodes sharing their secret through the private folder (`settle`)."""
    return (config.secret_at_home and not config.min_nodes and config.static_nodes is None
            and config.node_num > 1 and not config.meets_through_file)


def launch(config: LaunchConfig, *, visible_gpus: int | None = None) -> int:
    """Run the job described by ``config`` on this node and return the launcher's exit code."""
    check_worker_count(config)  # before binding a port per worker
    hosted: HostedEndpoints | None = None
    if config.auto_ports:
        # held until every worker is gone, so no other process can take the ports meanwhile
        config, hosted = host_ports(config)
    stop = _StopRequest()
    stop.install()
    try:
        check_machine(config, visible_gpus=visible_gpus)
        config = settle(config, stop.event)
        if _greets_before_workers(config):
            # Paddle's fixed-port form without an exported secret: the other nodes take the secret
            # from node 0's greeting, which must not wait for a worker script that may never host
            # fleetlike's store (a plain torch DDP script), so node 0's launcher greets at rank 0's
            # endpoint until every node has met, then frees the port for rank 0
            host, port = config.master_endpoint.rsplit(":", 1)
            paddle = TorchNodes(nnodes=config.node_num, node_rank=config.node_index, master_addr=host,
                                master_port=int(port), node_ip=config.node_ip, ips=config.cluster_node_ips,
                                started_port=config.started_port)
            try:
                meet_nodes(paddle, config.nproc_per_node, config.job_secret, config.job_id,
                           config.rendezvous_timeout, stop.event)
            except NodeMeetingError as exc:
                print(f"{_PREFIX} {exc}", file=sys.stderr, flush=True)
                return 128 + stop.signum if stop.signum is not None else 1
        if config.static_nodes is not None and config.static_nodes.pending:
            try:  # torch's static form: learn the other nodes' addresses (`fleetlike.launch.torch_flags`)
                ips = meet_nodes(config.static_nodes, config.nproc_per_node, config.job_secret, config.job_id,
                                 config.rendezvous_timeout, stop.event)
            except NodeMeetingError as exc:
                print(f"{_PREFIX} {exc}", file=sys.stderr, flush=True)
                return 128 + stop.signum if stop.signum is not None else 1
            config = dataclasses.replace(config, cluster_node_ips=ips,
                                         static_nodes=dataclasses.replace(config.static_nodes, ips=ips, met=True))
        if config.meets_through_file and hosted is not None:
            try:
                config = meet(config, hosted, stop=stop.event)
            except MeetingError as exc:
                if stop.signum is not None:
                    print(f"{_PREFIX} received {signal.Signals(stop.signum).name}; stopped while "
                          "waiting for the other nodes; no worker was started",
                          file=sys.stderr, flush=True)
                    return 128 + stop.signum
                print(f"{_PREFIX} {exc}", file=sys.stderr, flush=True)
                return 1
        if config.max_restarts or config.min_nodes:
            return restart_loop(config, stop, _run, hosted.store if hosted is not None else None)
        return _run(config, stop)
    finally:
        stop.restore()
        forget(config)
        if hosted is not None:
            hosted.close()


def _run(config: LaunchConfig, stop: _StopRequest, extra_env: dict[str, str] | None = None,
         failed_out: list[Worker] | None = None, replace: Replace | None = None) -> int:
    """Start, watch and stop the workers of a checked ``config`` whose ports are settled.

    ``extra_env`` is added to every worker's environment; ``failed_out`` receives the failed
    worker (`fleetlike.launch.elastic_agent` restarts after it). ``replace(failed, respawn)``,
    given for an elastic job, may start the failed worker again alone (``respawn(local_rank,
    log_path, env)``) instead of ending the local job; it returns the new worker or None."""
    if config.print_config:
        print(format_config(config), flush=True)
    for note in (open_job_warning(config), omp_note(config)):
        if note is not None:
            print(f"{_PREFIX} {note}", file=sys.stderr, flush=True)
    workers: list[Worker] = []
    command = worker_command(config)

    def respawn(local: int, log_path: str, env: dict[str, str]) -> Worker:
        return start_worker(command, {**worker_env(config, local), **(extra_env or {}), **env},
                            local_rank=local, rank=config.rank(local), log_path=log_path,
                            echo=local == 0, preload=config.preload)

    try:
        for local in range(config.nproc_per_node):
            try:
                workers.append(respawn(local, config.log_path(local), {}))
            except OSError as exc:
                print(f"{_PREFIX} cannot start rank {config.rank(local)}: {exc}", file=sys.stderr)
                stop_workers(workers, grace=config.kill_grace)
                return 1
        while True:
            if stop.signum is not None:
                return _stopped_by_signal(workers, config, stop.signum)
            unlogged = next((w for w in workers if w.log_error is not None), None)
            if unlogged is not None:
                print(f"{_PREFIX} rank {unlogged.rank}'s log file {unlogged.log_path} cannot be written "
                      f"({unlogged.log_error}); stopping the job (free space there, or give another "
                      "--log_dir)", file=sys.stderr, flush=True)
                stop_workers(workers, grace=config.kill_grace)
                if failed_out is not None:
                    failed_out.append(unlogged)
                return 1
            failed, all_done = _first_failure(workers)
            if failed is not None:
                stop_workers([failed], grace=config.kill_grace)  # its children, and its log
                code = failed.process.returncode
                unwritable = log_problem(failed.log_path) if code > 0 else None
                said = "" if unwritable else last_line(failed.log_path)
                print(
                    f"{_PREFIX} rank {failed.rank} (local {failed.local_rank}) "
                    f"{describe_exit(code)}; log: {failed.log_path}"
                    + (f"; last line: {said}" if said else "")
                    + (f" (cannot be written: {unwritable}; free space there, or give another "
                       "--log_dir)" if unwritable else ""),
                    file=sys.stderr,
                    flush=True,
                )
                if unwritable:
                    stop_workers(workers, grace=config.kill_grace)
                    close_logs(workers)
                    if failed_out is not None:
                        failed_out.append(failed)
                    return code
                again = replace(failed, respawn) if replace is not None else None
                if again is not None:
                    workers[workers.index(failed)] = again
                    continue
                stop_workers(workers, grace=config.kill_grace)
                close_logs(workers)
                if failed_out is not None:
                    failed_out.append(failed)
                return code if code > 0 else 128 - code
            if all_done:
                # children the workers left behind do not outlive the job
                stop_workers(workers, grace=config.kill_grace)
                return 0
            stop.event.wait(_POLL_SECONDS)
    finally:
        # still under our handlers, so a second Ctrl-C cannot interrupt the clean-up
        if any(w.process.poll() is None for w in workers):
            stop_workers(workers, grace=config.kill_grace)
        close_logs(workers)


def _stopped_by_signal(workers: list[Worker], config: LaunchConfig, signum: int) -> int:
    name = signal.Signals(signum).name
    stop_workers(workers, grace=config.kill_grace, first_signal=signum)
    print(
        f"{_PREFIX} received {name}; stopped all {len(workers)} local workers",
        file=sys.stderr,
        flush=True,
    )
    return 128 + signum


def main(
    argv: Sequence[str] | None = None, *, device_count: Callable[[], int] | None = None
) -> int:
    """Entry point of ``python -m fleetlike.launch``; returns the exit code (never exits).

    ``device_count`` (default: torch.cuda.device_count) is injectable for tests.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    count = device_count or cuda_device_count
    try:
        config = parse_config(args, device_count=count)
        return launch(config, visible_gpus=count() if config.selected_gpus else None)
    except _HelpExit as done:
        return done.status
    except LaunchInputError as exc:
        print(f"{_PREFIX} error: {exc}", file=sys.stderr, flush=True)
        return 2

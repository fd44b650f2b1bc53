"""Who is in the job now: torch.distributed.elastic's dynamic rendezvous, one participant per worker.

The launcher (``--nnodes MIN:MAX --rdzv_endpoint HOST:PORT``) hosts a TCP store at the endpoint
(on the node whose IP it is) and tells its workers where it is (`ENV`). Each worker is one
participant of torch's ``DynamicRendezvousHandler`` over the c10d backend on that store: the
same engine and state format as ``torchrun --rdzv_backend=c10d``, reused as it is, for what it
does well: rounds, a minimum and maximum membership, a last call before a round closes with
fewer than the maximum, a wait list for late joiners, and heartbeats that drop a participant
whose process (or node) is gone. What torch's agent would do next (stop and restart every
worker) is what fleetlike does *not* do: `fleetlike.elastic.run` keeps the surviving processes
and only builds a new world (a gloo communicator on the round's store) for the new round.

Only holders of the job's secret take part (`fleetlike.comm.secret`): the store's greeting must
verify with it before anything else, and torch's rendezvous state and every key of the rounds
live under the secret's prefix, which nobody without it can find. A worker's place in a round is
the seat torch's rendezvous assigned it; each seat's description (node IP, local rank, pid,
endpoint) carries an HMAC of the round's seat number, checked before use. Ranks of a round are
ordered by (node IP, local rank, pid), so a node's ranks are contiguous and the topology
(`Role`) is derived as for a launched job.

Example (what `fleetlike.elastic.init` does)::

    members = Membership.from_env()
    role, world = members.form(timeout=1800.0)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

from fleetlike.comm import Communicator
from fleetlike.config import envvars
from fleetlike.comm.gloo import GlooCommunicator
from fleetlike.comm import JOB_KEY, SecretMismatchError, challenge_of, job_store, knock
from fleetlike.comm import SECRET_ENV, JobSecret, SecretError, secret_from_env, set_current
from fleetlike.roles import Role, parse_endpoint

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "ENV", "EVENTS_KEY", "HEARTBEAT_ENV", "ElasticSettings", "Membership"]

#: What the launcher gives each worker of an elastic job (``--nnodes MIN:MAX``).
ENV = {
    "store": envvars.ELASTIC_STORE,          # host:port of the rendezvous store
    "min": envvars.ELASTIC_MIN_WORKERS,      # MIN nodes * nproc_per_node
    "max": envvars.ELASTIC_MAX_WORKERS,      # MAX nodes * nproc_per_node
    "last_call": envvars.ELASTIC_LAST_CALL,  # seconds a round waits for more after MIN
    "run_id": envvars.ELASTIC_RUN_ID,        # the job id
}

#: Where rank 0 of each re-formed world records it (a counter; the records at ``<key>/<n>``) on
#: the rendezvous store, for the launchers' summaries (``fleetlike.launch.nodewatch.EVENTS_KEY``:
#: the same name, a test checks the two agree).
EVENTS_KEY = "fleetlike.elastic/events"

#: Seconds of silent heartbeats after which a worker counts as gone (``--heartbeat_timeout``,
#: `HEARTBEAT_ENV`), and how many heartbeats a worker sends in that time.
DEFAULT_HEARTBEAT_TIMEOUT = 3.0
HEARTBEATS_MISSED = 3
#: The launcher's ``--heartbeat_timeout``; optional (a worker without it uses the default).
HEARTBEAT_ENV = envvars.ELASTIC_HEARTBEAT_TIMEOUT


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
    """The launcher's elastic settings as a worker reads them (`from_env`)."""

    store: str
    min_workers: int
    max_workers: int
    last_call: float
    run_id: str
    node_ip: str
    endpoint: str
    local_rank: int
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT

    @property
    def heartbeat_seconds(self) -> float:
        """Seconds between two heartbeats (`HEARTBEATS_MISSED` of them make the timeout)."""
        return self.heartbeat_timeout / HEARTBEATS_MISSED

    @staticmethod
    def launched(environ: Mapping[str, str] | None = None) -> bool:
        """Whether this process was started by an elastic launcher (``--nnodes``)."""
        return bool((os.environ if environ is None else environ).get(ENV["store"]))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ElasticSettings:
        env = os.environ if environ is None else environ
        missing = [name for name in ENV.values() if not env.get(name)]
        if missing:
            raise RuntimeError(
                f"fleetlike.elastic: {', '.join(missing)} not set: this process was not started by "
                "an elastic launcher; run it with python -m fleetlike.launch --nnodes MIN:MAX "
                "--rdzv_endpoint HOST:PORT ..."
            )
        return cls(env[ENV["store"]], int(env[ENV["min"]]), int(env[ENV["max"]]),
                   float(env[ENV["last_call"]]), env[ENV["run_id"]],
                   env.get(envvars.NODE_IP, "127.0.0.1"),
                   env.get(envvars.PADDLE_CURRENT_ENDPOINT, "127.0.0.1:1"), int(env.get(envvars.LOCAL_RANK, "0")),
                   _heartbeat_timeout(env.get(HEARTBEAT_ENV)))


def _heartbeat_timeout(text: str | None) -> float:
    if text is None or not text.strip():
        return DEFAULT_HEARTBEAT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise RuntimeError(f"fleetlike.elastic: {HEARTBEAT_ENV}={text!r} is not a number of seconds > 0; "
                           "the launcher sets it from --heartbeat_timeout (unset it to use the default, "
                           f"{DEFAULT_HEARTBEAT_TIMEOUT:g})")
    return value


def _member_secret(store: dist.Store, settings: ElasticSettings, host: str, port: int,
                   timeout: float) -> JobSecret:
    """The job's secret (`SECRET_ENV`), once the store's greeting proves its host holds it too."""
    try:
        secret = secret_from_env()
    except SecretError as exc:
        raise RuntimeError(f"fleetlike.elastic: {exc}") from None
    if secret is None:
        raise RuntimeError(
            f"fleetlike.elastic: {SECRET_ENV} is not set; an elastic job's workers get the job's "
            "secret from their launcher (python -m fleetlike.launch --nnodes MIN:MAX ...), whose "
            "nodes share it through that variable")
    # the challenge under the secret's prefix is what counts: the public marker only says that
    # some job is hosted there, and a stranger may delete it (that must stall nobody)
    deadline = time.monotonic() + timeout
    while challenge_of(store, secret) is None and not store.check([JOB_KEY]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"fleetlike.elastic: the rendezvous store at {host}:{port} never greeted "
                               f"this worker within {timeout:g}s: no fleetlike job is hosted there")
        time.sleep(0.02)
    if challenge_of(store, secret) is None:
        knock(store, settings.endpoint, settings.node_ip)
        raise SecretMismatchError(
            f"fleetlike.elastic: the rendezvous store at {host}:{port} does not hold this job's "
            f"secret: it belongs to another job, or this worker was given another {SECRET_ENV}; "
            "refusing to join")
    return secret


class Membership:
    """This worker's seat in the rendezvous; `form` joins the next round and builds its world."""

    def __init__(self, settings: ElasticSettings, *, join_timeout: float = 600.0) -> None:
        self.settings = settings
        host, port = parse_endpoint(settings.store, name=ENV["store"])
        self._store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=join_timeout))
        self._secret = _member_secret(self._store, settings, host, port, join_timeout)
        set_current(self._secret)
        self._private = job_store(self._store, self._secret)
        # the round's store is all fleetlike needs: no second TCP store server on rank 0
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        backend = C10dRendezvousBackend(self._private, settings.run_id)
        timeout = RendezvousTimeout(join=datetime.timedelta(seconds=join_timeout),
                                    last_call=datetime.timedelta(seconds=settings.last_call))
        self.handler: RendezvousHandler = DynamicRendezvousHandler.from_backend(
            settings.run_id, self._private, backend, settings.min_workers, settings.max_workers,
            settings.node_ip, timeout, keep_alive_interval=settings.heartbeat_seconds,  # type: ignore[arg-type]
            keep_alive_max_attempt=HEARTBEATS_MISSED)
        self.rounds = 0
        self._watch: Watch | None = None
        #: ``(node IP, endpoint)`` of every rank of the current world, in rank order
        self.members: list[tuple[str, str]] = []

    @classmethod
    def from_env(cls) -> Membership:
        return cls(ElasticSettings.from_env())

    def form(self, timeout: float) -> tuple[Role, Communicator]:
        """Join the next round (blocks until it closes) and build its world communicator."""
        info = self.handler.next_rendezvous()
        self.rounds += 1
        # info.store is the round's own key space (torch prefixes it with the round number),
        # the same for survivors and joiners whatever each has seen before
        store = dist.PrefixStore("fleetlike/", info.store)
        me = f"{self.settings.node_ip}|{self.settings.local_rank:06d}|{os.getpid():010d}|{self.settings.endpoint}"
        store.set(f"alive/{info.rank}", "0")  # before the seat: whoever sees every seat sees this
        tag = self._secret.mac("seat", self.settings.run_id, info.rank, me)
        store.set(f"member/{info.rank}", f"{tag}#{me}")
        keys = [f"member/{r}" for r in range(info.world_size)]
        store.wait(keys, datetime.timedelta(seconds=timeout))
        seats = sorted(self._seat(r, store.get(k).decode()) for r, k in enumerate(keys))
        rank = seats.index(me)
        self.members = [(s.split("|")[0], s.split("|")[3]) for s in seats]
        role = Role.from_endpoints(rank, [ep for _, ep in self.members], job_id=self.settings.run_id,
                                   source="elastic")
        world = GlooCommunicator(dist.PrefixStore("world/", store), rank, len(seats), range(len(seats)),
                                 "world", self.settings.node_ip, timeout)
        world.interrupt = threading.Event()
        if self._watch is not None:
            self._watch.stop()
        self._watch = Watch(store, info.rank, info.world_size, world.interrupt,
                            period=self.settings.heartbeat_seconds)
        self._watch.start()
        return role, world

    def _seat(self, seat: int, value: str) -> str:
        """The description at ``seat``, once its HMAC checks (a stranger's entry never counts)."""
        tag, _, me = value.partition("#")
        if not self._secret.verify(tag, "seat", self.settings.run_id, seat, me):
            raise SecretMismatchError(
                f"fleetlike.elastic: seat {seat} of this round is not signed with this job's "
                f"secret ({me[:80]!r}); refusing to form a world with it")
        return me

    def record(self, event: Mapping[str, object]) -> None:
        """Append one re-formation record (`EVENTS_KEY`) for the launchers to report."""
        self._private.set(f"{EVENTS_KEY}/{self._private.add(EVENTS_KEY, 1)}", json.dumps(dict(event)))

    def waiting(self) -> int:
        """Workers waiting to join (admitted when the world next re-forms)."""
        return self.handler.num_nodes_waiting()

    def close(self) -> None:
        """Leave the rendezvous for good (the job is done here): stop the heartbeats."""
        self.quiet()
        self.handler.shutdown()

    def quiet(self, wait: float | None = None) -> None:
        """Stop this process's heartbeat threads (the world's `Watch` and the rendezvous's
        keep-alive) and wait for them, at most ``wait`` seconds in all (a store call in progress
        finishes first; one to an unreachable store is left behind, said on stderr), staying in
        the rendezvous (a worker that ends after a failure may be started again and rejoin).
        Called at interpreter exit too (`fleetlike.elastic.init` registers it): a daemon thread
        still inside a store call when the interpreter finalizes is ended by CPython while it
        reacquires the GIL, which unwinds through torch's C++ frames and aborts the process
        (``terminate called without an active exception``, SIGABRT) after the script itself
        succeeded. ``wait`` defaults to the heartbeat timeout."""
        wait = self.settings.heartbeat_timeout if wait is None else wait
        deadline = time.monotonic() + wait
        if self._watch is not None:
            self._watch.stop(wait=wait)
        # torch's handler has no public way to stop its keep-alive without closing the
        # rendezvous for every participant (`shutdown`); its own stop joins without a bound
        stopper = threading.Thread(target=self.handler._stop_heartbeats,  # type: ignore[attr-defined]
                                   name="fleetlike-elastic-quiet", daemon=True)
        stopper.start()
        stopper.join(max(0.0, deadline - time.monotonic()))
        if stopper.is_alive() or (self._watch is not None and self._watch.is_alive()):
            print(f"fleetlike.elastic: a heartbeat thread is still in a call to the rendezvous store "
                  f"{self.settings.store} after {wait:g}s (unreachable?); going on without it",
                  file=sys.stderr, flush=True)


class Watch(threading.Thread):
    """Heartbeats among the ranks of one world, on the round's store: each rank bumps its
    counter every ``period`` seconds; a counter that has not moved for `HEARTBEATS_MISSED`
    periods (by this rank's clock: the nodes' clocks need not agree) means that rank is gone.

    Why not rely on the collective failing: gloo reports a peer's closed connection only when
    it is reading from it at that moment, and a cut link closes nothing, so a collective can
    wait for its whole timeout (1800 s by default). The watch sets the world's ``interrupt``
    event instead (`fleetlike.comm.guard.wait_work`), failing the blocked collective within a
    few seconds."""

    def __init__(self, store: dist.Store, seat: int, size: int, interrupt: threading.Event, *,
                 period: float = DEFAULT_HEARTBEAT_TIMEOUT / HEARTBEATS_MISSED) -> None:
        super().__init__(name="fleetlike-elastic-watch", daemon=True)
        self._store, self._seat, self._size, self._interrupt = store, seat, size, interrupt
        self.period = period
        self._stop_event = threading.Event()

    def stop(self, wait: float = 0.0) -> None:
        """Stop beating; with ``wait``, wait up to that many seconds for the thread to end (a
        store call in progress finishes first)."""
        self._stop_event.set()
        if wait > 0 and self.is_alive() and self is not threading.current_thread():
            self.join(timeout=wait)

    def run(self) -> None:
        keys = [f"alive/{r}" for r in range(self._size)]
        seen: dict[int, tuple[bytes, float]] = {}
        beat = 0
        while not self._stop_event.wait(self.period):
            beat += 1
            try:
                self._store.set(f"alive/{self._seat}", str(beat))
                values = self._store.multi_get(keys)
            except Exception:  # noqa: BLE001 - the store's host is gone: the job is ending
                return
            now = time.monotonic()
            lost = []
            for r, value in enumerate(values):
                last = seen.get(r)
                if last is None or last[0] != value:
                    seen[r] = (value, now)
                elif now - last[1] > self.period * HEARTBEATS_MISSED:
                    lost.append(r)
            if lost and not self._stop_event.is_set():
                print(f"fleetlike.elastic: seat(s) {lost} stopped heartbeating; interrupting this world's "
                      "collectives", file=sys.stderr, flush=True)
                self._interrupt.set()
                return


def describe_change(before: list[tuple[str, str]], after: list[tuple[str, str]]) -> tuple[list[str], list[str], list[str]]:
    """(nodes lost, nodes joined, nodes that lost some of their workers), by IP."""
    def count(members: list[tuple[str, str]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for ip, _ in members:
            out[ip] = out.get(ip, 0) + 1
        return out

    old, new = count(before), count(after)
    lost = sorted(ip for ip in old if ip not in new)
    joined = sorted(ip for ip in new if ip not in old)
    shrunk = sorted(ip for ip in old if ip in new and new[ip] < old[ip])
    return lost, joined, shrunk


"""Which nodes an elastic job lost, and why: the launchers' heartbeats on the rendezvous store.

In an elastic job (``--nnodes MIN:MAX``) the workers re-form their world by themselves
(`fleetlike.elastic`), so a launcher sees no failure when another node goes away: its own
workers carry on. To say in its summary which nodes were lost, and tell that apart from a
worker that failed and was restarted, each launcher

- heartbeats on the job's rendezvous store (the one ``--rdzv_endpoint`` names): key
  ``fleetlike.launch/beat/<node ip>`` holds ``"<counter> up"``, then ``"<counter> done <code>"``
  when the launcher ends by itself; a counter that stops moving for `MISSED` periods (by this
  launcher's clock) means that launcher stopped answering: its machine died, or its link was cut;
  a launcher whose own beat came more than `MISSED` periods late (it was stopped with SIGSTOP
  and continued: its clock ran on meanwhile) says so in every later beat (``" silent <s>"``
  appended), so the others learn its silence even when none of their looks fell inside it;
- reads the re-formations the workers record there (`EVENTS_KEY`: rank 0 of each new world
  appends one JSON line: the nodes lost and joined, the commit the world rolled back to).

At the end, `NodeWatch.summary` joins the two: for every node a re-formation lost, why (its
launcher stopped answering / ended with a code / still answers, so its workers left), and at
which commit. A launcher that stood still for `MISSED` periods and then answered again (it was
stopped with SIGSTOP and continued, or its link came back) is reported as having stopped
answering, for how long: that is why its node was lost, whatever code it ended with later. How
long is read off the store, between two of this watch's looks that read the same beat, so a
look that comes late on a loaded machine loses none of the silence and a pause of this watch
itself is never counted (tests/test_nodewatch_silence.py). A store that cannot be reached (this node's link is cut) ends the watch quietly:
the summary then says the store was lost.

Example::

    watch = NodeWatch(config.rdzv_endpoint, config.node_ip, store=hosted_or_none)
    watch.start(); ...; watch.finish(code); print(watch.summary())
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
import threading
import time
from typing import Any

import torch.distributed as dist

from fleetlike.comm import JobSecret, challenge_of, job_store
from fleetlike.roles import parse_endpoint

__all__ = ["BEAT_PREFIX", "EVENTS_KEY", "MISSED", "PERIOD", "EventKind", "NodeWatch", "NodeEvent"]

#: Seconds between two heartbeats, and how many may be missed before a node counts as lost.
PERIOD = 1.0
MISSED = 3
BEAT_PREFIX = "fleetlike.launch/beat/"
NODES_KEY = "fleetlike.launch/nodes"
#: The workers' re-formation records (``fleetlike.elastic.membership.EVENTS_KEY``: the same name,
#: a test checks the two agree): a counter at this key, the records at ``<key>/<n>``.
EVENTS_KEY = "fleetlike.elastic/events"


class EventKind(str, enum.Enum):
    """What a re-formation did to a node."""

    LOST = "lost"
    JOINED = "joined"


@dataclasses.dataclass(frozen=True)
class NodeEvent:
    """A node that left or joined the world, at the commit the world re-formed from."""

    kind: EventKind
    ip: str
    commit: int
    why: str

    def describe(self) -> str:
        if self.kind is EventKind.JOINED:
            return f"node {self.ip} joined at commit {self.commit}"
        return f"node {self.ip} lost at commit {self.commit} ({self.why})"


class NodeWatch(threading.Thread):
    """This launcher's heartbeat and its view of the other launchers' (see the module docstring)."""

    def __init__(self, endpoint: str, ip: str, *, store: Any | None = None, timeout: float = 10.0,
                 secret: JobSecret | None = None) -> None:
        super().__init__(name="fleetlike-launch-nodewatch", daemon=True)
        # under the job secret's prefix (`fleetlike.comm.rendezvous.job_store`), where the
        # workers record re-formations and nobody without the secret can touch the counters
        self._secret = secret
        if store is not None and secret is not None:
            store = job_store(store, secret)
        self._endpoint, self._ip, self._store, self._timeout = endpoint, ip, store, timeout
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._seen: dict[str, tuple[str, float]] = {}  # guarded by _lock: ip -> (beat, when it changed)
        #: guarded by _lock: ip -> the longest time its beat stood still past `MISSED` periods
        #: (stopped by SIGSTOP, paused, cut off) before it moved again or said done
        self._silent: dict[str, float] = {}
        #: guarded by _lock: ip -> when the latest look that read its beat unchanged began
        self._still: dict[str, float] = {}
        self._store_lost: str | None = None  # guarded by _lock
        self._beat = 0
        #: the longest time this launcher's own beat came late past `MISSED` periods
        self._late = 0.0

    def _connect(self) -> Any:
        host, port = parse_endpoint(self._endpoint, name="--rdzv_endpoint")
        raw = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=self._timeout))
        if self._secret is None:
            return raw
        # The launchers start together, so this one may reach the store before its host has
        # greeted (the port takes connections from the moment it is bound): wait for the
        # greeting, as a worker does, instead of taking an empty store for a lost one and never
        # beating (the other launchers would then report this node as still answering).
        deadline = time.monotonic() + self._timeout
        pause = 0.01
        while challenge_of(raw, self._secret) is None:
            if time.monotonic() >= deadline or self._stopping.wait(pause):
                raise TimeoutError(f"the store at {self._endpoint} did not greet with this job's secret "
                                   f"within {self._timeout:g} s")
            pause = min(pause * 2, 0.2)
        return job_store(raw, self._secret)

    def run(self) -> None:
        try:
            if self._store is None:
                self._store = self._connect()
            self._store.set(BEAT_PREFIX + self._ip, "0 up")
            self._store.set(f"{NODES_KEY}/{self._store.add(NODES_KEY, 1)}", self._ip)
            last = time.monotonic()
            while not self._stopping.wait(PERIOD):
                now = time.monotonic()
                if now - last > PERIOD * (MISSED + 1):
                    self._late = max(self._late, now - last - PERIOD)
                last = now
                self._beat += 1
                self._store.set(BEAT_PREFIX + self._ip, f"{self._beat} up{self._silence()}")
                self._look()
        except Exception as exc:  # noqa: BLE001 - the store's host or the link is gone
            with self._lock:
                self._store_lost = f"{type(exc).__name__}: {str(exc)[:120]}"

    def _silence(self) -> str:
        """What this launcher's beats append once it stood still (see the module docstring)."""
        return f" silent {self._late:.1f}" if self._late else ""

    def _look(self) -> None:
        began = time.monotonic()
        count = int(self._store.add(NODES_KEY, 0))
        ips = sorted({v.decode() for v in self._store.multi_get([f"{NODES_KEY}/{i}" for i in range(1, count + 1)])})
        beats = self._store.multi_get([BEAT_PREFIX + ip for ip in ips])
        now = time.monotonic()
        with self._lock:
            for ip, beat in zip(ips, beats):
                text = beat.decode()
                reported = _reported_silence(text)
                if reported > PERIOD * MISSED:
                    self._silent[ip] = max(self._silent.get(ip, 0.0), reported)
                seen, since = self._seen.get(ip, ("", now))
                if seen == text:
                    self._still[ip] = began
                    continue
                # The beat stood still at least from the end of the look that first read it to
                # the start of the last look that read it unchanged: two answers of the store,
                # so a pause of this watch itself (on a loaded machine this thread may be the
                # one that stood still) never counts, and a late look after the other launcher
                # answered again loses nothing of its silence.
                still = self._still.pop(ip, since) - since
                if seen and still > PERIOD * MISSED:
                    self._silent[ip] = max(self._silent.get(ip, 0.0), still)
                self._seen[ip] = (text, now)

    def _why(self, ip: str, now: float) -> str:
        beat, since = self._seen.get(ip, ("", now))
        if ip in self._silent:  # lost while it stood still: how it ended later is not why
            return (f"its launcher stopped answering for {self._silent[ip]:.0f} s: stopped (SIGSTOP), "
                    "paused or cut off, then answered again")
        words = beat.split()
        if len(words) >= 3 and words[1] == "done":
            return f"its launcher ended with code {words[2]}"
        if now - since > PERIOD * MISSED:
            return "its launcher stopped answering"
        return "its launcher still answers: its workers left the world"

    def _settle(self, ips: set[str]) -> None:
        """Look on (at most `MISSED` + 1 periods) until each of ``ips`` has either ended or
        stopped answering, or is seen answering: a node lost just before the job ended."""
        deadline = time.monotonic() + PERIOD * (MISSED + 1)
        while time.monotonic() < deadline:
            now = time.monotonic()
            with self._lock:
                undecided = [ip for ip in ips if self._why(ip, now).startswith("its launcher still")]
            if not undecided:
                return
            time.sleep(PERIOD / 2)
            try:
                self._look()
            except Exception:  # noqa: BLE001 - decide with what was seen
                return

    def finish(self, code: int) -> None:
        """Say this launcher is done (so no other reports it lost) and stop the heartbeat. A
        watch stuck in a store call (this node's link is cut) is left behind (it is a daemon):
        the launcher does not wait for the store's timeout to end."""
        self._stopping.set()
        self.join(timeout=PERIOD * 2)
        with self._lock:
            if self.is_alive() and self._store_lost is None:
                self._store_lost = "no answer within 2 s"
            lost = self._store_lost
        if lost is None and self._store is not None:
            try:
                self._store.set(BEAT_PREFIX + self._ip, f"{self._beat + 1} done {code}{self._silence()}")
            except Exception as exc:  # noqa: BLE001 - same as in run
                with self._lock:
                    self._store_lost = f"{type(exc).__name__}: {str(exc)[:120]}"

    def events(self) -> list[NodeEvent]:
        """The nodes the workers' re-formations lost or admitted, in order, with the reasons."""
        with self._lock:
            if self._store_lost is not None or self._store is None:
                return []
        records = []
        try:
            count = int(self._store.add(EVENTS_KEY, 0))
            if count:
                keys = [f"{EVENTS_KEY}/{i}" for i in range(1, count + 1)]
                records = [json.loads(v.decode()) for v in self._store.multi_get(keys)]
        except Exception as exc:  # noqa: BLE001 - same as in run
            with self._lock:
                self._store_lost = f"{type(exc).__name__}: {str(exc)[:120]}"
            return []
        self._settle({ip for r in records for ip in r.get("nodes_lost", [])})
        now = time.monotonic()
        out: list[NodeEvent] = []
        with self._lock:
            for record in records:
                for ip in record.get("nodes_lost", []):
                    out.append(NodeEvent(EventKind.LOST, ip, int(record["commit"]), self._why(ip, now)))
                for ip in record.get("nodes_joined", []):
                    out.append(NodeEvent(EventKind.JOINED, ip, int(record["commit"]), ""))
        return out

    def summary(self) -> str:
        """``nodes lost: ...; nodes joined: ...`` (``-`` for none), or why nothing is known."""
        events = self.events()
        with self._lock:
            lost_store = self._store_lost
        if lost_store is not None:
            return f"nodes: unknown (the rendezvous store at {self._endpoint} was lost: {lost_store})"
        lost = [e.describe() for e in events if e.kind is EventKind.LOST]
        joined = [e.describe() for e in events if e.kind is EventKind.JOINED]
        return f"nodes lost: {', '.join(lost) or '-'}; nodes joined: {', '.join(joined) or '-'}"


def _reported_silence(beat: str) -> float:
    """The seconds a launcher's beat says it stood still (``"... silent <s>"``), else 0."""
    words = beat.split()
    try:
        seconds = float(words[words.index("silent") + 1]) if "silent" in words else 0.0
    except (IndexError, ValueError):
        return 0.0
    return seconds if math.isfinite(seconds) else 0.0

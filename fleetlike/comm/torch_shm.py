"""``fleetlike_shm``: a ``torch.distributed`` backend whose point-to-point calls between ranks of
one host ride shared-memory rings (`fleetlike.comm.shm`); its collectives, and its sends to
ranks on other hosts, ride gloo.

Why: ``torch.distributed.pipelining`` sends every activation and gradient between stages with
``isend`` / ``irecv`` on the stage's process group. Given a group of this backend, torch's own
schedules run unchanged and their handoffs skip gloo's worker threads and loopback TCP
(``python -m bench.pipeline_handoff``: the latency of one 64 KiB handoff both ways).

Which peers share memory is agreed once, when the group forms: each rank writes a probe file
in ``/dev/shm`` and publishes its name on the group's store, each reads every other's, and a
pair rides the rings only when each read the other's probe (the same machine and the same
``/dev/shm``: containers that do not share it keep gloo). A ring per direction is made on the
first send (its name published on the store) and opened on the first receive.

Semantics are torch's: receives from one peer complete in the order they were posted, matched
to its sends in order, tag and size; a send is done when its bytes are in the ring (at once
when they fit, else it streams on a thread of its own while the caller goes on). ``abort()``
closes every ring of this rank (its peers' waits raise at once) and gloo's links.

Example:
    >>> register()                                    # once per process
    >>> pg = dist.new_group([0, 1], backend=BACKEND)  # every rank, as any new_group
    >>> stage = PipelineStage(module, stage_id, 2, torch.device("cpu"), group=pg)
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import secrets
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo

from fleetlike.comm.shm import SHM_DIR, Ring, shm_unsupported

__all__ = ["BACKEND", "RING_BYTES", "RING_MAX_BYTES", "ShmProcessGroup", "register"]

#: the backend's name for ``dist.new_group(..., backend=BACKEND)``
BACKEND = "fleetlike_shm"
#: data bytes of each direction's ring (at least 4 of the first message, so a few activations
#: can wait in it while the receiver computes, up to ``RING_MAX_BYTES``)
RING_BYTES = 4 << 20
#: the most a ring takes of ``/dev/shm`` (a longer message streams through it)
RING_MAX_BYTES = 64 << 20

_REGISTERED: list[bool] = []
_REGISTER_LOCK = threading.Lock()


def register() -> None:
    """Make ``BACKEND`` known to ``torch.distributed`` (idempotent)."""
    with _REGISTER_LOCK:
        if not _REGISTERED:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
            _REGISTERED.append(True)


def _create(opts: Any, backend_options: Any) -> ShmProcessGroup:
    return ShmProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)


class _Done(dist.Work):
    """A point-to-point call already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _SendWork(dist.Work):
    """A send streaming on its peer's sender thread."""

    def __init__(self) -> None:
        super().__init__()
        self._event = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def wait(self, timeout: Any = None) -> bool:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()


class _RecvWork(dist.Work):
    """A posted receive: its wait reads the peer's ring, completing earlier receives first."""

    def __init__(self, pg: ShmProcessGroup, src: int, tensor: torch.Tensor, tag: int) -> None:
        super().__init__()
        self.pg, self.src, self.tensor, self.tag = pg, src, tensor, tag
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.pg._complete(self)
        return True

    def is_completed(self) -> bool:
        return self.done


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it: the ring copies its bytes by address."""
    return t if t.is_contiguous() else t.contiguous()


class ShmProcessGroup(ProcessGroup):
    """A process group of ``BACKEND``; see the module docstring. Built by ``dist.new_group``."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout_s = timeout.total_seconds()
        self._gloo = ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._out: dict[int, Ring] = {}
        self._in: dict[int, Ring] = {}
        self._queues: dict[int, collections.deque[tuple[torch.Tensor, int, _SendWork]]] = {}
        self._senders: dict[int, threading.Thread | None] = {}
        self._posted: dict[int, collections.deque[_RecvWork]] = {}
        self._send_lock = threading.Lock()
        self._recv_locks: dict[int, threading.Lock] = {r: threading.Lock() for r in range(size)}
        self._aborted = False
        self._pids: dict[int, int] = {}  # the processes of the peers sharing memory
        self._why_not = shm_unsupported()
        self.local = self._agree_local()

    # ---------------------------------------------------------------- forming

    def _agree_local(self) -> frozenset[int]:
        """The group ranks this rank shares memory with, agreed pairwise through probe files."""
        me, size, store = self.rank(), self.size(), self._store
        probe: str | None = None
        token = secrets.token_hex(16)
        if self._why_not is None:
            probe = os.path.join(SHM_DIR, f"fleetlike-probe-{secrets.token_hex(8)}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
        store.set(f"probe/{me}", json.dumps({"path": probe, "token": token, "pid": os.getpid()}))
        reach = []
        for r in range(size):
            if r == me or probe is None:
                continue
            theirs = json.loads(store.get(f"probe/{r}"))
            try:
                if theirs["path"] is not None:
                    with open(theirs["path"]) as f:
                        if f.read() == theirs["token"]:
                            reach.append(r)
                            self._pids[r] = int(theirs["pid"])
            except OSError:  # another machine's, or a /dev/shm of its own
                pass
        store.set(f"reach/{me}", json.dumps(reach))
        local = set()
        for r in range(size):
            if r != me and r in reach and me in json.loads(store.get(f"reach/{r}")):
                local.add(r)
        if probe is not None:  # every rank has read it once every reach/ is out
            os.unlink(probe)
        return frozenset(local)

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout_s

    def _out_ring(self, dst: int, first: int) -> Ring:
        ring = self._out.get(dst)
        if ring is None:
            capacity = max(RING_BYTES, min(RING_MAX_BYTES, -(-4 * (first + 64) // 4096) * 4096))
            path = os.path.join(SHM_DIR, f"fleetlike-ring-{secrets.token_hex(8)}-{self.rank()}to{dst}")
            ring = self._out[dst] = Ring.create(path, capacity)
            self._store.set(f"ring/{self.rank()}/{dst}", path)
        return ring

    def _in_ring(self, src: int) -> Ring:
        ring = self._in.get(src)
        if ring is None:
            path = self._await_ring(src)
            ring = self._in[src] = Ring.open(path)
            ring.unlink()  # both ends mapped: the name is no longer needed
        return ring

    def _await_ring(self, src: int) -> str:
        """The name of ``src``'s ring to this rank, published at its first send; raises when
        ``src`` aborts or ends first (a stage failing before its first send)."""
        key, gone = f"ring/{src}/{self.rank()}", f"aborted/{src}"
        deadline, pause = self._deadline(), 1e-4
        while not self._store.check([key]):
            self._check("recv")
            if self._store.check([gone]):
                raise RuntimeError(f"recv from rank {src} of the {BACKEND} group: it aborted its links")
            try:
                os.kill(self._pids[src], 0)
            except ProcessLookupError:
                raise RuntimeError(f"recv from rank {src} of the {BACKEND} group: its process "
                                   f"(pid {self._pids[src]}) has ended") from None
            except PermissionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"recv from rank {src} of the {BACKEND} group: no send within the "
                                   f"group's timeout ({self._timeout_s:g} s)")
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        return self._store.get(key).decode()

    def _check(self, what: str) -> None:
        if self._aborted:
            raise RuntimeError(f"{what} on an aborted {BACKEND} process group (a rank aborted its links)")

    # ---------------------------------------------------------------- point to point

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Any:  # noqa: N803 - torch's names
        if dstRank not in self.local:
            return self._gloo.send(tensors, dstRank, tag)
        self._check("send")
        if len(tensors) != 1:
            raise ValueError(f"{BACKEND} send takes one tensor, got {len(tensors)}")
        payload = _contiguous(tensors[0])
        nbytes = payload.numel() * payload.element_size()
        ring = self._out_ring(dstRank, nbytes)
        with self._send_lock:
            queue = self._queues.setdefault(dstRank, collections.deque())
            if not queue and ring.try_send(payload.data_ptr(), nbytes, tag):
                return _Done()
            work = _SendWork()
            queue.append((payload, tag, work))
            if self._senders.get(dstRank) is None:
                thread = threading.Thread(target=self._stream, args=(dstRank, ring), daemon=True,
                                          name=f"{BACKEND}-send-{dstRank}")
                self._senders[dstRank] = thread
                thread.start()
        return work

    def _stream(self, dst: int, ring: Ring) -> None:
        """Write the queued sends to ``dst`` in order (the caller's thread went on)."""
        queue = self._queues[dst]
        while True:
            with self._send_lock:
                if not queue:
                    self._senders[dst] = None
                    return
                payload, tag, work = queue[0]
            error: BaseException | None = None
            try:
                ring.send(payload.data_ptr(), payload.numel() * payload.element_size(), tag, self._deadline())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                error = exc
            with self._send_lock:
                queue.popleft()
            work.finish(error)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Any:  # noqa: N803
        if srcRank not in self.local:
            return self._gloo.recv(tensors, srcRank, tag)
        self._check("recv")
        if len(tensors) != 1:
            raise ValueError(f"{BACKEND} recv takes one tensor, got {len(tensors)}")
        work = _RecvWork(self, srcRank, tensors[0], tag)
        with self._recv_locks[srcRank]:
            self._posted.setdefault(srcRank, collections.deque()).append(work)
        return work

    def _complete(self, work: _RecvWork) -> None:
        """Read ``work.src``'s messages into the receives posted before ``work``, then ``work``."""
        src = work.src
        with self._recv_locks[src]:
            ring = self._in_ring(src)
            posted = self._posted[src]
            while not work.done:
                self._check("recv")
                head = posted[0]
                t = head.tensor
                into = _contiguous(t)
                ring.recv(into.data_ptr(), into.numel() * into.element_size(), head.tag, self._deadline())
                if into is not t:
                    t.detach().copy_(into)
                posted.popleft()
                head.done = True

    # ---------------------------------------------------------------- collectives: gloo's

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._gloo.broadcast(tensors, opts)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._gloo.allreduce(tensors, opts)

    def allgather(self, output: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._gloo.allgather(output, inputs) if opts is None else self._gloo.allgather(output, inputs, opts)

    def gather(self, output: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        return self._gloo.gather(output, inputs, opts)

    def scatter(self, output: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        return self._gloo.scatter(output, inputs, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._gloo.reduce(tensors, opts)

    def barrier(self, opts: Any = None) -> Any:
        return self._gloo.barrier() if opts is None else self._gloo.barrier(opts)

    # ---------------------------------------------------------------- ending

    def abort(self) -> None:
        """Close every ring of this rank (peers waiting on it raise) and gloo's links."""
        self._aborted = True
        for ring in [*self._out.values(), *self._in.values()]:
            ring.close_link()
        try:  # a peer still waiting for this rank's first send learns it from the store
            self._store.set(f"aborted/{self.rank()}", "1")
        except Exception:  # noqa: BLE001 - the store itself may be gone: the rings are closed
            pass
        self._gloo.abort()

    def shutdown(self) -> None:
        """Unmap the rings and remove any name still there; shut gloo's links down."""
        for ring in self._out.values():
            ring.unlink()
        self._out.clear()  # mappings go when the last reference does (a streaming send may hold one)
        self._in.clear()
        self._gloo.shutdown()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def __repr__(self) -> str:
        return f"ShmProcessGroup(rank {self.rank()} of {self.size()}, shared memory with {sorted(self.local)})"

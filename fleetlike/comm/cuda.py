"""CUDA discipline for the threads fleetlike runs: one device per rank, streams handed across threads.

A collective on a helper thread (the hierarchical chain, the 16-bit casts, the sharded
reduce-scatter, the DDP hook's finishers) must read the gradients after the kernels that made
them and hand its result back before anyone reads it. The kernels that made them ran on the
*submitting* thread's current stream, which a helper thread cannot see (its own current stream
is the default one), so:

- `submit_to` captures the producer: on the submitting thread it records an event on that
  thread's current stream (``Handoff.ready``) and notes the device;
- the helper sets the device once per thread (`use_device`), makes its own dedicated stream
  wait on that event, and runs the job with that stream current, so every NCCL launch orders
  itself after the producer (the communicator's stream waits on the current one) and every
  ``wait()`` the job makes holds back only the helper's stream, never a stream others use;
- when the job is done an event is recorded on the helper's stream (``Handoff.done``), and the
  handle's ``wait()`` makes the *consumer's* current stream wait on it: no host sync.

Streams come from CuPy (``cupy.cuda.Stream(non_blocking=True)``), one per communicator and one
per helper thread, never from torch's stream pool: the pool hands out 32 streams per priority in
turn, so a 33rd user of it shares a stream with the first, and unrelated work serialises.

NCCL calls of several communicators must be issued in one order on every rank (NCCL documents a
deadlock otherwise), so every helper job that issues NCCL calls runs on one process-wide
thread, the issuer, in submission order; a launch from another thread while the issuer has work
queued is handed to it too (`ISSUER.busy`), so the order per rank is the order the training
thread asked for, on every rank.

Example:
    >>> work = submit_to(pool, job, device)     # on the training thread
    >>> work.wait()                             # consumer's stream waits; the host only for the job
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "ISSUER",
    "Handoff",
    "HandoffWork",
    "Issuer",
    "dedicated_stream",
    "release_stream",
    "selected_gpu",
    "stream_device",
    "submit_to",
    "use_device",
]

_THREAD = threading.local()


def selected_gpu(selected: Sequence[int], local_rank: int, rank: int) -> int:
    """The GPU of a rank from ``FLAGS_selected_gpus``: the one id, else the id at its local rank.

    One rule for every place that picks the device (``fleet.init``, the NCCL communicator), so
    a launcher's ``--selected_gpus=0,1,2,3`` puts local rank ``j`` on GPU ``selected[j]`` in
    both; before, fleet took ``selected[0]`` on every rank and NCCL found two ranks on one GPU."""
    if len(selected) == 1:
        return int(selected[0])
    if 0 <= local_rank < len(selected):
        return int(selected[local_rank])
    raise ValueError(
        f"rank {rank}: selected_gpus={list(selected)} has no entry for local rank {local_rank}; "
        "give one GPU per process on this node (--selected_gpus)"
    )


def use_device(device: torch.device | None) -> None:
    """Make ``device`` this thread's current CUDA device (a no-op for CPU devices and after the
    first call on a thread): CUDA calls on a thread whose device is another GPU make a context
    there (hundreds of MiB on GPU 0 per rank)."""
    if device is None or device.type != "cuda" or device.index is None:
        return
    if getattr(_THREAD, "device", None) != device.index:
        torch.cuda.set_device(device.index)
        _THREAD.device = device.index


def stream_device(comm: Any) -> torch.device | None:
    """The device whose streams ``comm``'s collectives run on (NCCL), else None (CPU backends:
    nothing to hand across threads)."""
    return getattr(comm, "stream_device", None)


# Every stream made here lives until the process ends. The caching allocator records an event on
# each stream a freed tensor was ``record_stream``-ed on, at the moment the tensor is freed, which
# may come after its communicator or helper thread is gone; on a destroyed stream that record
# aborts the process ("invalid device context"). torch's own pool streams are never destroyed
# for the same reason. A stream given back is handed to the next communicator or thread that
# asks: stream order already puts the new user's work after the old one's.
_STREAM_LOCK = threading.Lock()
_KEPT: list[Any] = []
_SPARE: dict[int, list[tuple[torch.cuda.Stream, Any]]] = {}


def dedicated_stream(device: torch.device) -> tuple[torch.cuda.Stream, Any]:
    """A CUDA stream of its own on ``device`` (not from torch's pool) and the CuPy object that
    owns it, reused from `release_stream` when one was given back. Never destroyed."""
    with _STREAM_LOCK:
        spare = _SPARE.get(device.index)
        if spare:
            return spare.pop()
    import cupy

    with cupy.cuda.Device(device.index):
        owner = cupy.cuda.Stream(non_blocking=True)
    with _STREAM_LOCK:
        _KEPT.append(owner)
    return torch.cuda.ExternalStream(owner.ptr, device=device), owner


def release_stream(device: torch.device, held: tuple[torch.cuda.Stream, Any]) -> None:
    """Give a `dedicated_stream` back for reuse once its user (a closed communicator, an ended
    helper thread) issues nothing more on it. A stream without a CuPy owner is not one of ours."""
    if held[1] is None:
        return
    with _STREAM_LOCK:
        _SPARE.setdefault(device.index, []).append(held)


def _helper_stream(device: torch.device) -> torch.cuda.Stream:
    """This helper thread's own stream on ``device`` (made once per thread, given back when the
    thread object goes away)."""
    streams = getattr(_THREAD, "streams", None)
    if streams is None:
        streams = _THREAD.streams = {}
    held = streams.get(device)
    if held is None:
        held = streams[device] = dedicated_stream(device)
        weakref.finalize(threading.current_thread(), release_stream, device, held)
    return held[0]


class Handoff:
    """Where a helper job's input was produced and where its result can be found."""

    __slots__ = ("device", "ready", "done")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))
        self.done: torch.cuda.Event | None = None

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on this (helper) thread after the producer's kernels, on the helper's stream."""
        use_device(self.device)
        stream = _helper_stream(self.device)
        stream.wait_event(self.ready)
        try:
            with torch.cuda.stream(stream):
                return fn()
        finally:
            done = torch.cuda.Event()
            done.record(stream)
            self.done = done

    def consume(self) -> None:
        """Make the calling thread's current stream wait for the job's kernels."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)


class HandoffWork:
    """A `Work` over a helper job: ``wait()`` re-raises its error; with a `Handoff`, it also
    orders the caller's current stream after the job's kernels (the host waits only for the
    job to be issued)."""

    __slots__ = ("_future", "_handoff")

    def __init__(self, future: concurrent.futures.Future, handoff: Handoff | None) -> None:
        self._future = future
        self._handoff = handoff

    def wait(self) -> Any:
        result = self._future.result()
        if self._handoff is not None:
            self._handoff.consume()
        return result

    def is_completed(self) -> bool:
        return self._future.done()


def submit_to(pool: concurrent.futures.Executor, fn: Callable[[], Any], device: torch.device | None) -> HandoffWork:
    """Run ``fn`` on ``pool``; with a ``device``, as the producer's stream work (see the module doc)."""
    if device is None:
        return HandoffWork(pool.submit(fn), None)
    handoff = Handoff(device)
    return HandoffWork(pool.submit(handoff.run, fn), handoff)


class Issuer:
    """The one thread that issues a process's NCCL calls from helper jobs, in submission order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._queued = 0  # jobs submitted and not finished; guarded by _lock

    def submit(self, fn: Callable[[], Any], device: torch.device | None) -> HandoffWork:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetlike-nccl")
            self._queued += 1
            pool = self._pool
        return submit_to(pool, lambda: self._job(fn), device)

    def _job(self, fn: Callable[[], Any]) -> Any:
        self._thread = threading.current_thread()
        try:
            return fn()
        finally:
            with self._lock:
                self._queued -= 1

    def busy(self) -> bool:
        """Whether another thread's NCCL launch must queue behind the issuer's jobs now."""
        return self._queued > 0 and threading.current_thread() is not self._thread

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the issuer after the jobs queued before it; returns its result."""
        with self._lock:
            assert self._pool is not None
            self._queued += 1
            pool = self._pool
        return pool.submit(self._job, fn).result()


#: the process's NCCL issuer (see the module doc)
ISSUER = Issuer()

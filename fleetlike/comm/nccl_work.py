"""The handle of an NCCL collective, NCCL's per-thread group state, and torch's current stream
read fast.

Why a module of its own: a collective on an NCCL communicator runs on the communicator's own
CUDA stream, so its handle is an event recorded there after the launch, with the buffers it
uses kept alive until ``wait()``; ``wait()`` makes torch's current stream wait for that event
(the host does not block, as with torch's own NCCL ``Work.wait``). Inside ``with comm.group():``
the kernels exist only at ``ncclGroupEnd``, so the handles are held per thread (`GROUP`) and
their events recorded then. `NcclWork` needs of its communicator only the few fields of
`LaunchSite`, so it stands below `fleetlike.comm.nccl`.

Example:
    >>> with world.group():
    ...     works = [world.all_reduce_async(g, op="avg") for g in grads]
    >>> for w in works:
    ...     w.wait()                                      # orders torch's stream; host goes on
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fleetlike.comm.cuda import use_device
from fleetlike.comm.errors import CommError
from fleetlike.comm.handles import Work

__all__ = ["GROUP", "ISSUE_LOCK", "LaunchSite", "NcclWork", "current_stream"]

_GET_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)  # absent in CPU builds
_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch's current stream on ``device``, as ``torch.cuda.current_stream(device)`` gives it.

    That call parses its argument and builds a new ``Stream`` object: 7.5 us a call on the H100
    host of the first GPU run, two calls per collective (the launch waits on the current stream,
    ``wait()`` makes it wait). This reads the same (id, device, type) triple from torch's C API
    and reuses one ``Stream`` object per triple (torch pools its streams, so there are few).
    ``setdefault`` keeps the cache consistent between threads without a lock.
    """
    if _GET_CURRENT_STREAM is None:
        return torch.cuda.current_stream(device)
    key = _GET_CURRENT_STREAM(torch.cuda.current_device() if device.index is None else device.index)
    stream = _STREAMS.get(key)
    if stream is None:
        made = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        stream = _STREAMS.setdefault(key, made)
    return stream


#: one NCCL launch at a time per process: the communicators' shared "ready" events are
#: recorded and waited under it, and NCCL's calls reach the GPU in the order they were made
ISSUE_LOCK = threading.Lock()


class _GroupState(threading.local):
    """NCCL groups are per thread: the depth and the handles launched at the outermost end."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: list[NcclWork] = []


GROUP = _GroupState()


class LaunchSite(Protocol):
    """What an `NcclWork` reads of the communicator that launched it (`NcclCommunicator`)."""

    _device: torch.device
    _stream: torch.cuda.Stream
    #: the watchdog's deadline for each collective, seconds (None: not watched)
    _deadline: float | None
    #: (launched at, seq, op, event) of the collectives the watchdog has not seen finish
    _flight: deque[tuple[float, int, str, Any]]


class NcclWork(Work):
    """An NCCL collective on a communicator's stream: an event, and the buffers it uses."""

    __slots__ = ("_comm", "_device", "_event", "_keep", "_post", "_blocking", "_what", "_seq")

    def __init__(
        self,
        comm: LaunchSite,
        keep: tuple[torch.Tensor, ...],
        post: Callable[[], None] | None,
        blocking: bool,
        what: str,
        seq: int,
    ) -> None:
        self._comm = comm
        self._device = comm._device
        self._event: torch.cuda.Event | None = None
        self._keep = keep
        self._post = post
        self._blocking = blocking
        self._what = what
        self._seq = seq

    def _launched(self) -> None:
        """The NCCL kernel is enqueued: run the finishing kernel, if any, and mark the end."""
        comm = self._comm
        if self._post is not None:
            with torch.cuda.stream(comm._stream):
                self._post()
            self._post = None
        event = torch.cuda.Event()
        event.record(comm._stream)
        self._event = event
        if comm._deadline is not None:  # the watchdog polls the event: the host may never wait
            comm._flight.append((time.monotonic(), self._seq, self._what, event))

    def wait(self) -> None:
        """Make torch's current stream wait for the collective (the host blocks only for a
        barrier)."""
        if self._event is None:
            raise CommError(
                "wait() on an NCCL collective inside `with comm.group():`; its kernel is launched "
                "at the end of the block, so wait on the handle after the block"
            )
        use_device(self._device)  # a thread that only waits (hvd.synchronize elsewhere) is set too
        current_stream(self._device).wait_event(self._event)
        if self._blocking:
            self._event.synchronize()
        self._keep = ()

    def is_completed(self) -> bool:
        return self._event is not None and self._event.query()

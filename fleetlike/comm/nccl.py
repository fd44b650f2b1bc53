"""The `nccl` backend: NCCL through CuPy's binding (``cupy.cuda.nccl``) on CUDA tensors.

Why CuPy and not torch's ProcessGroupNCCL: fleetlike keeps out of torch.distributed's global state
(as the gloo backend does) and talks to NCCL directly, so a communicator is a plain object that can
be split, grouped and closed at will. CuPy is imported lazily: this module imports on a machine
without a GPU or CuPy, and asking for the backend there raises `NcclUnavailableError` saying what
is missing (no CUDA device, no CuPy, no NCCL library, no such GPU) and what to do.

How it runs:

- Rendezvous: the group's rank 0 asks NCCL for a unique id and puts its 128 raw bytes into the
  job's store under a key of this communicator; the others read them and all call
  ``ncclCommInitRank``. Sub-communicators (`split`) do the same per color, the lowest new rank
  creating the id, so no ``ncclCommSplit`` is needed.
- Streams: each communicator owns a CUDA stream. A collective first makes that stream wait for
  torch's current stream (an event), so a kernel that produced the input just before the call is
  finished before NCCL reads it, with no host synchronisation. The handle records an event after
  the collective; ``wait()`` makes torch's current stream wait for it (the host does not block,
  as with torch's own NCCL ``Work.wait``), and the buffers are marked as used on the comm stream
  (``record_stream``) so the caching allocator cannot hand them out while NCCL still runs.
- Groups: ``with comm.group():`` brackets the launches with ``ncclGroupStart`` / ``ncclGroupEnd``
  so several gradient buckets go out as one NCCL launch. The events of the handles are recorded at
  the end of the block (the kernels exist only then): wait on the handles after the block.
- Types: float16, bfloat16 (NCCL >= 2.10), float32, float64, uint8, int32 and int64 are reduced by
  NCCL itself; AVG is NCCL's own (>= 2.10) for floats, and a sum followed by a floor division on
  the comm stream for integers, which is what the other backends give.
- A group of one still calls NCCL (``calls_backend_at_size_one``): a one-GPU job runs the same
  code path, with its ordering and its errors, as a large one.
- Deadline: every launched collective's event is handed to the watchdog
  (`fleetlike.comm.watchdog`); one whose event has not completed after the communicator's
  timeout is reported, the NCCL communicator is aborted and the process exits with code 1, so
  the launcher stops the job instead of every rank hanging on a peer that is gone.

Example:
    >>> world = create_world(role, backend="nccl")       # one process per GPU
    >>> grads = [torch.ones(1 << 20, device="cuda") for _ in range(4)]
    >>> with world.group():
    ...     works = [world.all_reduce_async(g, op="avg") for g in grads]
    >>> for w in works:
    ...     w.wait()                                      # orders torch's stream; host goes on
"""

from __future__ import annotations

import contextlib
import datetime
import os
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm.base import Communicator
from fleetlike.comm.core import divide_
from fleetlike.comm import cuda as _cuda
from fleetlike.comm import guard as _guard
from fleetlike.comm.colors import split_order
from fleetlike.comm.cuda import ISSUER, selected_gpu, use_device
from fleetlike.comm.dtypes import SUPPORTED_DTYPES
from fleetlike.comm.errors import CommError
from fleetlike.comm.handles import CompletedWork, Work
from fleetlike.comm.ops import ReduceOp
from fleetlike.comm.watchdog import WATCHDOG, InFlight
from fleetlike.roles.role import Role

__all__ = ["NcclCommunicator", "NcclUnavailableError", "nccl_unavailable_reason"]

#: NCCL's runtime version code from which ncclAvg and ncclBfloat16 exist (2.10.0).
_NCCL_2_10 = 21000
#: NCCL's enum values, fixed by its ABI (used where an old binding lacks the constant).
_NCCL_AVG = 4
_NCCL_BFLOAT16 = 9
_UID_BYTES = 128
_GPU_EXTRA = "pip install 'fleetlike[gpu]'"


class NcclUnavailableError(CommError):
    """The `nccl` backend cannot run here. ``reason`` says which check failed.

    Reasons: ``"no_cuda"`` (torch sees no CUDA device), ``"no_cupy"`` (CuPy does not import),
    ``"no_nccl"`` (CuPy has no NCCL library), ``"no_device"`` (the chosen GPU does not exist).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_NCCL: Any = None  # CuPy's nccl module once it loaded


def _require_nccl() -> Any:
    """CuPy's NCCL module, after checking CUDA, CuPy and NCCL in that order."""
    global _NCCL
    if not torch.cuda.is_available():
        build = (
            f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)"
        )
        raise NcclUnavailableError(
            "no_cuda",
            f"backend='nccl' moves CUDA tensors, but torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, built with {build}). Use backend='gloo' (or 'auto') for "
            "CPU tensors. On a GPU machine, check the driver with `nvidia-smi`, that "
            "CUDA_VISIBLE_DEVICES is not empty, and that torch is a CUDA build.",
        )
    if _NCCL is not None:
        return _NCCL
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA library CuPy cannot load
        raise NcclUnavailableError(
            "no_cupy",
            f"backend='nccl' needs CuPy for its NCCL binding, but `import cupy` failed: {exc}. "
            f"Install it with `{_GPU_EXTRA}` (cupy-cuda12x and nvidia-nccl-cu12; for a CUDA 13 "
            f"torch, cupy-cuda13x and nvidia-nccl-cu13; this torch has CUDA {torch.version.cuda}), "
            "or use backend='gloo' for CPU tensors.",
        ) from exc
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001
        nccl, error = None, exc
    else:
        error = None
    if nccl is None or not getattr(nccl, "available", False):
        detail = f": {error}" if error is not None else ""
        version = getattr(cupy, "__version__", "?")
        raise NcclUnavailableError(
            "no_nccl",
            f"CuPy {version} imports, but its NCCL binding (cupy.cuda.nccl) is not available: "
            f"the NCCL library was not found{detail}. Install it with `pip install "
            f"nvidia-nccl-cu12` (nvidia-nccl-cu13 for CUDA 13; `{_GPU_EXTRA}` brings it) or a "
            "system NCCL, check the driver with `nvidia-smi`, and test with "
            "`python -c \"from cupy.cuda import nccl; print(nccl.get_version())\"`.",
        ) from error
    _NCCL = nccl
    return nccl


def nccl_unavailable_reason() -> str | None:
    """None when the `nccl` backend can run here, else the message saying why not.

    Example:
        >>> backend = "nccl" if nccl_unavailable_reason() is None else "gloo"
    """
    try:
        _require_nccl()
    except NcclUnavailableError as exc:
        return str(exc)
    return None


def _resolve_device(role: Role, device: torch.device | str | int | None) -> torch.device:
    """The GPU of this rank: ``device``, else ``role.selected_gpus``, else the local rank."""
    count = torch.cuda.device_count()
    if device is not None:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(
                f"device={device!r}: the 'nccl' backend runs on a CUDA device; pass one such as "
                "'cuda:0', or use backend='gloo' for CPU tensors"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        source = f"device={device!r}"
    elif role.selected_gpus:
        index = selected_gpu(role.selected_gpus, role.local_rank, role.rank)
        source = f"selected_gpus={list(role.selected_gpus)} (FLAGS_selected_gpus)"
    else:
        index = role.local_rank
        source = f"local_rank={role.local_rank}"
    if not 0 <= index < count:
        raise NcclUnavailableError(
            "no_device",
            f"rank {role.rank}: GPU {index} (from {source}) does not exist; this process sees "
            f"{count} CUDA device(s). Start at most {count} process(es) per node, or pick GPU ids "
            f"below {count} with --selected_gpus; `nvidia-smi -L` lists the GPUs.",
        )
    return torch.device("cuda", index)


def _uid_to_bytes(uid: bytes | Sequence[int]) -> bytes:
    """NCCL's unique id as its raw bytes.

    CuPy 14 gives the 128 bytes as ``bytes``; older CuPy gave a tuple of 128 C ``char`` values
    (signed on x86, unsigned on Arm). Both land in the store as the same raw bytes.
    """
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(v & 0xFF for v in uid)


def _uid_candidates(raw: bytes) -> list[bytes | tuple[int, ...]]:
    """The id in each form a CuPy binding may take back, the newest first.

    ``bytes`` (CuPy >= 14), then signed chars (older CuPy on x86), then unsigned chars (Arm).
    A binding refuses the wrong form with ``TypeError`` (bytes vs tuple) or ``OverflowError``
    (char signedness), so the caller tries them in turn.
    """
    return [bytes(raw), struct.unpack(f"{len(raw)}b", raw), tuple(raw)]


_GET_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)  # absent in CPU builds
_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def _current_stream(device: torch.device) -> torch.cuda.Stream:
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


#: how long the watchdog lets ``ncclCommAbort`` take before it ends the process anyway
_ABORT_GRACE_S = 10.0


def _abort_within(comm: Any, grace: float, label: str) -> None:
    """``comm.abort()`` on a helper thread, waited for at most ``grace`` seconds.

    On the first GPU run (H100, NCCL 2.28.9) ``ncclCommAbort`` did not return while the
    collective's kernel was still queued behind a running kernel, and the process the watchdog
    meant to end ran on. The exit must not depend on the abort (torch's NCCL watchdog has the
    same escape: a monitor that ends the process when the abort hangs).
    """
    finished = threading.Event()

    def abort() -> None:
        try:
            comm.abort()
        finally:
            finished.set()

    threading.Thread(target=abort, name="fleetlike-nccl-abort", daemon=True).start()
    if not finished.wait(grace):
        print(f"fleetlike: ncclCommAbort on {label} did not return within {grace:g}s; "
              "ending the process without it", file=sys.stderr, flush=True)


def _exit_process(code: int) -> None:
    """End this process now, without Python's cleanup (which would wait on the dead stream)."""
    os._exit(code)


#: ncclInProgress: a non-blocking communicator's operation still running, not an error
_NCCL_IN_PROGRESS = 7


def _async_error(nccl: Any, comm: Any) -> str | None:
    """NCCL's asynchronous error on ``comm`` (``ncclCommGetAsyncError``), or None.

    CuPy 13 turns every non-zero result into ``NcclError`` through a table of names that has
    no ``ncclInProgress`` (NCCL >= 2.14), so that code arrives as a ``KeyError`` while the
    error is built; either form of it means "still running", not a failure.
    """
    try:
        comm.check_async_error()
    except nccl.NcclError as exc:
        if getattr(exc, "status", None) == _NCCL_IN_PROGRESS:
            return None
        return str(exc)
    except KeyError:
        return None
    return None


def _event_done(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:  # noqa: BLE001 - a failed query (a CUDA error) is the waiter's to report
        return True


def _init_expired(item: InFlight) -> None:
    """A rank never joined ``ncclCommInitRank`` (or NCCL's first connect): nothing to abort yet;
    end the process so that the launcher stops the job."""
    _exit_process(1)


#: one NCCL launch at a time per process: the communicators' shared "ready" events are
#: recorded and waited under it, and NCCL's calls reach the GPU in the order they were made
_ISSUE_LOCK = threading.Lock()


class _GroupState(threading.local):
    """NCCL groups are per thread: the depth and the handles launched at the outermost end."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: list[_NcclWork] = []


_GROUP = _GroupState()


class _NcclWork(Work):
    """An NCCL collective on a communicator's stream: an event, and the buffers it uses."""

    __slots__ = ("_comm", "_device", "_event", "_keep", "_post", "_blocking", "_what", "_seq")

    def __init__(
        self,
        comm: NcclCommunicator,
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
        _current_stream(self._device).wait_event(self._event)
        if self._blocking:
            self._event.synchronize()
        self._keep = ()

    def is_completed(self) -> bool:
        return self._event is not None and self._event.query()


class NcclCommunicator(Communicator):
    """A group of ranks, one GPU each, running NCCL collectives on its own CUDA stream.

    Build the world with `create` (``create_world(role, backend="nccl")`` calls it) and
    sub-communicators with `split`. ``device`` is this rank's GPU; tensors must live there.
    """

    backend = "nccl"
    calls_backend_at_size_one = True
    # The class values hold for NCCL >= 2.10; each instance narrows them to the NCCL it runs.
    native_reduce_dtypes = frozenset(SUPPORTED_DTYPES)
    native_avg = True

    def __init__(
        self,
        nccl: Any,
        nccl_comm: Any,
        store: dist.Store,
        rank: int,
        size: int,
        ranks: Sequence[int],
        name: str,
        device: torch.device,
        timeout: float,
    ) -> None:
        super().__init__(rank, size, ranks, name)
        self._nccl = nccl
        self._comm = nccl_comm
        self._store = store
        self._device = device
        self._timeout = timeout
        self._deadline: float | None = timeout
        self.timeout = timeout  # the watchdog's deadline for each collective
        # The watchdog thread aborts the NCCL communicator (`_expire`) while the training thread
        # may be closing it (`_close`): the lock orders them, so it is aborted or destroyed once.
        self._life = threading.Lock()
        self._closing: Any = None  # the NCCL comm `_close` is draining (abortable meanwhile)
        self._aborted = False
        self._splits = 0
        self.nccl_version: int = int(nccl.get_version())
        # a stream of its own, not from torch's pool (which wraps after 32 streams)
        self._stream, self._stream_owner = _cuda.dedicated_stream(device)
        self._handle = int(self._stream.cuda_stream)
        self._ready = torch.cuda.Event()  # the caller's stream position, re-recorded per launch
        #: (launched at, seq, op, event) of the collectives the watchdog has not seen finish
        self._flight: deque[tuple[float, int, str, Any]] = deque()
        self._connected = False  # NCCL connects to its peers on the first collective
        #: size checks in flight: (seq, op, event, host rows, row width), compared by `_poll`
        self._checks: deque[tuple[int, str, Any, torch.Tensor, int]] = deque()
        new = self.nccl_version >= _NCCL_2_10
        types = {
            torch.uint8: nccl.NCCL_UINT8,
            torch.int32: nccl.NCCL_INT32,
            torch.int64: nccl.NCCL_INT64,
            torch.float16: nccl.NCCL_FLOAT16,
            torch.float32: nccl.NCCL_FLOAT32,
            torch.float64: nccl.NCCL_FLOAT64,
        }
        if new:
            types[torch.bfloat16] = getattr(nccl, "NCCL_BFLOAT16", _NCCL_BFLOAT16)
        self._types: dict[torch.dtype, int] = types
        self._uint8 = int(nccl.NCCL_UINT8)
        self.native_reduce_dtypes = frozenset(types)
        self.native_avg = new
        self._ops = {
            ReduceOp.SUM: nccl.NCCL_SUM,
            ReduceOp.PROD: nccl.NCCL_PROD,
            ReduceOp.MAX: nccl.NCCL_MAX,
            ReduceOp.MIN: nccl.NCCL_MIN,
        }
        if new:
            self._ops[ReduceOp.AVG] = getattr(nccl, "NCCL_AVG", _NCCL_AVG)
        WATCHDOG.watch(id(self), self._poll, timeout)

    @property
    def timeout(self) -> float | None:  # type: ignore[override]
        """The watchdog's deadline for each collective, seconds (None: none)."""
        return self._deadline

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._deadline = value
        WATCHDOG.tighten(value)

    # ----------------------------------------------------------------- construction

    @classmethod
    def create(
        cls,
        store: dist.Store,
        role: Role,
        *,
        device: torch.device | str | int | None = None,
        timeout: float = 1800.0,
        name: str = "world",
    ) -> NcclCommunicator:
        """The world communicator of ``role``'s job over the job's ``store``.

        Checks, in order, that torch sees a CUDA device, that CuPy and its NCCL binding load and
        that this rank's GPU exists (``device``, else ``role.selected_gpus``, else the local rank),
        raising `NcclUnavailableError` with the fix otherwise. Collective: every rank calls it.
        """
        nccl = _require_nccl()
        dev = _resolve_device(role, device)
        use_device(dev)  # the rank's device, once: CUDA calls elsewhere would make a context on GPU 0
        return cls._connect(
            nccl,
            dist.PrefixStore("nccl/world/", store),
            role.rank,
            role.world_size,
            range(role.world_size),
            name,
            dev,
            timeout,
        )

    @classmethod
    def _connect(
        cls,
        nccl: Any,
        store: dist.Store,
        rank: int,
        size: int,
        ranks: Sequence[int],
        name: str,
        device: torch.device,
        timeout: float,
    ) -> NcclCommunicator:
        """Exchange the unique id through ``store`` (rank 0 writes it) and init the NCCL comm."""
        key = "unique_id"
        use_device(device)
        if rank == 0:
            raw = _uid_to_bytes(nccl.get_unique_id())
            store.set(key, raw)
        else:
            try:
                store.wait([key], datetime.timedelta(seconds=timeout))
            except Exception as exc:  # noqa: BLE001 - torch raises several types
                raise CommError(
                    f"rank {rank} of {name!r} waited {timeout:g}s for the NCCL unique id from "
                    f"its rank 0 (world rank {ranks[0]}); did every rank create it?"
                ) from exc
            raw = store.get(key)
        if len(raw) != _UID_BYTES:
            raise CommError(
                f"{name!r}: the NCCL unique id in the store has {len(raw)} bytes, not 128"
            )
        comm = None
        # ncclCommInitRank blocks until every rank of the group arrives: watched like a collective
        watch = WATCHDOG.begin(timeout, f"{name!r} (nccl)", "ncclCommInitRank", 0, rank=ranks[rank],
                               expire=_init_expired)
        try:
            for uid in _uid_candidates(raw):
                try:
                    comm = nccl.NcclCommunicator(size, uid, rank)
                    break
                except (TypeError, OverflowError):  # another CuPy's form of the id
                    continue
                except nccl.NcclError as exc:
                    raise CommError(
                        f"NCCL could not form {name!r} (rank {rank} of {size} on {device}): {exc}. "
                        "NCCL needs one GPU per rank: two ranks on one GPU fail here."
                    ) from exc
        finally:
            WATCHDOG.end(watch)
        if comm is None:
            raise CommError(
                f"{name!r}: CuPy rejected the NCCL unique id as bytes and as signed and "
                "unsigned chars"
            )
        return cls(nccl, comm, store, rank, size, ranks, name, device, timeout)

    # ----------------------------------------------------------------- properties

    @property
    def device(self) -> torch.device:
        """This rank's GPU."""
        return self._device

    @property
    def stream(self) -> torch.cuda.Stream:
        """The CUDA stream the collectives run on (this communicator's own)."""
        return self._stream

    @property
    def stream_device(self) -> torch.device:
        """The device whose streams order this communicator's collectives (helper threads hand
        their producer's stream position over on it: `fleetlike.comm.cuda`)."""
        return self._device

    @property
    def nccl_comm(self) -> Any:
        """CuPy's ``NcclCommunicator`` (for raw comparisons in benchmarks)."""
        return self._comm

    # ----------------------------------------------------------------- launching

    def _check_device(self, name: str, tensor: torch.Tensor, what: str) -> None:
        if tensor.device != self._device:
            raise ValueError(
                f"{name}: {what} is on {tensor.device}, but the 'nccl' communicator {self.name!r} "
                f"moves CUDA tensors on {self._device}; move it with .to('{self._device}') or use "
                "the 'gloo' backend for CPU tensors"
            )

    def _launch(
        self,
        what: str,
        call: Callable[[int], None],
        keep: tuple[torch.Tensor, ...],
        post: Callable[[], None] | None = None,
        blocking: bool = False,
    ) -> Work:
        use_device(self._device)  # before the event below: a thread of the caller's may still be on GPU 0
        if ISSUER.busy() and not _GROUP.depth:
            # helper jobs are issuing NCCL calls: queue behind them, so this rank's order of
            # calls is the order they were asked for, as on every other rank
            ready = torch.cuda.Event()
            ready.record(_current_stream(self._device))
            return ISSUER.call(lambda: self._enqueue(what, call, keep, post, blocking, ready))  # type: ignore[no-any-return]
        return self._enqueue(what, call, keep, post, blocking, None)

    def _enqueue(
        self,
        what: str,
        call: Callable[[int], None],
        keep: tuple[torch.Tensor, ...],
        post: Callable[[], None] | None,
        blocking: bool,
        ready: torch.cuda.Event | None,
    ) -> Work:
        """Order the comm stream after the caller's stream (``ready``: a position recorded on
        another thread) and enqueue ``call`` on it."""
        stream = self._stream
        use_device(self._device)  # on the issuer too: `_launch` set it on the calling thread only
        with _ISSUE_LOCK:
            if ready is None:
                ready = self._ready
                ready.record(_current_stream(self._device))
            stream.wait_event(ready)
            try:
                if self._connected:
                    call(self._handle)
                else:
                    self._first_call(what, call)
            except self._nccl.NcclError as exc:
                raise CommError(
                    f"NCCL {what} on {self.name!r} (rank {self.rank} of {self.size}, "
                    f"{self._device}) failed: {exc}"
                ) from exc
        for t in keep:
            t.record_stream(stream)
        work = _NcclWork(self, keep, post, blocking, self._check_label or what, self._seq)
        if _GROUP.depth:
            _GROUP.pending.append(work)
        else:
            work._launched()
        return work

    def _first_call(self, what: str, call: Callable[[int], None]) -> None:
        """The first collective: NCCL may connect to its peers inside the call, on the host."""
        watch = None
        if self._deadline is not None:
            watch = WATCHDOG.begin(self._deadline, f"{self.name!r} (nccl)", f"{what} (first connect)",
                                   self._seq, rank=self.ranks[self.rank], expire=self._expire)
        try:
            call(self._handle)
            self._connected = True
        finally:
            if watch is not None:
                WATCHDOG.end(watch)

    def _can_check_now(self) -> bool:
        # Inside a group nothing completes before ncclGroupEnd: the size check would wait on
        # itself. Callers in a group (the gradient buckets) pass sizes agreed by construction.
        return _GROUP.depth == 0

    def _issue(self, op: str, tensor: torch.Tensor | None, start: Callable[..., Work], args: tuple[Any, ...] = (),
               red: Any = None, root: int | None = None, agreed: bool = False) -> Work:
        if self.check_collectives:
            if _GROUP.depth:
                raise CommError(
                    f"{op} on {self.name!r} inside `with comm.group():` with check_collectives on: the "
                    "check exchanges each collective's description and waits for it, but nothing in an "
                    "NCCL group runs before the block ends. Check outside the group (turn "
                    "check_collectives off around it), or issue the collectives without a group"
                )
        elif self.check_sizes and not agreed and self.size > 1 and not _GROUP.depth:
            use_device(self._device)  # its pinned buffer and copies come before the launch
            self._check_sizes_async(op, tensor, red, root)
        return super()._issue(op, tensor, start, args, red, root, True)

    def _check_sizes_async(self, op: str, tensor: torch.Tensor | None, red: Any, root: int | None) -> None:
        """The default size check without a host sync: the ranks' descriptors are all-gathered
        on the comm stream just before the collective and copied to the host there; the
        watchdog compares them once they arrive (`_poll`). A mismatch, which would leave the
        collective itself hanging or reading past a buffer, ends the job on every rank with the
        ranks' table, within a poll period (every rank gathers the same rows)."""
        mine = _guard._encode(self._seq + 1, op, tensor, red, root)
        width = mine.numel()
        dev_row = mine.to(self._device, non_blocking=True)
        out = torch.empty(width * self.size, dtype=torch.int64, device=self._device)
        host = torch.empty(width * self.size, dtype=torch.int64, pin_memory=torch.cuda.is_available())
        self._check_label = op
        try:
            self._all_gather_start(out, dev_row)
        finally:
            self._check_label = None
        with torch.cuda.stream(self._stream):
            host.copy_(out, non_blocking=True)
            out.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        self._checks.append((self._seq + 1, op, event, host, width))

    def _size_mismatch(self) -> str | None:
        """The report of the first gathered size check whose rows disagree (watchdog thread)."""
        checks = self._checks
        while checks and _event_done(checks[0][2]):
            seq, op, _, host, width = checks.popleft()
            flat = host.tolist()
            table = [flat[i * width: (i + 1) * width] for i in range(self.size)]
            if all(r[f] == table[0][f] for r in table for f in _guard._SIZE_FIELDS):
                continue
            rows = [{"rank": str(self.ranks[i]), **_guard._describe(r)} for i, r in enumerate(table)]
            return (
                f"fleetlike: ranks of communicator {self.name!r} (nccl) disagree on collective #{seq} "
                f"{op} (found by the size check):\n{_guard.mismatch_table(rows)}\nEvery rank must "
                "issue the same collectives in the same order with the same sizes, dtypes and roots; "
                "for data whose size differs between ranks, gather it with "
                "fleetlike.comm.all_gather_ragged. The collective cannot finish, so the job is being aborted."
            )
        return None

    def _poll(self, now: float) -> tuple[InFlight, str] | None:
        """The watchdog's look at this communicator (its thread): NCCL's asynchronous error,
        and the oldest collective still running against the deadline."""
        use_device(self._device)  # the queries below must not make a context on another GPU
        flight = self._flight
        while flight and _event_done(flight[0][3]):
            flight.popleft()
        comm = self._comm
        reason = _async_error(self._nccl, comm) if comm is not None and not self._aborted else None
        head = flight[0] if flight else None
        rank, name = self.ranks[self.rank], f"{self.name!r} (nccl)"
        mismatch = self._size_mismatch() if self._checks else None
        if mismatch is not None:
            started, seq, what = head[:3] if head is not None else (now, self._seq, "-")
            return InFlight(started, self._deadline or 0.0, name, what, seq, rank, self._expire), mismatch
        if reason is not None:
            started, seq, what = head[:3] if head is not None else (now, self._seq, "no collective")
            item = InFlight(started, self._deadline or 0.0, name, what, seq, rank, self._expire)
            return item, (
                f"fleetlike: NCCL reported an error on {name} on rank {rank} (collective #{seq} "
                f"{what} in flight): {reason}. A peer died or the network failed; the collective "
                "cannot finish, so the job is being aborted."
            )
        deadline = self._deadline
        if head is None or deadline is None or now - head[0] <= deadline:
            return None
        item = InFlight(head[0], deadline, name, head[2], head[1], rank, self._expire)
        return item, item.message(now)

    def _expire(self, item: InFlight) -> None:
        """A kernel past its deadline (or an NCCL error): abort the NCCL communicator (its
        kernels return), then end the process, as torch's NCCL watchdog does: the CUDA context
        is not trustworthy after an abort, and the launcher stops the rest of the job when a
        worker dies."""
        try:
            with self._life:
                comm = self._comm if self._comm is not None else self._closing
                self._aborted = comm is not None
            if comm is not None:
                _abort_within(comm, _ABORT_GRACE_S, item.comm)
        finally:
            _exit_process(1)

    def _op(self, op: ReduceOp, buf: torch.Tensor) -> tuple[int, Callable[[], None] | None]:
        """NCCL's op, and a finishing step for an integer AVG (sum, then floor division)."""
        if op is ReduceOp.AVG and not buf.is_floating_point():
            size = self.size
            return self._ops[ReduceOp.SUM], lambda: divide_(buf, size)
        return self._ops[op], None

    def _moved(self, t: torch.Tensor) -> tuple[int, int]:
        """(datatype, count) to move ``t`` unreduced: its own type, else raw bytes."""
        code = self._types.get(t.dtype)
        if code is None:
            return self._uint8, t.numel() * t.element_size()
        return code, t.numel()

    def _all_reduce_start(self, buf: torch.Tensor, op: ReduceOp) -> Work:
        if buf.numel() == 0:
            return CompletedWork(buf)
        nop, post = self._op(op, buf)
        code, n, p, comm = self._types[buf.dtype], buf.numel(), buf.data_ptr(), self._comm
        return self._launch(
            "all_reduce", lambda s: comm.allReduce(p, p, n, code, nop, s), (buf,), post
        )

    def _broadcast_start(self, buf: torch.Tensor, root: int) -> Work:
        if buf.numel() == 0:
            return CompletedWork(buf)
        (code, n), p, comm = self._moved(buf), buf.data_ptr(), self._comm
        return self._launch("broadcast", lambda s: comm.broadcast(p, p, n, code, root, s), (buf,))

    def _reduce_start(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work:
        if buf.numel() == 0:
            return CompletedWork(buf)
        nop, post = self._op(op, buf)
        if self.rank != root:
            post = None
        code, n, p, comm = self._types[buf.dtype], buf.numel(), buf.data_ptr(), self._comm
        return self._launch(
            "reduce", lambda s: comm.reduce(p, p, n, code, nop, root, s), (buf,), post
        )

    def _all_gather_start(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        if chunk.numel() == 0:
            return CompletedWork(out)
        (code, n), src, dst, comm = self._moved(chunk), chunk.data_ptr(), out.data_ptr(), self._comm
        return self._launch(
            "all_gather", lambda s: comm.allGather(src, dst, n, code, s), (out, chunk)
        )

    def _reduce_scatter_start(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        if out.numel() == 0:
            return CompletedWork(out)
        nop, post = self._op(op, out)
        code, n, comm = self._types[buf.dtype], out.numel(), self._comm
        src, dst = buf.data_ptr(), out.data_ptr()
        return self._launch(
            "reduce_scatter",
            lambda s: comm.reduceScatter(src, dst, n, code, nop, s),
            (out, buf),
            post,
        )

    def _barrier_start(self) -> Work:
        buf = torch.zeros(1, dtype=torch.int32, device=self._device)
        code, p, comm = self._types[torch.int32], buf.data_ptr(), self._comm
        nop = self._ops[ReduceOp.SUM]
        return self._launch(
            "barrier", lambda s: comm.allReduce(p, p, 1, code, nop, s), (buf,), blocking=True
        )

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Launch the collectives of the block as one NCCL group (ncclGroupStart/GroupEnd).

        Nests; collectives of several NCCL communicators may share one block. Wait on the
        handles after the block: their kernels are launched when the outermost block ends.
        """
        nccl = self._nccl
        nccl.groupStart()
        _GROUP.depth += 1
        try:
            yield
        finally:
            _GROUP.depth -= 1
            try:
                use_device(self._device)
                nccl.groupEnd()
            except nccl.NcclError as exc:
                _GROUP.pending.clear()
                raise CommError(
                    f"NCCL group of {self.name!r} failed at ncclGroupEnd: {exc}"
                ) from exc
            if _GROUP.depth == 0:
                pending, _GROUP.pending = _GROUP.pending, []
                for work in pending:
                    work._launched()

    # ----------------------------------------------------------------- groups

    def _split(self, color: int | None, key: int) -> Communicator | None:
        seq = self._splits
        self._splits += 1
        order = split_order(self._store, seq=seq, rank=self.rank, size=self.size, color=color, key=key,
                            timeout=self._timeout, name=self.name)
        if order is None:
            return None
        return NcclCommunicator._connect(
            self._nccl,
            dist.PrefixStore(f"split{seq}/c{color}/", self._store),
            order.index(self.rank),
            len(order),
            [self.ranks[r] for r in order],
            f"{self.name}/split{seq}:{color}",
            self._device,
            self._timeout,
        )

    def _close(self) -> None:
        WATCHDOG.unwatch(id(self))
        with self._life:
            comm, self._comm = self._comm, None
            self._closing = comm
        try:
            # Not under the lock: a stuck kernel blocks here until the watchdog aborts it.
            self._stream.synchronize()
            with self._life:
                if comm is not None and not self._aborted:
                    comm.destroy()
                self._closing = None
            if comm is not None and self._stream_owner is not None:
                _cuda.release_stream(self._device, (self._stream, self._stream_owner))
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

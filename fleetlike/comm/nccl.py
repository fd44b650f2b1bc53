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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm.base import Communicator, divide_
from fleetlike.comm.colors import split_order
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
        gpus = role.selected_gpus
        if len(gpus) == 1:
            index = gpus[0]
        elif role.local_rank < len(gpus):
            index = gpus[role.local_rank]
        else:
            raise ValueError(
                f"rank {role.rank}: role.selected_gpus={list(gpus)} has no entry for local rank "
                f"{role.local_rank}; give one GPU per process on this node (--selected_gpus)"
            )
        source = f"selected_gpus={list(gpus)} (FLAGS_selected_gpus)"
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


class _GroupState(threading.local):
    """NCCL groups are per thread: the depth and the handles launched at the outermost end."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: list[_NcclWork] = []


_GROUP = _GroupState()


class _NcclWork(Work):
    """An NCCL collective on a communicator's stream: an event, and the buffers it uses."""

    __slots__ = ("_device", "_stream", "_event", "_keep", "_post", "_blocking", "_watch")

    def __init__(
        self,
        device: torch.device,
        stream: torch.cuda.Stream,
        keep: tuple[torch.Tensor, ...],
        post: Callable[[], None] | None,
        blocking: bool,
        watch: Callable[[torch.cuda.Event], None] | None = None,
    ) -> None:
        self._device = device
        self._stream = stream
        self._event: torch.cuda.Event | None = None
        self._keep = keep
        self._post = post
        self._blocking = blocking
        self._watch = watch

    def _launched(self) -> None:
        """The NCCL kernel is enqueued: run the finishing kernel, if any, and mark the end."""
        if self._post is not None:
            with torch.cuda.stream(self._stream):
                self._post()
            self._post = None
        event = torch.cuda.Event()
        event.record(self._stream)
        self._event = event
        if self._watch is not None:  # the watchdog polls the event: the host may never wait
            self._watch(event)
            self._watch = None

    def wait(self) -> None:
        """Make torch's current stream wait for the collective (the host blocks only for a
        barrier)."""
        if self._event is None:
            raise CommError(
                "wait() on an NCCL collective inside `with comm.group():`; its kernel is launched "
                "at the end of the block, so wait on the handle after the block"
            )
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
        self.timeout = timeout  # the watchdog's deadline for each collective
        # The watchdog thread aborts the NCCL communicator (`_expire`) while the training thread
        # may be closing it (`_close`): the lock orders them, so it is aborted or destroyed once.
        self._life = threading.Lock()
        self._closing: Any = None  # the NCCL comm `_close` is draining (abortable meanwhile)
        self._aborted = False
        self._splits = 0
        self.nccl_version: int = int(nccl.get_version())
        self._stream = torch.cuda.Stream(device=device)
        self._handle = int(self._stream.cuda_stream)
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
        with torch.cuda.device(device):
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
        """The CUDA stream the collectives run on."""
        return self._stream

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
        stream = self._stream
        with torch.cuda.device(self._device):
            stream.wait_stream(_current_stream(self._device))
            try:
                call(self._handle)
            except self._nccl.NcclError as exc:
                raise CommError(
                    f"NCCL {what} on {self.name!r} (rank {self.rank} of {self.size}, "
                    f"{self._device}) failed: {exc}"
                ) from exc
            for t in keep:
                t.record_stream(stream)
            work = _NcclWork(self._device, stream, keep, post, blocking, self._watcher(what))
            if _GROUP.depth:
                _GROUP.pending.append(work)
            else:
                work._launched()
        return work

    def _can_check_now(self) -> bool:
        # Inside a group nothing completes before ncclGroupEnd: the size check would wait on
        # itself. Callers in a group (the gradient buckets) pass sizes agreed by construction.
        return _GROUP.depth == 0

    def _watcher(self, what: str) -> Callable[[torch.cuda.Event], None] | None:
        """What registers a launched collective with the watchdog (None: no timeout)."""
        if self.timeout is None:
            return None
        what = self._check_label or what
        timeout, seq, name, rank = self.timeout, self._seq, f"{self.name!r} (nccl)", self.ranks[self.rank]

        def watch(event: torch.cuda.Event) -> None:
            WATCHDOG.begin(timeout, name, what, seq, rank=rank, expire=self._expire, done=event.query)

        return watch

    def _expire(self, item: InFlight) -> None:
        """A kernel past its deadline: abort the NCCL communicator (its kernels return), then end
        the process, as torch's NCCL watchdog does: the CUDA context is not trustworthy after
        an abort, and the launcher stops the rest of the job when a worker dies."""
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
                with torch.cuda.device(self._device):
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
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

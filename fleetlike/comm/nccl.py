"""The `nccl` backend: NCCL through CuPy's binding (``cupy.cuda.nccl``) on CUDA tensors.

Why CuPy and not torch's ProcessGroupNCCL: fleetlike keeps out of torch.distributed's global state
(as the gloo backend does) and talks to NCCL directly, so a communicator is a plain object that can
be split, grouped and closed at will. CuPy is imported lazily: this module imports on a machine
without a GPU or CuPy, and asking for the backend there raises `NcclUnavailableError` saying what
is missing (no CUDA device, no CuPy, no NCCL library, no such GPU) and what to do
(`fleetlike.comm.nccl_setup`).

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
  (``record_stream``) so the caching allocator cannot hand them out while NCCL still runs
  (the handle: `fleetlike.comm.nccl_work`).
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
  the launcher stops the job instead of every rank hanging on a peer that is gone
  (`fleetlike.comm.nccl_watch`).

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
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fleetlike.comm import cuda as _cuda
from fleetlike.comm import guard as _guard
from fleetlike.comm import nccl_watch as _watch
from fleetlike.comm.base import Communicator
from fleetlike.comm.colors import split_order
from fleetlike.comm.core import divide_
from fleetlike.comm.cuda import ISSUER, use_device
from fleetlike.comm.dtypes import SUPPORTED_DTYPES
from fleetlike.comm.errors import CommError
from fleetlike.comm.handles import CompletedWork, Work
from fleetlike.comm.nccl_setup import (
    NCCL_2_10,
    NCCL_AVG,
    NCCL_BFLOAT16,
    UID_BYTES,
    require_nccl,
    resolve_device,
    uid_candidates,
    uid_to_bytes,
)
from fleetlike.comm.nccl_watch import async_error, event_done, init_expired
from fleetlike.comm.nccl_work import GROUP, ISSUE_LOCK, NcclWork, current_stream
from fleetlike.comm.ops import ReduceOp
from fleetlike.comm.watchdog import WATCHDOG, InFlight
from fleetlike.roles.role import Role

__all__ = ["NcclCommunicator"]


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
        new = self.nccl_version >= NCCL_2_10
        types = {
            torch.uint8: nccl.NCCL_UINT8,
            torch.int32: nccl.NCCL_INT32,
            torch.int64: nccl.NCCL_INT64,
            torch.float16: nccl.NCCL_FLOAT16,
            torch.float32: nccl.NCCL_FLOAT32,
            torch.float64: nccl.NCCL_FLOAT64,
        }
        if new:
            types[torch.bfloat16] = getattr(nccl, "NCCL_BFLOAT16", NCCL_BFLOAT16)
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
            self._ops[ReduceOp.AVG] = getattr(nccl, "NCCL_AVG", NCCL_AVG)
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
        nccl = require_nccl()
        dev = resolve_device(role, device)
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
            raw = uid_to_bytes(nccl.get_unique_id())
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
        if len(raw) != UID_BYTES:
            raise CommError(
                f"{name!r}: the NCCL unique id in the store has {len(raw)} bytes, not 128"
            )
        comm = None
        # ncclCommInitRank blocks until every rank of the group arrives: watched like a collective
        watch = WATCHDOG.begin(timeout, f"{name!r} (nccl)", "ncclCommInitRank", 0, rank=ranks[rank],
                               expire=init_expired)
        try:
            for uid in uid_candidates(raw):
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
        if ISSUER.busy() and not GROUP.depth:
            # helper jobs are issuing NCCL calls: queue behind them, so this rank's order of
            # calls is the order they were asked for, as on every other rank
            ready = torch.cuda.Event()
            ready.record(current_stream(self._device))
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
        with ISSUE_LOCK:
            if ready is None:
                ready = self._ready
                ready.record(current_stream(self._device))
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
        work = NcclWork(self, keep, post, blocking, self._check_label or what, self._seq)
        if GROUP.depth:
            GROUP.pending.append(work)
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
        return GROUP.depth == 0

    def _issue(self, op: str, tensor: torch.Tensor | None, start: Callable[..., Work], args: tuple[Any, ...] = (),
               red: Any = None, root: int | None = None, agreed: bool = False) -> Work:
        if self.check_collectives:
            if GROUP.depth:
                raise CommError(
                    f"{op} on {self.name!r} inside `with comm.group():` with check_collectives on: the "
                    "check exchanges each collective's description and waits for it, but nothing in an "
                    "NCCL group runs before the block ends. Check outside the group (turn "
                    "check_collectives off around it), or issue the collectives without a group"
                )
        elif self.check_sizes and not agreed and self.size > 1 and not GROUP.depth:
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
        while checks and event_done(checks[0][2]):
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
        while flight and event_done(flight[0][3]):
            flight.popleft()
        comm = self._comm
        reason = async_error(self._nccl, comm) if comm is not None and not self._aborted else None
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
                _watch.abort_within(comm, _watch.ABORT_GRACE_S, item.comm)
        finally:
            _watch.exit_process(1)

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
        GROUP.depth += 1
        try:
            yield
        finally:
            GROUP.depth -= 1
            try:
                use_device(self._device)
                nccl.groupEnd()
            except nccl.NcclError as exc:
                GROUP.pending.clear()
                raise CommError(
                    f"NCCL group of {self.name!r} failed at ncclGroupEnd: {exc}"
                ) from exc
            if GROUP.depth == 0:
                pending, GROUP.pending = GROUP.pending, []
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

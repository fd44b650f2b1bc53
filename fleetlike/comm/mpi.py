"""The `mpi` backend: mpi4py collectives on the memory of CPU tensors, without copies.

For jobs started by ``mpirun`` / ``mpiexec`` (the ``mpich`` wheel provides one without a system
MPI). Tensors are handed to MPI as buffers over their own memory, so nothing is copied on the
way in or out. MPI has no 16-bit float reductions: float16 and bfloat16 are reduced in float32
by the base class, and moved (broadcast, gather) as raw 16-bit words.

A collective that has not finished after ``timeout`` seconds aborts the job with a message
naming it (`fleetlike.comm.watchdog`): MPI cannot cancel one, and waiting forever for a peer
that is gone helps nobody.

Note: MPICH progresses a non-blocking collective mostly inside MPI calls, so "async" here
overlaps less than gloo's worker threads do; ``wait()`` is always correct. The blocking grid
calls (``all_reduce`` ...) use MPI's blocking collectives, whose algorithms are faster than the
non-blocking schedules (a 1 MiB ``Ireduce_scatter_block`` + ``Wait`` takes ~16x a blocking
``Reduce_scatter_block`` on MPICH 5 over loopback).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from fleetlike.comm.base import Communicator
from fleetlike.comm.handles import CompletedWork, Work
from fleetlike.comm.ops import ReduceOp
from fleetlike.comm.watchdog import WATCHDOG, InFlight

__all__ = ["MPICommunicator", "mpi_available"]


def mpi_available() -> bool:
    """True when mpi4py imports (it needs an MPI library: the ``mpich`` wheel or a system one)."""
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError or a missing shared library
        return False
    return True


class _Request:
    """Adapts an MPI request to the `Work` protocol; ends its watchdog entry when done.

    MPI forbids two threads completing one request at once (a ``Wait`` in the training thread
    and a ``Test`` from a thread polling ``is_completed``), so both go through a lock."""

    __slots__ = ("_req", "_watch", "_keep", "_lock", "_finished")

    def __init__(self, req: Any, watch: int | None, *keep: Any) -> None:
        self._req = req
        self._watch = watch
        self._keep = keep  # buffers MPI writes into must outlive the request
        self._lock = threading.Lock()
        self._finished = False

    def wait(self) -> None:
        with self._lock:
            if not self._finished:
                self._req.Wait()
                self._done()

    def is_completed(self) -> bool:
        with self._lock:
            if not self._finished and self._req.Test():
                self._done()
            return self._finished

    def _done(self) -> None:
        self._finished = True
        self._keep = ()
        if self._watch is not None:
            WATCHDOG.end(self._watch)
            self._watch = None


#: seconds between the watchdog's message and MPI_Abort: mpiexec forwards a rank's stderr
#: asynchronously and tears the job down on an abort, so without a pause the message was lost
#: (seen in CI: the job ended with code 1 and no output at all)
_ABORT_GRACE = 1.0


def _abort_job(item: InFlight) -> None:
    """The watchdog's expiry action: MPI cannot cancel a collective, so end the whole job."""
    from mpi4py import MPI

    time.sleep(_ABORT_GRACE)
    MPI.COMM_WORLD.Abort(1)


#: What a blocking primitive returns: the call has finished when it returns.
_DONE = CompletedWork(None)



class MPICommunicator(Communicator):
    """Collectives over an mpi4py communicator (``MPI.COMM_WORLD`` or a split of it)."""

    backend = "mpi"
    native_reduce_dtypes = frozenset(
        {torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8}
    )

    def __init__(
        self, comm: Any | None = None, ranks: Sequence[int] | None = None, name: str = "world",
        timeout: float | None = None,
    ) -> None:
        """``timeout``: seconds after which a collective that has not finished aborts the job
        (`fleetlike.comm.watchdog`); None waits forever, as MPI itself does."""
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if comm is None else comm
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        super().__init__(rank, size, list(range(size)) if ranks is None else ranks, name)
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.PROD: MPI.PROD,
        }
        # MPI datatype of each tensor dtype; 16-bit floats only move (never reduce) in MPI, as
        # raw 16-bit words.
        self._types = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T,
            torch.uint8: MPI.UINT8_T,
            torch.float16: MPI.INT16_T,
            torch.bfloat16: MPI.INT16_T,
        }
        buffer = getattr(MPI, "buffer", None) or MPI.memory  # mpi4py >= 4 / 3
        self._fromaddress = buffer.fromaddress
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, or None")
        self.timeout = timeout

    def _watch(self, op: str) -> int | None:
        """Start the watchdog on the collective being issued (``_seq`` is its number)."""
        if self.timeout is None:
            return None
        return WATCHDOG.begin(self.timeout, f"{self.name!r} (mpi)", self._check_label or op, self._seq,
                              rank=self.ranks[self.rank], expire=_abort_job)

    def _blocking(self, op: str, call: Any, *args: Any) -> Work:
        key = self._watch(op)
        try:
            call(*args)
        finally:
            if key is not None:
                WATCHDOG.end(key)
        return _DONE

    def _msg(self, buf: torch.Tensor) -> list[Any]:
        """An MPI message over ``buf``'s own memory: ``[buffer, datatype]``.

        Built from the address rather than a numpy view: a fresh ndarray per call costs mpi4py
        ~2 us more to accept, most of the per-call overhead on small messages. The buffer does
        not keep ``buf`` alive: callers hold the tensor until MPI is done with it (a `_Request`
        keeps it for a non-blocking call)."""
        return [self._fromaddress(buf.data_ptr(), buf.nbytes), self._types[buf.dtype]]

    @property
    def mpi_comm(self) -> Any:
        """The underlying mpi4py communicator (for raw comparisons in benchmarks)."""
        return self._comm

    def _all_reduce_start(self, buf: torch.Tensor, op: ReduceOp) -> Work:
        req = self._comm.Iallreduce(self._MPI.IN_PLACE, self._msg(buf), self._ops[op])
        return _Request(req, self._watch("all_reduce"), buf)

    def _broadcast_start(self, buf: torch.Tensor, root: int) -> Work:
        return _Request(self._comm.Ibcast(self._msg(buf), root), self._watch("broadcast"), buf)

    def _reduce_start(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work:
        if self.rank == root:
            req = self._comm.Ireduce(self._MPI.IN_PLACE, self._msg(buf), self._ops[op], root)
        else:
            req = self._comm.Ireduce(self._msg(buf), None, self._ops[op], root)
        return _Request(req, self._watch("reduce"), buf)

    def _gather_send(self, out: torch.Tensor, chunk: torch.Tensor) -> Any:
        """The send buffer of an allgather: IN_PLACE when ``chunk`` is ``out``'s own slice."""
        nbytes = chunk.nbytes
        if nbytes and chunk.data_ptr() == out.data_ptr() + self.rank * nbytes:
            return self._MPI.IN_PLACE
        return self._msg(chunk)

    def _all_gather_start(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        req = self._comm.Iallgather(self._gather_send(out, chunk), self._msg(out))
        return _Request(req, self._watch("all_gather"), out, chunk)

    @staticmethod
    def _scatter_source(out: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        lo = buf.data_ptr()
        if lo <= out.data_ptr() < lo + buf.nbytes and out.nbytes:
            return buf.clone()  # MPI forbids overlapping send and receive buffers
        return buf

    def _reduce_scatter_start(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        src = self._scatter_source(out, buf)
        req = self._comm.Ireduce_scatter_block(self._msg(src), self._msg(out), self._ops[op])
        return _Request(req, self._watch("reduce_scatter"), out, src)

    def _barrier_start(self) -> Work:
        return _Request(self._comm.Ibarrier(), self._watch("barrier"))

    # Blocking forms (see the module note): the same buffers, MPI's blocking collectives.

    def _all_reduce_now(self, buf: torch.Tensor, op: ReduceOp) -> Work:
        return self._blocking("all_reduce", self._comm.Allreduce, self._MPI.IN_PLACE, self._msg(buf), self._ops[op])

    def _broadcast_now(self, buf: torch.Tensor, root: int) -> Work:
        return self._blocking("broadcast", self._comm.Bcast, self._msg(buf), root)

    def _reduce_now(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work:
        send = self._MPI.IN_PLACE if self.rank == root else self._msg(buf)
        recv = self._msg(buf) if self.rank == root else None
        return self._blocking("reduce", self._comm.Reduce, send, recv, self._ops[op], root)

    def _all_gather_now(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        return self._blocking("all_gather", self._comm.Allgather, self._gather_send(out, chunk), self._msg(out))

    def _reduce_scatter_now(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        src = self._scatter_source(out, buf)  # held here: an address buffer keeps nothing alive
        return self._blocking("reduce_scatter", self._comm.Reduce_scatter_block, self._msg(src), self._msg(out),
                              self._ops[op])

    def _barrier_now(self) -> Work:
        return self._blocking("barrier", self._comm.Barrier)

    def _split(self, color: int | None, key: int) -> Communicator | None:
        MPI = self._MPI
        sub = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        members = self._comm.allgather((color, key, self.rank))
        if color is None or sub == MPI.COMM_NULL:
            return None
        order = [r for _, r in sorted((k, r) for c, k, r in members if c == color)]
        return MPICommunicator(sub, [self.ranks[r] for r in order], f"{self.name}/split:{color}", self.timeout)

    def _close(self) -> None:
        if self._comm is not self._MPI.COMM_WORLD:
            try:
                self._comm.Free()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass

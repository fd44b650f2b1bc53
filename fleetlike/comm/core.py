"""What every communicator is underneath its grid: its state, the backend primitives, and the
checks and numbering each collective passes through.

Why a module of its own: a backend (`gloo`, `mpi`, `nccl`, `single`, the plan's dry one)
implements only what is declared here, the ``_*_start`` primitives on contiguous buffers of
dtypes it handles (and, where blocking calls are cheaper, the ``_*_now`` forms); the public
grid that callers use (`fleetlike.comm.base.Communicator`: ``all_reduce`` / ``all_reduce_async``,
in place or ``out=``, dtype conversion, AVG as SUM then divide) is built over them once, for all
backends. `CommunicatorCore._issue` is the one door every collective goes through: it numbers
the call, runs the agreement checks of `guard` and turns a backend's failure into a diagnosed
`CommError`. Every open communicator is closed at interpreter exit.

Example:
    >>> comm = SingleCommunicator()          # a backend: a CommunicatorCore with its primitives
    >>> comm.rank, comm.size, comm.device
    (0, 1, device(type='cpu'))
"""

from __future__ import annotations

import abc
import atexit
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.comm import guard as _guard
from fleetlike.comm.dtypes import SUPPORTED_DTYPES, dtype_names
from fleetlike.comm.errors import CommError
from fleetlike.comm.handles import Work
from fleetlike.comm.ops import ReduceOp
from fleetlike.comm.stats import CommStats, ring_send_bytes

__all__ = ["CommunicatorCore", "divide_"]

_CPU = torch.device("cpu")


class CommunicatorCore(abc.ABC):
    """A group of ranks as a backend sees it: its state, primitives, checks and lifecycle.

    Backends subclass `fleetlike.comm.base.Communicator`, which adds the public grid over
    these; nothing calls a `CommunicatorCore` that is not a `Communicator`.
    """

    backend: str = "abstract"
    #: dtypes the backend reduces natively; others travel as float32 (or float64 for int64).
    native_reduce_dtypes: frozenset[torch.dtype] = frozenset(SUPPORTED_DTYPES)
    #: whether the backend has a native AVG reduction.
    native_avg: bool = False
    #: whether a group of one still calls the backend's primitives. False short-cuts them (the
    #: result is already there); NCCL sets it so a one-GPU job really runs, and tests, its calls.
    calls_backend_at_size_one: bool = False
    #: whether the backend moves point-to-point messages (`_send_start` / `_recv_start`), which
    #: the coded allreduce (`all_reduce_coded_async`) is made of
    has_p2p: bool = False

    def __init__(self, rank: int, size: int, ranks: Sequence[int], name: str) -> None:
        self.rank = rank
        self.size = size
        self.ranks = tuple(ranks)
        self.name = name
        self.stats = CommStats()
        self._closed = False
        self._released = False
        #: bound on each collective, seconds (for messages; the backend enforces it)
        self.timeout: float | None = None
        #: set by another thread to fail this communicator's blocked collectives now (an
        #: elastic world whose peer stopped heartbeating: `fleetlike.elastic.membership`);
        #: shared with the communicators split from it
        self.interrupt: threading.Event | None = None
        #: agree on every collective's op/shape/dtype before running it (see `guard`)
        self.check_collectives = False
        #: agree on each collective's element count, op and dtype before its data moves (one
        #: small all-reduce; see `guard.agree_sizes`), unless the caller passes ``agreed=True``.
        #: On by default: a size mismatch otherwise aborts the process inside gloo.
        self.check_sizes = True
        #: a store private to this group, for failure diagnosis (None: no diagnosis)
        self._diag_store: Any = None
        #: number of the last collective issued; ``next(self._seqs)`` is atomic under the GIL,
        #: ``self._seq += 1`` from two threads is not
        self._seq = 0
        self._seqs = itertools.count(1)
        #: set by the guard while its agreement exchange runs, so a watchdog report names the
        #: collective being checked ("all_reduce"), not the exchange's primitive ("all_gather")
        self._check_label: str | None = None
        #: a coded allreduce is in flight (`all_reduce_coded_async`: one at a time)
        self._coded_busy = False
        self._coded_lock = threading.Lock()
        #: its receive space, per (dtype, device) (`_coded_scratch`; used one at a time)
        self._coded_space: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        with _LIVE_LOCK:
            _LIVE.add(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} rank {self.rank}/{self.size}>"

    @property
    def device(self) -> torch.device:
        """The device of the tensors this communicator moves, and so where a caller makes the
        small values the ranks agree on (flags, counts, norms, checksums): the CPU here, the
        rank's GPU on NCCL."""
        return _CPU

    # ----------------------------------------------------------------- backend primitives
    # Each starts the operation on contiguous tensors and returns a Work. Buffers given are
    # already of a dtype the backend handles for that op.

    @abc.abstractmethod
    def _all_reduce_start(self, buf: torch.Tensor, op: ReduceOp) -> Work: ...

    @abc.abstractmethod
    def _broadcast_start(self, buf: torch.Tensor, root: int) -> Work: ...

    @abc.abstractmethod
    def _reduce_start(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work: ...

    @abc.abstractmethod
    def _all_gather_start(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        """Gather ``chunk`` from every rank into the flat ``out`` (``size * chunk.numel()``).

        ``chunk`` may alias ``out``'s own slice (the in-place form)."""

    @abc.abstractmethod
    def _reduce_scatter_start(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        """Reduce the flat ``buf`` over ranks and leave chunk ``rank`` in ``out``."""

    @abc.abstractmethod
    def _barrier_start(self) -> Work: ...

    def _send_start(self, buf: torch.Tensor, dst: int, tag: int) -> Work:
        """Start sending ``buf`` to group rank ``dst`` (backends with `has_p2p`)."""
        raise CommError(f"the {self.backend!r} backend has no point-to-point messages (has_p2p is False)")

    def _recv_start(self, buf: torch.Tensor, src: int, tag: int) -> Work:
        """Start receiving into ``buf`` from group rank ``src`` (backends with `has_p2p`)."""
        raise CommError(f"the {self.backend!r} backend has no point-to-point messages (has_p2p is False)")

    # Blocking forms of the primitives, used by the blocking grid calls (``all_reduce``, ...).
    # The default starts the operation and the caller waits on it. A backend whose blocking
    # calls beat start-then-wait overrides them and returns a completed `Work` (MPI: its
    # blocking collectives use other algorithms than the non-blocking ones, and need no
    # progress engine, which is up to 16x faster for a 1 MiB reduce-scatter on MPICH).

    def _all_reduce_now(self, buf: torch.Tensor, op: ReduceOp) -> Work:
        return self._all_reduce_start(buf, op)

    def _broadcast_now(self, buf: torch.Tensor, root: int) -> Work:
        return self._broadcast_start(buf, root)

    def _reduce_now(self, buf: torch.Tensor, root: int, op: ReduceOp) -> Work:
        return self._reduce_start(buf, root, op)

    def _all_gather_now(self, out: torch.Tensor, chunk: torch.Tensor) -> Work:
        return self._all_gather_start(out, chunk)

    def _reduce_scatter_now(self, out: torch.Tensor, buf: torch.Tensor, op: ReduceOp) -> Work:
        return self._reduce_scatter_start(out, buf, op)

    def _barrier_now(self) -> Work:
        return self._barrier_start()

    def _can_check_now(self) -> bool:
        """Whether a blocking agreement exchange can run before this collective (NCCL: not
        inside ``with comm.group():``, where no collective completes before the block ends)."""
        return True

    def _close(self) -> None:
        """Release backend resources (override when there are any)."""

    def _abort(self) -> None:
        """After a failed collective: drop connections without waiting; mark closed."""
        self._closed = True

    def _issue(
        self,
        op: str,
        tensor: torch.Tensor | None,
        start: Callable[..., Work],
        args: tuple[Any, ...] = (),
        red: Any = None,
        root: int | None = None,
        agreed: bool = False,
    ) -> Work:
        """Number the collective, check agreement (sizes by default, everything when asked),
        start it (``start(*args)``: no closure per call), diagnose failures."""
        seq = self._seq = next(self._seqs)
        if self.check_collectives:
            _guard.agree(self, seq, op, tensor, red, root)
        elif self.check_sizes and not agreed and self.size > 1 and self._can_check_now():
            _guard.agree_sizes(self, seq, op, tensor, red, root)
        try:
            work = start(*args)
        except CommError:
            raise
        except Exception as exc:  # noqa: BLE001 - backends raise RuntimeError and friends
            raise _guard.failure(self, op, seq, exc) from exc
        return work if self._diag_store is None else _guard.GuardedWork(work, self, op, seq)

    # ----------------------------------------------------------------- checks and helpers

    def _check(self, name: str, tensor: torch.Tensor, what: str = "tensor") -> None:
        if self._closed:
            raise CommError(
                f"{name} on communicator {self.name!r}, which was closed (by close(), or after a "
                "failed collective: start again with fleet.init)"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: {what} has dtype {tensor.dtype}; supported dtypes: {dtype_names(SUPPORTED_DTYPES)}; "
                "convert it with .to(...) (fleet.util.all_reduce accepts every integer and float dtype)"
            )
        self._check_device(name, tensor, what)

    def _check_device(self, name: str, tensor: torch.Tensor, what: str) -> None:
        if not tensor.is_cpu:  # not device.type: 0.3 us per call on small messages
            raise ValueError(
                f"{name}: {what} is on {tensor.device}, but the {self.backend!r} backend moves CPU "
                "tensors; move it with .cpu() or use the 'nccl' backend for CUDA tensors"
            )

    def _check_root(self, name: str, root: int) -> None:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"{name}: root={root!r} is not a rank of this group (0..{self.size - 1})")

    def _wire_dtype(self, dtype: torch.dtype, op: ReduceOp | None) -> torch.dtype:
        if op is None or dtype in self.native_reduce_dtypes:
            return dtype
        return torch.float64 if dtype in (torch.int64, torch.float64) else torch.float32

    def _solo(self) -> bool:
        """True when this group of one short-cuts the backend (see `calls_backend_at_size_one`)."""
        return self.size == 1 and not self.calls_backend_at_size_one

    def _record(self, op: str, nbytes: int, dtype: torch.dtype | None = None) -> None:
        """Count one call in ``stats``. ``dtype`` (the wire's) is for subclasses that log calls
        (`fleetlike.plan.dry`): a reduction's cost on a CPU backend depends on it."""
        self.stats.record(op, nbytes, ring_send_bytes(op, nbytes, self.size))

    def close(self) -> None:
        """Release the group's resources; later calls raise CommError. Idempotent."""
        self._closed = True
        if not self._released:
            self._released = True
            self._close()

    def _check_same(self, name: str, tensor: torch.Tensor, out: torch.Tensor, what: str = "out") -> None:
        self._check(name, out, what)
        if out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise ValueError(
                f"{name}: {what} is {tuple(out.shape)} {out.dtype} but the input is "
                f"{tuple(tensor.shape)} {tensor.dtype}; they must match"
            )


#: Every open communicator, closed at interpreter exit: a gloo group torn down by the
#: interpreter after its peers' store is gone aborts the process with a non-zero status.
_LIVE: weakref.WeakSet[CommunicatorCore] = weakref.WeakSet()
#: WeakSet is not safe to add to while another thread iterates it (communicators are created
#: in helper threads too); every access takes this lock.
_LIVE_LOCK = threading.Lock()


@atexit.register
def _close_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for comm in sorted(live, key=lambda c: -len(c.name)):  # sub-groups before their parents
        comm.close()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t.view(-1)``, skipped when ``t`` is already flat (a view costs ~0.8 us per call)."""
    return t if t.dim() == 1 else t.view(-1)


def divide_(buf: torch.Tensor, n: int) -> None:
    """In-place mean from a sum: true division for floats, floor division for integers (what
    every backend's AVG gives). Dividing by 1 is skipped."""
    if n == 1:
        return
    if buf.is_floating_point():
        buf.div_(n)
    else:
        buf.floor_divide_(n)

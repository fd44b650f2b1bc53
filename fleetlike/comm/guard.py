"""Never hang, never desync silently: numbered collectives, failure diagnosis, agreement checks.

Every collective a communicator issues gets a sequence number. When one fails (the backend's
timeout expired, or a peer died and closed its connections), each waiting rank marks itself as
having reached that number in the job's store, waits a short grace for the others' marks, and
raises an error naming the op, its number and the ranks that never arrived: the message that
tells a user *which* worker to look at, where a bare "timed out" does not.

Two agreement checks run before a collective's data moves, because a mismatch found by the
backend is worse than an error: gloo aborts the process from its C++ transport thread
(``enforce fail at gloo/transport/tcp/pair.cc``, SIGABRT, nothing to catch), MPI truncates or
hangs, NCCL reads past the buffer.

Both exchange the same fixed-size descriptor (sequence number, op, reduction, root, dtype,
element count, shape) with one small all-gather before the collective, and raise
`CollectiveMismatchError` on every rank with a per-rank table (each rank's shape included):

- The size check (on by default, ``comm.check_sizes``) raises when what decides the bytes on the
  wire differs: sequence number, op, reduction, root, dtype or element count. Skipped for
  traffic whose sizes agree by construction: the caller passes ``agreed=True`` (gradient
  buckets, the second step of `all_gather_ragged`), and inside an NCCL ``group()``.
- The full check (``check_collectives``) raises on any difference, shapes included.

The cost is one small collective's latency per call (docs/benchmarks/desync_check.json).

Example of the message (two ranks, different lengths, default settings)::

    CollectiveMismatchError: ranks of communicator 'world' disagree on collective #3:
      rank  seq  op          reduce  root  dtype    shape
      0     3    all_reduce  sum     -     float32  (4,)
      1     3    all_reduce  sum     -     float32  (6,)
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Protocol

import torch

from fleetlike.comm.dtypes import SUPPORTED_DTYPES, dtype_name
from fleetlike.comm.errors import (
    CollectiveError,
    CollectiveFailedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommError,
)
from fleetlike.comm.handles import Work

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "Guarded",
    "GuardedWork",
    "failure",
    "agree",
    "agree_sizes",
    "wait_work",
]

_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier")
_ARGS = ("sum", "avg", "max", "min", "prod")
_DTYPES = SUPPORTED_DTYPES
_WIDTH = 16  # seq, op, reduce, root, dtype, ndim, numel, 8 dims, spare
_MAX_DIMS = 8


class Guarded(Protocol):
    """What the guard needs of a communicator (`fleetlike.comm.Communicator` has it all)."""

    rank: int
    size: int
    ranks: tuple[int, ...]
    name: str
    timeout: float | None
    interrupt: Any
    _diag_store: Any
    _check_label: str | None

    def _abort(self) -> None: ...

    def _all_gather_now(self, out: torch.Tensor, chunk: torch.Tensor) -> Work: ...



class GuardedWork:
    """A backend handle whose failure is turned into a diagnosed `CollectiveError`."""

    __slots__ = ("_inner", "_comm", "_op", "_seq")

    def __init__(self, inner: Work, comm: Guarded, op: str, seq: int) -> None:
        self._inner = inner
        self._comm = comm
        self._op = op
        self._seq = seq

    def wait(self) -> Any:
        try:
            return wait_work(self._inner, self._comm)
        except CommError:
            raise
        except Exception as exc:  # noqa: BLE001 - the backends raise RuntimeError and friends
            raise failure(self._comm, self._op, self._seq, exc) from exc

    def is_completed(self) -> bool:
        return self._inner.is_completed()


#: How often a wait on an interruptible communicator looks at its ``interrupt`` event.
_INTERRUPT_PERIOD = datetime.timedelta(seconds=0.25)


def wait_work(work: Any, comm: Guarded) -> Any:
    """``work.wait()``; on a communicator with an ``interrupt`` event (and a torch work, whose
    wait takes a timeout), waited in slices so that setting the event fails it within a
    quarter second. A completed collective returns at once either way."""
    event = getattr(comm, "interrupt", None)
    if event is None or not isinstance(work, torch._C._distributed_c10d.Work):
        return work.wait()
    while True:
        try:
            return work.wait(_INTERRUPT_PERIOD)
        except RuntimeError:
            if work.is_completed() or not event.is_set():
                if work.is_completed():
                    raise  # the collective itself failed
                continue  # only this slice ended
            raise RuntimeError(
                "interrupted: a peer of this world stopped heartbeating (fleetlike.elastic's "
                "watch), so the collective cannot complete"
            ) from None


def _who_arrived(comm: Guarded, seq: int, grace: float) -> list[int] | None:
    """Group ranks that reached collective ``seq`` (marked in the store), or None if unknown."""
    store = comm._diag_store
    if store is None:
        return None
    present: list[int] | None = None
    try:
        store.set(f"diag/{seq}/{comm.rank}", "1")
        # Close our connections so peers still blocked in this collective fail now and mark
        # themselves too: without it a peer waiting on us would only notice at its timeout.
        comm._abort()
        keys = [f"diag/{seq}/{r}" for r in range(comm.size)]
        deadline = time.monotonic() + grace
        while True:
            present = [r for r, k in enumerate(keys) if store.check([k])]
            if len(present) == comm.size or time.monotonic() >= deadline:
                return present
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone: rank 0 died, or finished its own report
        return present


def failure(comm: Guarded, op: str, seq: int, exc: BaseException) -> CollectiveError:
    """Diagnose a failed collective: which ranks never arrived, and why it failed.

    The communicator is unusable afterwards (the backend's state is undefined after a failed
    collective), so it is aborted and later calls raise at once."""
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    timeout = comm.timeout if comm.timeout is not None else float("nan")
    grace = min(5.0, max(1.0, timeout / 4)) if timeout == timeout else 5.0
    if getattr(comm, "interrupt", None) is not None:
        grace = 1.0  # an elastic world: the job goes on without the missing; re-form quickly
    present = _who_arrived(comm, seq, grace)
    where = f"{op} #{seq} on communicator {comm.name!r} (rank {comm.rank} of {comm.size})"
    if present is None:
        who = (
            "the rendezvous store is unreachable too, so rank 0 (which hosts it) has probably "
            "died; see its log"
        )
        missing = None
    else:
        missing = [comm.ranks[r] for r in range(comm.size) if r not in present]
        who = (
            f"ranks {missing} did not arrive at it (dead, stuck, or in another collective)"
            if missing
            else "every rank reached it, so the failure is in the transport"
        )
    if timed_out:
        return CollectiveTimeoutError(
            f"{where} did not complete within the {timeout:g}s timeout: {who}. Backend said: {text}",
            op=op, seq=seq, missing=missing,
        )
    return CollectiveFailedError(
        f"{where} failed: {who}. Backend said: {text}", op=op, seq=seq, missing=missing
    )


def _red_index(red: Any) -> int:
    name = str(getattr(red, "value", red)) if red is not None else ""
    return _ARGS.index(name) if name in _ARGS else -1


def _encode(seq: int, op: str, tensor: torch.Tensor | None, red: Any, root: int | None) -> torch.Tensor:
    """A fixed-size row: seq, op, reduction, root, dtype, ndim, numel, shape[:8]."""
    row = [-1] * _WIDTH
    row[0] = seq
    row[1] = _OPS.index(op)
    row[2] = _red_index(red)
    row[3] = -1 if root is None else root
    if tensor is not None:
        row[4] = _DTYPES.index(tensor.dtype)
        row[5] = tensor.dim()
        row[6] = tensor.numel()
        for i, d in enumerate(tuple(tensor.shape)[:_MAX_DIMS]):
            row[7 + i] = d
    return torch.tensor(row, dtype=torch.int64)


def _describe(row: list[int]) -> dict[str, str]:
    ndim = row[5]
    if ndim < 0:
        shape = "-"
    elif ndim > _MAX_DIMS:
        shape = f"{ndim}-d, {row[6]} elements"
    else:
        shape = str(tuple(row[7 : 7 + ndim]))
    return {
        "seq": str(row[0]),
        "op": _OPS[row[1]],
        "reduce": _ARGS[row[2]] if row[2] >= 0 else "-",
        "root": str(row[3]) if row[3] >= 0 else "-",
        "dtype": dtype_name(_DTYPES[row[4]]) if row[4] >= 0 else "-",
        "shape": shape,
    }


def mismatch_table(rows: list[dict[str, str]]) -> str:
    """The per-rank rows as an aligned text table (the body of a mismatch message)."""
    header = list(rows[0])
    lines = [header, *([r[c] for c in header] for r in rows)]
    widths = [max(len(x[c]) for x in lines) for c in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join("  " + fmt.format(*x).rstrip() for x in lines)


def _exchange(comm: Guarded, seq: int, op: str, mine: torch.Tensor, like: torch.Tensor | None) -> list[int]:
    """All-gather the int64 row ``mine`` with the backend's blocking primitive, on ``like``'s
    device; a failure is diagnosed as the collective's own."""
    if like is not None and not like.is_cpu:
        mine = mine.to(like.device)
    out = torch.empty(mine.numel() * comm.size, dtype=torch.int64, device=mine.device)
    # The check is the collective's first step: a peer missing here is missing from it, and
    # reports (the failure diagnosis, MPI's and NCCL's watchdog) name the collective itself.
    comm._check_label = op
    try:
        wait_work(comm._all_gather_now(out, mine), comm)
    except Exception as exc:  # noqa: BLE001
        raise failure(comm, op, seq, exc) from exc
    finally:
        comm._check_label = None
    return out.tolist()


#: Fields of the descriptor the size check compares: seq, op, reduce, root, dtype, numel (all
#: that decides what the backend sends and expects), not the shape's split into dimensions.
_SIZE_FIELDS = (0, 1, 2, 3, 4, 6)


def agree(comm: Guarded, seq: int, op: str, tensor: torch.Tensor | None, red: Any = None,
          root: int | None = None, *, strict: bool = True) -> None:
    """All ranks of ``comm`` check they are about to run the same collective; raise if not.

    One all-gather of a 16-int descriptor per rank (on gloo the cheapest small exchange: an
    all-reduce of 12 ints costs about 3x an all-gather of 6 there, as gloo's ring splits it).
    ``strict`` (``check_collectives``) compares the whole descriptor, shapes included; otherwise
    (the default size check) only what decides the bytes on the wire: sequence number, op,
    reduction, root, dtype and element count, so views of one buffer may differ in shape. The
    message shows every rank's shape either way."""
    flat = _exchange(comm, seq, op, _encode(seq, op, tensor, red, root), tensor)
    table = [flat[i * _WIDTH : (i + 1) * _WIDTH] for i in range(comm.size)]
    if strict:
        if all(r == table[0] for r in table):
            return
    elif all(r[f] == table[0][f] for r in table for f in _SIZE_FIELDS):
        return
    why = "check_collectives is on" if strict else "found by the size check, before any data moved"
    rows = [{"rank": str(comm.ranks[i]), **_describe(r)} for i, r in enumerate(table)]
    raise CollectiveMismatchError(
        f"ranks of communicator {comm.name!r} disagree on collective #{seq} ({why}):\n"
        f"{mismatch_table(rows)}\nEvery rank must issue the same collectives in the same order "
        "with the same sizes, dtypes and roots; for data whose size differs between ranks, "
        "gather it with fleetlike.comm.all_gather_ragged (fleet.util.all_gather does).",
        rows,
    )


def agree_sizes(comm: Guarded, seq: int, op: str, tensor: torch.Tensor | None, red: Any = None,
                root: int | None = None) -> None:
    """The default check (`check_sizes`): `agree` comparing sizes, not shapes."""
    agree(comm, seq, op, tensor, red, root, strict=False)

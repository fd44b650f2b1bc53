"""Never hang, never desync silently: numbered collectives, failure diagnosis, desync checks.

Every collective a communicator issues gets a sequence number. When one fails (the backend's
timeout expired, or a peer died and closed its connections), each waiting rank marks itself as
having reached that number in the job's store, waits a short grace for the others' marks, and
raises an error naming the op, its number and the ranks that never arrived: the message that
tells a user *which* worker to look at, where a bare "timed out" does not.

The optional desync check (``check_collectives``) makes the ranks exchange a fixed-size
descriptor (sequence number, op, reduction or root, dtype, shape) with one small all-gather
before each collective; any difference raises on every rank with a per-rank table. Off, it costs
nothing: one attribute test per call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from fleetlike.comm.base import CommError, Work

if TYPE_CHECKING:
    from fleetlike.comm.base import Communicator

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "GuardedWork",
    "failure",
    "agree",
]

_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier")
_ARGS = ("sum", "avg", "max", "min", "prod")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8)
_WIDTH = 16  # seq, op, reduce, root, dtype, ndim, numel, 8 dims, spare
_MAX_DIMS = 8


class CollectiveError(CommError):
    """A collective could not complete; the message names the op, its number and the ranks."""

    def __init__(self, message: str, *, op: str, seq: int, missing: list[int] | None) -> None:
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.missing = missing


class CollectiveTimeoutError(CollectiveError):
    """The collective did not complete within the timeout given to ``fleet.init``."""


class CollectiveFailedError(CollectiveError):
    """The backend failed (typically: a peer died and its connections closed)."""


class CollectiveMismatchError(CommError):
    """Ranks called different collectives at the same point (op, shape, dtype, root...)."""


class GuardedWork:
    """A backend handle whose failure is turned into a diagnosed `CollectiveError`."""

    __slots__ = ("_inner", "_comm", "_op", "_seq")

    def __init__(self, inner: Work, comm: Communicator, op: str, seq: int) -> None:
        self._inner = inner
        self._comm = comm
        self._op = op
        self._seq = seq

    def wait(self) -> Any:
        try:
            return self._inner.wait()
        except CommError:
            raise
        except Exception as exc:  # noqa: BLE001 - the backends raise RuntimeError and friends
            raise failure(self._comm, self._op, self._seq, exc) from exc

    def is_completed(self) -> bool:
        return self._inner.is_completed()


def _who_arrived(comm: Communicator, seq: int, grace: float) -> list[int] | None:
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


def failure(comm: Communicator, op: str, seq: int, exc: BaseException) -> CollectiveError:
    """Diagnose a failed collective: which ranks never arrived, and why it failed.

    The communicator is unusable afterwards (the backend's state is undefined after a failed
    collective), so it is aborted and later calls raise at once."""
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    timeout = comm.timeout if comm.timeout is not None else float("nan")
    grace = min(5.0, max(1.0, timeout / 4)) if timeout == timeout else 5.0
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


def _encode(seq: int, op: str, tensor: torch.Tensor | None, red: Any, root: int | None) -> torch.Tensor:
    """A fixed-size row: seq, op, reduction, root, dtype, ndim, numel, shape[:8]."""
    row = torch.full((_WIDTH,), -1, dtype=torch.int64)
    row[0] = seq
    row[1] = _OPS.index(op)
    name = str(getattr(red, "value", red)) if red is not None else ""
    row[2] = _ARGS.index(name) if name in _ARGS else -1
    row[3] = -1 if root is None else root
    if tensor is not None:
        row[4] = _DTYPES.index(tensor.dtype)
        row[5] = tensor.dim()
        row[6] = tensor.numel()
        for i, d in enumerate(tuple(tensor.shape)[:_MAX_DIMS]):
            row[7 + i] = d
    return row


def _describe(row: list[int]) -> tuple[str, ...]:
    red = _ARGS[row[2]] if row[2] >= 0 else "-"
    root = str(row[3]) if row[3] >= 0 else "-"
    dtype = str(_DTYPES[row[4]]).replace("torch.", "") if row[4] >= 0 else "-"
    shape = str(tuple(row[7 : 7 + min(row[5], _MAX_DIMS)])) if row[5] >= 0 else "-"
    return str(row[0]), _OPS[row[1]], red, root, dtype, shape


def agree(comm: Communicator, seq: int, op: str, tensor: torch.Tensor | None, red: Any = None,
          root: int | None = None) -> None:
    """All ranks of ``comm`` check they are about to run the same collective; raise if not."""
    mine = _encode(seq, op, tensor, red, root)
    if tensor is not None and tensor.device.type != "cpu":
        mine = mine.to(tensor.device)
    rows = torch.empty(_WIDTH * comm.size, dtype=torch.int64, device=mine.device)
    try:
        comm._all_gather_now(rows, mine).wait()
    except Exception as exc:  # noqa: BLE001
        raise failure(comm, f"{op} (desync check)", seq, exc) from exc
    table = rows.view(comm.size, _WIDTH).cpu().tolist()
    if all(r == table[0] for r in table):
        return
    header = ("rank", "seq", "op", "reduce", "root", "dtype", "shape")
    lines = [(str(comm.ranks[i]), *_describe(r)) for i, r in enumerate(table)]
    widths = [max(len(x[c]) for x in [header, *lines]) for c in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    body = "\n".join("  " + fmt.format(*x) for x in [header, *lines])
    raise CollectiveMismatchError(
        f"ranks of communicator {comm.name!r} disagree on collective #{seq} "
        f"(check_collectives is on):\n{body}\nEvery rank must issue the same collectives in the "
        "same order with the same shapes and dtypes."
    )

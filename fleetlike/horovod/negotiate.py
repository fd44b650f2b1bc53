"""Agreement before every Horovod collective: what each rank asks for, and ``join``.

Horovod's coordinator lets ranks announce tensors by name and starts a collective once all
ranks (less those that called ``join``) announced it. fleetlike has no background coordinator:
every hvd collective first all-gathers one fixed-size descriptor per rank (`descriptor`): whether
the rank is active or has joined, the collective, its reduction, dtype, root, name and shape.
From that table every rank decides the same thing (`check` is a pure function of it):

- the active ranks disagree (shape, dtype, op, root, name, collective): every rank raises
  `CollectiveMismatchError` with a table naming each rank's value, instead of hanging or
  aborting inside the backend;
- some ranks have joined: a joined rank answers the active ranks' allreduce with the identity of
  the reduction (zeros for Sum / Average / Adasum, as Horovod) and the active ranks go on;
  collectives Horovod does not allow with join (allgather, alltoall, broadcast, reducescatter)
  raise on every rank with Horovod's message;
- every rank has joined: ``join`` returns the rank that joined last on every rank.

The exchange is one small collective (a SUM all-reduce of a table in which each rank fills its
row; an all-gather in large worlds), about the cost of fleetlike's default size check, which
the data collective then skips (``agreed=True``); an allreduce every rank predicts from this
history needs none: its data carry the agreement (`fleetlike.horovod.speculate`). A DistributedOptimizer's reduction carries the
join flags in its first bucket instead and agrees only once a rank has joined (`fleetlike.horovod.optimizer`;
``agree=False`` drops both, and join with them). Unlike Horovod, ranks must
issue their collectives in the same order (a different order raises here, naming both names).

Example (two ranks, rank 1 passes a longer tensor)::

    CollectiveMismatchError: hvd.allreduce: the ranks of 'world' disagree ...
      rank  collective  name       op       dtype    shape
      0     allreduce   grad.w     average  float32  (4,)
      1     allreduce   grad.w     average  float32  (6,)
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from fleetlike.comm import CollectiveMismatchError, Communicator, dtype_name
from fleetlike.comm.guard import mismatch_table

__all__ = [
    "ACTIVE",
    "JOINED",
    "NOT_WITH_JOIN",
    "Agreement",
    "HorovodInternalError",
    "Kind",
    "allreduce_count",
    "check",
    "descriptor",
    "finish_exchange",
    "signature",
    "start_exchange",
]


class HorovodInternalError(RuntimeError):
    """A collective the ranks cannot run together (Horovod's name for it)."""


class Kind(enum.IntEnum):
    """The collectives the descriptor can announce."""

    ALLREDUCE = 1
    GROUPED_ALLREDUCE = 2
    ALLGATHER = 3
    BROADCAST = 4
    ALLTOALL = 5
    REDUCESCATTER = 6
    BARRIER = 7
    OPTIMIZER = 8  # a DistributedOptimizer's gradient reduction (its buckets follow)
    JOIN = 9
    OPTIMIZER_SETUP = 10  # a DistributedOptimizer is built (its bucket layout is compared)
    PROCESS_SET = 11  # a process set is added or removed (its ranks travel in the name)
    GROUPED_ALLGATHER = 12
    GROUPED_REDUCESCATTER = 13

    @property
    def label(self) -> str:
        return self.name.lower()


ACTIVE, JOINED = 0, 1
#: dtypes with a code in the descriptor (the code is the position)
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool,
)
MAX_DIMS = 12
_NAME_SLOTS = 6  # 48 bytes of the name travel for the error table; its crc32 compares it whole
# state kind op dtype root ntensors name_crc name[6] ndim numel dims[12]
_HEAD = 7 + _NAME_SLOTS + 2
WIDTH = _HEAD + MAX_DIMS
NOT_WITH_JOIN = {
    Kind.ALLGATHER: "Allgather is not supported with Join at this time. "
                    "Specify sparse_as_dense=True if using DistributedOptimizer",
    Kind.ALLTOALL: "Alltoall is not supported with Join at this time.",
    Kind.BROADCAST: "Broadcast is not supported with Join at this time.",
    Kind.REDUCESCATTER: "Reducescatter is not supported with Join at this time.",
    Kind.GROUPED_ALLGATHER: "Allgather is not supported with Join at this time.",
    Kind.GROUPED_REDUCESCATTER: "Reducescatter is not supported with Join at this time.",
}


def _name_slots(name: str) -> list[int]:
    raw = name.encode()[: 8 * _NAME_SLOTS].ljust(8 * _NAME_SLOTS, b"\0")
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _name_text(slots: Sequence[int]) -> str:
    raw = b"".join(int(s).to_bytes(8, "little", signed=True) for s in slots)
    return raw.rstrip(b"\0").decode(errors="replace")


def descriptor(
    kind: Kind,
    *,
    state: int = ACTIVE,
    op: int = -1,
    dtype: torch.dtype | None = None,
    root: int = -1,
    ntensors: int = 1,
    name: str = "",
    shape: Sequence[int] = (),
    numel: int | None = None,
) -> list[int]:
    """This rank's descriptor row: `WIDTH` ints (int64 on the wire)."""
    if len(shape) > MAX_DIMS:
        raise ValueError(
            f"hvd.{kind.label}: a tensor of {len(shape)} dims; fleetlike's Horovod collectives take "
            f"at most {MAX_DIMS} dims (reshape it, e.g. .flatten(1))"
        )
    code = -1 if dtype is None else (DTYPES.index(dtype) if dtype in DTYPES else -2)
    if code == -2:
        raise TypeError(
            f"hvd.{kind.label}: dtype {dtype} is not supported; use one of "
            f"{', '.join(dtype_name(d) for d in DTYPES)}"
        )
    count = numel if numel is not None else (int(torch.Size(shape).numel()) if shape else 0)
    row = [state, int(kind), op, code, root, ntensors, zlib.crc32(name.encode()) if name else 0,
           *_name_slots(name), len(shape), count, *shape]
    return row + [0] * (WIDTH - len(row))


def allreduce_count(row: Sequence[int]) -> int:
    """The element count of an allreduce's row (a grouped allreduce's shape is (total, crc))."""
    return int(row[_HEAD - 1]) if row[1] == Kind.ALLREDUCE else int(row[_HEAD])


def signature(row: Sequence[int]) -> tuple[int, ...]:
    """What `check` compares of a row, less its state: equal signatures of the active ranks are
    an agreement (kind, op, dtype, root, ntensors, the name's crc32, ndim, numel, dims)."""
    return (*row[1:7], *row[_HEAD - 2 : _HEAD + row[_HEAD - 2]])


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The exchanged table, decoded: what the active ranks asked for and who has joined."""

    rows: list[list[int]]
    joined: list[int]

    @property
    def active(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r[0] == ACTIVE]

    def first(self) -> list[int]:
        """The row of the first active rank (what a joined rank must answer)."""
        return self.rows[self.active[0]]

    def shape(self, i: int) -> tuple[int, ...]:
        r = self.rows[i]
        return tuple(r[_HEAD : _HEAD + r[_HEAD - 2]])

    def kind(self, i: int) -> Kind:
        return Kind(self.rows[i][1])

    def op(self, i: int) -> int:
        return self.rows[i][2]

    def dtype(self, i: int) -> torch.dtype:
        return DTYPES[self.rows[i][3]]

    def root(self, i: int) -> int:
        return self.rows[i][4]

    def ntensors(self, i: int) -> int:
        return self.rows[i][5]

    def name(self, i: int) -> str:
        return _name_text(self.rows[i][7 : 7 + _NAME_SLOTS])

    def numel(self, i: int) -> int:
        return self.rows[i][_HEAD - 1]


#: up to this many bytes of table the exchange is one SUM all-reduce of a zero table holding this
#: rank's row (gloo answers a small all-reduce in about half the time of a small all-gather);
#: larger worlds all-gather the rows
_ALLREDUCE_TABLE_BYTES = 32 << 10


def start_exchange(comm: Communicator, row: torch.Tensor,
                   device: torch.device | None = None) -> tuple[Any, torch.Tensor]:
    """Start exchanging every rank's descriptor (sizes equal by construction: ``agreed=True``)
    on ``device`` (the communicator's: CUDA for NCCL); `finish_exchange` waits and decodes."""
    row = row.to(device) if device is not None else row
    if comm.size * WIDTH * 8 <= _ALLREDUCE_TABLE_BYTES:
        table = torch.zeros(comm.size, WIDTH, dtype=torch.int64, device=row.device)
        table[comm.rank] = row
        return comm.all_reduce_async(table, "sum", agreed=True), table
    out = torch.empty(comm.size * WIDTH, dtype=torch.int64, device=row.device)
    return comm.all_gather_flat_async(row, out=out, agreed=True), out


def finish_exchange(work: Any, table: torch.Tensor, size: int) -> Agreement:
    work.wait()
    rows = table.view(size, WIDTH).tolist()
    return Agreement(rows, [i for i, r in enumerate(rows) if r[0] == JOINED])


def _fields(kind: Kind) -> tuple[str, ...]:
    """What must be equal between the active ranks for ``kind``."""
    common = ("kind", "name")
    if kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        return common + ("op", "dtype", "shape")
    if kind in (Kind.GROUPED_ALLREDUCE, Kind.GROUPED_REDUCESCATTER):
        return common + ("op", "dtype", "ntensors", "shape")
    if kind is Kind.GROUPED_ALLGATHER:
        return common + ("dtype", "ntensors", "shape")
    if kind is Kind.BROADCAST:
        return common + ("dtype", "root", "shape")
    if kind in (Kind.ALLGATHER, Kind.ALLTOALL):
        return common + ("dtype", "trailing")
    if kind in (Kind.OPTIMIZER, Kind.OPTIMIZER_SETUP):
        return common + ("op", "numel", "shape")
    return common


def check(agreement: Agreement, comm: Communicator, what: str, op_names: Sequence[str]) -> None:
    """Raise on every rank alike when the active ranks disagree or the collective cannot run
    beside joined ranks (a pure function of the table, so every rank decides the same)."""
    active = agreement.active
    if not active:
        return
    kind = agreement.kind(active[0])
    if agreement.joined and kind in NOT_WITH_JOIN and all(agreement.kind(i) == kind for i in active):
        raise HorovodInternalError(
            f"{NOT_WITH_JOIN[kind]} (ranks {[comm.ranks[i] for i in agreement.joined]} of "
            f"communicator {comm.name!r} have called hvd.join())"
        )

    def value(i: int, field: str) -> object:
        r = agreement.rows[i]
        if field == "kind":
            return r[1]
        if field == "name":
            return r[6]
        if field == "op":
            return r[2]
        if field == "dtype":
            return r[3]
        if field == "root":
            return r[4]
        if field == "ntensors":
            return r[5]
        if field == "numel":
            return agreement.numel(i)
        if field == "trailing":
            return agreement.shape(i)[1:], len(agreement.shape(i))
        return agreement.shape(i)

    fields = ("kind",) + tuple(f for f in _fields(kind) if f != "kind")
    for field in fields:
        if len({repr(value(i, field)) for i in active}) > 1:
            _raise(agreement, comm, what, op_names, field)


def _raise(agreement: Agreement, comm: Communicator, what: str, op_names: Sequence[str], field: str) -> None:
    rows = []
    for i, r in enumerate(agreement.rows):
        joined = r[0] == JOINED
        rows.append({
            "rank": str(comm.ranks[i]),
            "collective": "joined" if joined else Kind(r[1]).label,
            "name": "-" if joined else (agreement.name(i) or "-"),
            "op": op_names[r[2]] if 0 <= r[2] < len(op_names) else "-",
            "dtype": dtype_name(DTYPES[r[3]]) if r[3] >= 0 else "-",
            "root": str(r[4]) if r[4] >= 0 else "-",
            "shape": str(agreement.shape(i)) if not joined else "-",
        })
    fix = {
        "kind": "every rank must issue the same hvd collectives in the same order (fleetlike does not "
                "reorder them by name as Horovod's coordinator does)",
        "name": "the same collective must carry the same name on every rank, in the same order",
        "op": "pass the same op on every rank",
        "dtype": "cast to one dtype on every rank",
        "root": "pass the same root_rank on every rank",
        "ntensors": "pass the same number of tensors on every rank",
        "shape": "pass tensors of the same shape on every rank (DistributedOptimizer: the same model, "
                 "strategy and groups, so the gradient buckets match)",
        "numel": "every rank must wrap the same model's parameters",
        "trailing": "all dimensions but the first must be the same on every rank",
    }[field]
    raise CollectiveMismatchError(
        f"{what}: the ranks of communicator {comm.name!r} disagree on the {field} of one collective:\n"
        f"{mismatch_table(rows)}\n{fix}",
        rows,
    )

"""`Program`: one training step as an ordered, printable, cloneable list of ops.

Paddle users think of a step as a program they can print, clone and swap
(``fleet.main_program`` vs ``fleet._origin_program``). Here a program is a list of `Op` s that
each call into live PyTorch objects (the model, the optimizer, a gradient reducer). Strategy
passes rewrite a program by replacing and inserting ops, so ``print(program)`` shows exactly what
a strategy did: which collectives, on which buckets and communicators, in which order.

Some ops only *describe* work that another op carries out (a bucket allreduce is launched from
a gradient hook during ``backward``); they have no ``fn`` and are printed indented under the op
that runs them, so the listing stays true to the execution order.

Example:
    >>> prog = Program("demo", [Op("forward", fn=lambda s: None)])
    >>> print(prog)
    program 'demo' (1 ops)
      0  forward
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["Op", "Program", "StepState"]


@dataclasses.dataclass
class StepState:
    """What flows between the ops of one run: the feed, the loss and the named outputs."""

    feed: Any
    outputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    loss: torch.Tensor | None = None
    #: set by an op (AMP's finite check) to skip the optimizer update of this step
    skip_update: bool = False
    #: set by gradient merge on all but the k-th run: gradients only accumulate (no
    #: communication, no update, no clearing)
    accumulate: bool = False
    #: False inside ``model.no_sync()``: this backward's gradients stay local (they accumulate)
    communicate: bool = True
    #: tensors whose autograd graph the coming backward walks (the loss; in eager style the
    #: model's outputs), for finding parameters that get no gradient
    roots: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: free-form per-step facts (collectives issued, bytes, k, ...) for the stats record
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Op:
    """One step of a program.

    Attributes:
        type: what it is, in Paddle's vocabulary where one exists ("forward", "backward",
            "c_allreduce_avg", "optimizer_update", ...).
        fn: the work; ``None`` for an op carried out by its parent (see the module docstring).
        attrs: facts printed with the op (bucket, size, dtype, communicator, ...). A callable
            value is evaluated at print time, for live facts such as the current k.
        parent: for descriptive ops, the type of the op that carries them out.
    """

    type: str
    fn: Callable[[StepState], None] | None = None
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    parent: str | None = None

    def describe(self) -> str:
        parts = []
        for key, value in self.attrs.items():
            if callable(value):
                value = value()
            parts.append(f"{key}={value}")
        return self.type + (" " + " ".join(parts) if parts else "")


class Program:
    """An ordered list of ops; ``run(feed)`` executes one training step.

    Programs are cheap to clone (ops are shared, the list is not), so a pass never mutates the
    program it was given: ``_origin_program`` stays purely local however ``main_program`` was
    rewritten.
    """

    def __init__(self, name: str, ops: list[Op] | None = None, *, device: torch.device | None = None) -> None:
        self.name = name
        self.ops: list[Op] = list(ops or [])
        self.device = device if device is not None else torch.device("cpu")
        #: lines printed under the header (strategy state such as k or the loss scale)
        self.notes: list[Callable[[], str]] = []
        self.runs = 0

    # ------------------------------------------------------------------ editing (for passes)

    def clone(self, name: str | None = None) -> Program:
        other = Program(name or self.name, [copy.copy(op) for op in self.ops], device=self.device)
        other.notes = list(self.notes)
        return other

    def index(self, op_type: str) -> int:
        for i, op in enumerate(self.ops):
            if op.type == op_type:
                return i
        raise KeyError(f"program {self.name!r} has no op {op_type!r}; ops: {[o.type for o in self.ops]}")

    def has(self, op_type: str) -> bool:
        return any(op.type == op_type for op in self.ops)

    def replace(self, op_type: str, *ops: Op) -> None:
        i = self.index(op_type)
        self.ops[i : i + 1] = list(ops)

    def insert_before(self, op_type: str, *ops: Op) -> None:
        i = self.index(op_type)
        self.ops[i:i] = list(ops)

    def wrap(self, op_type: str, before: Callable[[StepState], None] | None = None,
             after: Callable[[StepState], None] | None = None, **attrs: Any) -> None:
        """Replace op ``op_type`` by one running ``before``, the old op, then ``after``.

        This is how passes compose on the same op (AMP scales the loss in ``backward``, data
        parallel arms its hooks around it) without knowing of each other."""
        i = self.index(op_type)
        old = self.ops[i]
        inner = old.fn

        def fn(state: StepState) -> None:
            if before is not None:
                before(state)
            if inner is not None:
                inner(state)
            if after is not None:
                after(state)

        self.ops[i] = Op(old.type, fn, {**old.attrs, **attrs}, old.parent)

    def insert_after(self, op_type: str, *ops: Op) -> None:
        i = self.index(op_type)
        self.ops[i + 1 : i + 1] = list(ops)

    def collectives(self) -> list[Op]:
        """The communication ops, in order (what differs between main and origin programs)."""
        return [op for op in self.ops if op.type.startswith(("c_", "broadcast", "all_", "reduce"))]

    # ------------------------------------------------------------------ running

    def run(self, feed: Any = None) -> StepState:
        state = StepState(feed=feed)
        for op in self.ops:
            if op.fn is not None:
                op.fn(state)
        self.runs += 1
        return state

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __str__(self) -> str:
        lines = [f"program {self.name!r} ({len(self.ops)} ops)"]
        lines += [f"  # {note()}" for note in self.notes]
        n = 0
        for op in self.ops:
            if op.fn is None and op.parent is not None:
                lines.append(f"       - {op.describe()}   (during {op.parent})")
            else:
                lines.append(f"  {n:>2}  {op.describe()}")
                n += 1
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Program {self.name!r}: {', '.join(op.type for op in self.ops)}>"


def to_host(value: Any) -> Any:
    """A fetched output as the user expects it: a Python float for scalars, else numpy."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.numel() == 1 and value.dim() == 0:
            return float(value.float().item()) if value.is_floating_point() else int(value.item())
        return value.cpu().float().numpy() if value.dtype == torch.bfloat16 else value.cpu().numpy()
    return value


def fetch(state: StepState, fetch_list: list[str] | None, program: Program) -> list[Any]:
    """Values of ``fetch_list`` (names of ``loss_fn`` outputs) from one run, in order."""
    if not fetch_list:
        return []
    out = []
    available: Mapping[str, Any] = {**state.info, **state.outputs}
    for name in fetch_list:
        key = getattr(name, "name", name)
        if key not in available:
            raise KeyError(
                f"fetch_list names {key!r}, but program {program.name!r} produced "
                f"{sorted(state.outputs)}; return it from loss_fn as a dict entry"
            )
        out.append(to_host(available[key]))
    return out

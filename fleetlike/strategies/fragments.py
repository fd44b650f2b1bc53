"""Local SGD's synced unit: a fragment of the model, its anchor, and the outer step applied to it.

Every rank keeps, per fragment, an *anchor*: the parameters as they were after the fragment's
last sync, identical on all ranks. A sync sends the change since then, ``delta = anchor - param``
(DiLoCo's pseudo-gradient), averages it over the ranks and applies it to the anchor with the
outer rule:

- ``average`` (Paddle's local SGD): ``anchor -= mean_delta`` — the average of the parameters;
- ``sgd``: torch's SGD on the anchor with ``mean_delta`` as its gradient, ``lr=outer_lr``,
  heavy-ball ``momentum=outer_momentum`` (none if 0);
- ``nesterov`` (DiLoCo): the same with ``nesterov=True``.

The arithmetic is torch.optim.SGD's, operation for operation (``buf = mu * buf + g`` with the
first buffer ``g`` itself; ``g + mu * buf`` for Nesterov; ``p.add_(d, alpha=-lr)``), so an
in-process `torch.optim.SGD` over the anchors is an exact reference.

Streaming DiLoCo (Douillard et al., 2025) splits the model into fragments synced at staggered
steps, so each sync sends 1/F of the model, and lets a fragment's allreduce run while the next
``overlap`` inner steps compute: ``launch`` starts it, ``land`` waits and applies it. Whatever the
overlapped local steps changed in the meantime is mixed back in: ``param = new_anchor +
alpha * (param_now - new_anchor)`` (torchft's ``fragment_update_alpha``; 0 keeps only the outer
result). Without overlap ``param = new_anchor``.

**One scratch buffer per flat buffer.** A sync writes the flat parameters and the delta into
the same persistent buffer (``torch.cat(out=)``, then ``anchor - it`` in place), instead of two
fresh tensors per sync. Fresh tensors of model size come back from the allocator as fresh pages:
on a 2-core host a rank of the 14 MB transformer took 1,559-1,921 minor faults per sync in this
op (~9 ms of first touch at 3-8 us a page), every sync. The buffer keeps one copy of the model
resident; the peak is one copy lower (the flat copy and the delta no longer coexist).

Example:
    >>> frags = split_fragments(params, 4, collective, cap_bytes=32 << 20)
    >>> frags[0].snapshot()
    >>> sent = frags[0].launch(); frags[0].land(OuterRule("nesterov", 0.7, 0.9), alpha=0.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fleetlike.collectives import plan_buckets
from fleetlike.comm import Work, dtype_name

__all__ = ["AveragingStart", "Fragment", "OuterRule", "split_fragments"]


class AveragingStart(Protocol):
    """What a fragment needs of a collective: average a tensor in place, asynchronously."""

    def start_tensor(self, tensor: torch.Tensor, index: int) -> Work: ...


@dataclasses.dataclass(frozen=True)
class OuterRule:
    """The outer optimizer: ``kind`` in {"average", "sgd", "nesterov"}, its lr and momentum."""

    kind: str = "average"
    lr: float = 1.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("average", "sgd", "nesterov"):
            raise ValueError(f"outer optimizer {self.kind!r} is not one of 'average', 'sgd', 'nesterov'")
        if self.kind == "nesterov" and not self.momentum > 0:
            raise ValueError("outer optimizer 'nesterov' needs outer_momentum > 0")

    @property
    def uses_momentum(self) -> bool:
        return self.kind != "average" and self.momentum > 0

    def apply_(self, anchor: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor | None:
        """Step ``anchor`` in place with the averaged ``delta``; returns the momentum buffer."""
        if self.kind == "average":
            anchor.sub_(delta)
            return buf
        step = delta
        if self.momentum > 0:
            if buf is None:
                buf = delta.clone()
            else:
                buf.mul_(self.momentum).add_(delta)
            step = delta.add(buf, alpha=self.momentum) if self.kind == "nesterov" else buf
        anchor.add_(step, alpha=-self.lr)
        return buf


class Fragment:
    """Some of the model's parameters, as flat per-dtype buffers, with their anchor and momentum.

    ``first_slot`` spreads the buffers of all fragments over the collective's communicators
    (buffer ``i`` of the job goes to communicator ``i % n``)."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], collective: AveragingStart,
                 cap_bytes: int | None, first_slot: int, wire: torch.dtype | None) -> None:
        self.index = index
        self.params = params
        self.collective = collective
        self.groups = plan_buckets(params, cap_bytes) if params else []
        self.first_slot = first_slot
        self.wire = wire
        self.anchors: list[torch.Tensor] | None = None
        self.momentum: list[torch.Tensor | None] = [None] * len(self.groups)
        #: the averaged deltas in flight (launched, not landed) and their handles
        self.deltas: list[torch.Tensor] | None = None
        self.works: list[Work] = []
        #: one persistent buffer per flat buffer: the flat parameters, then the delta in place
        self.scratch: list[torch.Tensor] = []

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def wire_bytes(self) -> int:
        """Bytes one sync of this fragment sends per rank (the wire dtype's, if compressed)."""
        total = 0
        for g in self.groups:
            size = torch.empty((), dtype=self.wire).element_size() if self.wire is not None else g[0].element_size()
            total += sum(p.numel() for p in g) * size
        return total

    def flat(self, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Buffer ``i``'s parameters as one flat tensor (written into ``out`` where given)."""
        pieces = [p.detach().reshape(-1) for p in self.groups[i]]
        return torch.cat(pieces) if out is None else torch.cat(pieces, out=out)

    def _scratch(self, i: int) -> torch.Tensor:
        if not self.scratch:  # made at the first sync, shaped like the anchors
            self.scratch = [torch.empty_like(a) for a in self.anchors or []]
        return self.scratch[i]

    def snapshot(self) -> None:
        """Anchor = the parameters now (identical on every rank after a broadcast or an average)."""
        self.anchors = [self.flat(i) for i in range(len(self.groups))]

    @property
    def in_flight(self) -> bool:
        return self.deltas is not None

    def launch(self) -> int:
        """Start averaging ``anchor - param`` over the ranks; returns the bytes this rank sends."""
        if self.anchors is None:
            raise RuntimeError(f"local SGD fragment {self.index}: no anchor was taken before its first sync")
        if self.deltas is not None:
            raise RuntimeError(f"local SGD fragment {self.index}: launched twice without landing")
        deltas = []
        for i, a in enumerate(self.anchors):
            d = self.flat(i, out=self._scratch(i))
            deltas.append(torch.sub(a, d, out=d))
        self.deltas = deltas
        self.works = [self.collective.start_tensor(d, self.first_slot + i) for i, d in enumerate(self.deltas)]
        return self.wire_bytes()

    def wait(self) -> None:
        """Wait for the deltas in flight (they are then averaged, on every rank)."""
        for w in self.works:
            w.wait()
        self.works = []

    def land(self, rule: OuterRule, alpha: float, overlapped: bool) -> None:
        """Wait, step the anchor with ``rule``, and set the parameters (see the module doc)."""
        if self.deltas is None or self.anchors is None:
            raise RuntimeError(f"local SGD fragment {self.index}: landing a sync that was never launched")
        self.wait()
        with torch.no_grad():
            for i, (group, anchor, delta) in enumerate(zip(self.groups, self.anchors, self.deltas)):
                self.momentum[i] = rule.apply_(anchor, delta, self.momentum[i])
                new = anchor
                if overlapped and alpha != 0.0:  # delta is spent: its buffer takes the mix
                    new = self.flat(i, out=self._scratch(i)).sub_(anchor).mul_(alpha).add_(anchor)
                offset = 0
                for p in group:
                    p.copy_(new[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.deltas = None

    def describe(self, comm_name: Callable[[int], str]) -> list[str]:
        out = []
        for i, g in enumerate(self.groups):
            numel = sum(p.numel() for p in g)
            wire = dtype_name(self.wire) if self.wire is not None else dtype_name(g[0].dtype)
            out.append(f"fragment={self.index} buffer={i} params={len(g)} numel={numel} "
                       f"dtype={dtype_name(g[0].dtype)} wire={wire} comm={comm_name(self.first_slot + i)}")
        return out

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Anchor, momentum and a sync in flight (waited for: its averaged deltas are saved, so a
        resumed job lands it at the same step)."""
        if self.deltas is not None:
            self.wait()
        return {
            "anchors": None if self.anchors is None else [a.clone() for a in self.anchors],
            "momentum": [None if m is None else m.clone() for m in self.momentum],
            "pending": None if self.deltas is None else [d.clone() for d in self.deltas],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        want = [sum(p.numel() for p in g) for g in self.groups]
        for key in ("anchors", "pending"):
            got = state[key]
            if got is not None and [t.numel() for t in got] != want:
                raise ValueError(
                    f"local SGD state: fragment {self.index}'s saved {key} have sizes "
                    f"{[t.numel() for t in got]}, this model's buffers {want}; load a checkpoint of "
                    "the same model, fuse_grad_size_in_MB, fuse_all_reduce_ops and fragments"
                )
        self.anchors = None if state["anchors"] is None else [a.clone() for a in state["anchors"]]
        momentum = state["momentum"]
        self.momentum = [None if m is None else m.clone() for m in momentum] if momentum else [None] * len(self.groups)
        self.deltas = None if state["pending"] is None else [d.clone() for d in state["pending"]]
        self.works = []


def split_fragments(params: list[torch.nn.Parameter], count: int, collective: AveragingStart,
                    cap_bytes: int | None, wire: torch.dtype | None = None) -> list[Fragment]:
    """``count`` fragments of consecutive parameters with about equal bytes each.

    Consecutive, so a fragment is a run of layers (Streaming DiLoCo's sequential pattern) and
    its buffers are contiguous in the model's order; a parameter is never split. With fewer
    parameters than fragments the surplus fragments are empty (they sync nothing)."""
    if count < 1:
        raise ValueError(f"fragments={count!r} must be >= 1")
    total = sum(p.numel() * p.element_size() for p in params)
    parts: list[list[torch.nn.Parameter]] = [[] for _ in range(count)]
    done, f = 0, 0
    for p in params:
        # move on once this fragment holds its share of the bytes (never leaving a later one empty
        # while parameters remain for it)
        while f < count - 1 and parts[f] and done >= total * (f + 1) / count:
            f += 1
        parts[f].append(p)
        done += p.numel() * p.element_size()
    frags, slot = [], 0
    for i, part in enumerate(parts):
        frag = Fragment(i, part, collective, cap_bytes, slot, wire)
        slot += len(frag.groups)
        frags.append(frag)
    return frags

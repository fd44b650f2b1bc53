"""The divergence guard: a parameter checksum across ranks, so ranks never silently diverge.

Data parallelism keeps one model on every rank only as long as every rank starts from the same
parameters and applies the same averaged update. A rank that skipped a broadcast, loaded
another checkpoint, ran another optimizer step, or trained alone in a world it mistook for
one of its own goes on training happily and ends with other parameters. The guard compares
the ranks' parameters where they must agree (right after the starting broadcast, and every
``every`` steps) and stops the job on every rank, naming the first parameter that differs and
which ranks hold which value.

The checksum of a parameter is the 64-bit integer sum of its raw bits (each element read as an
integer of its own width): exact and independent of order, so any single changed element
changes it, and equal parameters always agree. Every check is one pass over the parameters and
one allreduce of ``2 x count`` int64 values (max of the checksums and of their negation); only a
failed check gathers more, to name the ranks. At the default ``every`` it costs well under 1%
of a step (docs/ddp.md has the measurement).

``FLEETLIKE_DIVERGENCE_CHECK_N_STEPS`` sets ``every`` for every face (0 turns the periodic check
off; the check after the starting broadcast stays): the faces read it through
`fleetlike.roles.settings.env_settings` and pass it down; this layer never reads the environment.

Example:
    >>> guard = DivergenceGuard(comm, model.named_parameters(), every=DEFAULT_EVERY)
    >>> guard.check("after the broadcast")     # collective: every rank calls it
    >>> for batch in data: ...; opt.step(); guard.tick()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fleetlike.comm import Communicator, ReduceOp

__all__ = ["DEFAULT_EVERY", "DivergenceError", "DivergenceGuard", "checksums"]

#: steps between two checks by default (``every=None``)
DEFAULT_EVERY = 200

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DivergenceError(RuntimeError):
    """The ranks' parameters differ where data parallelism requires them equal."""


def checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' raw bits (on the tensors' device)."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(_INT_OF_WIDTH[flat.element_size()]) if flat.dtype.is_floating_point else flat
        out.append(bits.sum(dtype=torch.int64))
    if not out:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack(out).cpu()


class DivergenceGuard:
    """Compares ``params`` across the ranks of ``comm`` (see the module doc).

    Args:
        comm: a communicator of the ranks that must agree, used by nothing that may run at the
            same time (a face gives the guard a split of its own).
        params: ``(name, tensor)`` pairs (``model.named_parameters()``), the same on every rank.
        every: steps between periodic checks (`tick`); 0 turns them off; None: `DEFAULT_EVERY`.
        what: the face, for the error (``"DDP"``, ``"fleet"``, ``"hvd.DistributedOptimizer"``).
    """

    def __init__(self, comm: Communicator, params: Iterable[tuple[str, torch.Tensor]], every: int | None = None,
                 what: str = "data parallel") -> None:
        every = DEFAULT_EVERY if every is None else every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"every={every!r} must be an integer >= 0 (0 = no periodic check)")
        self.comm = comm
        pairs = list(params)
        self.names = [n for n, _ in pairs]
        self.tensors = [t for _, t in pairs]
        self.every = every
        self.what = what
        self.steps = 0
        self.checks = 0

    def tick(self) -> None:
        """One training step done: check every ``every`` steps (collective then)."""
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            self.check(f"after step {self.steps}")

    def check(self, when: str) -> None:
        """Raise `DivergenceError` on every rank when the parameters differ (collective)."""
        self.checks += 1
        if self.comm.size == 1:
            return
        mine = checksums(self.tensors).to(self.comm.device)
        both = torch.cat([mine, -mine])
        self.comm.all_reduce(both, ReduceOp.MAX)
        n = mine.numel()
        both, mine = both.cpu(), mine.cpu()
        hi, lo = both[:n], -both[n:]
        differ = (hi != lo).nonzero()
        if differ.numel() == 0:
            return
        first = int(differ[0])
        values = self.comm.all_gather_flat(mine[first: first + 1].to(self.comm.device)).tolist()
        holders: dict[int, list[int]] = {}
        for r, v in enumerate(values):
            holders.setdefault(int(v), []).append(r)
        camps = sorted(holders.values(), key=lambda rs: (-len(rs), rs[0]))
        split = "; ".join(f"ranks {rs} agree" if len(rs) > 1 else f"rank {rs[0]} alone" for rs in camps)
        t = self.tensors[first]
        raise DivergenceError(
            f"rank {self.comm.rank}: the ranks' parameters differ {when} ({self.what}): the first is "
            f"{self.names[first]!r} {tuple(t.shape)} (parameter {first} of {n}; {int(differ.numel())} differ "
            f"in all): {split}. Every rank must start from the same parameters (broadcast them from "
            f"one rank) and apply the same averaged update; a rank that trains alone or loads "
            f"another checkpoint diverges. (FLEETLIKE_DIVERGENCE_CHECK_N_STEPS sets how often this is checked)"
        )

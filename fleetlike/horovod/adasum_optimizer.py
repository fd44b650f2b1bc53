"""``hvd.DistributedOptimizer(..., op=hvd.Adasum)``: Horovod's Adasum "delta" optimizer.

With Adasum Horovod reduces the update, not the gradient (``_DistributedAdasumOptimizer``):
each rank steps its own optimizer on its own gradients, the change of every parameter
(``delta = new - start``) is combined over the ranks with Adasum (each parameter with its own
coefficients), and every rank lands on ``start + adasum(deltas)``. Gradients accumulate locally
over ``backward_passes_per_step`` backward passes; the reduction happens in ``step()`` (one
fused grouped allreduce of every delta, through the same agreement as ``hvd.grouped_allreduce``,
so ranks that called ``hvd.join()`` contribute zero deltas). ``synchronize()`` does nothing and
``skip_synchronize()`` raises, as in Horovod.

Example:
    >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    >>> loss.backward(); opt.step()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fleetlike.collectives import Accumulation, count_passes
from fleetlike.fleet import fleet
from fleetlike.horovod.adasum import check_adasum
from fleetlike.horovod.collectives import grouped_allreduce_
from fleetlike.horovod.ops import Compression, Compressor, ReduceOp
from fleetlike.horovod.optimizer import _TOO_MANY, _ZERO_GRAD_ERROR, HorovodWrapper, named_parameter_map
from fleetlike.horovod.runtime import runtime
from fleetlike.horovod.strategy_units import passes_per_step

__all__ = ["AdasumOptimizer"]


class AdasumOptimizer(HorovodWrapper):
    """What ``hvd.DistributedOptimizer(op=hvd.Adasum)`` returns (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                 compression: type[Compressor] | Compressor = Compression.none,
                 backward_passes_per_step: int = 1) -> None:
        rt = runtime("hvd.DistributedOptimizer")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        for dtype in {p.dtype for p in params}:
            check_adasum(rt.comm.size, dtype)
        chosen = fleet.effective_strategy(None, "hvd.DistributedOptimizer")
        on = [n for n in ("gossip", "slow_rank_check") if getattr(chosen, n)]
        if on:
            raise ValueError(f"strategy.{' and '.join(on)} (FLEETLIKE_/PERSEUS_DOWNSAMPLE_N_ELEMENTS, "
                             "..._PERF_CHECK_N_STEPS) with hvd.DistributedOptimizer(op=hvd.Adasum): Adasum combines "
                             "the updates inside step(), there are no gradient buckets to down-sample or time. Fix: "
                             "unset them for this job, or use op=hvd.Average")
        # AIACC's accumulate knob (gradient_merge) is Horovod's backward_passes_per_step here too
        backward_passes_per_step = passes_per_step(chosen, backward_passes_per_step)
        super().__init__(optimizer, chosen, fleet.context())
        self._names = named_parameter_map(optimizer, named_parameters)
        self.compression = compression
        self.op = ReduceOp.ADASUM
        #: the core's count of backward passes (the gradients add up locally; step() closes it)
        self._accumulation = Accumulation(backward_passes_per_step, field="backward_passes_per_step",
                                          too_many=_TOO_MANY)
        self._params = params
        self._hooks = count_passes(params, self._accumulation)

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self.inner_optimizer!r}, op=Adasum)"

    @property
    def backward_passes_per_step(self) -> int:
        return self._accumulation.k

    def set_backward_passes_per_step(self, passes: int) -> None:
        self._accumulation.set_k(passes, "backward_passes_per_step")

    def _detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def synchronize(self) -> bool:  # type: ignore[override]
        """Nothing to do: Adasum reduces the update inside ``step()``."""
        return True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Local step, then every rank moves to ``start + adasum(delta)``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        starts = [p.detach().clone() for p in self._params]
        self.inner_optimizer.step()
        with torch.no_grad():
            deltas = [(p - s).reshape(-1) for p, s in zip(self._params, starts)]
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, p in enumerate(self._params):
                by_dtype.setdefault(p.dtype, []).append(i)
            for dtype, idx in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
                pairs = [self.compression.compress(deltas[i]) for i in idx]
                wire = [q[0] for q in pairs]  # fresh tensors (p - start), reduced in place
                grouped_allreduce_(wire, op=ReduceOp.ADASUM, name=f"adasum.delta.{dtype}")
                for (_, ctx), t, i in zip(pairs, wire, idx):
                    delta = self.compression.decompress(t, ctx)
                    p = self._params[i]
                    p.copy_(starts[i] + delta.view_as(p))
        self._accumulation.close()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._accumulation.count:
            raise AssertionError(_ZERO_GRAD_ERROR)
        self.inner_optimizer.zero_grad(set_to_none)

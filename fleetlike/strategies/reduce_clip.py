"""How data parallel reduces and clips the gradients: EPL's ``communication.gradients_reduce_method``
(``sharding_configs.gradients_reduce_method``) and ``communication.clip_after_allreduce``
(``sharding_configs.clip_after_allreduce``) with the clip of ``sharding_configs.clip_norm``.

EPL describes the two keys as "the way of the gradient AllReduce, 'mean' or 'sum'" and "clip the
gradients after the communication, or communicate after clipping them". With ``g_r`` the gradient
of rank ``r`` (its complete gradient: every parameter, one global L2 norm) and ``clip(g, c)`` =
``g * min(1, c / (||g|| + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule), a step updates with

=========================  ==========================  ==========================
                           ``clip_after_allreduce``    ``clip_after_allreduce``
                           True                        False (EPL's default)
=========================  ==========================  ==========================
``"mean"`` (the default)   ``clip(mean_r g_r, c)``     ``mean_r clip(g_r, c)``
``"sum"``                  ``clip(sum_r g_r, c)``      ``sum_r clip(g_r, c)``
=========================  ==========================  ==========================

"After" is data parallel followed by ``clip_grad_norm_``: every rank holds the same reduced
gradient, so its norm is computed locally, once per update. "Before" clips each rank's own norm,
so a rank with a large gradient no longer dominates the average; the buckets then start at the
end of backward, not while it runs (the clip needs the whole local gradient). The clip sees true
gradients in every combination: under AMP's float16 loss scaling the local gradient is ``scale``
times the true one and the threshold is ``c * scale``; under gradient merge with ``avg`` the local
gradient is the sum of ``k`` micro-steps and the threshold is ``c * k`` (the clip of their mean).
"After" runs once the update's gradients are final (unscaled, merged, averaged).

A clip of your own (``clip_grad_norm_`` after ``optimizer.synchronize()``, as with Horovod) sees the
reduced gradient, which is what ``clip_after_allreduce = True`` means.

Example:
    >>> s = DistributedStrategy.from_dict({"communication.gradients_reduce_method": "sum",
    ...                                    "sharding_configs.clip_norm": 1.0})
    >>> policy = ReduceClip(s, world_size=2)
    >>> policy.method, policy.clip_after, policy.clip_norm
    ('sum', False, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fleetlike.collectives import Bucket, BucketCollective, ScaledAllReduce
from fleetlike.comm import Communicator, Work
from fleetlike.config import DistributedStrategy
from fleetlike.program import StepState

__all__ = ["ReduceClip", "SummedAllReduce", "clip_by_norm", "global_norm"]


def global_norm(grads: Sequence[torch.Tensor]) -> float:
    """The L2 norm of all of ``grads`` together (float64 accumulation)."""
    sq = 0.0
    for g in grads:
        sq += float(g.detach().double().pow(2).sum())
    return math.sqrt(sq)


def clip_by_norm(grads: Sequence[torch.Tensor], max_norm: float, norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s rule in place: multiply by ``min(1, max_norm / (norm +
    1e-6))``; returns the coefficient. A non-finite norm leaves the gradients as they are (AMP's
    finite check, or check_nan_inf, then sees them)."""
    if not math.isfinite(norm):
        return 1.0
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return coef


class SummedAllReduce:
    """A `BucketCollective` that sums: the inner one averages over ``world.size`` ranks, so its
    result is multiplied by the size (exact for a power-of-two world)."""

    def __init__(self, inner: BucketCollective) -> None:
        self.inner = inner
        self._scaled = ScaledAllReduce(inner, 1.0, float(inner.world.size))

    @property
    def world(self) -> Communicator:
        return self.inner.world

    def start(self, bucket: Bucket) -> Work:
        return self._scaled.start(bucket)

    def describe(self, bucket: Bucket) -> dict[str, Any]:
        d = dict(self.inner.describe(bucket))
        d["op"] = d.get("op", "c_allreduce_avg").replace("_avg", "_sum")
        return d


class ReduceClip:
    """The reduce method and the clip of one data-parallel job (see the module docstring).

    ``multiplier()`` says, at the end of a communicating backward, what the local gradient is a
    multiple of its true value (AMP's loss scale, gradient merge's k), so that the clip before
    the allreduce clips the true gradient."""

    def __init__(self, s: DistributedStrategy, *, world_size: int,
                 multiplier: Callable[[], float] = lambda: 1.0) -> None:
        cfg = s.sharding_configs
        self.method = str(cfg["gradients_reduce_method"])
        self.clip_norm = float(cfg["clip_norm"])
        self.clip_after = bool(cfg["clip_after_allreduce"])
        self.world_size = world_size
        self.multiplier = multiplier
        #: the last clip's norm of the true gradient and coefficient (a rank's own before the
        #: allreduce, the reduced one after)
        self.last_norm: float | None = None
        self.last_coef: float | None = None

    @property
    def clips_before(self) -> bool:
        return self.clip_norm > 0 and not self.clip_after

    @property
    def clips_after(self) -> bool:
        return self.clip_norm > 0 and self.clip_after

    def collective(self, coll: BucketCollective) -> BucketCollective:
        """``coll`` (which averages) as the reduce method wants it."""
        return SummedAllReduce(coll) if self.method == "sum" else coll

    def clip_local(self, grads: Sequence[torch.Tensor]) -> None:
        """Clip this rank's complete local gradient (``grads``, multiplied by ``multiplier()``)."""
        m = float(self.multiplier())
        norm = global_norm(grads)
        self.last_coef = clip_by_norm(grads, self.clip_norm * m, norm)
        self.last_norm = norm / m

    def clip_reduced(self, st: StepState, grads: Sequence[torch.Tensor]) -> None:
        """Clip the reduced gradient of an update (the same on every rank)."""
        if st.accumulate or st.skip_update:
            return
        norm = global_norm(grads)
        self.last_coef = clip_by_norm(grads, self.clip_norm, norm)
        self.last_norm = norm
        st.info["grad_norm"] = norm

    def describe_method(self) -> str:
        """What ``fleet.applied_strategy()`` says about the reduction."""
        return ("gradients averaged over" if self.method == "mean" else "gradients summed over") + f" {self.world_size} ranks"

    def describe_clip(self) -> str:
        """What ``fleet.applied_strategy()`` says about the clip."""
        if self.clip_norm <= 0:
            return ("no clip_norm: the strategy clips nothing (a clip_grad_norm_ of your own after "
                    "optimizer.synchronize() sees the reduced gradient)")
        if self.clip_after:
            return f"the reduced gradient clipped to global norm {self.clip_norm:g} after the allreduce"
        return (f"each rank's own gradient clipped to global norm {self.clip_norm:g} before the "
                "allreduce, which then starts at the end of backward")

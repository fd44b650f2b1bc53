"""`fleetlike_hook`: a DDP communication hook that averages DDP's buckets with fleetlike's collectives.

``DistributedDataParallel.register_comm_hook(state, hook)`` hands each gradient bucket
(``dist.GradBucket``: a flat buffer, its index, its parameters) to ``hook(state, bucket)``, which
must return a ``torch.futures.Future`` whose value is the averaged buffer; DDP waits for every
future at the end of backward and copies the values into ``.grad`` (torch's
``default_hooks.allreduce_hook`` is the reference). Here the bucket is averaged by the
collective `FleetHookState` built from the strategy (flat, hierarchical, 16-bit, several
communicators; gossip on top), issued from autograd's thread in bucket order on every rank,
and a helper thread per communicator completes the future when the collective is done, so
backward keeps running meanwhile, as with DDP's own allreduce.

Local accumulation (``gradient_merge_configs.k_steps = k``): passes that do not communicate
return the bucket unchanged, which is DDP's ``no_sync()``: the gradients stay in ``.grad`` and
the k-th backward averages their sum. Write the loop as for ``no_sync`` (step and zero the
gradients after the k-th backward), or let `fleetlike.auto` do that for an unchanged script.

Example:
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
    >>> state = register(ddp, DistributedStrategy(use_hierarchical_allreduce=True))
    >>> # or by hand: ddp.register_comm_hook(FleetHookState(strategy, model=ddp), fleetlike_hook)
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks the hook's
# annotations as objects (``bucket: dist.GradBucket``), not strings.
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from fleetlike.config import DistributedStrategy
from fleetlike.ddp.state import FleetHookState

__all__ = ["fleetlike_hook", "register"]


def fleetlike_hook(state: FleetHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the job with ``state``'s collective (see the module doc)."""
    buf, index, params = bucket.buffer(), bucket.index(), bucket.parameters()
    # devices=: DDP's stream waits on the stream the finisher completes the future on
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
    if index == 0:
        state.communicating = state.start_pass()
    if not state.communicating:  # an accumulating pass: as no_sync, the gradients stay local
        fut.set_result(buf)
        return fut
    state.ensure_connected(buf.device)
    if state.sampler is not None:
        state.record_sizes(params)
    local_bad = state.non_finite(buf, params, state.name) if state.nan_check else []
    work, finish = state.start(buf, index, params)
    state.bucket_launched()
    last = bucket.is_last()

    def complete() -> None:
        try:
            work.wait()
            if finish is not None:
                finish()
            if state.nan_check:
                state.check_finite(buf, params, local_bad, index)
            if last:
                state.pass_done()
            fut.set_result(buf)
        except BaseException as exc:  # noqa: BLE001 - DDP re-raises it from backward
            fut.set_exception(exc)

    state.finish_async(index, complete)
    if last:
        state.perf_tick()
    return fut


def register(
    model: torch.nn.parallel.DistributedDataParallel,
    strategy: Optional[Union[DistributedStrategy, FleetHookState]] = None,
    **state_args: Any,
) -> FleetHookState:
    """Register `fleetlike_hook` on ``model`` with a state built from ``strategy`` (or the
    given state), bound to the model's parameter names; returns the state (checkpoint it with
    ``torch.save`` / ``pickle`` like torch's PowerSGDState)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register(model=...) takes a DistributedDataParallel model, got {type(model).__name__}")
    state = strategy if isinstance(strategy, FleetHookState) else FleetHookState(strategy, **state_args)
    state.bind(model)
    model.register_comm_hook(state, fleetlike_hook)
    return state

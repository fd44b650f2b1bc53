"""The comm hook slot of a DDP model built under `fleetlike.auto`: the script's own hook wins.

DDP takes one communication hook per model, and refuses a second ("register_comm_hook ... can
only be called once"). `fleetlike.auto` registers its hook inside ``DDP.__init__``, before the
script's own ``ddp.register_comm_hook(state, hook)`` (torch's allreduce / fp16_compress /
PowerSGD hooks, or one of the script's) can run. So what DDP holds is a slot that calls
fleetlike's hook until the script registers its own; then the slot calls the script's hook and
fleetlike says so in one line (rank 0 of the model's group). A script that wants both writes a
hook that calls `fleetlike.ddp.fleetlike_hook` itself.

Example:
    >>> slot = attach(ddp_model, state, on_replace=print)
    >>> ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)   # the slot now calls it
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fleetlike.collectives.divergence import DivergenceGuard
from fleetlike.ddp.hooks import fleetlike_hook
from fleetlike.ddp.state import FleetHookState

__all__ = ["HookSlot", "attach", "slot_hook"]


class HookSlot:
    """The hook and state DDP's reducer calls through `slot_hook`."""

    def __init__(self, hook: Callable[..., Any], state: Any) -> None:
        self.hook = hook
        self.state = state
        self.replaced = False
        #: the model's divergence guard: ticks once per backward pass, whoever's hook runs
        self.guard: Optional[DivergenceGuard] = None


def slot_hook(slot: HookSlot, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Call the slot's hook on ``bucket`` (fleetlike's, or the script's own); the first bucket of
    a pass (autograd's thread, the same order on every rank) ticks the divergence guard."""
    if slot.guard is not None and bucket.index() == 0:
        slot.guard.tick()
    return slot.hook(slot.state, bucket)


def attach(model: torch.nn.parallel.DistributedDataParallel, state: FleetHookState,
           on_replace: Optional[Callable[[HookSlot], None]] = None) -> HookSlot:
    """Register a slot holding `fleetlike_hook` on ``model`` and let the model's
    ``register_comm_hook`` fill the slot with the script's hook instead (once, as DDP allows)."""
    slot = HookSlot(fleetlike_hook, state)
    model.register_comm_hook(slot, slot_hook)

    def register_comm_hook(hook_state: object, hook: Callable[..., Any]) -> None:
        model._check_comm_hook(hook)
        if slot.replaced:
            raise RuntimeError(
                "register_comm_hook can only be called once on a DDP model, and this model already "
                f"has the script's hook {getattr(slot.hook, '__qualname__', slot.hook)!r}")
        slot.hook, slot.state, slot.replaced = hook, hook_state, True
        if model.logger is not None:
            model.logger._set_comm_hook_name(getattr(hook, "__qualname__", str(hook)))
        group = getattr(model, "process_group", None)
        if group is None or group.rank() == 0:
            print(f"fleetlike.auto: the script registers its own DDP comm hook "
                  f"{getattr(hook, '__qualname__', hook)!s}; fleetlike's hook steps aside for this model "
                  "(the FLEETLIKE_* knobs do not apply to it; to combine both, call "
                  "fleetlike.ddp.fleetlike_hook from your hook)", file=sys.stderr, flush=True)
        if on_replace is not None:
            on_replace(slot)

    model.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
    return slot

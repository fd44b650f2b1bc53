"""PyTorch DDP's face: communication hooks that run DDP's gradient buckets through fleetlike.

``torch.nn.parallel.DistributedDataParallel`` keeps its own bucketing, overlap and API; a
communication hook replaces only how a bucket is averaged. `fleetlike_hook` averages it with
the collective a `DistributedStrategy` chooses (flat, hierarchical by node, fp16/bf16 on every
hop or only across nodes, several communicators, gossip compression), plus local accumulation,
a NaN check naming parameter and rank, and the slow-rank report. `fleetlike.auto` registers it
on every DDP model of a process from environment knobs (`fleetlike.ddp.knobs`), so a DDP script
runs accelerated without a code change.

Example:
    >>> from fleetlike.ddp import register
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
    >>> state = register(ddp, DistributedStrategy(use_hierarchical_allreduce=True, fp16_allreduce=True))
"""

from fleetlike.ddp.hooks import fleetlike_hook, register
from fleetlike.ddp.knobs import KNOBS, Knob, KnobError, applied_knobs, strategy_from_env
from fleetlike.ddp.state import FleetHookState

__all__ = ["KNOBS", "FleetHookState", "Knob", "KnobError", "applied_knobs", "fleetlike_hook", "register", "strategy_from_env"]

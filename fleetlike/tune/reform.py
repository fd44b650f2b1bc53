"""The online tuner when the world re-forms under it (an elastic job lost or gained ranks).

The ranks that were already running agreed on a setting; a rank that joins has a fresh tuner
at the start setting. Tuning on would diverge (the joiner's trials would not line up with the
survivors', and its buckets would differ), so every rank of the new world takes part in
`agreed_after_reform`: when no rank had begun tuning (an elastic job's first world, formed
before any step), the face builds a fresh tuner on the new world; otherwise every rank takes
the setting of the lowest rank that had begun (the last one the running ranks agreed on) and
the tuner stops there (`OnlineTuner.stop`), saying why in its applied line.

Example:
    >>> kept = agreed_after_reform(tuner, new_world_comm)
    >>> if kept is None: tuner = make_tuner()            # nobody had begun: tune on the new world
    ... else: apply(kept); tuner.stop(kept, REFORMED)
"""

from __future__ import annotations

import torch

from fleetlike.comm import Communicator
from fleetlike.tune.tuner import OnlineTuner, decode, encode
from fleetlike.tune.space import Setting

__all__ = ["REFORMED", "agreed_after_reform"]

#: why a tuner stopped when its world re-formed
REFORMED = ("the world re-formed (an elastic job's ranks changed) after tuning began: every rank keeps the setting "
            "the running ranks last agreed on, and tuning does not resume")


def agreed_after_reform(tuner: OnlineTuner, world: Communicator) -> Setting | None:
    """Collective on ``world`` (every rank of the new world, each with its tuner): None when no
    rank had taken a step under its tuner, else the current setting of the lowest rank that had."""
    began = tuner.steps > 0
    rank = torch.tensor([float(world.rank if began else world.size)], dtype=torch.float64, device=world.device)
    world.all_reduce(rank, "min")
    holder = int(rank.item())
    if holder >= world.size:
        return None
    code = torch.tensor(encode(tuner.current), dtype=torch.float64, device=world.device)
    world.broadcast(code, holder)
    return decode(code.cpu().tolist())

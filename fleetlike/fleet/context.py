"""What ``fleet.init`` sets up and every later fleet call needs: one frozen record.

The facade builds it; `DistributedOptimizer` and `DistributedModel` are handed it when they are
built, so nothing below the facade calls back into it.
"""

from __future__ import annotations

import dataclasses

import torch

from fleetlike.comm import CommGroups, Communicator
from fleetlike.config import DistributedStrategy
from fleetlike.roles import Role
from fleetlike.strategies.step import StepContext

__all__ = ["FleetContext"]


@dataclasses.dataclass(frozen=True)
class FleetContext:
    role: Role
    world: Communicator
    groups: CommGroups
    device: torch.device
    #: the strategy given to ``fleet.init`` (default for the wrappers)
    strategy: DistributedStrategy
    timeout: float

    def step_context(self, model: torch.nn.Module, strategy: DistributedStrategy) -> StepContext:
        return StepContext(model=model, strategy=strategy, groups=self.groups, role=self.role, device=self.device)

"""The online tuner in the DDP face: switches the hook's collective between passes.

DDP lays out its own buckets (``bucket_cap_mb``, fixed when the model is built), so here the
tuner leaves the bucket size alone and tries the number of communicators, the allreduce mode
(two-level where the nodes allow) and, where allowed, the 16-bit wire. The step boundary is
the first bucket of each communicating pass, which arrives on autograd's thread in the same
order on every rank after the previous pass's buckets were all waited for: the tuner's
agreement runs there on a communicator of its own and the new collective takes the pass's
buckets. Gossip, applied by the hook around the collective, is kept across switches.

Example:
    >>> state = FleetHookState(DistributedStrategy(auto_tune=True), model=ddp)   # or FLEETLIKE_AUTOTUNE=1
    >>> ...  # train; state.tuning.tuner.summary() says what was chosen
"""

from __future__ import annotations

from typing import Any

from fleetlike.collectives import BucketCollective
from fleetlike.comm import CommGroups
from fleetlike.config import DistributedStrategy
from fleetlike.roles import Role
from fleetlike.strategies.autotune import shutdown_collective
from fleetlike.strategies.data_parallel import gradient_collective
from fleetlike.strategies.topology import two_level_possible
from fleetlike.tune import OnlineTuner, Setting, log_path

__all__ = ["HookTuning"]


class HookTuning:
    """A `FleetHookState`'s tuner: ``collective`` is the one the hook uses for the coming pass."""

    def __init__(self, strategy: DistributedStrategy, groups: CommGroups, role: Role, collective: Any,
                 param_bytes: list[int]) -> None:
        self.strategy, self.groups, self.role = strategy, groups, role
        self.collective = collective
        self._colls: dict[tuple[Any, int, str], BucketCollective] = {self._key(Setting.of(strategy)): collective}
        agree = groups.extra("ddp autotune", 0, groups.world.rank)
        assert agree is not None  # every rank takes part
        ok, _ = two_level_possible(strategy, groups, role)
        #: DDP's buckets in a pass (learnt from the bucket indices the hook sees)
        self.buckets = 1
        self.tuner = OnlineTuner(agree, strategy, param_bytes=param_bytes or [1], two_level_ok=ok, apply=self._apply,
                                 fixed={"bucket_mb": "DDP lays out its own buckets"}, log_path=log_path(), bucket_count=lambda _: self.buckets)

    @staticmethod
    def _key(s: Setting) -> tuple[Any, int, str]:
        return (s.mode, s.comm_num, s.wire)

    def saw_bucket(self, index: int) -> None:
        """DDP's bucket ``index`` is being reduced (the same indices on every rank)."""
        if index >= self.buckets:
            self.buckets = index + 1

    def pass_begins(self) -> Any:
        """A communicating pass's first bucket: the end of the previous step for the tuner;
        returns the collective for this pass."""
        if not self.tuner.done:
            self.tuner.step_done()
            if self.tuner.done:
                for coll in self._colls.values():
                    if coll is not self.collective:
                        shutdown_collective(coll)
                self._colls = {self._key(self.tuner.current): self.collective}
        return self.collective

    def _apply(self, setting: Setting) -> None:
        key = self._key(setting)
        coll = self._colls.get(key)
        if coll is None:
            plain = setting.applied_to(self.strategy)
            plain.gossip = False  # the hook applies gossip around the collective
            coll, _ = gradient_collective(plain, self.groups, self.role)
            self._colls[key] = coll
        self.collective = coll

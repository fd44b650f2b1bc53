"""``hvd.elastic``: Horovod Elastic's names over `fleetlike.elastic`, so a Horovod elastic script
runs unchanged.

``State``, ``ObjectState``, ``TorchState`` (with Horovod's ``check_host_updates()``), ``run``
and ``HostsUpdatedInterrupt``. Under ``python -m fleetlike.launch --nnodes MIN:MAX`` (where
``hvd.init()`` joins the elastic job), ``@hvd.elastic.run`` is `fleetlike.elastic.run`: a failed
peer rolls every survivor back to the last commit, workers waiting to join come in at the next
commit, the reset callbacks run on the survivors and every rank takes the resulting state, and
``hvd.DistributedOptimizer`` rebinds its communicators to the new world
(`fleetlike.horovod.runtime`). Beyond Horovod, a commit also keeps every rank's random generators
(`fleetlike.elastic.rng`): a restarted worker draws what its rank would have drawn. Launched any other way (the launcher without
``--nnodes``, ``mpiexec``, ``torchrun``), ``run`` does what Horovod's does outside an elastic
job: every rank takes rank 0's state, then the function runs once; a failure is raised.

Example (Horovod's own lines)::

    state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state): ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from fleetlike import elastic as _elastic
from fleetlike.elastic import HostsUpdatedInterrupt, ObjectState as _ObjectState, State as _State
from fleetlike.elastic import TorchState as _TorchState

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]

R = TypeVar("R")


class _HostUpdates:
    """Horovod's ``State.check_host_updates()``: raise `HostsUpdatedInterrupt` on every rank
    when workers wait to join (only in an elastic job; ``commit()`` checks too)."""

    _host_check: Callable[[], None] | None

    def check_host_updates(self) -> None:
        if self._host_check is not None:
            self._host_check()


class State(_HostUpdates, _State):  # type: ignore[misc]
    """Horovod's abstract ``hvd.elastic.State`` (`fleetlike.elastic.State`)."""


class ObjectState(_HostUpdates, _ObjectState):
    """Horovod's ``hvd.elastic.ObjectState(**values)`` (`fleetlike.elastic.ObjectState`)."""


class TorchState(_HostUpdates, _TorchState):
    """Horovod's ``hvd.elastic.TorchState(model, optimizer, **values)``
    (`fleetlike.elastic.TorchState`)."""


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Horovod's ``@hvd.elastic.run`` (see the module docstring)."""
    elastic_run = _elastic.run(func)

    @functools.wraps(func)
    def wrapper(state: _State, *args: Any, **kwargs: Any) -> R:
        if _elastic.ElasticSettings.launched():
            return elastic_run(state, *args, **kwargs)
        if not isinstance(state, _State):
            raise TypeError(f"hvd.elastic.run: the first argument must be an hvd.elastic State, got "
                            f"{type(state).__name__}")
        state.sync(root=0)
        return func(state, *args, **kwargs)

    return wrapper

"""Elastic, fault-tolerant training with Horovod Elastic's names (``fleetlike.horovod.elastic``
is this same module).

- `State`, `ObjectState`, `TorchState`: what a rank keeps (model, optimizer with the strategy's
  state, samplers, values); ``commit()`` / ``restore()`` / ``sync()``, optional atomic on-disk
  copies every K commits (``directory=``, ``save_every=``) read back by ``load()``.
- `init` / `run` / `shutdown`: an elastic job (``--nnodes MIN:MAX``): ``@run`` re-forms the world
  when a peer fails or workers join, keeps the surviving processes, rolls back to the last
  commit of a survivor, and calls the function again.
- `mark_progress`: tells ``python -m fleetlike.launch --max_restarts N`` that this start did
  some work (so a failure is retryable).

Example (resuming after the launcher restarted the workers)::

    from fleetlike import elastic
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, step=0,
                               directory="ckpt", save_every=5)
    state.load()                      # nothing on the first start
    for batch in ...: ...; state.step += 1; state.commit()
"""

from fleetlike.elastic.membership import ElasticSettings, Membership
from fleetlike.elastic.run import (
    RESET_LOG,
    HostsUpdatedInterrupt,
    init,
    membership,
    on_world_replaced,
    run,
    shutdown,
)
from fleetlike.elastic.state import (
    PROGRESS_DIR_VAR,
    ObjectState,
    State,
    TorchState,
    broadcast_object,
    mark_progress,
)

__all__ = [
    "PROGRESS_DIR_VAR",
    "RESET_LOG",
    "ElasticSettings",
    "HostsUpdatedInterrupt",
    "Membership",
    "ObjectState",
    "State",
    "TorchState",
    "broadcast_object",
    "init",
    "mark_progress",
    "membership",
    "on_world_replaced",
    "run",
    "shutdown",
]

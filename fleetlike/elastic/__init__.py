"""Elastic, fault-tolerant training with Horovod Elastic's names (``fleetlike.horovod.elastic``
is this same module).

- `State`, `ObjectState`, `TorchState`: what a rank keeps (model, optimizer with the strategy's
  state, samplers, values); ``commit()`` / ``restore()`` / ``sync()``, optional atomic on-disk
  copies every K commits (``directory=``, ``save_every=``) read back by ``load()``.
- `mark_progress`: tells ``python -m fleetlike.launch --max_restarts N`` that this start did
  some work (so a failure is retryable).

Example (resuming after the launcher restarted the workers)::

    from fleetlike import elastic
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, step=0,
                               directory="ckpt", save_every=5)
    state.load()                      # nothing on the first start
    for batch in ...: ...; state.step += 1; state.commit()
"""

from fleetlike.elastic.state import (
    PROGRESS_DIR_VAR,
    ObjectState,
    State,
    TorchState,
    broadcast_object,
    mark_progress,
)

__all__ = ["PROGRESS_DIR_VAR", "ObjectState", "State", "TorchState", "broadcast_object", "mark_progress"]

"""`init` and `run`: keep training when a peer fails or the membership changes, without
restarting the surviving processes (Horovod Elastic's ``hvd.elastic.run``).

``@run`` wraps the training function ``train(state, ...)``. When a collective fails (a peer
died: gloo sees its connections close, or the collective timeout expires; `fleetlike.comm`'s
`CollectiveError`) every surviving rank leaves the function, the world re-forms with whoever is
there (`fleetlike.elastic.membership`: torch's dynamic rendezvous; at least the launcher's MIN),
the fleet's models and optimizers are rebound to the new world (`Fleet.replace_world`), the
state is rolled back to the last commit *of a surviving rank* and broadcast from it (no disk
read while one rank survives; ranks that joined get it the same way), samplers re-deal the rest
of the epoch over the new world size, the reset callbacks run, and ``train`` is called again.
At a ``commit()`` every rank also asks whether workers are waiting to join; if any are (all
ranks agree by one small all-reduce), they raise `HostsUpdatedInterrupt` together and the world
re-forms with the joiners, keeping the state just committed.

Each re-formation prints one line (stderr): the cause, the old and new sizes, the nodes lost or
joined (a node whose IP left the world entirely is a node loss; fewer workers on a node that
is still there is a worker failure), the commit rolled back to, and how long it took; rank 0 of
the new world also records it on the rendezvous store for the launchers' summaries.

Example::

    from fleetlike import elastic, fleet
    elastic.init()                                  # instead of fleet.init()
    model = fleet.distributed_model(net); opt = fleet.distributed_optimizer(sgd)
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 10):
            sampler.set_epoch(state.epoch)
            for i, batch in enumerate(loader): step(batch); state.commit() if i % 10 == 0 else None

    train(state)
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from fleetlike.comm import CommError, ReduceOp, SingleCommunicator
from fleetlike.config import DistributedStrategy
from fleetlike.elastic.membership import Membership, describe_change
from fleetlike.elastic.state import State
from fleetlike.fleet import fleet
from fleetlike.roles import Role

__all__ = ["HostsUpdatedInterrupt", "init", "run", "membership", "on_world_replaced", "shutdown", "RESET_LOG"]

R = TypeVar("R")

_LOCK = threading.Lock()
_MEMBERSHIP: Membership | None = None  # guarded by _LOCK
_LISTENERS: list[Callable[[], None]] = []  # guarded by _LOCK
#: one dict per re-formation in this process (cause, sizes, nodes, seconds); read by tests/benchmarks
RESET_LOG: list[dict[str, Any]] = []


class HostsUpdatedInterrupt(RuntimeError):
    """Workers are waiting to join: raised by ``commit()`` on every rank at once, so the world
    re-forms with them (Horovod's name). ``skip_sync`` is False: joiners need the state."""

    skip_sync = False


def on_world_replaced(callback: Callable[[], None]) -> None:
    """Call ``callback()`` each time `run` has moved the fleet to a new world (before the state
    is synced): faces with state of their own over the fleet's world follow it
    (``fleetlike.horovod`` registers its runtime here)."""
    with _LOCK:
        _LISTENERS.append(callback)


def _replace(role: Role, world: Any) -> None:
    fleet.replace_world(role, world)
    with _LOCK:
        listeners = list(_LISTENERS)
    for callback in listeners:
        callback()


def membership() -> Membership:
    """This process's seat in the elastic job (after `init`)."""
    with _LOCK:
        if _MEMBERSHIP is None:
            raise RuntimeError("fleetlike.elastic: call elastic.init() first (instead of fleet.init())")
        return _MEMBERSHIP


def init(strategy: DistributedStrategy | None = None, timeout: float | None = None) -> None:
    """``fleet.init`` for an elastic job (started by ``python -m fleetlike.launch --nnodes``).

    Until the first call of a `run` function, the fleet is a world of one (this process): the
    setup (``fleet.distributed_model``'s broadcast, ``exe.run(fleet.startup_program)``) stays
    local, so a worker joining a running job does not issue collectives the others never will.
    The first call joins the rendezvous, builds the real world, rebinds the wrapped models and
    optimizers to it and makes every rank take the state of one rank (`State.sync`). Samplers
    in the `State` are re-dealt then; code that reads ``fleet.worker_index()`` before ``run``
    sees 0 of 1."""
    global _MEMBERSHIP
    with _LOCK:
        if _MEMBERSHIP is not None:
            raise RuntimeError("fleetlike.elastic.init() was already called in this process")
        _MEMBERSHIP = members = Membership.from_env()
    atexit.unregister(_quiet_at_exit)  # once, however often init follows shutdown
    atexit.register(_quiet_at_exit)
    limit = 1800.0 if timeout is None else timeout
    alone = Role.from_endpoints(0, [members.settings.endpoint], job_id=members.settings.run_id, source="elastic")
    fleet.replace_world(alone, SingleCommunicator("world", 0), strategy=strategy, timeout=limit)


def _quiet_at_exit() -> None:
    """At interpreter exit (a script that never called `shutdown`, as Horovod's elastic scripts
    do not): stop the heartbeat threads before the interpreter finalizes (`Membership.quiet`)."""
    with _LOCK:
        members = _MEMBERSHIP
    if members is not None:
        members.quiet()


def shutdown() -> None:
    """Leave the elastic job (end of training) and shut the fleet down."""
    global _MEMBERSHIP
    with _LOCK:
        members, _MEMBERSHIP = _MEMBERSHIP, None
    if members is not None:
        members.close()
    fleet.shutdown()


def _check_hosts() -> None:
    """At a commit: raise `HostsUpdatedInterrupt` on every rank when any rank sees joiners."""
    waiting = 1 if membership().waiting() > 0 else 0
    world = fleet.context().world
    if int(world.all_reduce(torch.tensor([waiting], device=world.device), op=ReduceOp.MAX).item()):
        raise HostsUpdatedInterrupt("workers are waiting to join; re-forming the world")


def _survivor(state: State) -> int:
    """The rank whose commit every rank takes: the most commits, the lowest rank among them."""
    world = fleet.context().world
    most = int(world.all_reduce(torch.tensor([state.commits], device=world.device), op=ReduceOp.MAX).item())
    mine = world.rank if state.commits == most else world.size
    return int(world.all_reduce(torch.tensor([mine], device=world.device), op=ReduceOp.MIN).item())


def _reform(cause: str, started: float) -> dict[str, Any]:
    members = membership()
    before = list(members.members)
    old_size = fleet.worker_num()
    role, world = members.form(fleet.context().timeout)
    _replace(role, world)
    lost, joined, shrunk = describe_change(before, members.members)
    record = {"cause": cause, "old_size": old_size, "new_size": role.world_size, "nodes_lost": lost,
              "nodes_joined": joined, "worker_failures_on": shrunk, "seconds": time.monotonic() - started}
    RESET_LOG.append(record)
    if role.rank == 0:
        print(f"fleetlike.elastic: world re-formed after {cause}: {old_size} -> {role.world_size} ranks; "
              f"nodes lost: {lost or '-'}; nodes joined: {joined or '-'}; worker failures on: "
              f"{shrunk or '-'}; {record['seconds']:.1f}s", file=sys.stderr, flush=True)
    return record


def _publish(record: dict[str, Any], state: State) -> None:
    """After the state is synced: note the commit rolled back to, and (rank 0) tell the
    launchers (`Membership.record`), so their summaries name the nodes lost and joined."""
    record["commit"] = state.commits
    if fleet.worker_index() == 0:
        try:
            membership().record(record)
        except Exception as exc:  # noqa: BLE001 - the summary is a report; training goes on
            print(f"fleetlike.elastic: could not record the re-formation for the launcher: {exc}",
                  file=sys.stderr, flush=True)


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Wrap ``func(state, *args, **kwargs)`` so that it survives peers failing and joining (see
    the module docstring). The first call also makes every rank start from rank 0's state."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(f"elastic.run: the first argument must be a fleetlike.elastic State, got "
                            f"{type(state).__name__}")
        members = membership()  # init() first
        if not members.members:  # the first call: leave the world of one for the job's
            role, world = members.form(fleet.context().timeout)
            _replace(role, world)
        state._host_check, state._in_run = _check_hosts, True
        record: dict[str, Any] | None = None
        try:
            while True:
                try:
                    state.sync(root=_survivor(state))
                    if record is not None:
                        _publish(record, state)
                        record = None
                    return func(state, *args, **kwargs)
                except CommError as exc:
                    started = time.monotonic()
                    cause = f"a collective failure ({type(exc).__name__}: {str(exc)[:160]})"
                except HostsUpdatedInterrupt:
                    started = time.monotonic()
                    cause = "workers waiting to join (admitted at a commit)"
                record = _reform(cause, started)
                # Horovod's order: roll back, run the callbacks, then hand the state out; their
                # changes (the learning rate for the new size) reach every rank with the sync
                state.restore()
                state.on_reset()
                state._keep_reset()
        finally:
            state._host_check, state._in_run = None, False

    return wrapper

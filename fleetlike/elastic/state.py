"""What an elastic job keeps between failures: Horovod Elastic's `State`, `ObjectState`, `TorchState`.

A `State` holds everything a rank needs to carry on after the world changed: the model, the
optimizer (whose ``state_dict`` already holds the strategy's own state: the AMP loss scale,
local SGD's counters and snapshots, the gradient-merge window; `fleetlike.fleet.optimizer`),
samplers (`fleetlike.io.DistributedSampler`: one world-independent offset into the epoch), the
user's values (``epoch``, ``batch``...) and every rank's process-wide random generators
(`fleetlike.elastic.rng`; Horovod's states do not keep them). ``commit()`` copies it in memory (a
clone, cheap next to a step: docs/BENCHMARKS.md, "Elastic"), ``restore()`` puts the copy back, ``sync()``
broadcasts one rank's copy to every rank (how survivors hand the state to a re-formed world:
no disk read needed while one rank survives). With ``directory=``, every ``save_every``-th
commit is also written to disk atomically (rank 0; a cut save leaves the previous one), which
``load()`` reads after a restart of the whole group (``--max_restarts``).

Anything with ``state_dict`` / ``load_state_dict`` is kept by its state; samplers with
``num_replicas`` and ``rank`` are re-dealt over the current world at ``restore()``, so the rest
of the epoch is shared by whoever is there (every remaining sample once).

The first ``commit()`` of a process also marks progress for the launcher
(`mark_progress`): a start that fails before any progress, twice the same way, is not retried.

Example:
    >>> state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)
    >>> state.register_reset_callbacks([lambda: scale_lr(opt, fleet.worker_num())])
    >>> ... train; every 10 steps: state.batch = step; state.commit()
"""

from __future__ import annotations

import abc
import copy
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from fleetlike.comm import dumps_signed, loads_signed
from fleetlike.config import envvars
from fleetlike.elastic import rng
from fleetlike.fleet import fleet
from fleetlike.fleet.checkpoint_files import (
    LEGACY_FORMAT,
    CheckpointError,
    atomic_dir,
    load_pt,
    resolve,
    save_pt,
    verify,
)

__all__ = ["PROGRESS_DIR_VAR", "State", "ObjectState", "TorchState", "mark_progress", "broadcast_object"]

#: Where the launcher (``--max_restarts``) looks for progress markers; the same name as
#: ``fleetlike.launch.elastic_agent.PROGRESS_DIR_VAR`` (a test checks they agree).
PROGRESS_DIR_VAR = envvars.PROGRESS_DIR

_PROGRESS_LOCK = threading.Lock()
_MARKED: set[str] = set()  # guarded by _PROGRESS_LOCK


def mark_progress() -> None:
    """Tell the launcher this start has made progress (once per process; cheap afterwards).

    ``State.commit()`` calls it; a script that checkpoints its own way calls it after its first
    successful step, so a later failure of this start counts as retryable."""
    folder = os.environ.get(PROGRESS_DIR_VAR)
    if not folder:
        return
    with _PROGRESS_LOCK:
        if folder in _MARKED:
            return
        _MARKED.add(folder)
    try:
        Path(folder, f"pid{os.getpid()}").write_text("progress\n")
    except OSError:
        pass  # the launcher only loses its evidence; training goes on


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """``root``'s ``obj`` on every rank of the fleet's world (pickled; two broadcasts). The
    payload carries an HMAC with the job's secret, checked before unpickling
    (`fleetlike.comm.secret.loads_signed`): only a member of the job can hand state over."""
    world = fleet.context().world
    if world.size == 1:
        return obj
    data = dumps_signed(obj, "elastic.sync", root) if world.rank == root else b""
    size = world.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=world.device), root)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if world.rank == root \
        else torch.empty(int(size.item()), dtype=torch.uint8)
    buf = world.broadcast(buf.to(world.device), root)
    return obj if world.rank == root else loads_signed(buf.cpu().numpy().tobytes(), "elastic.sync", root)


def _clone(value: Any) -> Any:
    """A copy sharing nothing mutable with ``value`` (tensors cloned, containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


#: the file `State.save_to_disk` writes, and what it holds (the ``content`` inside it)
_FILE, _CONTENT = "state.pt", "elastic state"


def _read_state(path: Path, fmt: int) -> tuple[int, Any]:
    """``(commits, committed state)`` of a ``state.pt``; one written before versions is named."""
    saved = load_pt(path, _CONTENT, fmt)
    if fmt == LEGACY_FORMAT and not (isinstance(saved, dict) and {"commits", "state"} <= set(saved)):
        keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(
            f"{path} has no format version and is not a State.save_to_disk file (it holds {keys}, not "
            "'commits' and 'state'): it was written by something else. Point State(directory=...) at "
            "the directory State.commit() writes, or remove it to start afresh"
        )
    if not isinstance(saved, dict) or not isinstance(saved.get("commits"), int) or "state" not in saved:
        raise CheckpointError(f"{path} lacks 'commits' or 'state': it was edited or damaged; load an earlier copy")
    return saved["commits"], saved["state"]


def _rank() -> int:
    return fleet.worker_index() if fleet.initialized else 0


class State(abc.ABC):
    """The base: commits, restores, reset callbacks, on-disk copies (see the module docstring).

    Subclasses say what is kept with `_snapshot` / `_apply`."""

    def __init__(self, *, directory: str | os.PathLike[str] | None = None, save_every: int = 1) -> None:
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"State(save_every={save_every!r}): give a positive int (write every "
                             "save_every-th commit to disk)")
        self.directory = None if directory is None else Path(directory)
        self.save_every = save_every
        self.commits = 0
        self._committed: dict[str, Any] | None = None
        #: the random generators of each rank at the last commit, by rank (`fleetlike.elastic.rng`)
        self._rng: dict[int, dict[str, Any]] = {}
        #: set by `fleetlike.elastic.run`: commits are collective, and gather every rank's generators
        self._in_run = False
        self._reset_callbacks: list[Callable[[], None]] = []
        #: set by `fleetlike.elastic.run`: raises when the membership should change at a commit
        self._host_check: Callable[[], None] | None = None

    # -------------------------------------------------------------- what is kept

    @abc.abstractmethod
    def _snapshot(self) -> dict[str, Any]:
        """A copy of what this state keeps, sharing nothing mutable with the live objects."""

    @abc.abstractmethod
    def _apply(self, snapshot: dict[str, Any]) -> None:
        """Put ``snapshot`` (from `_snapshot`) back into the live objects."""

    # -------------------------------------------------------------- Horovod's API

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (the world re-formed, the state restored):
        rescale the learning rate to the new world size, say."""
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"register_reset_callbacks: {cb!r} is not callable")
            self._reset_callbacks.append(cb)

    def on_reset(self) -> None:
        """Run the reset callbacks (`fleetlike.elastic.run` calls it after each reset)."""
        for cb in self._reset_callbacks:
            cb()

    def save(self) -> None:
        """Keep an in-memory copy of the state now, and of this rank's random generators (what
        `restore` returns to)."""
        self._committed = self._snapshot()
        self._rng = {_rank(): rng.capture()}

    def commit(self) -> None:
        """`save`, write every ``save_every``-th commit to ``directory``, mark progress, and let
        a waiting joiner in (raises ``HostsUpdatedInterrupt`` under `fleetlike.elastic.run`,
        which re-forms the world and carries on from this commit).

        Under `fleetlike.elastic.run` every rank's random generators are gathered first (one
        collective), so that a worker started again after a failure resumes with the generators
        its rank had at this commit; when that gather fails nothing of this commit is kept."""
        world = fleet.context().world if self._in_run and fleet.initialized else None
        mine = rng.capture()
        every = rng.gather(world, mine) if world is not None and world.size > 1 else None
        self._committed = self._snapshot()
        self._rng = dict(enumerate(every)) if every is not None else {_rank(): mine}
        self.commits += 1
        mark_progress()
        if self.directory is not None and self.commits % self.save_every == 0:
            self.save_to_disk()
        if self._host_check is not None:
            self._host_check()

    def restore(self) -> None:
        """Put the last committed copy back (nothing to do before the first commit), and the
        random generators this rank's number had then (a rank the commit has none for, in a
        world that grew, keeps its own)."""
        if self._committed is not None:
            self._apply(_clone(self._committed))
            saved = self._rng.get(_rank())
            if saved is not None:
                rng.restore(saved)

    def _keep_reset(self) -> None:
        """After a rollback and the reset callbacks: make what the callbacks changed (a learning
        rate scaled to the new world, say) part of the committed copy, which `sync` hands to
        every rank (as Horovod's sync hands out rank 0's state after its callbacks). The
        commit count and the generators of the commit stay."""
        if self._committed is not None:
            self._committed = self._snapshot()

    def sync(self, root: int = 0) -> None:
        """Every rank takes ``root``'s committed state (its current one if it never committed),
        and the generators ``root`` holds for its rank number."""
        if self._committed is None:
            self.save()
        snapshot = broadcast_object((self.commits, self._committed, self._rng), root)
        self.commits, self._committed, self._rng = snapshot
        self.restore()

    # -------------------------------------------------------------- on disk

    def save_to_disk(self) -> None:
        """Write the committed state to ``directory`` atomically (rank 0 only; others return)."""
        if self.directory is None:
            raise ValueError("State.save_to_disk: give State(..., directory=PATH) first")
        if fleet.initialized and fleet.worker_index() != 0:
            return
        with atomic_dir(self.directory) as tmp:
            save_pt({"commits": self.commits, "state": self._committed}, tmp / _FILE, _CONTENT)

    def load(self) -> bool:
        """Take the state written to ``directory`` (True), or keep the current one when none
        was written yet (False): the first start of a job, or one cut before its first save."""
        if self.directory is None:
            raise ValueError("State.load: give State(..., directory=PATH) first")
        try:
            path = resolve(self.directory)
        except CheckpointError:
            if self.directory.exists() and any(self.directory.iterdir()):
                raise
            return False
        commits, committed = _read_state(path / _FILE, verify(path))
        self._check_fits(path / _FILE, committed)
        held = (self.commits, self._committed, self._snapshot(), self._rng)
        self.commits, self._committed, self._rng = commits, committed, {}
        try:
            self.restore()
        except Exception as exc:
            self.commits, self._committed, self._rng = held[0], held[1], held[3]
            self._apply(held[2])
            raise CheckpointError(f"{path / _FILE} could not be applied ({type(exc).__name__}: {exc}); the "
                                  "state was put back as it was: restart with the objects it was saved from") from exc
        return True

    def _check_fits(self, path: Path, committed: Any) -> None:
        """What `_apply` would need of ``committed``, checked before anything changes."""
        if not isinstance(committed, dict):
            raise CheckpointError(f"{path} holds a {type(committed).__name__} state, not a dict of named values")


class ObjectState(State):
    """Plain values kept as attributes: ``state.epoch``, ``state.batch``...

    Example:
        >>> state = ObjectState(epoch=0, batch=0)
        >>> state.epoch += 1; state.commit()
    """

    def __init__(self, *, directory: str | os.PathLike[str] | None = None, save_every: int = 1,
                 **values: Any) -> None:
        super().__init__(directory=directory, save_every=save_every)
        self._names = list(values)
        for name, value in values.items():
            setattr(self, name, value)

    def _snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._names:
            value = getattr(self, name)
            out[name] = ("state", _clone(value.state_dict())) if _stateful(value) else ("value", _clone(value))
        return out

    def _check_fits(self, path: Path, committed: Any) -> None:
        super()._check_fits(path, committed)
        for name, entry in committed.items():
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and entry[0] in ("value", "state")):
                raise CheckpointError(f"{path}: entry {name!r} is neither a saved value nor a saved state; "
                                      "it was edited or damaged: load an earlier copy")
            if entry[0] == "state" and not _stateful(getattr(self, name, None)):
                raise CheckpointError(
                    f"{path} holds the state of {name!r}, which this {type(self).__name__} keeps no object with "
                    f"load_state_dict for (it keeps {self._names}): restart with the objects it was saved from"
                )

    def _apply(self, snapshot: dict[str, Any]) -> None:
        for name, (kind, saved) in snapshot.items():
            if kind == "value":
                setattr(self, name, saved)
                continue
            target = getattr(self, name)
            if hasattr(target, "num_replicas") and hasattr(target, "rank") and fleet.initialized:
                # a resumable sampler: deal the rest of the epoch over the world as it is now
                target.num_replicas, target.rank = fleet.worker_num(), fleet.worker_index()
            target.load_state_dict(saved)


class TorchState(ObjectState):
    """Horovod's ``TorchState(model=..., optimizer=..., **values)``: the model's parameters and
    buffers, the optimizer's state (a `fleetlike.fleet.DistributedOptimizer`'s includes the
    strategy's), and `ObjectState` values (samplers re-dealt at restore).

    Example:
        >>> state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                 directory: str | os.PathLike[str] | None = None, save_every: int = 1, **values: Any) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"TorchState(model=...): give a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TorchState(optimizer=...): give a torch.optim.Optimizer, got {type(optimizer).__name__}")
        kept = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(directory=directory, save_every=save_every, **kept, **values)

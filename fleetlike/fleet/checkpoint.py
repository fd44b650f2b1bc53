"""Checkpoints written atomically: a kill during a save leaves the previous one loadable.

`save_training` / `load_training` are ``fleet.save_persistables`` / ``load_persistables`` for
both styles: the models, the optimizers (whose state includes the strategy's: loss scale, local
SGD counters and snapshots, the gradient-merge window), any object with ``state_dict`` the user
registered (an LR scheduler), and the program run counters. A checkpoint that does not fit the
job (strategy, number of models) is refused with the list of differences. The world size may
change: parameters and strategy state are replicated, and under ``strategy.sharding`` every
rank writes its shard of the optimizer state, which a job of any size (sharded or not) reads
back through `consolidate_optimizer_state`'s union, keeping its own partition.

A checkpoint is a directory. It is written in full to a temporary sibling, every file and the
directory are fsync'ed, and only then swapped in by renames. The one moment when ``dirname``
does not exist (between moving the old one aside and moving the new one in) is covered by
`resolve`, which falls back to the moved-aside previous checkpoint.

Example:
    >>> with atomic_dir("ckpt") as tmp:
    ...     torch.save(model.state_dict(), tmp / "model.pt")
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fleetlike.strategies.recompute import plain_forwards

__all__ = [
    "CheckpointError",
    "SERVED_FILE",
    "TrainingState",
    "atomic_dir",
    "consolidate_optimizer_state",
    "load_inference_model",
    "load_training",
    "read_json",
    "resolve",
    "save_inference_model",
    "save_training",
    "write_json",
]

_FORMAT = 2
#: the strategy state inside a fleetlike optimizer's state_dict (`DistributedOptimizer`)
_ENGINE_KEY = "fleetlike"
#: strategy options a checkpoint may be loaded across: the optimizer state is resharded
_RESHARDABLE = frozenset({"sharding", "sharding_configs"})

#: ``save_inference_model``'s served model: TorchScript in eval mode, loadable by a plain PyTorch
#: process (``torch.jit.load(dirname + "/served.pt")``) that imports neither fleetlike nor the
#: model's code, as a model server does.
SERVED_FILE = "served.pt"

log = logging.getLogger("fleetlike")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not fit the current job."""


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(target: Path, tag: str) -> Path:
    """Check ``target`` may be replaced and create its temporary sibling for tag ``tag``."""
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / "COMPLETE").exists())):
        raise CheckpointError(
            f"{target} exists and is not a fleetlike checkpoint; a save replaces its directory "
            "whole, so it refuses to touch other files. Give an empty or new directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{tag}"
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def atomic_dir(dirname: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``dirname`` atomically."""
    target = Path(dirname)
    tag = uuid.uuid4().hex[:8]
    tmp = _temporary(target, tag)
    try:
        yield tmp
        (tmp / "COMPLETE").write_text("ok\n")
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _commit(tmp, target, tag)


def _commit(tmp: Path, target: Path, tag: str) -> None:
    """Swap the finished ``tmp`` in for ``target`` (the previous one moved aside, then removed)."""
    old = target.parent / f".{target.name}.old-{tag}"
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    for stale in target.parent.glob(f".{target.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def resolve(dirname: str | os.PathLike[str]) -> Path:
    """The complete checkpoint to load for ``dirname`` (the previous one if a save was cut)."""
    target = Path(dirname)
    if (target / "COMPLETE").exists():
        return target
    olds = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    for old in reversed(olds):
        if (old / "COMPLETE").exists():
            return old
    if target.exists():
        raise CheckpointError(f"{target} is not a complete fleetlike checkpoint (no COMPLETE marker)")
    raise CheckpointError(f"no checkpoint at {target}")


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


@dataclasses.dataclass
class TrainingState:
    """What one job saves and restores (see the module docstring)."""

    models: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    extras: dict[str, Any]
    world_size: int
    rank: int
    strategy: dict[str, Any]
    #: program name -> runs (program style; restored so schedules keyed on runs continue)
    program_runs: dict[str, int] = dataclasses.field(default_factory=dict)


def _manifest(state: TrainingState) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "world_size": state.world_size,
        "saved_by_rank": state.rank,
        "strategy": state.strategy,
        "models": len(state.models),
        "optimizers": len(state.optimizers),
        "extras": sorted(state.extras),
        "program_runs": state.program_runs,
    }


def _write_replicated(tmp: Path, state: TrainingState) -> None:
    torch.save([m.state_dict() for m in state.models], tmp / "models.pt")
    torch.save({k: v.state_dict() for k, v in state.extras.items()}, tmp / "extras.pt")


def save_training(dirname: str | os.PathLike[str], state: TrainingState) -> None:
    """Write ``state``; under ``strategy.sharding`` every rank must call it (each writes its shard)."""
    if _sharding_units(state):
        _save_sharded(Path(dirname), state)
        return
    with atomic_dir(dirname) as tmp:
        _write_replicated(tmp, state)
        torch.save([o.state_dict() for o in state.optimizers], tmp / "optimizers.pt")
        write_json(tmp / "fleet.json", _manifest(state))


# ------------------------------------------------------------------ sharded checkpoints
#
# Layout: the replicated parts (models, registered objects, fleet.json) as above, written by
# rank 0, and one file per rank, shard-<rank>.pt, holding that rank's optimizer state_dicts
# (the state of the parameters it owns, plus its strategy state). fleet.json's "sharding" entry
# names the layout: the world size and, per optimizer, the owner of each parameter index.
# The shards are written into one temporary directory that every rank sees (a shared
# filesystem); rank 0 swaps it in only when every rank reported success, so a cut save leaves
# the previous checkpoint, as for the unsharded one.


def _sharding_units(state: TrainingState) -> list[Any]:
    """The sharding units driving ``state``'s optimizers, one per optimizer (None if unsharded)."""
    units = []
    for opt in state.optimizers:
        found = [e.unit("sharding") for e in getattr(opt, "engines", [])]
        units.append(next((u for u in found if u is not None), None))
    return units if any(u is not None for u in units) else []


def _agree(world: Any, failed: bool) -> bool:
    """True on every rank when any rank failed (one small MAX allreduce; also a barrier)."""
    flag = torch.tensor([1.0 if failed else 0.0])
    world.all_reduce(flag, "max", agreed=True)
    return bool(flag.item())


def _shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.pt"


def _save_sharded(target: Path, state: TrainingState) -> None:
    units = _sharding_units(state)
    unit = next(u for u in units if u is not None)
    world = unit.ctx.groups.world
    tag = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    world.broadcast(tag, 0, agreed=True)
    tag_s = f"{int(tag.item()):08x}"
    tmp = target.parent / f".{target.name}.tmp-{tag_s}"
    error: BaseException | None = None
    try:
        if world.rank == 0:
            _temporary(target, tag_s)
    except BaseException as exc:  # every rank must learn of it, or the others would wait forever
        error = exc
    if _agree(world, error is not None):
        raise error if error is not None else CheckpointError(f"rank 0 could not create {tmp}; see its error")
    try:
        if not tmp.is_dir():
            raise CheckpointError(
                f"rank {world.rank} cannot see {tmp}, which rank 0 created: a sharded checkpoint is "
                "written by every rank into one directory, so dirname must be on a filesystem all ranks share"
            )
        torch.save([o.state_dict() for o in state.optimizers], tmp / _shard_name(world.rank))
        if world.rank == 0:
            _write_replicated(tmp, state)
            meta = _manifest(state)
            meta["sharding"] = {
                "world_size": world.size,
                "shards": [_shard_name(r) for r in range(world.size)],
                "layouts": [None if u is None else u.layout(o) for u, o in zip(units, state.optimizers)],
            }
            write_json(tmp / "fleet.json", meta)
    except BaseException as exc:
        error = exc
    if _agree(world, error is not None):
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error if error is not None else CheckpointError(f"another rank failed to write its shard into {tmp}")
    try:
        if world.rank == 0:
            missing = [n for n in (_shard_name(r) for r in range(world.size)) if not (tmp / n).exists()]
            if missing:
                raise CheckpointError(f"{tmp} lacks {missing}: the ranks do not share this filesystem")
            (tmp / "COMPLETE").write_text("ok\n")
            _fsync_tree(tmp)
            _commit(tmp, target, tag_s)
    except BaseException as exc:
        error = exc
        shutil.rmtree(tmp, ignore_errors=True)
    if _agree(world, error is not None):
        raise error if error is not None else CheckpointError(f"rank 0 could not complete {target}; see its error")


def _read_shards(path: Path, meta: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Every rank's list of optimizer state_dicts, in rank order."""
    out = []
    for name in meta["sharding"]["shards"]:
        if not (path / name).exists():
            raise CheckpointError(f"sharded checkpoint {path} lacks {name}")
        out.append(torch.load(path / name, map_location="cpu", weights_only=False))
    return out


def _union(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One ordinary optimizer state_dict from the shards of one optimizer (disjoint states)."""
    state: dict[Any, Any] = {}
    for shard in shards:
        state.update(shard["state"])
    full = {k: v for k, v in shards[0].items() if k not in ("state", _ENGINE_KEY)}
    full["state"] = dict(sorted(state.items()))
    return full


def _merge_ranks(values: list[Any]) -> Any:
    """The strategy state of several ranks as one: equal values kept, tensors averaged (the
    gradient-merge partial sums: their mean is what the reduction of the window would use),
    the ``rank`` tag dropped (the result is no one rank's)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if all(torch.equal(first, v) for v in values[1:]):
            return first
        return torch.stack([v.double() for v in values]).mean(0).to(first.dtype)
    if isinstance(first, dict):
        return {k: _merge_ranks([v[k] for v in values]) for k in first if k != "rank"}
    if isinstance(first, (list, tuple)) and all(isinstance(v, (list, tuple)) and len(v) == len(first) for v in values):
        return type(first)(_merge_ranks(list(vs)) for vs in zip(*values))
    if all(v is None for v in values):
        return None
    if any(v != first for v in values[1:]):
        raise CheckpointError(f"the ranks' strategy states differ ({values!r}) and cannot be merged")
    return first


def consolidate_optimizer_state(dirname: str | os.PathLike[str], index: int = 0) -> dict[str, Any]:
    """An ordinary ``torch.optim`` state_dict of optimizer ``index`` from a checkpoint, sharded
    or not: ``torch.optim.Adam(model.parameters()).load_state_dict(...)`` takes it on one process.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> opt.load_state_dict(consolidate_optimizer_state("ckpt"))
    """
    path = resolve(dirname)
    meta = read_json(path / "fleet.json")
    if not 0 <= index < int(meta["optimizers"]):
        raise IndexError(f"optimizer index {index}: checkpoint {path} holds {meta['optimizers']} optimizer(s)")
    if meta.get("sharding"):
        return _union([shard[index] for shard in _read_shards(path, meta)])
    saved = torch.load(path / "optimizers.pt", map_location="cpu", weights_only=False)[index]
    return {k: v for k, v in saved.items() if k != _ENGINE_KEY}


def load_training(dirname: str | os.PathLike[str], state: TrainingState, device: torch.device) -> dict[str, int]:
    """Restore into ``state``'s objects; returns the saved program run counters."""
    path = resolve(dirname)
    meta = read_json(path / "fleet.json")
    problems = []
    if meta.get("format") != _FORMAT:
        problems.append(f"format: saved {meta.get('format')!r}, this fleetlike reads {_FORMAT}")
    for key in ("models", "optimizers"):
        now = len(getattr(state, key))
        if meta.get(key) != now:
            problems.append(f"{key}: saved {meta.get(key)}, now {now}")
    if meta.get("extras", []) != sorted(state.extras):
        problems.append(f"registered objects: saved {meta.get('extras')}, now {sorted(state.extras)}")
    for key in sorted(set(state.strategy) | set(meta["strategy"])):
        if key in _RESHARDABLE:
            continue
        if state.strategy.get(key) != meta["strategy"].get(key):
            problems.append(f"strategy.{key}: saved {meta['strategy'].get(key)!r}, now {state.strategy.get(key)!r}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit this job:\n  " + "\n  ".join(problems)
            + "\nrestart with the saved strategy and models (DistributedStrategy.from_dict)"
        )
    for model, saved in zip(state.models, torch.load(path / "models.pt", map_location=device, weights_only=True)):
        model.load_state_dict(saved)
    for opt, saved in zip(state.optimizers, _optimizer_states(path, meta, state, device)):
        opt.load_state_dict(saved)
    extras = torch.load(path / "extras.pt", map_location=device, weights_only=False)
    for name, obj in state.extras.items():
        obj.load_state_dict(extras[name])
    return dict(meta.get("program_runs", {}))


def _optimizer_states(path: Path, meta: dict[str, Any], state: TrainingState,
                      device: torch.device) -> list[dict[str, Any]]:
    """What each optimizer loads. Unsharded: the saved state_dicts. Sharded: each optimizer's
    shards united (a sharded job then keeps its own partition), with the strategy state of this
    rank when the world size is the same, else the ranks' states merged (`_merge_ranks`)."""
    if not meta.get("sharding"):
        return torch.load(path / "optimizers.pt", map_location=device, weights_only=False)
    shards = _read_shards(path, meta)
    out = []
    same_world = meta["sharding"]["world_size"] == state.world_size
    for i in range(len(state.optimizers)):
        full = _union([shard[i] for shard in shards])
        engines = [shard[i].get(_ENGINE_KEY) for shard in shards]
        if engines[0] is not None:
            full[_ENGINE_KEY] = engines[state.rank] if same_world else _merge_ranks(engines)
        out.append(full)
    return out
def _script_for_serving(model: torch.nn.Module) -> tuple[Any, str | None]:
    """``(TorchScript module in eval mode, None)``, or ``(None, why not)``."""
    try:
        scripted = torch.jit.script(model)
    except Exception as exc:  # TorchScript rejects many Python constructs; say which and go on
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}"
    scripted.eval()
    return scripted, None


def save_inference_model(dirname: str | os.PathLike[str], model: torch.nn.Module,
                         feeded_var_names: list[str], target_vars: list[str], served: bool = True) -> None:
    """Write the model for inference; with ``served`` also `SERVED_FILE` (TorchScript, eval mode).

    A model TorchScript cannot compile still gets ``model.pt`` and ``state_dict.pt``; the reason
    is logged and kept in ``inference.json`` (``served_error``)."""
    with plain_forwards(model):  # recompute's wrappers are training machinery, not the model
        _write_inference(dirname, model, feeded_var_names, target_vars, served)


def _write_inference(dirname: str | os.PathLike[str], model: torch.nn.Module, feeded_var_names: list[str],
                     target_vars: list[str], served: bool) -> None:
    scripted, why = _script_for_serving(model) if served else (None, None)
    if why is not None:
        log.warning("fleet.save_inference_model: no %s (the model does not compile to TorchScript: %s); "
                    "model.pt and state_dict.pt are written, which need the model's code to load. Make the "
                    "model scriptable, or pass export_for_deployment=False to skip this", SERVED_FILE, why)
    with atomic_dir(dirname) as tmp:
        torch.save(model, tmp / "model.pt")
        torch.save(model.state_dict(), tmp / "state_dict.pt")
        if scripted is not None:
            torch.jit.save(scripted, str(tmp / SERVED_FILE))
        write_json(tmp / "inference.json", {
            "feeded_var_names": list(feeded_var_names),
            "target_vars": list(target_vars),
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "served": SERVED_FILE if scripted is not None else None,
            "served_error": why,
        })


def load_inference_model(dirname: str | os.PathLike[str]) -> tuple[torch.nn.Module, list[str], list[str]]:
    """Load what ``fleet.save_inference_model`` wrote: ``(model in eval mode, feeds, targets)``."""
    path = resolve(dirname)
    meta = read_json(path / "inference.json")
    model = torch.load(path / "model.pt", weights_only=False)
    model.eval()
    return model, meta["feeded_var_names"], meta["target_vars"]

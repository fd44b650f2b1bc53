"""Checkpoints written atomically: a kill during a save leaves the previous one loadable.

`save_training` / `load_training` are ``fleet.save_persistables`` / ``load_persistables`` for
both styles: the models, the optimizers (whose state includes the strategy's: loss scale, local
SGD counters and snapshots, the gradient-merge window), any object with ``state_dict`` the user
registered (an LR scheduler), and the program run counters. A checkpoint that does not fit the
job (world size, strategy, number of models) is refused with the list of differences.

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
    "load_inference_model",
    "load_training",
    "read_json",
    "resolve",
    "save_inference_model",
    "save_training",
    "write_json",
]

_FORMAT = 2

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


@contextlib.contextmanager
def atomic_dir(dirname: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``dirname`` atomically."""
    target = Path(dirname)
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / "COMPLETE").exists())):
        raise CheckpointError(
            f"{target} exists and is not a fleetlike checkpoint; a save replaces its directory "
            "whole, so it refuses to touch other files. Give an empty or new directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = target.parent / f".{target.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        (tmp / "COMPLETE").write_text("ok\n")
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def save_training(dirname: str | os.PathLike[str], state: TrainingState) -> None:
    with atomic_dir(dirname) as tmp:
        torch.save([m.state_dict() for m in state.models], tmp / "models.pt")
        torch.save([o.state_dict() for o in state.optimizers], tmp / "optimizers.pt")
        torch.save({k: v.state_dict() for k, v in state.extras.items()}, tmp / "extras.pt")
        write_json(tmp / "fleet.json", {
            "format": _FORMAT,
            "world_size": state.world_size,
            "saved_by_rank": state.rank,
            "strategy": state.strategy,
            "models": len(state.models),
            "optimizers": len(state.optimizers),
            "extras": sorted(state.extras),
            "program_runs": state.program_runs,
        })


def load_training(dirname: str | os.PathLike[str], state: TrainingState, device: torch.device) -> dict[str, int]:
    """Restore into ``state``'s objects; returns the saved program run counters."""
    path = resolve(dirname)
    meta = read_json(path / "fleet.json")
    problems = []
    if meta.get("format") != _FORMAT:
        problems.append(f"format: saved {meta.get('format')!r}, this fleetlike reads {_FORMAT}")
    if meta["world_size"] != state.world_size:
        problems.append(f"world size: saved {meta['world_size']}, now {state.world_size}")
    for key in ("models", "optimizers"):
        now = len(getattr(state, key))
        if meta.get(key) != now:
            problems.append(f"{key}: saved {meta.get(key)}, now {now}")
    if meta.get("extras", []) != sorted(state.extras):
        problems.append(f"registered objects: saved {meta.get('extras')}, now {sorted(state.extras)}")
    for key in sorted(set(state.strategy) | set(meta["strategy"])):
        if state.strategy.get(key) != meta["strategy"].get(key):
            problems.append(f"strategy.{key}: saved {meta['strategy'].get(key)!r}, now {state.strategy.get(key)!r}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit this job:\n  " + "\n  ".join(problems)
            + "\nrestart with the saved world size, strategy and models (DistributedStrategy.from_dict)"
        )
    for model, saved in zip(state.models, torch.load(path / "models.pt", map_location=device, weights_only=True)):
        model.load_state_dict(saved)
    for opt, saved in zip(state.optimizers, torch.load(path / "optimizers.pt", map_location=device, weights_only=False)):
        opt.load_state_dict(saved)
    extras = torch.load(path / "extras.pt", map_location=device, weights_only=False)
    for name, obj in state.extras.items():
        obj.load_state_dict(extras[name])
    return dict(meta.get("program_runs", {}))


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

"""Training and inference checkpoints: what is saved, and a load that is all or nothing.

`save_training` / `load_training` are ``fleet.save_persistables`` / ``load_persistables`` for
both styles: the models, the optimizers (whose state includes the strategy's: loss scale, local
SGD counters and snapshots, the gradient-merge window), any object with ``state_dict`` the user
registered (an LR scheduler), and the program run counters. A checkpoint that does not fit the
job (strategy, number of models) is refused with the list of differences. The world size may
change: parameters and strategy state are replicated, and under ``strategy.sharding`` every
rank writes its shard of the optimizer state, which a job of any size (sharded or not) reads
back through `consolidate_optimizer_state`'s union, keeping its own partition.

The files are written and checked by `fleetlike.fleet.checkpoint_files`: atomically (a kill
during a save leaves the previous checkpoint loadable), versioned, with checksums, read with
``torch.load(weights_only=True)``. A load reads and checks every file, and that they fit the
job, before it changes anything; should applying them still fail, what was applied is put back.

Example:
    >>> fleet.save_persistables(exe, "ckpt")
    >>> fleet.load_persistables(exe, "ckpt")      # all or nothing; errors name the file
    >>> read_file("ckpt", "models.pt")[0]          # a model's state_dict, for plain PyTorch
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fleetlike.config import DistributedStrategy
from fleetlike.fleet.checkpoint_files import (
    COMPLETE,
    FORMAT,
    LEGACY_FORMAT,
    CheckpointError,
    atomic_dir,
    checkpoint_path,
    commit,
    explain_write_error,
    full_disk_errno,
    full_disk_error,
    load_pt,
    make_tag,
    read_json,
    resolve,
    save_pt,
    seal,
    temporary,
    verify,
    write_json,
)
from fleetlike.fleet.inference_model import SERVED_FILE, load_inference_model, save_inference_model
from fleetlike.strategies.zero import full_state_dict, is_sharded, plain_shards, shard_state_like, unite_shards

__all__ = [
    "CheckpointError",
    "SERVED_FILE",
    "TrainingState",
    "atomic_dir",
    "consolidate_optimizer_state",
    "load_inference_model",
    "load_training",
    "read_file",
    "read_json",
    "resolve",
    "save_inference_model",
    "save_training",
    "write_json",
]

#: the strategy state inside a fleetlike optimizer's state_dict (`DistributedOptimizer`)
_ENGINE_KEY = "fleetlike"
#: strategy options a checkpoint may be loaded across: the optimizer state is resharded
_RESHARDABLE = frozenset({"sharding", "sharding_configs", "num_apply_group"})
#: what each file of a training checkpoint holds (the ``content`` inside it)
_CONTENT = {"models.pt": "models", "optimizers.pt": "optimizers", "extras.pt": "registered objects"}
_SHARD_CONTENT = "optimizer shard"
#: fleet.json's keys every load needs
_MANIFEST_KEYS = ("format", "strategy", "models", "optimizers", "extras")


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
        "format": FORMAT,
        "world_size": state.world_size,
        "saved_by_rank": state.rank,
        "strategy": state.strategy,
        "models": len(state.models),
        "optimizers": len(state.optimizers),
        "extras": sorted(state.extras),
        "program_runs": state.program_runs,
    }


def _write_replicated(tmp: Path, state: TrainingState, models: list[dict[str, Any]] | None = None) -> None:
    models = [m.state_dict() for m in state.models] if models is None else models
    save_pt(models, tmp / "models.pt", _CONTENT["models.pt"])
    save_pt({k: v.state_dict() for k, v in state.extras.items()}, tmp / "extras.pt", _CONTENT["extras.pt"])


def save_training(dirname: str | os.PathLike[str], state: TrainingState) -> None:
    """Write ``state``; under ``strategy.sharding`` every rank must call it (each writes its shard)."""
    if _sharding_units(state):
        _save_sharded(checkpoint_path(dirname), state)
        return
    with atomic_dir(dirname) as tmp:
        _write_replicated(tmp, state)
        save_pt([o.state_dict() for o in state.optimizers], tmp / "optimizers.pt", _CONTENT["optimizers.pt"])
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
    flag = torch.tensor([1.0 if failed else 0.0], device=world.device)
    world.all_reduce(flag, "max", agreed=True)
    return bool(flag.item())


def _agree_on_writes(world: Any, error: BaseException | None, target: Path) -> None:
    """Raise on every rank when any rank's write failed: its own error on a failing rank, and on
    the others what the first failing rank met (a full disk named as such, with the directory
    and the intact previous checkpoint). One MAX allreduce of every rank's outcome."""
    codes = torch.zeros(world.size)
    if error is not None:  # 1 + errno of a full disk, or 1
        codes[world.rank] = 1.0 + full_disk_errno(error)
    codes = codes.to(world.device)
    world.all_reduce(codes, "max", agreed=True)
    failed = [(r, int(c) - 1) for r, c in enumerate(codes.tolist()) if c > 0]
    if error is not None:
        raise error
    if failed:
        rank, errnum = failed[0]
        if errnum:
            raise full_disk_error(target, errnum, f" (rank {rank}'s shard)")
        raise CheckpointError(f"rank {rank} failed to write its shard of {target} (see its error); nothing was "
                              "replaced, the previous checkpoint is as it was")


def _shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.pt"


def _broadcast_tag(world: Any) -> str:
    """Rank 0's `make_tag` on every rank (drawn from the OS: torch's generator is left alone)."""
    buf = torch.zeros(128, dtype=torch.uint8)
    if world.rank == 0:
        raw = make_tag().encode()
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = world.broadcast(buf.to(world.device), 0, agreed=True)
    return bytes(buf.tolist()).rstrip(b"\0").decode()


def _save_sharded(target: Path, state: TrainingState) -> None:
    units = _sharding_units(state)
    unit = next(u for u in units if u is not None)
    world = unit.ctx.groups.world
    # sharded parameters (stages 2 and 3) are gathered on every rank, kept by rank 0 only: the
    # models are saved whole (consolidated), loadable at any world size and stage
    models = [full_state_dict(m, rank0_only=True, rank=world.rank) for m in state.models] \
        if any(is_sharded(p) for m in state.models for p in m.parameters()) else None
    tag_s = _broadcast_tag(world)
    tmp = target.parent / f".{target.name}.tmp-{tag_s}"
    error: BaseException | None = None
    try:
        if world.rank == 0:
            temporary(target, tag_s)
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
        save_pt([plain_shards(o.state_dict()) for o in state.optimizers], tmp / _shard_name(world.rank),
                _SHARD_CONTENT)
        if world.rank == 0:
            _write_replicated(tmp, state, models)
            meta = _manifest(state)
            meta["sharding"] = {
                "world_size": world.size,
                "shards": [_shard_name(r) for r in range(world.size)],
                "layouts": [None if u is None else u.layout(o) for u, o in zip(units, state.optimizers)],
            }
            write_json(tmp / "fleet.json", meta)
    except BaseException as exc:
        error = explain_write_error(exc, target)
    try:
        _agree_on_writes(world, error, target)
    except BaseException:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        if world.rank == 0:
            missing = [n for n in (_shard_name(r) for r in range(world.size)) if not (tmp / n).exists()]
            if missing:
                raise CheckpointError(f"{tmp} lacks {missing}: the ranks do not share this filesystem")
            seal(tmp)
            commit(tmp, target, tag_s)
    except BaseException as exc:
        error = explain_write_error(exc, target)
        shutil.rmtree(tmp, ignore_errors=True)
    if _agree(world, error is not None):
        raise error if error is not None else CheckpointError(f"rank 0 could not complete {target}; see its error")


def _read_shards(path: Path, meta: dict[str, Any], fmt: int) -> list[list[dict[str, Any]]]:
    """Every rank's list of optimizer state_dicts, in rank order."""
    return [load_pt(path / name, _SHARD_CONTENT, fmt, "cpu") for name in meta["sharding"]["shards"]]


def _union(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One ordinary optimizer state_dict from the shards of one optimizer (disjoint states)."""
    state: dict[Any, Any] = {}
    if "dim0_shards" in shards[0]:  # stages 2 and 3: every rank a dim-0 piece of every tensor
        state = unite_shards(shards)
    else:  # stage 1: each rank the whole state of the parameters it owns
        for shard in shards:
            state.update(shard["state"])
    full = {k: v for k, v in shards[0].items() if k not in ("state", _ENGINE_KEY, "dim0_shards")}
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
    path, fmt, meta = _open(dirname)
    if not 0 <= index < int(meta["optimizers"]):
        raise IndexError(f"optimizer index {index}: checkpoint {path} holds {meta['optimizers']} optimizer(s)")
    if meta.get("sharding"):
        return _union([shard[index] for shard in _read_shards(path, meta, fmt)])
    saved = load_pt(path / "optimizers.pt", _CONTENT["optimizers.pt"], fmt, "cpu")[index]
    return {k: v for k, v in saved.items() if k != _ENGINE_KEY}


def read_file(dirname: str | os.PathLike[str], name: str) -> Any:
    """What file ``name`` of a training checkpoint holds, checked and read without running code.

    ``models.pt``: the models' state_dicts; ``extras.pt``: the registered objects' (by name);
    ``optimizers.pt`` / ``shard-NNNNN.pt``: optimizer state_dicts (`consolidate_optimizer_state`
    unites the shards).

    Example:
        >>> model.load_state_dict(read_file("ckpt", "models.pt")[0])   # plain PyTorch, one process
    """
    path, fmt, _ = _open(dirname)
    content = _SHARD_CONTENT if name.startswith("shard-") else _CONTENT.get(name)
    if content is None:
        raise ValueError(f"read_file(name={name!r}): give one of {sorted(_CONTENT)} or shard-NNNNN.pt")
    return load_pt(path / name, content, fmt, "cpu")


def _open(dirname: str | os.PathLike[str]) -> tuple[Path, int, dict[str, Any]]:
    """``(path, format, manifest)`` of a checkpoint whose files all passed `verify`."""
    path = resolve(dirname)
    fmt = verify(path)
    manifest = path / "fleet.json"
    meta = read_json(manifest)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{manifest} is corrupt (not a JSON object); load an earlier checkpoint")
    if meta.get("format") != fmt:
        raise CheckpointError(
            f"{manifest} says format {meta.get('format')!r}, its directory's {COMPLETE} says {fmt}: "
            f"this fleetlike reads formats {LEGACY_FORMAT}-{FORMAT} and the files must come from one save; "
            "load an earlier checkpoint"
        )
    missing = [k for k in _MANIFEST_KEYS if k not in meta]
    if meta.get("sharding") is not None and not isinstance(meta["sharding"], dict):
        missing.append("sharding")
    if missing:
        raise CheckpointError(f"{manifest} lacks {', '.join(repr(k) for k in missing)} (every fleetlike save "
                              "writes them): the file was edited or damaged; load an earlier checkpoint")
    return path, fmt, meta


def _fit_problems(meta: dict[str, Any], state: TrainingState) -> list[str]:
    problems = []
    for key in ("models", "optimizers"):
        now = len(getattr(state, key))
        if meta.get(key) != now:
            problems.append(f"{key}: saved {meta.get(key)}, now {now}")
    if meta.get("extras", []) != sorted(state.extras):
        problems.append(f"registered objects: saved {meta.get('extras')}, now {sorted(state.extras)}")
    saved_strategy = meta["strategy"] if isinstance(meta["strategy"], dict) else {}
    # an option (or a section's key) added since the save is absent from it: the save ran with
    # its default
    defaults = DistributedStrategy().to_dict()
    saved_strategy = {**defaults, **{k: {**defaults[k], **v} if isinstance(v, dict) and isinstance(defaults.get(k), dict)
                                     else v for k, v in saved_strategy.items()}}
    for key in sorted(set(state.strategy) | set(saved_strategy)):
        if key in _RESHARDABLE:
            continue
        if state.strategy.get(key) != saved_strategy.get(key):
            problems.append(f"strategy.{key}: saved {saved_strategy.get(key)!r}, now {state.strategy.get(key)!r}")
    return problems


def _check_models(path: Path, saved: Any, models: list[torch.nn.Module]) -> None:
    """Each saved state_dict has every key of its model, of the same shape (or the load would half-apply)."""
    if not isinstance(saved, list) or len(saved) != len(models):
        raise CheckpointError(f"{path} holds {len(saved) if isinstance(saved, list) else type(saved).__name__} "
                              f"model state(s), the job has {len(models)}; load an earlier checkpoint")
    for i, (held, model) in enumerate(zip(saved, models)):
        now = model.state_dict()
        if not isinstance(held, dict):
            raise CheckpointError(f"{path}: model {i} is a {type(held).__name__}, not a state_dict")
        diff = sorted(set(now) ^ set(held))
        shapes = [f"{k}: saved {tuple(held[k].shape)}, now {tuple(v.shape)}" for k, v in now.items()
                  if k in held and isinstance(v, torch.Tensor)
                  and (not isinstance(held[k], torch.Tensor) or held[k].shape != v.shape)]
        if diff or shapes:
            raise CheckpointError(
                f"checkpoint {path.parent} does not fit model {i} ({type(model).__name__}): "
                + "; ".join(([f"keys only in one of them: {diff[:8]}"] if diff else []) + shapes[:8])
                + "; restart with the model it was saved from"
            )


def load_training(dirname: str | os.PathLike[str], state: TrainingState, device: torch.device) -> dict[str, int]:
    """Restore into ``state``'s objects; returns the saved program run counters.

    All or nothing: every file is checked (`verify`) and read, and its fit to the job checked,
    before anything is applied; should applying still fail, what was applied is put back."""
    path, fmt, meta = _open(dirname)
    problems = _fit_problems(meta, state)
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit this job:\n  " + "\n  ".join(problems)
            + "\nrestart with the saved strategy and models (DistributedStrategy.from_dict)"
        )
    models = load_pt(path / "models.pt", _CONTENT["models.pt"], fmt, device)
    _check_models(path / "models.pt", models, state.models)
    optimizers = _optimizer_states(path, meta, state, device, fmt)
    extras = load_pt(path / "extras.pt", _CONTENT["extras.pt"], fmt, device)
    if not isinstance(extras, dict) or sorted(extras) != sorted(state.extras):
        raise CheckpointError(f"{path / 'extras.pt'} holds {sorted(extras) if isinstance(extras, dict) else extras!r}, "
                              f"fleet.json lists {sorted(state.extras)}: the files come from different saves")
    # Models go last, and a model whose application cannot fail (`_why_unsafe` finds nothing:
    # names and shapes were checked above, and torch's own code copies tensor into tensor) goes
    # without a copy of its weights: nothing that could call for putting it back comes after it.
    # Every other object is held (copied) just before it is applied.
    models = [shard_state_like(m, saved) for m, saved in zip(state.models, models)]  # stages 2 and 3
    risky = [(m, saved, bool(_why_unsafe(m, saved))) for m, saved in zip(state.models, models)]
    plan = [(o, saved, True) for o, saved in zip(state.optimizers, optimizers)] \
        + [(obj, extras[name], True) for name, obj in state.extras.items()] \
        + [item for item in risky if item[2]] + [item for item in risky if not item[2]]
    touched: list[tuple[Any, Any]] = []
    try:
        for obj, saved, hold in plan:
            touched.append((obj, _hold(obj) if hold else None))  # a failing object is put back too
            obj.load_state_dict(saved)
    except Exception as exc:
        stuck = _put_back(touched)
        raise CheckpointError(
            f"checkpoint {path} could not be applied ({type(exc).__name__}: {exc}); "
            + (f"putting back failed for {stuck}: the job's state is mixed, restart it" if stuck else
               "the job's state was put back as it was")
            + ": restart with the job it was saved from"
        ) from exc
    return dict(meta.get("program_runs", {}))


def _copy(value: Any) -> Any:
    """A CPU copy sharing nothing with ``value`` (what `_put_back` restores)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = type(value)((k, _copy(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # a module state_dict's versions, which load_state_dict reads
            out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return out
    if type(value) in (list, tuple):
        return type(value)(_copy(v) for v in value)
    return copy.deepcopy(value)


def _hold(obj: Any) -> tuple[Any, Any]:
    """What `_put_back` needs to return ``obj`` to now: its state (copied) and, for a fleetlike
    optimizer, the strategy state it keeps until its model's engine is built."""
    return _copy(obj.state_dict()), copy.copy(getattr(obj, "_pending_state", None))


def _put_back(touched: list[tuple[Any, Any]]) -> list[str]:
    """Return each touched object to its held state, last first; the ones that refused (or,
    applied without a copy because nothing could fail, failed all the same)."""
    stuck = []
    for obj, held in reversed(touched):
        if held is None:
            stuck.append(f"{type(obj).__name__} (applied without a copy: its application was not expected to fail)")
            continue
        saved, pending = held
        try:
            obj.load_state_dict(saved)
        except Exception as exc:  # noqa: BLE001 - reported with the original error
            stuck.append(f"{type(obj).__name__} ({exc})")
        if hasattr(obj, "_pending_state"):
            obj._pending_state = pending
    return stuck


#: torch's modules whose own ``_load_from_state_dict`` (normalization layers: versions and
#: ``num_batches_tracked``) copies as `torch.nn.Module`'s does
_TORCH_LOADERS = "torch.nn.modules."


def _why_unsafe(model: torch.nn.Module, saved: dict[str, Any]) -> str:
    """Why applying ``saved`` (names and shapes already checked) could fail half-way; "" when it
    cannot: torch's own ``load_state_dict`` with no hooks and no extra state, which only
    ``copy_`` each tensor into a plain, same-device, writable tensor of the same shape."""
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict:
        return f"{type(model).__name__} has its own load_state_dict"
    if torch.__future__.get_swap_module_params_on_conversion():
        return "torch swaps module parameters on load (torch.__future__)"
    for name, module in model.named_modules():
        kind = type(module)
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return f"module {name or kind.__name__!r} has load_state_dict hooks"
        loader = kind._load_from_state_dict
        if loader is not torch.nn.Module._load_from_state_dict and not loader.__module__.startswith(_TORCH_LOADERS):
            return f"module {name or kind.__name__!r} has its own _load_from_state_dict"
        if kind.set_extra_state is not torch.nn.Module.set_extra_state:
            return f"module {name or kind.__name__!r} has extra state"
    for key, now in model.state_dict(keep_vars=True).items():
        held = saved[key]
        if type(held) is not torch.Tensor or type(now) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            return f"{key} is a tensor subclass"
        if now.device != held.device or now.is_inference() or now.is_meta \
                or torch._debug_has_internal_overlap(now) != 0:
            return f"{key} may refuse the copy (device, inference or overlapping memory)"
    return ""


def _optimizer_states(path: Path, meta: dict[str, Any], state: TrainingState,
                      device: torch.device, fmt: int) -> list[dict[str, Any]]:
    """What each optimizer loads. Unsharded: the saved state_dicts. Sharded: each optimizer's
    shards united (a sharded job then keeps its own partition), with the strategy state of this
    rank when the world size is the same, else the ranks' states merged (`_merge_ranks`)."""
    if not meta.get("sharding"):
        saved = load_pt(path / "optimizers.pt", _CONTENT["optimizers.pt"], fmt, device)
    else:
        shards = _read_shards(path, meta, fmt)
        saved = []
        same_world = meta["sharding"]["world_size"] == state.world_size
        for i in range(len(state.optimizers)):
            full = _union([shard[i] for shard in shards])
            engines = [shard[i].get(_ENGINE_KEY) for shard in shards]
            if engines[0] is not None:
                full[_ENGINE_KEY] = engines[state.rank] if same_world else _merge_ranks(engines)
            saved.append(full)
    if not isinstance(saved, list) or len(saved) != len(state.optimizers) or \
            not all(isinstance(o, dict) and "param_groups" in o for o in saved):
        raise CheckpointError(f"{path}: the optimizer states do not match fleet.json ({len(state.optimizers)} "
                              "optimizer state_dicts expected): the files come from different saves")
    return saved

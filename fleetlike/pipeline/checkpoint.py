"""Checkpoints of a pipelined model: one file per stage, named by the unsplit model's names.

Each stage's first data-parallel rank writes ``stage-<s>-of-<p>.pt`` (atomically: a temporary
file renamed over the old one): the stage's parameters and buffers, and its optimizer state,
both keyed by the unsplit model's parameter names rather than by position. So a checkpoint
loads into the same pipeline, into a pipeline of another number of stages (each stage takes
its names from the union of the files), and -- through `consolidated_state_dict` -- into the
plain model or plain data parallel; a plain model's ``state_dict`` loads into a pipeline with
``model.load_state_dict``.

Example:
    >>> save_stage("ckpt", model, opt)            # every rank calls it; one per stage writes
    >>> load_stage("ckpt", model, opt)            # every rank: its stage's part
    >>> plain.load_state_dict(consolidated_state_dict("ckpt"))
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["consolidated_state_dict", "load_stage", "named_optimizer_state", "save_stage", "stage_files"]

_FILE = re.compile(r"^stage-(\d+)-of-(\d+)\.pt$")


def _param_names(model: Any) -> dict[int, str]:
    return {id(t): name for name, t in model.stage.named_state() if isinstance(t, torch.nn.Parameter)}


def named_optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each parameter's position replaced by its name in the
    unsplit model (ValueError for a parameter that is not the stage's)."""
    names = _param_names(model)
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    if missing:
        raise ValueError(f"the optimizer holds {len(missing)} parameter(s) that are not this stage's; build it "
                         "on model.parameters() of the pipelined model")
    state = optimizer.state_dict()
    by_index = [names[id(p)] for p in order]
    groups = [{**g, "params": [by_index[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {by_index[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def save_stage(dirname: str | os.PathLike[str], model: Any, optimizer: torch.optim.Optimizer | None = None,
               extra: dict[str, Any] | None = None) -> Path | None:
    """Write this stage's file if this rank is the stage's first data-parallel rank; the path
    written (None on the other ranks)."""
    hcg = model.hcg
    if hcg.dp_rank != 0:
        return None
    target = Path(dirname)
    target.mkdir(parents=True, exist_ok=True)
    for old in stage_files(target):  # a save of another stage count would mix with this one
        if int(_FILE.match(old.name).group(2)) != hcg.pp_degree:  # type: ignore[union-attr]
            old.unlink(missing_ok=True)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    content = {
        "stage": hcg.stage_id,
        "num_stages": hcg.pp_degree,
        "model": model.state_dict(),
        "optimizer": named_optimizer_state(model, inner) if inner is not None else None,
        "extra": extra or {},
    }
    path = target / f"stage-{hcg.stage_id}-of-{hcg.pp_degree}.pt"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(content, tmp)
    os.replace(tmp, path)
    return path


def stage_files(dirname: str | os.PathLike[str]) -> list[Path]:
    """The stage files in ``dirname``, stage order."""
    found = [p for p in Path(dirname).iterdir() if _FILE.match(p.name)] if Path(dirname).is_dir() else []
    return sorted(found, key=lambda p: int(_FILE.match(p.name).group(1)))  # type: ignore[union-attr]


def _read_all(dirname: str | os.PathLike[str]) -> list[dict[str, Any]]:
    files = stage_files(dirname)
    if not files:
        raise FileNotFoundError(f"{os.fspath(dirname)!r} holds no pipeline stage file (stage-<s>-of-<p>.pt). Fix: "
                                "save with fleet.save_persistables (or save_stage) from a pipelined model first")
    parts = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    counts = {p["num_stages"] for p in parts}
    stages = sorted(p["stage"] for p in parts)
    if len(counts) != 1 or stages != list(range(next(iter(counts)))):
        raise ValueError(f"{os.fspath(dirname)!r} holds stage files {[f.name for f in files]}, not one complete "
                         "pipeline's. Fix: load a directory written by one save")
    return parts


def consolidated_state_dict(dirname: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The unsplit model's ``state_dict`` from every stage's file (loads into the plain model)."""
    full: dict[str, torch.Tensor] = {}
    for part in _read_all(dirname):
        full.update(part["model"])
    return full


def load_stage(dirname: str | os.PathLike[str], model: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load this stage's parameters (and optimizer state) from the files of any stage count;
    returns the saving rank's ``extra`` of this rank's first parameter's stage."""
    parts = _read_all(dirname)
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part["model"])
    model.load_state_dict(full)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if inner is not None:
        named_state: dict[str, Any] = {}
        saved_groups: list[dict[str, Any]] | None = None
        for part in parts:
            if part["optimizer"] is None:
                raise ValueError(f"{os.fspath(dirname)!r} was saved without optimizer state; load the model only")
            named_state.update(part["optimizer"]["state"])
            saved_groups = saved_groups or part["optimizer"]["param_groups"]
        names = _param_names(model)
        assert saved_groups is not None
        if len(saved_groups) != len(inner.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one "
                             f"{len(inner.param_groups)}. Fix: build the optimizer as it was when saved")
        order = [p for group in inner.param_groups for p in group["params"]]
        index = {names[id(p)]: i for i, p in enumerate(order)}
        groups, start = [], 0
        for saved, group in zip(saved_groups, inner.param_groups):
            n = len(group["params"])
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        state = {index[name]: value for name, value in named_state.items() if name in index}
        inner.load_state_dict({"state": state, "param_groups": groups})
    mine = [p for p in parts if p["stage"] == min(model.hcg.stage_id, len(parts) - 1)]
    return dict(mine[0]["extra"]) if mine else {}

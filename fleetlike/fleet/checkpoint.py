"""Checkpoints written atomically: a kill during a save leaves the previous one loadable.

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
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_dir", "resolve", "write_json", "read_json", "CheckpointError"]


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

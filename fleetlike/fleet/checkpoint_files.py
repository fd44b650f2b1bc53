"""The files of a checkpoint directory: written atomically, versioned, checked before any is used.

A checkpoint directory is written in full to a temporary sibling (``.<name>.tmp-<host>-<pid>-<random>``),
sealed, fsync'ed, and only then swapped in by renames; a kill at any moment leaves the previous
checkpoint loadable (`resolve`), and the next save removes what killed saves left behind
(`remove_leftovers`: only directories whose writer is provably gone).

Sealing writes ``COMPLETE``: the format and, per file, its size and SHA-256. A load first
checks every file against it (`verify`), so a missing, empty, truncated or corrupt file is
named before anything is read into a model. Every ``.pt`` file holds
``{"format": FORMAT, "content": what, "data": ...}`` of tensors, plain values (numpy numbers
included) and containers only,
written through `save_pt` (which refuses anything else, naming where it sits) and read
through `load_pt` with ``torch.load(weights_only=True)``: loading a checkpoint runs no code
from the file. A directory sealed by fleetlike before per-file versions (format 2: ``COMPLETE``
holds ``ok``) still loads, without checksums, with a one-line notice.

Example:
    >>> with atomic_dir("ckpt") as tmp:
    ...     save_pt([model.state_dict()], tmp / "models.pt", "models")
    >>> models = load_pt(resolve("ckpt") / "models.pt", "models", verify(resolve("ckpt")))
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import importlib
import io
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import socket
import stat
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "COMPLETE",
    "FORMAT",
    "LEGACY_FORMAT",
    "CheckpointError",
    "atomic_dir",
    "checkpoint_path",
    "commit",
    "explain_write_error",
    "full_disk_errno",
    "full_disk_error",
    "load_pt",
    "make_tag",
    "read_json",
    "remove_leftovers",
    "resolve",
    "save_pt",
    "seal",
    "temporary",
    "verify",
    "write_json",
]

#: the layout this fleetlike writes: per-file versions and the checksums in COMPLETE
FORMAT = 3
#: the layout before per-file versions (COMPLETE holds "ok"); still read
LEGACY_FORMAT = 2
COMPLETE = "COMPLETE"
#: the largest COMPLETE read (a list of ~100k files): a bigger one is refused, never read whole
_MAX_MARKER_BYTES = 16 << 20
#: a leftover whose writer cannot be checked (another host, or a name without a pid) is removed
#: only when nothing in it changed for this long: no save stalls that long between two writes
STALE_AFTER_S = 6 * 3600.0

log = logging.getLogger("fleetlike")


def _numpy_scalars() -> list[Any]:
    """What a numpy number needs to be read by ``weights_only`` (a metric kept as ``np.float64``):
    the scalar constructor and the numeric dtypes; no arrays of objects, nothing that runs code."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        return []
    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
             np.float16, np.float32, np.float64, np.complex64, np.complex128)
    return [multiarray.scalar, np.dtype, *{type(np.dtype(k)) for k in kinds}]


#: the globals, besides torch's own, a checkpoint file may name (`_numpy_scalars`)
_SAFE_GLOBALS = _numpy_scalars()


def _read_plainly(source: Any, map_location: Any = None) -> Any:
    with torch.serialization.safe_globals(_SAFE_GLOBALS):
        return torch.load(source, map_location=map_location, weights_only=True)


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, of another version, or does not fit the current job."""


def _damaged(path: Path, cause: str) -> CheckpointError:
    return CheckpointError(
        f"{path} {cause}. The checkpoint {path.parent} is damaged and nothing was loaded from it "
        "(the job's state is unchanged): load an earlier checkpoint, or copy this one again from its source"
    )


# ------------------------------------------------------------------ where a checkpoint lives


def checkpoint_path(dirname: str | os.PathLike[str]) -> Path:
    """Where the checkpoint ``dirname`` really is, after two checks a save and a load both make.

    A ``dirname`` that is a symbolic link (``ckpt -> /big/disk/run1/ckpt``: the checkpoints kept
    on another disk) is followed: the save goes to where it points, replacing that directory
    atomically beside it, and the link stays as it was, as ``cp`` or an editor writes through a
    link. Renaming the link itself aside would leave the target stale and the link kept as a
    ``.ckpt.old-*`` forever. A link another user owns is not followed (in a shared folder anyone
    may create one, pointing at this user's files): `CheckpointError`.

    The folder that holds the checkpoint must not be writable by others without the sticky bit
    (mode ``0777``, not ``1777``): anyone could then rename the checkpoint away and put their own
    in its place, which the next load would take for this job's. `CheckpointError` names the
    folder, its mode and the fix. Group-writable folders (a team's) are the group's choice.

    Example:
        >>> checkpoint_path("ckpt")            # ckpt -> /big/disk/run1/ckpt
        PosixPath('/big/disk/run1/ckpt')
    """
    target = Path(dirname)
    if target.is_symlink():
        owner = target.lstat().st_uid
        if owner != os.getuid():
            raise CheckpointError(
                f"{target} is a symbolic link owned by uid {owner}, not by this user (uid {os.getuid()}); "
                "a checkpoint is never saved or loaded through another user's link (it could point at "
                "your files, or at a checkpoint of theirs). Remove it, or give the path it points to")
        try:
            target = target.resolve(strict=False)
        except (OSError, RuntimeError) as exc:  # a loop of links
            raise CheckpointError(f"{dirname} is a symbolic link that cannot be followed ({exc}); "
                                  "point it at a directory, or give that directory's path") from None
    folder = target.parent
    try:
        mode = folder.stat().st_mode
    except OSError:
        return target  # not there yet: a save creates it (with this user's umask)
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise CheckpointError(
            f"checkpoint {target}: its folder {folder} may be written by every user (mode {mode & 0o7777:o}, "
            "without the sticky bit), so anyone could replace the checkpoint with their own, which a "
            f"load would then take for this job's; run chmod o-w {folder} (or chmod +t), or keep "
            "checkpoints in a folder of your own")
    return target


# ------------------------------------------------------------------ writing


def make_tag() -> str:
    """``<host>-<pid>-<random>``: who writes a temporary directory (see `remove_leftovers`).

    Drawn from the OS, not torch's generator: a run that saves draws the same random numbers
    as one that does not."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def temporary(target: Path, tag: str) -> Path:
    """Check ``target`` may be replaced, clear leftovers, and create its temporary sibling."""
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not (target / COMPLETE).exists())):
        raise CheckpointError(
            f"{target} exists and is not a fleetlike checkpoint; a save replaces its directory "
            "whole, so it refuses to touch other files. Give an empty or new directory"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)
    tmp = target.parent / f".{target.name}.tmp-{tag}"
    tmp.mkdir()
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _newest_change(root: Path) -> float:
    newest = root.lstat().st_mtime
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            newest = max(newest, path.lstat().st_mtime)
    return newest


def _stale(path: Path) -> bool:
    """Whether ``path`` (a ``.tmp-`` or ``.old-`` sibling) is provably left by a save that ended."""
    try:
        st = path.lstat()
    except OSError:
        return False
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid():
        return False  # not a directory this user's saves made
    tag = path.name.rsplit(".tmp-", 1)[-1].rsplit(".old-", 1)[-1]
    parts = tag.rsplit("-", 2)
    here = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"
    if len(parts) == 3 and parts[0] == here and parts[1].isdigit():
        pid = int(parts[1])
        return pid != os.getpid() and not _alive(pid)
    return time.time() - _newest_change(path) > STALE_AFTER_S


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the temporary and moved-aside directories of ``target`` that killed saves left.

    Only stale ones (`_stale`): a save in progress keeps its directory. A moved-aside previous
    checkpoint is kept while ``target`` itself is incomplete: `resolve` falls back to it."""
    removed = []
    leftovers = list(target.parent.glob(f".{target.name}.tmp-*"))
    if (target / COMPLETE).exists():
        leftovers += target.parent.glob(f".{target.name}.old-*")
    for path in leftovers:
        if _stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("checkpoint %s: removed %d leftover(s) of interrupted saves: %s", target, len(removed),
                 ", ".join(p.name for p in removed))
    return removed


#: types ``torch.load(weights_only=True)`` reads (others are tried once per type, `_loads_plainly`)
_PLAIN: frozenset[type] = frozenset({int, float, bool, str, bytes, complex, type(None), dict, list, tuple,
                                     collections.OrderedDict, torch.Size, torch.dtype, torch.device})


def _check_plain(obj: Any, where: str, tried: dict[type, bool]) -> None:
    """Raise, naming ``where``, if ``obj`` holds what ``torch.load(weights_only=True)`` refuses."""
    kind = type(obj)
    if not isinstance(obj, torch.Tensor) and kind not in _PLAIN:
        if kind not in tried:
            tried[kind] = _loads_plainly(obj)
        if not tried[kind]:
            raise _not_plain(obj, where)
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_plain(key, f"{where} key {key!r}", tried)
            _check_plain(value, f"{where}[{key!r}]", tried)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]", tried)


def _loads_plainly(obj: Any) -> bool:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        _read_plainly(buf)
    except Exception:  # noqa: BLE001 - any refusal means the checkpoint could not be loaded back
        return False
    return True


def _not_plain(obj: Any, where: str) -> CheckpointError:
    return CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint cannot hold: "
        "checkpoint files hold tensors and plain values only and are read with torch.load(weights_only=True), "
        "so that loading one runs no code from the file. Keep its state_dict() or plain values instead"
    )


def save_pt(obj: Any, path: Path, content: str) -> None:
    """Write ``obj`` (tensors and plain containers, checked) as ``path``, versioned."""
    _check_plain(obj, f"{path.name}: {content}", {})
    with open(path, "wb") as fh:  # a file object: a full disk raises OSError(ENOSPC), not a zip error
        torch.save({"format": FORMAT, "content": content, "data": obj}, fh)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))


def _digest(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _self_digest(fmt: Any, files: Any) -> str:
    """The checksum of COMPLETE's own list (a damaged list is then named, not the file it misdescribes)."""
    return hashlib.sha256(json.dumps({"format": fmt, "files": files}, sort_keys=True).encode()).hexdigest()


def seal(tmp: Path) -> None:
    """Write ``COMPLETE`` (format, size and SHA-256 of every file) and fsync the tree."""
    files = {}
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            files[path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _digest(path)}
    write_json(tmp / COMPLETE, {"format": FORMAT, "files": files, "sha256": _self_digest(FORMAT, files)})
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(tmp)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, target: Path, tag: str) -> None:
    """Swap the sealed ``tmp`` in for ``target`` (the previous one moved aside, then removed)."""
    old = target.parent / f".{target.name}.old-{tag}"
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    remove_leftovers(target)


def _full_disk(exc: BaseException) -> OSError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def full_disk_errno(exc: BaseException) -> int:
    """``ENOSPC`` or ``EDQUOT`` when ``exc`` (or what caused it) is a full disk; else 0."""
    full = _full_disk(exc)
    return 0 if full is None else int(full.errno)


def full_disk_error(target: Path, errnum: int, who: str = "") -> CheckpointError:
    """A full disk while saving ``target`` (``who``: whose write, when not this process's),
    naming the directory and the checkpoint that is intact."""
    try:
        intact = f"the previous checkpoint {resolve(target)} is intact"
    except CheckpointError:
        intact = f"there was no previous checkpoint at {target}"
    what = "no space left" if errnum == errno.ENOSPC else "disk quota exceeded"
    return CheckpointError(f"{what} on {target.parent} while saving {target}{who} ({os.strerror(errnum)}); "
                           f"{intact}. Free space there (or save elsewhere) and save again")


def explain_write_error(exc: BaseException, target: Path) -> BaseException:
    """``exc`` as the user should read it: a full disk names the directory and what is intact."""
    errnum = full_disk_errno(exc)
    if not errnum:
        return exc
    explained = full_disk_error(target, errnum)
    explained.__cause__ = exc  # what the OS said, kept (and `full_disk_errno` still finds it)
    return explained


@contextlib.contextmanager
def atomic_dir(dirname: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory; on success it is sealed and replaces ``dirname`` atomically
    (where it points, when it is a symbolic link: `checkpoint_path`)."""
    target = checkpoint_path(dirname)
    tag = make_tag()
    tmp = temporary(target, tag)
    try:
        yield tmp
        seal(tmp)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        explained = explain_write_error(exc, target)
        if explained is exc:
            raise
        raise explained from exc
    commit(tmp, target, tag)


# ------------------------------------------------------------------ reading


def resolve(dirname: str | os.PathLike[str]) -> Path:
    """The complete checkpoint to load for ``dirname`` (the previous one if a save was cut;
    where it points when it is a symbolic link: `checkpoint_path`)."""
    target = checkpoint_path(dirname)
    if (target / COMPLETE).exists():
        return target
    olds = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.lstat().st_mtime)
    for old in reversed(olds):
        info = old.lstat()
        if old.is_symlink() or info.st_uid != os.getuid():
            # in a shared (sticky) folder anyone may plant one: only this user's own are loaded
            log.warning("checkpoint: ignoring %s (owned by uid %d%s, not this user's own save)", old,
                        info.st_uid, ", a symbolic link" if old.is_symlink() else "")
            continue
        if (old / COMPLETE).exists():
            return old
    if target.exists():
        raise CheckpointError(
            f"{target} is not a complete fleetlike checkpoint (no {COMPLETE} marker: the save that wrote it "
            "did not finish, or it was made by something else); load an earlier checkpoint"
        )
    raise CheckpointError(f"no checkpoint at {target}: check the path (a save creates it)")


def read_json(path: Path) -> Any:
    """``path``'s JSON; a missing, empty or unparsable file is named with the cause."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _damaged(path, "is missing") from None
    except UnicodeDecodeError as exc:
        raise _damaged(path, f"is corrupt (not UTF-8 text at byte {exc.start})") from None
    if not text.strip():
        raise _damaged(path, "is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        cut = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")
        raise _damaged(path, f"is {'truncated' if cut else 'corrupt'} (JSON: {exc.msg} at line {exc.lineno} "
                             f"column {exc.colno})") from None


def verify(path: Path) -> int:
    """Check every file of the checkpoint ``path`` against its ``COMPLETE``; return its format.

    Format 2 (written before checksums) is returned with a one-line notice."""
    marker = path / COMPLETE
    try:
        with open(marker, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > _MAX_MARKER_BYTES:
                raise _damaged(marker, f"is {size} bytes, far more than a checkpoint's file list "
                                       f"(at most {_MAX_MARKER_BYTES}): not written by a save")
            raw = fh.read(_MAX_MARKER_BYTES + 1)
    except FileNotFoundError:
        raise _damaged(marker, "is missing") from None
    except IsADirectoryError:
        raise _damaged(marker, "is a directory, not the file a save writes") from None
    if raw.strip() == b"ok":
        log.warning("checkpoint %s is in format %d (written before per-file versions and checksums): "
                    "loading it unchecked; save it again to upgrade", path, LEGACY_FORMAT)
        return LEGACY_FORMAT
    seal_data = read_json(marker)
    fmt = seal_data.get("format") if isinstance(seal_data, dict) else None
    if not isinstance(fmt, int) or not isinstance(seal_data.get("files"), dict):
        raise _damaged(marker, "is corrupt (no format and file list)")
    if fmt > FORMAT or fmt < LEGACY_FORMAT:
        raise CheckpointError(f"{path} is in checkpoint format {fmt} ({marker}); this fleetlike reads formats "
                              f"{LEGACY_FORMAT}-{FORMAT}: load it with the fleetlike that wrote it")
    if seal_data.get("sha256") != _self_digest(fmt, seal_data["files"]) or not all(
            isinstance(w, dict) and isinstance(w.get("bytes"), int) and isinstance(w.get("sha256"), str)
            for w in seal_data["files"].values()) or any(".." in Path(n).parts or Path(n).is_absolute()
                                                         for n in seal_data["files"]):
        raise _damaged(marker, "is corrupt (its list of files does not match its own checksum)")
    for name, want in sorted(seal_data["files"].items()):
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise _damaged(file, f"is missing ({COMPLETE} lists it)") from None
        if size == 0 and want["bytes"]:
            raise _damaged(file, f"is empty ({want['bytes']} bytes were written)")
        if size < want["bytes"]:
            raise _damaged(file, f"is truncated ({size} of {want['bytes']} bytes)")
        if size > want["bytes"]:
            raise _damaged(file, f"is corrupt ({size} bytes, {want['bytes']} were written)")
        if _digest(file) != want["sha256"]:
            raise _damaged(file, "is corrupt (its SHA-256 differs from the one recorded when it was saved)")
    return fmt


def load_pt(path: Path, content: str, fmt: int, map_location: Any = None) -> Any:
    """The data of a checkpoint ``.pt`` file (format ``fmt`` of its directory; `verify` first)."""
    if not path.exists():
        raise _damaged(path, "is missing")
    if path.stat().st_size == 0:
        raise _damaged(path, "is empty")
    try:
        with open(path, "rb") as fh:
            saved = _read_plainly(fh, map_location)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain values ({first[-1] if first else exc}); "
            "fleetlike reads checkpoints with torch.load(weights_only=True) so that a file cannot run code. "
            "If you wrote it yourself and trust it, read it with torch.load(weights_only=False) and apply it"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as exc:
        truncated = "central directory" in str(exc) or isinstance(exc, EOFError)
        raise _damaged(path, f"is {'truncated' if truncated else 'corrupt'} "
                             f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else 'end of file'})"
                       ) from None
    if fmt == LEGACY_FORMAT and not (isinstance(saved, dict) and "format" in saved and "content" in saved):
        return saved
    if not isinstance(saved, dict) or not isinstance(saved.get("format"), int) or "data" not in saved:
        raise CheckpointError(f"{path} has no format version: it was not written by fleetlike's save, or "
                              "comes from another checkpoint than its directory; load an earlier checkpoint")
    if saved["format"] != fmt or saved.get("content") != content:
        raise CheckpointError(
            f"{path} is {saved.get('content')!r} of format {saved['format']}, its checkpoint expects {content!r} of "
            f"format {fmt}: the files come from different saves; load an earlier checkpoint"
        )
    return saved["data"]

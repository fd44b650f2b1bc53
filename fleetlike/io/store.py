"""A directory of cached files bounded in bytes, shared by every process on a node.

Both caches stand on it: the raw-file cache (`FileCache`: least recently used files are evicted
to make room) and the decoded-sample cache's disk part (`CachedDataset`: what does not fit is not
cached, since an epoch reads every sample once and LRU would evict each one just before its next
use). Several DataLoader workers and ranks write at once, so

- every file is written to a temporary name in the same directory and renamed into place: a
  reader sees a whole file or none;
- ``lock(key)`` is an ``fcntl`` lock per key: the first process fetches, the others wait and
  then find the file (one fetch, not one per process);
- the byte count lives in a small file under a node-wide lock, recounted from the directory when
  evicting, so processes agree on the total without a server;
- what is in the directory is trusted (the decoded-sample cache unpickles it), so the directory
  must be the user's own and nobody else may write to it (`owned_directory`): one that does not
  exist yet is created with mode 0700; another user's, or one that group or others may write
  (``/tmp`` itself, a shared 0777 folder), is refused, saying why.

Example:
    >>> store = DiskStore("/local/cache/fc", max_bytes=2**30, evict=True, what="FileCache")
    >>> with store.lock("a/b.jpg"):
    ...     path = store.get("a/b.jpg") or store.put("a/b.jpg", chunks)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["CacheFullError", "DiskStore", "LockPickling", "UnsafeCacheDirError", "check_size", "owned_directory"]

_META = ".fleetlike-cache"


class LockPickling:
    """For objects guarding their state with ``self._lock``: pickled without it (a DataLoader
    started with spawn or forkserver pickles the dataset for its workers), given a new one when
    unpickled."""

    _lock: threading.Lock

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class CacheFullError(ValueError):
    """One item is larger than the whole cache."""


class UnsafeCacheDirError(PermissionError):
    """The cache directory belongs to another user, or others may write to it."""


def owned_directory(directory: Path, what: str) -> None:
    """Create ``directory`` (mode 0700) or check that it is this user's and that neither group
    nor others may write to it; `UnsafeCacheDirError` saying which and the fix otherwise."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError:
        return  # the write probe below names the directory and the error
    info = directory.lstat()
    mode = info.st_mode & 0o777
    why = None
    if not directory.is_dir() or directory.is_symlink():
        why = "is not a directory of its own (a link or a file)"
    elif info.st_uid != os.getuid():
        why = f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
    elif mode & 0o022:
        why = f"may be written by {'group and others' if mode & 0o022 == 0o022 else 'group' if mode & 0o020 else 'others'} (mode {mode:o})"
    if why is not None:
        raise UnsafeCacheDirError(
            f"{what}: cache directory {str(directory)!r} {why}: whoever can write there could plant "
            "files that this process would load (the decoded-sample cache unpickles them). Give a "
            "directory of your own that only you may write, or a new path (it is created with "
            "mode 0700), e.g. cache_dir=os.path.expanduser('~/.cache/fleetlike/decoded')"
        )

def check_size(limit: int | None, what: str) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"{what}: the size limit must be a positive int of bytes (or None: no limit), got {limit!r}")
    return limit


class DiskStore:
    """Files under ``directory`` keyed by relative names; ``max_bytes`` None is unbounded."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None, evict: bool, what: str) -> None:
        self.root = Path(directory)
        self.max_bytes, self.evict, self.what = check_size(max_bytes, what), evict, what
        owned_directory(self.root, what)
        meta = self.root / _META
        try:
            (meta / "locks").mkdir(parents=True, exist_ok=True)
            probe = meta / f"probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise OSError(
                f"{what}: cache directory {str(self.root)!r} cannot be written ({error}); give a "
                "writable directory on a local disk (cache_dir=...)"
            ) from error
        self.meta = meta

    # ------------------------------------------------------------------ locks

    @contextlib.contextmanager
    def _flock(self, path: Path) -> Iterator[None]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def lock(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Exclusive among the node's processes for ``key`` (blocks until free)."""
        digest = hashlib.sha1(key.encode()).hexdigest()
        return self._flock(self.meta / "locks" / digest)

    # ------------------------------------------------------------------ files

    def path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> Path | None:
        """The cached file of ``key``, marked as just used; None when absent."""
        path = self.path(key)
        try:
            os.utime(path)
        except FileNotFoundError:
            return None
        return path

    def put(self, key: str, chunks: Iterable[bytes]) -> Path | None:
        """Write ``chunks`` as ``key`` atomically. Returns the path, or None when the store keeps
        what fits and this does not (the bytes are then not kept)."""
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{uuid.uuid4().hex}"
        size = 0
        try:
            with open(tmp, "wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)
                    size += len(chunk)
            if self.max_bytes is not None and size > self.max_bytes:
                raise CacheFullError(
                    f"{self.what}: {key!r} is {size} bytes, more than the whole cache ({self.max_bytes} "
                    "bytes); raise the cache size above one item"
                )
            with self._flock(self.meta / "size.lock"):
                total = self._total()
                old = final.stat().st_size if final.exists() else 0
                if self.max_bytes is not None and total - old + size > self.max_bytes:
                    if not self.evict:
                        return None
                    total = self._evict(self.max_bytes - size, keep=final)
                    old = final.stat().st_size if final.exists() else 0
                os.replace(tmp, final)
                self._write_total(total - old + size)
            return final
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _files(self) -> list[os.DirEntry[str]]:
        found = []
        stack = [str(self.root)]
        while stack:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    if entry.name == _META or entry.name.startswith(".tmp-"):
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        found.append(entry)
        return found

    def _total(self) -> int:
        try:
            return int((self.meta / "size").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return sum(e.stat().st_size for e in self._files())

    def _write_total(self, total: int) -> None:
        tmp = self.meta / f"size.{uuid.uuid4().hex}"
        tmp.write_text(str(total))
        os.replace(tmp, self.meta / "size")

    def _evict(self, room: int, keep: Path) -> int:
        """Remove least recently used files until the rest is <= ``room``; the new total."""
        entries = []
        for e in self._files():
            with contextlib.suppress(FileNotFoundError):
                st = e.stat()
                entries.append((st.st_mtime, e.path, st.st_size))
        entries.sort()
        total = sum(size for _, _, size in entries)
        for _, path, size in entries:
            if total <= room:
                break
            if path == str(keep):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                total -= size
        return total

    def used_bytes(self) -> int:
        """Bytes in the cache now (recounted from the directory)."""
        return sum(e.stat().st_size for e in self._files())

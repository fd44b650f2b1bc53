"""The raw-file cache: a local copy of each file of a slow source, fetched once per node.

Why: training reads the same files every epoch, and on a network mount (or any slow source)
each read costs the network again, once per rank. `FileCache` copies a file into a local,
size-limited directory the first time any process on the node asks for it; later reads are
local. Eviction is least recently used by bytes; writes are atomic; when several DataLoader
workers or ranks ask for the same missing file at once, one fetches and the others wait for it
(a per-file ``fcntl`` lock, see `DiskStore`).

Example:
    >>> cache = FileCache("/mnt/nfs/imagenet", "/local/me/imagenet-cache", max_bytes=200 * 2**30)
    >>> local = cache.get_file("train/n01440764/n01440764_10026.JPEG")
    >>> ds = ImageListDataset("/mnt/nfs/imagenet", "train.txt", file_cache=cache)   # reads through it
    >>> get_file("train/x.JPEG", source="/mnt/nfs/imagenet", cache_dir="/local/me/imagenet-cache")
    >>> set_file_cache(cache); get_file("train/x.JPEG")       # Light's form: one process-wide cache
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from fleetlike.config import envvars
from fleetlike.io.store import DiskStore, LockPickling

__all__ = ["FileCache", "ThrottledReader", "files_cache", "get_file", "read_chunks", "register_cache",
           "set_file_cache"]

Reader = Callable[[Path], Iterator[bytes]]
_CHUNK = 1 << 20


def read_chunks(path: Path) -> Iterator[bytes]:
    """The default reader: the file in 1 MiB chunks."""
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            yield chunk


class ThrottledReader:
    """A reader limited to ``bytes_per_second`` (and ``latency`` seconds per file): a stand-in
    for a network mount in tests and benchmarks. Picklable, so DataLoader workers can use it."""

    def __init__(self, bytes_per_second: float, latency: float = 0.0, chunk: int = 64 * 1024) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"ThrottledReader: bytes_per_second={bytes_per_second!r}; it must be > 0")
        self.rate, self.latency, self.chunk = float(bytes_per_second), float(latency), int(chunk)

    def __call__(self, path: Path) -> Iterator[bytes]:
        start = time.perf_counter()
        if self.latency:
            time.sleep(self.latency)
        sent = 0
        with open(path, "rb") as fh:
            while chunk := fh.read(self.chunk):
                sent += len(chunk)
                ahead = start + self.latency + sent / self.rate - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
                yield chunk


class FileCache(LockPickling):
    """Files of ``source`` (a directory) cached under ``cache_dir`` up to ``max_bytes`` (None:
    no limit). ``reader(path)`` yields a source file's bytes (default: plain reads).

    ``hits`` / ``fetches`` count this process's lookups."""

    def __init__(self, source: str | os.PathLike[str], cache_dir: str | os.PathLike[str],
                 max_bytes: int | None = None, reader: Reader | None = None) -> None:
        self.source = Path(source).resolve()
        if not self.source.is_dir():
            raise FileNotFoundError(f"FileCache: source {str(source)!r} is not a directory")
        self.store = DiskStore(cache_dir, max_bytes, evict=True, what="FileCache")
        if self.store.root.resolve() == self.source or self.source in self.store.root.resolve().parents:
            raise ValueError(f"FileCache: cache_dir {str(cache_dir)!r} is inside the source {str(source)!r}; "
                             "put the cache on a separate local directory")
        self.reader: Reader = reader or read_chunks
        self.hits = self.fetches = 0
        self._lock = threading.Lock()

    def _key(self, path: str | os.PathLike[str]) -> tuple[str, Path]:
        given = Path(path)
        full = (given if given.is_absolute() else self.source / given).resolve()
        try:
            key = full.relative_to(self.source).as_posix()
        except ValueError:
            raise ValueError(f"FileCache: {str(path)!r} is not under the source {str(self.source)!r}; "
                             "give a path relative to it (or absolute inside it)") from None
        return key, full

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.fetches += 1

    def get_file(self, path: str | os.PathLike[str]) -> Path:
        """The local copy of ``path`` (relative to the source, or absolute inside it)."""
        key, full = self._key(path)
        local = self.store.get(key)
        if local is not None:
            self._count(True)
            return local
        with self.store.lock(key):
            local = self.store.get(key)  # fetched by another process while this one waited
            if local is not None:
                self._count(True)
                return local
            if not full.is_file():
                raise FileNotFoundError(f"FileCache: {str(full)!r} does not exist in the source")
            local = self.store.put(key, self.reader(full))
            self._count(False)
        assert local is not None  # an evicting store always keeps the new file
        return local

    def read_bytes(self, path: str | os.PathLike[str]) -> bytes:
        """The bytes of ``path`` through the cache (a copy evicted between lookup and read by
        another process is fetched again)."""
        for _ in range(3):
            local = self.get_file(path)
            try:
                return local.read_bytes()
            except FileNotFoundError:
                continue
        raise OSError(f"FileCache: {str(path)!r} was evicted three times between fetch and read; the "
                      f"cache ({self.store.max_bytes} bytes) is too small for the files read at once")


_CACHES: dict[tuple[str, str, int | None], FileCache] = {}
_DEFAULT: list[FileCache | None] = [None]
_REGISTERED: list[FileCache] = []  # files_cache's, looked up by source when get_file gets a bare path
#: Light's default cache size (20 GB) for the caches `files_cache` makes
DEFAULT_FILES_CACHE_BYTES = 20 * 2**30
_CACHES_LOCK = threading.Lock()


def set_file_cache(cache: FileCache | None) -> None:
    """Make ``cache`` the one `get_file(path)` uses without ``source``/``cache_dir`` (Light's
    form). DataLoader workers inherit it when they are forked (Linux's default); with the spawn
    start method, set it in ``worker_init_fn`` too."""
    if cache is not None and not isinstance(cache, FileCache):
        raise TypeError(f"set_file_cache: expected a FileCache or None, got {type(cache).__name__}")
    with _CACHES_LOCK:
        _DEFAULT[0] = cache


def files_cache(files: Sequence[str | os.PathLike[str]], cache_dir: str | os.PathLike[str] | None = None,
                max_bytes: int | None = DEFAULT_FILES_CACHE_BYTES) -> FileCache:
    """The cache of a dataset's ``files_path_list`` (Light's form): a `FileCache` over the folder
    the files share, under ``cache_dir`` (default ``$FLEETLIKE_FILE_CACHE_DIR`` or
    ``~/.cache/fleetlike/files``, one subfolder per source folder), registered so that
    `get_file(path)` of any of the files reads through it. `get_data_loader` calls this for a
    dataset that has a ``files_path_list``."""
    if isinstance(files, (str, bytes)) or not isinstance(files, Sequence) or not files:
        raise TypeError(f"files_path_list must be a non-empty list of file paths, got {type(files).__name__} "
                        f"({files!r:.80})")
    parents = {str(Path(f).resolve().parent) for f in files}
    source = Path(os.path.commonpath(sorted(parents)))
    if cache_dir is None:
        base = os.environ.get(envvars.FILE_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache",
                                                                          "fleetlike", "files")
        digest = hashlib.sha1(str(source).encode()).hexdigest()[:12]
        cache_dir = os.path.join(base, f"{source.name or 'root'}-{digest}")
    key = (str(source), str(Path(cache_dir).resolve()), max_bytes)
    with _CACHES_LOCK:
        cache = _CACHES.get(key)
        if cache is None:
            cache = _CACHES[key] = FileCache(source, cache_dir, max_bytes)
    register_cache(cache)
    return cache


def register_cache(cache: FileCache) -> None:
    """Let `get_file(path)` read the files under ``cache.source`` through ``cache``."""
    with _CACHES_LOCK:
        if cache not in _REGISTERED:
            _REGISTERED.append(cache)


def _registered_for(path: str | os.PathLike[str]) -> FileCache | None:
    full = Path(path).resolve()
    with _CACHES_LOCK:
        for cache in reversed(_REGISTERED):
            if cache.source in full.parents:
                return cache
    return None


def get_file(path: str | os.PathLike[str], *, source: str | os.PathLike[str] | None = None,
             cache_dir: str | os.PathLike[str] | None = None, max_bytes: int | None = None) -> Path:
    """Light's ``get_file``: the local copy of ``path``. With ``source`` and ``cache_dir``, from
    the `FileCache` of that pair (made once, reused by later calls); without them, from the
    cache given to `set_file_cache`, else the one `files_cache` made for a dataset's
    ``files_path_list`` holding ``path``."""
    if source is None and cache_dir is None:
        with _CACHES_LOCK:
            cache = _DEFAULT[0]
        if cache is None:
            cache = _registered_for(path)
        if cache is None:
            raise RuntimeError(f"get_file({str(path)!r}): no cache to read through; declare the dataset's "
                               "self.files_path_list (get_data_loader caches those files), pass source= and "
                               "cache_dir=, or call fleetlike.io.set_file_cache(FileCache(source, cache_dir)) first")
        return cache.get_file(path)
    if source is None or cache_dir is None:
        raise ValueError(f"get_file: give both source and cache_dir (got source={source!r}, cache_dir={cache_dir!r})")
    key = (str(Path(source).resolve()), str(Path(cache_dir).resolve()), max_bytes)
    with _CACHES_LOCK:
        cache = _CACHES.get(key)
        if cache is None:
            cache = _CACHES[key] = FileCache(source, cache_dir, max_bytes)
    return cache.get_file(path)

"""The decoded-sample cache: decode each sample once, augment it freshly every time.

Why: decoding a JPEG costs more than most of what follows it; the decoded sample is the same
every epoch, the random augmentation must not be. `CachedDataset` keeps ``dataset[i]`` (the
decoded, not yet augmented sample) and applies ``transforms`` after the cache on every read, so
no augmentation is ever cached.

``cache_type``: ``memory`` (a dict in this process: with DataLoader workers each worker holds
its own, so use it with ``num_workers=0`` or ``persistent_workers=True``), ``disk`` (pickled
files under ``cache_dir``, shared by every worker and rank on the node, served by the page
cache when memory allows), or ``auto`` (memory up to ``cache_size``, the rest spilled to disk up
to ``disk_size``). Limits are bytes; what does not fit is not cached (an epoch reads every
sample once, so evicting would throw away each sample just before its next use).

Example:
    >>> decoded = ImageFolder("data/train", transform=Resize(256))         # deterministic part
    >>> train = CachedDataset(decoded, "auto", os.path.expanduser("~/.cache/decoded"), cache_size=8 * 2**30,
    ...                       transforms=Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor()]))
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fleetlike.comm import parse_choice
from fleetlike.io.loader import Skipped
from fleetlike.io.pillow import is_image
from fleetlike.io.store import CacheFullError, DiskStore, LockPickling, check_size

__all__ = ["CacheType", "CachedDataset", "sample_bytes", "transform_input"]


class CacheType(str, enum.Enum):
    """Where decoded samples are kept (module docstring)."""

    MEMORY = "memory"
    DISK = "disk"
    AUTO = "auto"


def sample_bytes(sample: Any) -> int:
    """The memory a sample holds: tensors, arrays and images by their pixels, containers summed."""
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.nelement()
    if isinstance(sample, np.ndarray):
        return int(sample.nbytes)
    if is_image(sample):
        return sample.width * sample.height * len(sample.getbands())
    if isinstance(sample, (list, tuple)):
        return sum(sample_bytes(s) for s in sample) + 8 * len(sample)
    if isinstance(sample, dict):
        return sum(sample_bytes(v) for v in sample.values()) + 16 * len(sample)
    if isinstance(sample, (int, float, bool)) or sample is None:
        return 8
    return len(pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL))


def transform_input(transforms: Callable[[Any], Any] | None, sample: Any) -> Any:
    """``transforms`` applied to a sample's input: the first element of a tuple/list sample, or
    the whole sample otherwise (a `Skipped` passes unchanged)."""
    if transforms is None or isinstance(sample, Skipped):
        return sample
    if isinstance(sample, (tuple, list)):
        return type(sample)([transforms(sample[0]), *sample[1:]])
    return transforms(sample)


class CachedDataset(LockPickling, Dataset[Any]):
    """``dataset`` with its samples cached; ``transforms`` applied after the cache (to the first
    element of a tuple/list sample, the input, or to the whole sample otherwise).

    ``hits`` / ``misses`` count this process's reads."""

    def __init__(self, dataset: Dataset[Any], cache_type: CacheType | str = CacheType.MEMORY,
                 cache_dir: str | os.PathLike[str] | None = None, cache_size: int | None = None,
                 transforms: Callable[[Any], Any] | None = None, *, disk_size: int | None = None) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"CachedDataset: {type(dataset).__name__} is not a map-style dataset (len and [i])")
        self.dataset, self.transforms = dataset, transforms
        self.cache_type = parse_choice(CacheType, cache_type, what="cache_type", noun="cache type")
        self.cache_size = check_size(cache_size, "CachedDataset cache_size")
        self.memory_limit = None if self.cache_type is CacheType.DISK else self.cache_size
        if self.cache_type is CacheType.AUTO and self.cache_size is None:
            raise ValueError("CachedDataset: cache_type='auto' keeps cache_size bytes in memory and spills "
                             "the rest to disk, so it needs cache_size (bytes of memory)")
        self.store: DiskStore | None = None
        if self.cache_type is not CacheType.MEMORY:
            if cache_dir is None:
                raise ValueError(f"CachedDataset: cache_type={self.cache_type.value!r} needs cache_dir "
                                 "(a local directory for the decoded samples)")
            limit = self.cache_size if self.cache_type is CacheType.DISK else disk_size
            self.store = DiskStore(cache_dir, limit, evict=False, what="CachedDataset")
            self._check_fingerprint()
        self._memory: dict[int, Any] = {}
        self._memory_bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _check_fingerprint(self) -> None:
        """A cache directory belongs to one dataset: refuse one written for another length."""
        assert self.store is not None
        mine = {"length": len(self), "dataset": type(self.dataset).__qualname__}
        path = self.store.meta / "dataset.json"
        with self.store.lock("dataset.json"):
            if path.exists():
                theirs = json.loads(path.read_text())
                if theirs != mine:
                    raise ValueError(
                        f"CachedDataset: {str(self.store.root)!r} holds the cache of another dataset "
                        f"({theirs}), this one is {mine}; give each dataset its own cache_dir or empty it"
                    )
            else:
                path.write_text(json.dumps(mine))

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _too_big(self, size: int, limit: int) -> CacheFullError:
        return CacheFullError(f"CachedDataset: a sample is {size} bytes, more than cache_size={limit}; "
                              "raise cache_size above one sample")

    def _lookup(self, index: int) -> Any:
        with self._lock:
            if index in self._memory:
                self.hits += 1
                return self._memory[index]
        if self.store is not None:
            local = self.store.get(f"{index}.pkl")
            if local is not None:
                try:
                    sample = pickle.loads(local.read_bytes())
                except FileNotFoundError:
                    sample = None
                else:
                    with self._lock:
                        self.hits += 1
                    return sample
        with self._lock:
            self.misses += 1
        sample = self.dataset[index]
        if not isinstance(sample, Skipped):
            self._keep(index, sample)
        return sample

    def _keep(self, index: int, sample: Any) -> None:
        if self.memory_limit is not None or self.cache_type is CacheType.MEMORY:
            size = sample_bytes(sample)
            if self.cache_type is CacheType.MEMORY and self.memory_limit is not None and size > self.memory_limit:
                raise self._too_big(size, self.memory_limit)
            with self._lock:
                if self.memory_limit is None or self._memory_bytes + size <= self.memory_limit:
                    self._memory[index] = sample
                    self._memory_bytes += size
                    return
        if self.store is not None:
            try:
                self.store.put(f"{index}.pkl", [pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)])
            except CacheFullError as error:
                raise CacheFullError(f"{error} (disk part, cache_dir {str(self.store.root)!r})") from None

    def __getitem__(self, index: int) -> Any:
        return transform_input(self.transforms, self._lookup(index))

    @property
    def memory_bytes(self) -> int:
        with self._lock:
            return self._memory_bytes

"""Light's ``LightDataset``: a base class whose subclasses' samples are cached as they are read.

Why: Light converts a dataset to a cached one by changing its base class and one
``super().__init__`` call; the subclass's ``__getitem__`` stays as written. `LightDataset` wraps
the subclass's ``__getitem__`` when the subclass is defined (``__init_subclass__``): a read goes
through a `CachedDataset` over the subclass's own ``__getitem__``, and ``transforms`` (given to
the base) run after the cache on every read, so random augmentation stays random. Light's two
patterns:

- ``super().__init__(cache_type='auto', transforms=transform)`` and a ``__getitem__`` without
  the transform: the raw sample is cached, the transform runs after the cache;
- ``self.transform = transform`` kept in the subclass, ``super().__init__(cache_type='auto')``:
  the transformed sample is what is cached.

Fields (Light's): ``need_cache`` (default True), ``cache_type`` ``memory`` (default), ``disk``
or ``auto``, ``cache_dir`` (default: a fresh folder under the system's temporary folder, one per
dataset object, removed at exit: a cache is never read by another dataset), ``cache_size``
(bytes; Light's default 20 GB: the memory part for ``auto``, the folder's limit for ``disk``),
``transforms``. With DataLoader workers, a ``memory`` cache is each worker's own (use
``persistent_workers=True``); ``disk`` is shared by the workers.

Example:
    >>> class CustomDataset(LightDataset):
    ...     def __init__(self, filename, transform):
    ...         super().__init__(cache_type="auto", transforms=transform)
    ...         self.items = read(filename)
    ...     def __len__(self):
    ...         return len(self.items)
    ...     def __getitem__(self, index):
    ...         return decode(self.items[index])        # cached; the transform runs after
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from fleetlike.comm import parse_choice
from fleetlike.io.cached import CachedDataset, CacheType, transform_input

__all__ = ["LIGHT_CACHE_SIZE", "LightDataset"]

#: Light's default cache size, 20 GB
LIGHT_CACHE_SIZE = 20 * 2**30


class _Raw(Dataset[Any]):
    """The subclass's own reads (unwrapped ``__getitem__``), what the cache is filled from."""

    def __init__(self, owner: LightDataset, read: Callable[[Any, int], Any]) -> None:
        self.owner, self.read = owner, read

    def __len__(self) -> int:
        return len(self.owner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.read(self.owner, index)


def _remove_later(path: str) -> None:
    pid = os.getpid()

    def remove() -> None:
        if os.getpid() == pid:  # only the process that made it, not a forked worker
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)


class LightDataset(Dataset[Any]):
    """Base class of a cached dataset (module docstring); a subclass defines ``__getitem__``
    and ``__len__`` and calls ``super().__init__(...)`` with Light's fields."""

    def __init__(self, *args: Any, need_cache: bool = True, cache_type: CacheType | str = CacheType.MEMORY,
                 cache_dir: str | os.PathLike[str] | None = None, cache_size: int | None = LIGHT_CACHE_SIZE,
                 transforms: Callable[[Any], Any] | None = None) -> None:
        # Light's own table writes super(CustomDataset, self).__init__(self, ...): the instance
        # itself may come once more, positionally; anything else positional is a mistake
        if args and not (len(args) == 1 and args[0] is self):
            raise TypeError(f"LightDataset.__init__ takes keyword arguments (need_cache, cache_type, cache_dir, "
                            f"cache_size, transforms), got positional {args!r:.80}")
        if not isinstance(need_cache, bool):
            raise TypeError(f"LightDataset: need_cache must be a bool, got {need_cache!r}")
        self.need_cache = need_cache
        self.cache_type = parse_choice(CacheType, cache_type, what="cache_type", noun="cache type")
        if cache_dir is None and self.cache_type is not CacheType.MEMORY and need_cache:
            cache_dir = tempfile.mkdtemp(prefix="fleetlike-lightdataset-")
            _remove_later(cache_dir)
        self.cache_dir, self.cache_size, self.transforms = cache_dir, cache_size, transforms
        self._light_cache: CachedDataset | None = None
        self._light_lock = threading.Lock()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        read = cls.__dict__.get("__getitem__")
        if read is None or getattr(read, "_light_wrapped", False):
            return  # inherited: already wrapped in the class that defined it

        @functools.wraps(read)
        def __getitem__(self: LightDataset, index: int) -> Any:
            return self._light_read(index, read)

        __getitem__._light_wrapped = True  # type: ignore[attr-defined]
        cls.__getitem__ = __getitem__  # type: ignore[method-assign]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_light_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._light_lock = threading.Lock()

    @property
    def cache(self) -> CachedDataset | None:
        """The `CachedDataset` serving reads (made at the first read; None without a cache)."""
        return self.__dict__.get("_light_cache")

    def _light_read(self, index: int, read: Callable[[Any, int], Any]) -> Any:
        if "_light_lock" not in self.__dict__:
            raise TypeError(f"{type(self).__name__}.__init__ did not call LightDataset.__init__ "
                            "(super().__init__(cache_type=...)); the cache is set up there")
        if not self.need_cache:
            return transform_input(self.transforms, read(self, index))
        with self._light_lock:
            if self._light_cache is None:
                self._light_cache = CachedDataset(_Raw(self, read), self.cache_type, self.cache_dir, self.cache_size,
                                                  self.transforms)
        return self._light_cache[index]

"""Light's ``io`` with Light's exact signatures and defaults (seed 000's API blocks).

Why: ``fleetlike.io.get_data_loader`` is ``(dataset, batch_size, num_replicas, rank, shuffle=True)``
and a script written for it must keep working; Light documents
``get_data_loader(dataset, num_replicas, rank, batch_size=1, shuffle=False, ...)``. One name
cannot hold both orders (``import fleetlike as light; light.io`` and ``from fleetlike import io``
are the same module object), so Light's order lives here, and the page's own example call,
``get_data_loader(dataset, batchsize, num_replicas=..., rank=...)``, runs on both. Here:

- `get_data_loader`: Light's order and defaults (``shuffle=False``, ``pin_memory=True``); its
  page's example form (batch size second, ``num_replicas``/``rank`` by keyword) as well;
  ``enable_optimizations`` defaults to ``light_init``'s ``params`` (True outside one): False
  returns torch's ``DataLoader``;
- `ImageFolder`: Light's, which caches decoded images by default (``cache_transform=True``
  caches the transformed ones);
- `LightDataset`, `get_file` (with a dataset's ``files_path_list``), `files_shard`, and the
  rest of `fleetlike.io` under the same names.

Example:
    >>> from fleetlike.io import light as lio
    >>> loader = lio.get_data_loader(dataset, light.cc.size(), light.cc.rank(), batch_size=32, shuffle=True)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from fleetlike.io.cached import CacheType
from fleetlike.io.datasets import ImageFolder as _ImageFolder
from fleetlike.io.file_cache import get_file
from fleetlike.io.light_dataset import LightDataset
from fleetlike.io.loader import DistributedDataLoader
from fleetlike.io.loader import get_data_loader as _get_data_loader
from fleetlike.io.shard import files_shard

__all__ = ["ImageFolder", "LightDataset", "files_shard", "get_data_loader", "get_dataloader", "get_file"]

_LIGHT_ORDER = ("num_replicas", "rank", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers",
                "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn", "multiprocessing_context",
                "generator")
_DEFAULTS: dict[str, Any] = {"batch_size": 1, "shuffle": False, "sampler": None, "batch_sampler": None,
                             "num_workers": 0, "collate_fn": None, "pin_memory": True, "drop_last": False,
                             "timeout": 0, "worker_init_fn": None, "multiprocessing_context": None,
                             "generator": None}
_EXTRA = ("enable_optimizations", "prefetch", "device", "seed", "tail", "prefetch_factor", "persistent_workers")


def _light_init_enables() -> bool:
    """``enable_optimizations`` of the running ``light_init`` (True outside one, Light's default)."""
    face = sys.modules.get("fleetlike.horovod.light")
    params = getattr(face, "_STATE", {}).get("params") if face is not None else None
    return bool(params.get("enable_optimizations", True)) if isinstance(params, dict) else True


def get_data_loader(dataset: Dataset[Any], *args: Any, **kwargs: Any) -> DistributedDataLoader | DataLoader:
    """Light's ``get_data_loader(dataset, num_replicas, rank, batch_size=1, shuffle=False,
    sampler=None, batch_sampler=None, num_workers=0, collate_fn=None, pin_memory=True,
    drop_last=False, timeout=0, worker_init_fn=None, multiprocessing_context=None,
    generator=None)``, plus fleetlike's keywords (``enable_optimizations``, ``prefetch``,
    ``device``, ``seed``, ``tail``, ``prefetch_factor``, ``persistent_workers``).

    Light's page also calls it ``get_data_loader(dataset, batchsize, num_replicas=..., rank=...)``:
    with both of those given by keyword, one positional argument is the batch size.

    Example:
        >>> get_data_loader(ds, 2, 0, 32, True, num_workers=4)       # 2 ranks, this is 0, batch 32
    """
    if "num_replicas" in kwargs and "rank" in kwargs and len(args) == 1 and "batch_size" not in kwargs:
        args, kwargs = (), {**kwargs, "batch_size": args[0]}  # the page's example form
    if len(args) > len(_LIGHT_ORDER):
        raise TypeError(f"light.io.get_data_loader takes at most {len(_LIGHT_ORDER) + 1} positional arguments "
                        f"({', '.join(('dataset',) + _LIGHT_ORDER)}), got {len(args) + 1}")
    given = dict(zip(_LIGHT_ORDER, args))
    for name, value in kwargs.items():
        if name in given:
            raise TypeError(f"light.io.get_data_loader got multiple values for argument {name!r}")
        if name not in _LIGHT_ORDER and name not in _EXTRA:
            raise TypeError(f"light.io.get_data_loader got an unexpected keyword argument {name!r}; "
                            f"Light's are {', '.join(_LIGHT_ORDER)}; fleetlike's {', '.join(_EXTRA)}")
        given[name] = value
    missing = [n for n in ("num_replicas", "rank") if n not in given]
    if missing:
        raise TypeError(f"light.io.get_data_loader missing required argument(s) {missing}: Light's form is "
                        "get_data_loader(dataset, num_replicas, rank, ...), e.g. light.cc.size(), light.cc.rank()")
    options = {**_DEFAULTS, **given}
    if options["batch_sampler"] is not None and not given.get("shuffle"):
        options["shuffle"] = None  # Light's default False; beside a batch sampler, not given at all
    options.setdefault("enable_optimizations", _light_init_enables())
    if "pin_memory" not in given and not torch.cuda.is_available():
        options["pin_memory"] = False  # Light's True pins for the copy to a GPU; without one torch drops it
    return _get_data_loader(dataset, **options)


#: Light's other spelling (its feature table names ``light.io.get_dataloader``).
get_dataloader = get_data_loader


class ImageFolder(_ImageFolder):
    """Light's ImageFolder (``from light.pytorch.datasets.folder import ImageFolder``): decoded
    images cached in memory by default (``cache_type=`` memory / disk / auto, ``cache_dir``,
    ``cache_size``); ``cache_transform=True`` caches the transformed images instead.

    Example:
        >>> dataset = ImageFolder(traindir, transform=transform, cache_transform=True)
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[int], Any] | None = None, *,
                 cache_type: CacheType | str | None = CacheType.MEMORY, cache_transform: bool = False,
                 **options: Any) -> None:
        super().__init__(root, transform, target_transform, cache_type=cache_type,
                         cache_transform=cache_transform, **options)


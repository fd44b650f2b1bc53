"""Splitting file lists: by rank (Light's ``files_shard``) and by rank and worker (EPL).

`files_shard` gives each rank a contiguous block, the first ``len % size`` ranks one file more
(Paddle's ``get_file_shard``); with fewer files than ranks, Light returns the whole list to
every rank, and so does this, with a warning saying so (every rank then reads every file).

`worker_shard` and `FileShardDataset` go one level further for iterable datasets, as EPL slices
by worker: each DataLoader worker of each rank reads a disjoint block of the files, nothing read
twice, nothing skipped (with fewer files than workers in all, some workers read none).

Example:
    >>> files_shard(["a", "b", "c", "d", "e"], size=2, rank=0)
    ['a', 'b', 'c']
    >>> loader = get_data_loader(FileShardDataset(files, read_records), 64, num_workers=4)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from fleetlike.io.job import io_settings, replicas

__all__ = ["FileShardDataset", "files_shard", "worker_shard"]


def _block(files: Sequence[str], index: int, parts: int) -> list[str]:
    base, extra = divmod(len(files), parts)
    start = index * base + min(index, extra)
    return list(files[start : start + base + (1 if index < extra else 0)])


def _check_files(files: Any, what: str) -> None:
    if isinstance(files, (str, bytes)) or not isinstance(files, Sequence):
        raise TypeError(f"{what}: files must be a list of names, got {type(files).__name__}")


def files_shard(files: Sequence[str], size: int | None = None, rank: int | None = None,
                drop_last: bool | None = None) -> list[str]:
    """This rank's contiguous block of ``files`` (``size``/``rank`` default to the fleet job's).

    ``drop_last=True`` gives every rank ``len // size`` files (the tail is dropped) so ranks read
    equally many. Fewer files than ranks: the whole list, with a warning (Light's behaviour).
    Unset ``drop_last`` and the job's defaults follow its strategy's ``io_configs`` (EPL's
    ``io.*`` keys): ``slicing`` False gives every rank the whole list, ``drop_last_files`` is
    ``drop_last``, and ``unbalanced_io_slicing`` False refuses a list that does not divide."""
    _check_files(files, "files_shard")
    settings = io_settings()
    if size is None and rank is None and not settings["slicing"]:
        return list(files)  # io.slicing off: every rank reads every file
    rank, size = replicas(size, rank, "files_shard")
    if drop_last is None:
        drop_last = settings["drop_last_files"]
        _check_balanced(len(files), size, drop_last, settings)
    if len(files) < size:
        warnings.warn(f"files_shard: {len(files)} file(s) for {size} ranks; every rank gets the whole "
                      "list (each reads every file). Split the data into at least as many files as ranks",
                      stacklevel=2)
        return list(files)
    if drop_last:
        each = len(files) // size
        return list(files[rank * each : (rank + 1) * each])
    return _block(files, rank, size)


def _check_balanced(count: int, size: int, drop_last: bool, settings: dict[str, bool]) -> None:
    if count % size and not drop_last and not settings["unbalanced_io_slicing"]:
        raise ValueError(f"files_shard: {count} files do not divide over {size} ranks, and the strategy sets "
                         "io.unbalanced_io_slicing (io_configs.unbalanced_io_slicing) False; set it True (some "
                         "ranks read one file more) or io.drop_last_files True (the extra files are dropped)")


def worker_shard(files: Sequence[str], rank: int, size: int, worker: int = 0, num_workers: int = 1) -> list[str]:
    """The block of ``files`` read by DataLoader worker ``worker`` of ``rank``: the files are cut
    into ``size * num_workers`` contiguous blocks, ranks first. Disjoint and complete."""
    _check_files(files, "worker_shard")
    if not (0 <= rank < size and 0 <= worker < num_workers):
        raise ValueError(f"worker_shard: rank {rank} of {size}, worker {worker} of {num_workers}: "
                         "each index must be in [0, count)")
    return _block(files, rank * num_workers + worker, size * num_workers)


class FileShardDataset(IterableDataset[Any]):
    """Iterate ``read(file)`` over this rank's and this DataLoader worker's files.

    ``read(path)`` yields the records of one file. ``num_replicas``/``rank`` default to the fleet
    job's (read when the dataset is built, in the training process, never in a worker), and then
    the strategy's ``io_configs`` act as in `files_shard`.

    Example:
        >>> ds = FileShardDataset(sorted(glob.glob("data/part-*")), lambda p: open(p).read().split())
    """

    def __init__(self, files: Sequence[str], read: Callable[[str], Iterable[Any]],
                 num_replicas: int | None = None, rank: int | None = None) -> None:
        _check_files(files, "FileShardDataset")
        self.files, self.read = list(files), read
        settings = io_settings()
        if num_replicas is None and rank is None and not settings["slicing"]:
            num_replicas, rank = 1, 0  # io.slicing off: every rank reads every file (split over its workers)
        self.rank, self.num_replicas = replicas(num_replicas, rank, "FileShardDataset")
        if settings["drop_last_files"] and num_replicas is None:
            self.files = self.files[: len(self.files) // self.num_replicas * self.num_replicas]
        else:
            _check_balanced(len(self.files), self.num_replicas, False, settings)

    def my_files(self) -> list[str]:
        """The files the calling process (a DataLoader worker or the main process) reads."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return worker_shard(self.files, self.rank, self.num_replicas, worker, workers)

    def __iter__(self) -> Iterator[Any]:
        for path in self.my_files():
            yield from self.read(path)

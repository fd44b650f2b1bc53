"""`get_data_loader`: torch's DataLoader with the resumable sampler, prefetch and data-wait time.

Why: the input pipeline is where a distributed job silently loses what its collectives won.
The loader built here

- shards with `DistributedSampler` by default (``set_epoch`` passes through), so every rank
  reads its part and a restart continues the epoch (`state_dict` holds the sampler's position
  at the batches *delivered to the training loop*, not those fetched ahead);
- prefetches the next ``prefetch`` batches onto the device (``fleet.device()`` by default) from a
  background thread; on CUDA the copy runs on a side stream from pinned memory so it overlaps
  compute, and the training stream waits for it only when the batch is used;
- measures how long each step waited for its batch: `DistributedDataLoader.last_wait` (the last
  step), `epoch_wait` (the current or last pass), and fleetlike's slow-rank report (the wait is
  recorded into ``strategies.health.DATA_WAIT``), so a slow input pipeline is named as such;
- counts samples a dataset chose to skip (a `Skipped` item, e.g. an undecodable image with
  ``on_error="skip"``): they are left out of the batch and reported at the end of the pass.

Example:
    >>> loader = get_data_loader(dataset, 64, num_workers=4, prefetch=2)
    >>> fleet.register_state("loader", loader)            # saved and restored with the model
    >>> for epoch in range(start_epoch, epochs):
    ...     loader.set_epoch(epoch)
    ...     for x, y in loader:
    ...         train_step(x, y)
    ...     print(loader.epoch_wait, "s waited on data")
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from fleetlike.comm.cuda import use_device
from fleetlike.io.batch_slots import BatchSlots, SlotCollate, map_tensors
from fleetlike.io.file_cache import files_cache, register_cache
from fleetlike.io.job import current_device, io_settings
from fleetlike.io.readahead import HintingSampler
from fleetlike.io.sampler import DistributedSampler, Tail
from fleetlike.strategies.health import DATA_WAIT

__all__ = ["DistributedDataLoader", "Skipped", "get_data_loader", "get_dataloader", "to_device"]

log = logging.getLogger("fleetlike")


@dataclasses.dataclass(frozen=True)
class Skipped:
    """What a dataset returns instead of a sample it could not read (and was told to skip)."""

    index: int
    path: str
    reason: str


class _Collated(NamedTuple):
    batch: Any
    skipped: tuple[Skipped, ...]
    slot: int | None = None  # the `BatchSlots` slot the batch is in (copied out, then freed)


class _SkipCollate:
    """Collate the samples that were read; carry the skipped ones beside (picklable for workers).
    Without a ``collate_fn`` of the user's, ``default_collate`` into a reused shared-memory slot
    where one is free (`SlotCollate`)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None, slots: BatchSlots | None = None) -> None:
        self.collate_fn = collate_fn or default_collate
        self.slotted = SlotCollate(slots) if slots is not None and collate_fn is None else None

    def __call__(self, samples: list[Any]) -> _Collated:
        kept = [s for s in samples if not isinstance(s, Skipped)]
        skipped = tuple(s for s in samples if isinstance(s, Skipped))
        if not kept:
            return _Collated(None, skipped)
        if self.slotted is not None:
            batch, slot = self.slotted(kept)
            return _Collated(batch, skipped, slot)
        return _Collated(self.collate_fn(kept), skipped)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor in it (tuples, lists, dicts, nested) moved to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def _record_stream(batch: Any, stream: Any) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            _record_stream(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)


_END = object()
_ALL = 2**62  # "every sample of the pass" for the sampler's state


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pass:
    """One pass over the torch loader: a background thread fetching ``prefetch`` batches ahead
    (none with ``prefetch=0``: the training thread fetches, and waits, itself)."""

    def __init__(self, owner: DistributedDataLoader) -> None:
        self.owner = owner
        if owner.slots is not None:
            owner.slots.reset()  # before the workers start: no batch of an earlier pass is read
        self.source = iter(owner.loader)
        self.pinned = bool(getattr(self.source, "_pin_memory", False))  # torch's pin thread copies
        self.device = owner.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda and owner.prefetch else None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if owner.prefetch:
            self.queue: queue.Queue[Any] = queue.Queue(maxsize=owner.prefetch)
            self.thread = threading.Thread(target=self._fill, name="fleetlike-prefetch", daemon=True)
            self.thread.start()

    def _move(self, item: _Collated) -> tuple[_Collated, Any]:
        if item.slot is not None:  # out of the worker's slot into memory of our own, the slot freed
            item = _Collated(self.owner.slots.copy_out(item.batch, item.slot, self.pinned), item.skipped)  # type: ignore[union-attr]
        if self.device.type == "cpu":
            return item, None
        if self.stream is None:
            return _Collated(to_device(item.batch, self.device), item.skipped), None
        with torch.cuda.stream(self.stream):
            moved = to_device(item.batch, self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _Collated(moved, item.skipped), event

    def _put(self, value: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            # the copies, pinning and events below run on this thread: with GPU 0 current
            # they would land there (and make a context there) on every rank of the node
            use_device(self.device)
            for item in self.source:
                if not self._put(self._move(item)):
                    return
            self._put(_END)
        except BaseException as error:  # handed to the training thread, raised there
            self._put(_Failure(error))

    def next(self) -> tuple[_Collated, Any] | None:
        if self.thread is None:
            try:
                return self._move(next(self.source))
            except StopIteration:
                return None
        value = self.queue.get()
        if value is _END:
            return None
        if isinstance(value, _Failure):
            raise value.error
        return value

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        self.source = iter(())  # drops torch's iterator: its workers shut down
        if self.owner.slots is not None:
            self.owner.slots.unmap()


class DistributedDataLoader:
    """What `get_data_loader` returns: iterate it as a DataLoader. Read `last_wait` /
    `epoch_wait` (seconds waited on data), `skipped`; save `state_dict()`."""

    def __init__(self, loader: DataLoader, sampler: Sampler[int] | None, batch_size: int,
                 drop_last: bool, prefetch: int, device: torch.device, slots: BatchSlots | None = None) -> None:
        self.loader, self.sampler, self.batch_size, self.drop_last = loader, sampler, batch_size, drop_last
        self.prefetch, self.device, self.slots = prefetch, device, slots
        self.dataset = loader.dataset
        self._lock = threading.Lock()
        self._pass: _Pass | None = None
        self._taken = 0          # batches taken from the pass (delivered or all-skipped)
        self._finished = False
        self.last_wait = 0.0     #: seconds the last step waited for its batch
        self.epoch_wait = 0.0    #: seconds waited on data in the current (or last) pass
        self.steps = 0           #: batches delivered in the current (or last) pass
        self.skipped: list[Skipped] = []  #: samples skipped in the current (or last) pass

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        """The torch DataLoader's other attributes (``num_workers``, ``collate_fn``, ...)."""
        loader = self.__dict__.get("loader")
        if loader is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to the sampler (reshuffles, as torch's ``set_epoch``)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[Any]:
        self._close()
        with self._lock:
            self._taken, self._finished = 0, False
            self.last_wait, self.epoch_wait, self.steps, self.skipped = 0.0, 0.0, 0, []
        self._pass = current = _Pass(self)
        try:
            while True:
                t0 = time.perf_counter()
                got = current.next()
                waited = time.perf_counter() - t0
                if got is None:
                    with self._lock:
                        self._finished = True
                    break
                item, event = got
                if event is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(event)
                    _record_stream(item.batch, stream)
                with self._lock:
                    self._taken += 1
                    self.skipped.extend(item.skipped)
                if item.batch is None:  # every sample of the batch was skipped
                    continue
                with self._lock:
                    self.last_wait = waited
                    self.epoch_wait += waited
                    self.steps += 1
                DATA_WAIT.record(waited)
                yield item.batch
        finally:
            current.close()
            if self._pass is current:
                self._pass = None
        if self.skipped:
            first = self.skipped[0]
            log.warning("fleetlike.io: %d sample(s) could not be read and were skipped this pass "
                        "(first: index %d, %s: %s); see loader.skipped", len(self.skipped),
                        first.index, first.path, first.reason)

    def _close(self) -> None:
        if self._pass is not None:
            self._pass.close()
            self._pass = None

    def wait_share(self, step_seconds: float) -> float:
        """``epoch_wait / step_seconds``: the share of ``step_seconds`` (the pass's wall time)
        spent waiting on data."""
        return self.epoch_wait / step_seconds if step_seconds > 0 else 0.0

    # ------------------------------------------------------------------ state

    def _sampler(self, what: str) -> DistributedSampler:
        if not isinstance(self.sampler, DistributedSampler):
            kind = "an IterableDataset" if self.sampler is None else type(self.sampler).__name__
            raise TypeError(
                f"DistributedDataLoader.{what}: the loader reads through {kind}, which has no "
                "position to save; use the default fleetlike.io.DistributedSampler to resume mid-epoch"
            )
        return self.sampler

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the batches delivered so far (any world size can load it)."""
        sampler = self._sampler("state_dict")
        with self._lock:
            consumed = _ALL if self._finished else self._taken * self.batch_size
        return {"sampler": sampler.state_dict(consumed=consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass delivers the rest of the saved epoch."""
        if "sampler" not in state:
            raise KeyError("DistributedDataLoader.load_state_dict: the state has no 'sampler' entry; "
                           "give what DistributedDataLoader.state_dict() returned")
        self._close()
        self._sampler("load_state_dict").load_state_dict(state["sampler"])
        with self._lock:
            self._taken, self._finished = 0, False


def _block_size(dataset: Dataset[Any], block_size: int | None) -> int | None:
    """The sampler's block size: ``block_size``, else the dataset's ``readahead_block``. A dataset
    that reads ``k`` records ahead under a sampler with other blocks reads bytes nobody uses."""
    ahead = getattr(dataset, "readahead_block", None)
    if block_size is None or ahead is None or block_size == ahead:
        return ahead if block_size is None else block_size
    raise ValueError(f"get_data_loader: block_size={block_size}, but the dataset reads blocks of "
                     f"readahead_block={ahead} records ahead; a sampler whose blocks differ makes it read "
                     "records no sample of the window uses: pass the same value (or leave block_size out)")


def get_data_loader(
    dataset: Dataset[Any],
    batch_size: int = 1,
    num_replicas: int | None = None,
    rank: int | None = None,
    shuffle: bool | None = None,
    *,
    seed: int = 0,
    tail: Tail | str = Tail.PAD,
    block_size: int | None = None,
    blocks_per_window: int = 8,
    sampler: Sampler[int] | None = None,
    batch_sampler: Sampler[list[int]] | Iterable[list[int]] | None = None,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool | None = None,
    drop_last: bool = False,
    timeout: float = 0,
    worker_init_fn: Callable[[int], None] | None = None,
    multiprocessing_context: Any = None,
    generator: torch.Generator | None = None,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    prefetch: int = 2,
    device: torch.device | str | None = None,
    enable_optimizations: bool = True,
) -> DistributedDataLoader | DataLoader:
    """A DataLoader over this rank's share of ``dataset`` (see the module docstring).

    torch's DataLoader parameters keep their meaning (``drop_last`` drops this rank's last
    incomplete batch). ``num_replicas``/``rank`` default to the fleet job's; ``shuffle``,
    ``seed`` and ``tail`` configure the `DistributedSampler` (``tail="even"``: ranks agree on
    the number of batches, no sample repeated). ``sampler`` replaces it (not resumable then).
    ``block_size``/``blocks_per_window``: the sampler's block shuffle (`DistributedSampler`);
    ``block_size`` defaults to the dataset's ``readahead_block`` (`IndexTFRDataset`), so a
    dataset that reads blocks ahead is read block by block.
    ``prefetch``: batches fetched ahead onto ``device`` (default ``fleet.device()``, else the
    CPU); 0 fetches in the training thread. ``pin_memory`` defaults to True on CUDA.
    ``shuffle`` defaults to True (False with a ``batch_sampler``). The job strategy's
    ``io_configs.slicing`` False (EPL's ``io.slicing``) makes the defaults read the whole
    dataset on every rank.

    Light's parameters: ``batch_sampler`` (yields the index lists of this rank's batches, as
    torch's: no ``batch_size``, ``shuffle``, ``sampler`` or ``drop_last`` beside it; not
    resumable); ``enable_optimizations=False`` returns torch's own ``DataLoader`` over the same
    sampler (no prefetch thread, no data-wait time, no state); a dataset with a
    ``files_path_list`` gets its files cached (`files_cache`: ``get_file(path)`` in its
    ``__getitem__`` returns the local copy, in DataLoader workers too).

    Example:
        >>> loader = get_data_loader(ImageListDataset("data", "train.txt", transform=t), 32, num_workers=4)
    """
    for name, value, low in (("batch_size", batch_size, 1), ("prefetch", prefetch, 0), ("num_workers", num_workers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"get_data_loader: {name}={value!r}; it must be an int >= {low}")
    if not isinstance(enable_optimizations, bool):
        raise TypeError(f"get_data_loader: enable_optimizations must be a bool, got {enable_optimizations!r}")
    target = current_device() if device is None else torch.device(device)
    iterable = isinstance(dataset, IterableDataset)
    if batch_sampler is not None:
        _check_batch_sampler(batch_size, shuffle, sampler, drop_last, iterable)
    elif sampler is None and not iterable:
        if num_replicas is None and rank is None and not io_settings()["slicing"]:
            num_replicas, rank = 1, 0  # the strategy's io.slicing off: every rank reads the whole dataset
        sampler = DistributedSampler(dataset, num_replicas, rank, shuffle=True if shuffle is None else shuffle,  # type: ignore[arg-type]
                                     seed=seed, tail=tail, batch_size=batch_size, drop_last_batch=drop_last,
                                     block_size=_block_size(dataset, block_size),
                                     blocks_per_window=blocks_per_window)
    elif iterable and sampler is not None:
        raise ValueError("get_data_loader: an IterableDataset takes no sampler (it shards itself, "
                         "e.g. FileShardDataset); drop sampler=")
    files = getattr(dataset, "files_path_list", None)
    if files is not None:
        caches = [files_cache(files)]
        worker_init_fn = _WorkerCaches(caches, worker_init_fn)
    extra: dict[str, Any] = {}
    if num_workers > 0:
        extra.update(prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    if batch_sampler is not None:
        extra["batch_sampler"] = batch_sampler
    else:
        extra.update(batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    pin = (target.type == "cuda") if pin_memory is None else pin_memory
    if not enable_optimizations:  # Light's switch: torch's loader, as it is
        return DataLoader(dataset, num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin, timeout=timeout,
                          worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                          generator=generator, **extra)
    if "sampler" in extra:
        extra["sampler"] = _hinting(dataset, sampler)
    # the workers collate default_collate's batches into reused shared memory (BatchSlots): a slot
    # for each batch a worker can have ahead of the loader (prefetch_factor), and one being filled
    slots = BatchSlots(num_workers, (prefetch_factor or 2) + 1) if num_workers > 0 and collate_fn is None else None
    loader = DataLoader(
        dataset, num_workers=num_workers, collate_fn=_SkipCollate(collate_fn, slots),
        pin_memory=pin, timeout=timeout, worker_init_fn=worker_init_fn,
        multiprocessing_context=multiprocessing_context, generator=generator, **extra,
    )
    return DistributedDataLoader(loader, sampler if batch_sampler is None else batch_sampler,  # type: ignore[arg-type]
                                 batch_size, drop_last, prefetch, target, slots)


def _hinting(dataset: Dataset[Any], sampler: Sampler[int] | None) -> Sampler[int] | None:
    """The sampler the torch loader iterates: ``sampler``, or under a block shuffle over a dataset
    that reads blocks ahead (``hint_ahead``: `IndexTFRDataset` ``readahead_block``) a
    `HintingSampler` one window of this rank's share ahead, so this process hints each block
    before its samples reach a worker (the dataset's workers then hint nothing)."""
    if not (isinstance(sampler, DistributedSampler) and sampler.shuffle and sampler.block_size is not None
            and getattr(dataset, "readahead_block", None) == sampler.block_size and hasattr(dataset, "hint_ahead")):
        return sampler
    dataset.hint_ahead(None)  # marks the hints as the loader's before any worker starts
    window = sampler.block_size * sampler.blocks_per_window
    return HintingSampler(sampler, dataset, max(1, -(-window // sampler.num_replicas)))


def _check_batch_sampler(batch_size: int, shuffle: bool | None, sampler: Any, drop_last: bool, iterable: bool) -> None:
    """torch's rule: a batch sampler decides the batches alone."""
    clashes = [name for name, clash in (("batch_size", batch_size != 1), ("shuffle", shuffle is not None),
                                        ("sampler", sampler is not None), ("drop_last", drop_last),
                                        ("an IterableDataset", iterable)) if clash]
    if clashes:
        raise ValueError(f"get_data_loader: batch_sampler decides the batches itself, so {', '.join(clashes)} "
                         "cannot be given beside it; drop them (the batch sampler yields this rank's index lists)")


class _WorkerCaches:
    """``worker_init_fn`` that registers the dataset's file caches in each DataLoader worker
    (a spawned or forkserver worker does not inherit them), then calls the user's."""

    def __init__(self, caches: list[Any], user: Callable[[int], None] | None) -> None:
        self.caches, self.user = caches, user

    def __call__(self, worker_id: int) -> None:
        for cache in self.caches:
            register_cache(cache)
        if self.user is not None:
            self.user(worker_id)


#: Light's other spelling (its feature table names ``light.io.get_dataloader``).
get_dataloader = get_data_loader

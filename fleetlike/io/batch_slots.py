"""Shared-memory batch slots: DataLoader workers collate into memory they reuse, batch after batch.

Why: torch's ``default_collate`` in a loader worker stacks every batch into a *new* shared-memory
tensor, so the kernel allocates and zeroes fresh tmpfs pages for each batch and maps them page
by page: 132 µs per 224x224 image here against 7 µs into pages already mapped
(``python -m bench.image_decode``), a fifth of a worker's time once decoding is fast
(``python -m bench.image_input``: 1.20-1.26x images/s). `BatchSlots` gives each worker a few
slots of shared memory, made at its first batches and reused while it lives: a worker
collates a batch into a free slot and marks it taken; the loader's process copies the batch out
of the slot into its own memory (the tensors the training loop receives, which it may keep as
long as it likes) and frees the slot. A worker that finds no free slot (the loader's process is
behind, or iterates the torch loader without copying out) collates into new shared memory, as
torch does: a slot is never written while its batch is unread, and nothing waits for one.

The collate is torch's (``collate`` with ``default_collate``'s type map), with the tensor and
number leaves placed in the slot: batches are equal to ``default_collate``'s, dtypes included.

Example:
    >>> slots = BatchSlots(workers=2, per_worker=3)
    >>> collate = SlotCollate(slots)                 # a DataLoader's collate_fn, in its workers
    >>> batch, slot = collate(samples)               # in a worker: the batch and its slot (or None)
    >>> mine = slots.copy_out(batch, slot)           # in the loader's process: its own copy, slot freed
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

__all__ = ["BatchSlots", "SlotCollate", "map_tensors"]

_FREE, _TAKEN = 0, 1


class _Collating(threading.local):
    """What the collate running in this thread places its leaves into: the slot's storages
    (one per tensor leaf, in collate order) and the next leaf's number."""

    storages: list[torch.UntypedStorage] | None = None
    leaf = 0


_NOW = _Collating()


class BatchSlots:
    """``per_worker`` shared-memory slots per loader worker, and which hold an unread batch.

    The flags live in shared memory made in the loader's process before its workers start (a
    fork inherits them; a spawned worker receives them through torch's sharing), so the worker
    that fills a slot and the process that empties it see one flag. A slot's storages live in
    its worker (made on first use, grown when a batch outgrows them) and go with each batch as
    torch sends any shared tensor; the loader's process keeps the last batch of each slot
    until the pass ends (its storages stay mapped), so the next batch in the slot maps nothing
    new."""

    def __init__(self, workers: int, per_worker: int) -> None:
        if workers < 1 or per_worker < 1:
            raise ValueError(f"BatchSlots: workers={workers} and per_worker={per_worker} must be >= 1")
        self.workers, self.per_worker = workers, per_worker
        self.flags = torch.zeros(workers * per_worker, dtype=torch.int32).share_memory_()
        self._storages: dict[int, list[torch.UntypedStorage]] = {}  # in a worker: its slots' storages
        self._held: dict[int, Any] = {}                              # in the loader: each slot's last batch

    def __getstate__(self) -> dict[str, Any]:
        return {"workers": self.workers, "per_worker": self.per_worker, "flags": self.flags}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.workers, self.per_worker, self.flags = state["workers"], state["per_worker"], state["flags"]
        self._storages, self._held = {}, {}

    def reset(self) -> None:
        """Mark every slot free and unmap the slots: in the loader's process, before a pass's
        workers start (a batch an abandoned pass left unread is never read)."""
        self.flags.zero_()
        self.unmap()

    def unmap(self) -> None:
        """Let go of the slots mapped in this process (at the end of a pass: the workers' memory
        is returned once they exit, not kept by the loader between passes)."""
        self._held.clear()

    def acquire(self) -> int | None:
        """In a loader worker: a free slot of this worker, now taken; ``None`` when all are
        taken, or outside a worker."""
        info = get_worker_info()
        if info is None or info.id >= self.workers:
            return None
        flags = self.flags.numpy()
        base = info.id * self.per_worker
        for slot in range(base, base + self.per_worker):
            if flags[slot] == _FREE:
                flags[slot] = _TAKEN
                return slot
        return None

    def release(self, slot: int) -> None:
        """Free ``slot``: its batch has been copied out (or was never sent)."""
        self.flags.numpy()[slot] = _FREE

    def collate_into(self, slot: int, samples: list[Any]) -> Any:
        """``default_collate(samples)`` with its tensor and number leaves in ``slot``."""
        _NOW.storages, _NOW.leaf = self._storages.setdefault(slot, []), 0
        try:
            return collate(samples, collate_fn_map=_SLOT_MAP)
        finally:
            _NOW.storages = None

    def copy_out(self, batch: Any, slot: int | None, copied: bool = False) -> Any:
        """In the loader's process: ``batch`` in memory of its own and ``slot`` freed
        (``copied``: its tensors are copies already, e.g. pinned by torch's loader)."""
        if slot is None:
            return batch
        mine = batch if copied else map_tensors(batch, _copy)
        if not copied:
            self._held[slot] = batch
        self.release(slot)
        return mine


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` made on this thread alone: torch's ``clone`` of a batch-sized tensor
    runs on the intra-op thread pool, whose threads then spin for work on the cores the loader's
    workers decode on; numpy's copy of a contiguous tensor is one ``memcpy`` (the same strides)."""
    if (tensor.layout is torch.strided and tensor.device.type == "cpu" and tensor.dtype in _NUMPY_DTYPES
            and tensor.is_contiguous() and not tensor.requires_grad and not tensor.is_neg()):
        return torch.from_numpy(tensor.numpy().copy())
    return tensor.clone()


_NUMPY_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                           torch.float32, torch.float64, torch.bool})


def _place(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An empty tensor on the next storage of the slot being collated into (made, or grown, to
    fit); ``None`` outside `BatchSlots.collate_into`."""
    storages = _NOW.storages
    if storages is None:
        return None
    k = _NOW.leaf
    _NOW.leaf += 1
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if k == len(storages):
        storages.append(torch.UntypedStorage._new_shared(max(nbytes, 1)))
    elif storages[k].nbytes() < nbytes:  # a larger batch than this slot held before
        storages[k] = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storages[k], 0, shape)


def _slot_tensor(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """torch's ``collate_tensor_fn``, stacking into the slot where the samples are plain CPU
    tensors of one shape and dtype (anything else: torch's own path, new shared memory)."""
    elem = batch[0]
    if (elem.layout is torch.strided and elem.device.type == "cpu" and not elem.is_nested
            and all(x.shape == elem.shape and x.dtype == elem.dtype for x in batch)):
        out = _place((len(batch), *elem.shape), elem.dtype)
        if out is not None:
            return torch.stack(batch, 0, out=out)
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def _slot_numbers(dtype: torch.dtype | None) -> Callable[..., torch.Tensor]:
    def fn(batch: list[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
        values = torch.tensor(batch, dtype=dtype)  # default_collate's dtypes: int64, float64
        out = _place(tuple(values.shape), values.dtype)
        return values if out is None else out.copy_(values)
    return fn


_SLOT_MAP: dict[Any, Any] = {**default_collate_fn_map, torch.Tensor: _slot_tensor,
                             int: _slot_numbers(None), float: _slot_numbers(torch.float64)}


class SlotCollate:
    """A DataLoader ``collate_fn``: ``(batch, slot)``, the batch in one of ``slots``' slots when
    called in a worker with one free (`BatchSlots`), else ``default_collate``'s and ``None``."""

    def __init__(self, slots: BatchSlots) -> None:
        self.slots = slots

    def __call__(self, samples: list[Any]) -> tuple[Any, int | None]:
        slot = self.slots.acquire()
        if slot is None:
            return collate(samples, collate_fn_map=default_collate_fn_map), None
        try:
            return self.slots.collate_into(slot, samples), slot
        except BaseException:
            self.slots.release(slot)
            raise


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn(tensor)`` for every tensor in it (tuples, named tuples, lists, dicts,
    nested); other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch

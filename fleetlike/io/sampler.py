"""A resumable drop-in for ``torch.utils.data.DistributedSampler``.

Why: a job restarted mid-epoch with torch's sampler either repeats the epoch's first part or
skips to the next epoch. Here the epoch's order is one global list (torch's: ``randperm`` seeded
with ``seed + epoch``), rank ``r`` of ``W`` reads its positions ``r, r + W, ...``, and because the
ranks move in lockstep, what the job has consumed is always a *prefix* of that list. The state is
therefore one number, ``offset`` (how far into the epoch's list the job is), independent of the
world size: a restart with the same or another number of ranks deals ``order[offset:]`` out
again and every remaining sample is seen exactly once. With the same world size, the resumed
order is exactly the uninterrupted run's; with no resume, the indices are exactly torch's.

Uneven tails (`Tail`): ``pad`` (torch's default: repeat the epoch's first samples so every rank
gets as many), ``drop`` (torch's ``drop_last=True``: drop the tail so it divides evenly), or
``even`` (no sample repeated; ranks take ``n`` or ``n + 1`` samples, and the extra one is kept
unless it would give some ranks one more batch than others, which would leave the others
waiting in a collective: needs ``batch_size``).

Block shuffle (``block_size=k``, ``blocks_per_window=g``), the chunk-wise shuffle of litdata and
WebDataset, for records packed in files (`IndexTFRDataset`): a fully shuffled order reads one small
record per device read, because a random ``pread`` gets no readahead. With ``block_size`` the
epoch's order is blocks of ``k`` consecutive indices (``[0, k)``, ``[k, 2k)``, ...) in a seeded
random order, cut into windows of ``g`` blocks, the indices shuffled within each window: a batch
mixes ``g`` blocks rather than one run of neighbours, and a reader that fetches a block's bytes at
once (`IndexTFRDataset` ``readahead_block=k``) pays one large read per ``k`` records. What it gives
up: two samples more than ``g * k`` positions apart in the order never come from the same window,
and samples of one block are never more than ``g * k`` positions apart. The state stays one
``offset``: resumable at any world size, as the plain order. ``block_size=None`` (or 1) is torch's
order, unchanged.

Example:
    >>> sampler = DistributedSampler(dataset, num_replicas=4, rank=1, seed=0)
    >>> sampler.set_epoch(epoch)
    >>> state = sampler.state_dict(consumed=samples_this_rank_took)   # save it with the model
    >>> sampler.load_state_dict(state)   # any world size; the next iteration continues the epoch
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from fleetlike.comm import parse_choice
from fleetlike.io.job import replicas
from fleetlike.io.store import LockPickling

__all__ = ["DistributedSampler", "Tail", "block_order", "deal"]


class Tail(str, enum.Enum):
    """What happens when the epoch does not divide evenly over the ranks (module docstring)."""

    PAD = "pad"
    DROP = "drop"
    EVEN = "even"


def _batches(n: int, batch_size: int, drop_last_batch: bool) -> int:
    return n // batch_size if drop_last_batch else -(-n // batch_size)


def block_order(n: int, block_size: int, blocks_per_window: int, generator: torch.Generator) -> list[int]:
    """A permutation of ``range(n)``: blocks of ``block_size`` consecutive indices (the last one
    shorter when it does not divide) in random order, windows of ``blocks_per_window`` blocks,
    each window's indices in random order (module docstring). Deterministic in ``generator``.

    Example:
        >>> order = block_order(1000, 64, 8, torch.Generator().manual_seed(0))
        >>> len({i // 64 for i in order[:512]})   # the first window: 8 blocks of 64
        8
    """
    blocks = -(-n // block_size)
    rank = torch.empty(blocks, dtype=torch.int64)
    rank[torch.randperm(blocks, generator=generator)] = torch.arange(blocks)   # a block's place
    window = rank[torch.arange(n) // block_size] // blocks_per_window           # each index's window
    key = torch.rand(n, generator=generator, dtype=torch.float64)
    by_key = torch.argsort(key, stable=True)                                     # random within ...
    return by_key[torch.sort(window[by_key], stable=True).indices].tolist()     # ... each window


def deal(order: list[int], offset: int, world: int, tail: Tail, batch_size: int | None = None,
         drop_last_batch: bool = False) -> list[int]:
    """The list dealt out from ``offset`` on: rank ``r`` reads its positions ``r::world``.

    ``order`` is the whole epoch's order (padding repeats its first samples, as torch does)."""
    rest = order[offset:]
    remaining = len(rest)
    if tail is Tail.DROP:
        return rest[: remaining // world * world]
    if tail is Tail.EVEN:
        low = remaining // world
        if remaining % world and batch_size is not None and \
                _batches(low, batch_size, drop_last_batch) != _batches(low + 1, batch_size, drop_last_batch):
            return rest[: low * world]
        return rest
    pad = -remaining % world
    if pad and order:
        rest = rest + (order * math.ceil(pad / len(order)))[:pad]
    return rest


class DistributedSampler(LockPickling, Sampler[int]):
    """torch's ``DistributedSampler`` (same constructor, ``set_epoch``, indices) plus
    ``state_dict``/``load_state_dict`` and the ``tail`` choice; see the module docstring.

    ``num_replicas``/``rank`` default to the fleet job's. ``drop_last=True`` is ``tail="drop"``.
    ``batch_size`` (and ``drop_last_batch``, the loader's ``drop_last``) is needed by
    ``tail="even"`` only: ranks must agree on the number of batches, not of samples.
    ``block_size``/``blocks_per_window``: the block shuffle (module docstring); ignored by an
    unshuffled order, which is file order already.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 tail: Tail | str | None = None, batch_size: int | None = None,
                 drop_last_batch: bool = False, block_size: int | None = None,
                 blocks_per_window: int = 8) -> None:
        self.rank, self.num_replicas = replicas(num_replicas, rank, "DistributedSampler")
        for name, value in (("block_size", 1 if block_size is None else block_size),
                            ("blocks_per_window", blocks_per_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DistributedSampler: {name} must be a positive int, got {value!r}")
        self.block_size = None if block_size in (None, 1) else int(block_size)  # 1: torch's order
        self.blocks_per_window = int(blocks_per_window)
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                f"DistributedSampler: the dataset ({type(dataset).__name__}) has no length; an "
                "IterableDataset is sharded by FileShardDataset / worker_shard instead"
            )
        self.dataset = dataset
        self.shuffle, self.seed, self.epoch = bool(shuffle), int(seed), 0
        chosen = Tail.DROP if drop_last else Tail.PAD
        self.tail = chosen if tail is None else parse_choice(Tail, tail, what="tail", noun="tail policy")
        if drop_last and self.tail is not Tail.DROP:
            raise ValueError(f"DistributedSampler: drop_last=True is tail='drop', but tail={tail!r} was "
                             "given too; pass one of them")
        self.drop_last = self.tail is Tail.DROP
        if self.tail is Tail.EVEN and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"DistributedSampler: tail='even' makes ranks agree on the number of "
                             f"batches, so it needs batch_size (a positive int), got {batch_size!r}")
        self.batch_size, self.drop_last_batch = batch_size, bool(drop_last_batch)
        self._lock = threading.Lock()
        self._start = 0       # offset the current (or next) pass starts at
        self._fresh = True    # the next pass starts at _start (a loaded state or a new epoch)
        self._yielded = 0     # indices the current pass has handed out

    # ------------------------------------------------------------------ order

    @property
    def dataset_size(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def order(self) -> list[int]:
        """The epoch's global order (torch's: ``randperm`` seeded with ``seed + epoch``; with
        ``block_size``, `block_order` from the same seed)."""
        n = self.dataset_size
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.block_size is not None:
            return block_order(n, self.block_size, self.blocks_per_window, g)
        return torch.randperm(n, generator=g).tolist()

    def _blocks(self) -> dict[str, Any]:
        """The block-shuffle settings a state records (none for the plain order: states stay as
        they were)."""
        if self.block_size is None:
            return {}
        return {"block_size": self.block_size, "blocks_per_window": self.blocks_per_window}

    def _share(self, start: int) -> list[int]:
        dealt = deal(self.order(), start, self.num_replicas, self.tail, self.batch_size, self.drop_last_batch)
        return dealt[self.rank :: self.num_replicas]

    def _next_start(self) -> int:
        return self._start if self._fresh else 0

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            start = self._next_start()
            self._start, self._fresh, self._yielded = start, False, 0
        share = self._share(start)
        for index in share:
            with self._lock:
                self._yielded += 1
            yield index

    def __len__(self) -> int:
        with self._lock:
            start = self._next_start()
        return len(self._share(start))

    def set_epoch(self, epoch: int) -> None:
        """As torch's: the next pass uses this epoch's order. Setting the epoch a loaded state is
        in keeps its position (the usual loop calls ``set_epoch`` before every pass)."""
        with self._lock:
            if epoch != self.epoch:
                self._start, self._fresh, self._yielded = 0, True, 0
            self.epoch = epoch

    # ------------------------------------------------------------------ state

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The job's position in the epoch. ``consumed``: samples this rank has taken in the
        current pass (default: the indices handed out, which is ahead of training when a
        DataLoader prefetches; `get_data_loader`'s loader passes the exact count)."""
        with self._lock:
            fresh, start = self._fresh, self._start
            done = self._yielded if consumed is None else int(consumed)
        n = self.dataset_size
        if fresh:
            offset = start
        else:
            share = len(self._share(start))
            offset = n if done >= share else min(n, start + done * self.num_replicas)
        return {"epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_size": n, "offset": offset, **self._blocks()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (saved at any world size): the next pass deals out the rest of
        the saved epoch. Refuses a state of a dataset of another size."""
        missing = {"epoch", "seed", "shuffle", "dataset_size", "offset"} - set(state)
        if missing:
            raise KeyError(f"DistributedSampler.load_state_dict: the state lacks {sorted(missing)}; "
                           "give what DistributedSampler.state_dict() returned")
        n = self.dataset_size
        if state["dataset_size"] != n:
            raise ValueError(
                f"DistributedSampler.load_state_dict: the state was saved for a dataset of "
                f"{state['dataset_size']} samples, this dataset has {n}; positions in one epoch order "
                "do not carry over to another dataset (restore the same dataset, or start the epoch anew)"
            )
        saved = {key: state[key] for key in ("block_size", "blocks_per_window") if key in state}
        if saved != self._blocks() and bool(state["shuffle"]):
            raise ValueError(
                f"DistributedSampler.load_state_dict: the state was saved with the block shuffle "
                f"{saved or 'off'}, this sampler has {self._blocks() or 'it off'}; the offset is a position "
                "in that epoch order: build the sampler with the same block_size and blocks_per_window")
        if not 0 <= int(state["offset"]) <= n:
            raise ValueError(f"DistributedSampler.load_state_dict: offset={state['offset']} is outside "
                             f"[0, {n}] for a dataset of {n} samples")
        with self._lock:
            self.epoch, self.seed, self.shuffle = int(state["epoch"]), int(state["seed"]), bool(state["shuffle"])
            self._start, self._fresh, self._yielded = int(state["offset"]), True, 0

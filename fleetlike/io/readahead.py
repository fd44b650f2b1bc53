"""Block readahead for packed records: the first touch of a block asks the kernel for its bytes.

Why: a shuffled ``pread`` of one record gets no readahead, so on storage that charges per read
(a cloud volume's IOPS cap, a disk's seek) every record costs a device read. Under the sampler's
block shuffle (`DistributedSampler` ``block_size=k``) the records of a block of ``k`` consecutive
indices are all read within one window; `BlockReadahead.touch` issues
``posix_fadvise(POSIX_FADV_WILLNEED)`` over the block's byte range when a process first reads one
of its records, so the kernel fetches the block in a few large reads, into the page cache that
every loader worker shares, and the block's other records are page-cache hits.

The kernel caps one ``WILLNEED`` at the device's readahead size (the larger of its queue's
``read_ahead_kb`` and ``max_sectors_kb``), so a range is hinted in chunks of that size (read from
``/sys/dev/block``; 128 KiB where it cannot be read). A block's records are hinted as the merged
ranges they occupy in each file (records of one block in several files, or not adjacent, work:
only their bytes, plus gaps of at most one chunk, are fetched). A process remembers the last
``memory`` blocks it hinted, so a block is hinted once per window while a later epoch hints it
again.

Hinted at a block's first read, a window's blocks arrive when the window starts, and on slow
storage the workers wait for them there. `HintingSampler` hints ahead instead: it walks the
loader's sampler (in the loader's main process, which hands the indices out) ``lookahead``
positions ahead of what it yields and hints each block once per pass when the block's first index
enters that look-ahead, so the next window's bytes are read while the current one is decoded;
`get_data_loader` puts it in front of a block-shuffle sampler over a dataset that reads ahead
(one window of the rank's share ahead), and the workers then hint nothing (``driven``). Bounded:
at most ``lookahead`` positions (plus the blocks they start) are fetched ahead of the loader.

Example:
    >>> ahead = BlockReadahead(files, offsets, lengths, block_size=64)
    >>> ahead.touch(index, fd_of)      # before os.pread of sample index
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Sampler

__all__ = ["DEFAULT_CHUNK", "BlockReadahead", "HintingSampler", "hint_chunk"]

#: the kernel's default readahead (``read_ahead_kb``), the chunk where sysfs says nothing
DEFAULT_CHUNK = 128 << 10


def hint_chunk(fd: int) -> int:
    """Bytes one ``POSIX_FADV_WILLNEED`` on ``fd`` fetches at most: the larger of the device
    queue's ``read_ahead_kb`` and ``max_sectors_kb`` (a partition's: its disk's queue)."""
    dev = os.fstat(fd).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):
        try:
            sizes = [int(Path(queue, name).read_text(encoding="ascii")) for name in
                     ("read_ahead_kb", "max_sectors_kb")]
        except (OSError, ValueError):
            continue
        return max(max(sizes) << 10, 4096)
    return DEFAULT_CHUNK


class BlockReadahead:
    """Hints each block of ``block_size`` consecutive samples once (module docstring).

    ``files``/``offsets``/``lengths``: every sample's file id, byte offset and length (arrays of
    the dataset's index); ``memory``: blocks a process remembers as hinted (at least a window's).
    """

    def __init__(self, files: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, block_size: int,
                 memory: int = 64) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"readahead_block must be a positive int (records per block), got {block_size!r}")
        self.block_size, self.memory = block_size, int(memory)
        self._files, self._offsets, self._lengths = files, offsets, lengths
        self._chunks: dict[int, int] = {}
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._pid = os.getpid()
        self.driven = False  #: a `HintingSampler` hints (in the loader's process): `touch` does nothing

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_recent": OrderedDict(), "_chunks": {}}

    def ranges(self, block: int, gap: int) -> list[tuple[int, int, int]]:
        """``(file id, start, end)`` byte ranges of ``block``'s records, per file, merged where
        they are at most ``gap`` bytes apart."""
        lo = block * self.block_size
        hi = min(lo + self.block_size, len(self._offsets))
        fids, starts = self._files[lo:hi], self._offsets[lo:hi]
        ends = starts + self._lengths[lo:hi]
        merged: list[tuple[int, int, int]] = []
        for i in np.lexsort((starts, fids)):
            fid, start, end = int(fids[i]), int(starts[i]), int(ends[i])
            if merged and merged[-1][0] == fid and start <= merged[-1][2] + gap:
                merged[-1] = (fid, merged[-1][1], max(end, merged[-1][2]))
            else:
                merged.append((fid, start, end))
        return merged

    def touch(self, index: int, fd_of: Callable[[int], int]) -> bool:
        """At a read of sample ``index``: hint its block unless this process hinted it recently
        or a `HintingSampler` hints (``driven``); whether it did. ``fd_of(file id)``: the
        process's descriptor of that file."""
        return False if self.driven else self.hint(index, fd_of)

    def forget(self) -> None:
        """Forget the blocks hinted (a new pass hints each block again)."""
        self._recent.clear()

    def hint(self, index: int, fd_of: Callable[[int], int]) -> bool:
        """Hint the block of sample ``index`` unless this process hinted it recently; whether it
        did."""
        if self._pid != os.getpid():  # a forked worker: its own memory of what it hinted
            self._recent, self._chunks, self._pid = OrderedDict(), {}, os.getpid()
        block = index // self.block_size
        if block in self._recent:
            self._recent.move_to_end(block)
            return False
        self._recent[block] = None
        if len(self._recent) > self.memory:
            self._recent.popitem(last=False)
        fid = int(self._files[index])
        chunk = self._chunks.get(fid) or self._chunks.setdefault(fid, hint_chunk(fd_of(fid)))
        for fid, start, end in self.ranges(block, chunk):
            fd = fd_of(fid)
            for at in range(start, end, chunk):
                os.posix_fadvise(fd, at, min(chunk, end - at), os.POSIX_FADV_WILLNEED)
        return True


class HintingSampler(Sampler[int]):
    """``sampler``'s indices, each handed out after the next ``lookahead`` ones were read from
    ``sampler`` and ``dataset.hint_ahead(index)`` was called on each, in order (module
    docstring). ``dataset.hint_ahead`` hints a block once per pass (`IndexTFRDataset`); a pass
    (``iter``) calls ``dataset.hint_ahead(None)`` first and last, which forgets the blocks hinted
    and closes the files it opened.

    Example:
        >>> loader = DataLoader(ds, 64, sampler=HintingSampler(sampler, ds, lookahead=512))
    """

    def __init__(self, sampler: Sampler[int], dataset: Any, lookahead: int) -> None:
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"HintingSampler: lookahead must be an int >= 0 (positions), got {lookahead!r}")
        self.sampler, self.dataset, self.lookahead = sampler, dataset, lookahead

    def __iter__(self) -> Iterator[int]:
        self.dataset.hint_ahead(None)
        try:
            ahead: deque[int] = deque()
            for index in self.sampler:
                self.dataset.hint_ahead(index)
                ahead.append(index)
                if len(ahead) > self.lookahead:
                    yield ahead.popleft()
            yield from ahead
        finally:  # the pass is over (or dropped): the dataset closes what it opened to hint
            self.dataset.hint_ahead(None)

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        return len(self.sampler)

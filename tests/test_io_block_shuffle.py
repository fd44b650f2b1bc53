"""The sampler's block shuffle and the packed dataset's block readahead.

References: a plain-Python block shuffle drawing from the same generator (loops, lists, a sort
per window), torch's own ``DistributedSampler`` for the unchanged plain order, the dataset read
without readahead for the records, and the hints recorded at ``os.posix_fadvise``.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler as TorchSampler

from fleetlike.io import DistributedSampler, IndexTFRDataset, Tail, get_data_loader
from fleetlike.io.readahead import BlockReadahead, HintingSampler
from fleetlike.io.sampler import block_order
from test_io_tfrecord import pack, pixels


def reference_order(n: int, k: int, g: int, seed: int) -> list[int]:
    """The block shuffle by hand: blocks in randperm order, windows of g, each window's indices
    sorted by one uniform key per index (the same draws, in the same sequence)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [list(range(b * k, min(b * k + k, n))) for b in range(-(-n // k))]
    perm = torch.randperm(len(blocks), generator=gen).tolist()
    key = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    out: list[int] = []
    for w in range(0, len(perm), g):
        members = [i for b in perm[w : w + g] for i in blocks[b]]
        out += sorted(members, key=lambda i: (key[i], i))
    return out


def windows_of(order: list[int], k: int, g: int) -> list[set[int]]:
    """The order cut where its windows end: a window is the blocks of its first g new blocks."""
    out, pos = [], 0
    while pos < len(order):
        blocks: list[int] = []
        end = pos
        while end < len(order) and (order[end] // k in blocks or len(blocks) < g):
            if order[end] // k not in blocks:
                blocks.append(order[end] // k)
            end += 1
        out.append(set(order[pos:end]))
        pos = end
    return out


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 300), k=st.integers(1, 40), g=st.integers(1, 6), seed=st.integers(0, 50))
def test_block_order_is_the_reference_and_whole_blocks_per_window(n, k, g, seed):
    order = block_order(n, k, g, torch.Generator().manual_seed(seed))
    assert order == reference_order(n, k, g, seed)
    assert sorted(order) == list(range(n))
    for window in windows_of(order, k, g):  # each window: whole blocks, at most g of them
        blocks = {i // k for i in window}
        assert len(blocks) <= g and window == {i for b in blocks for i in range(b * k, min(b * k + k, n))}


def shares(n, world, tail, seed, epoch, k, g, batch=3):
    out = []
    for r in range(world):
        s = DistributedSampler(range(n), world, r, seed=seed, tail=tail, batch_size=batch, block_size=k,
                               blocks_per_window=g)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 200), k=st.integers(1, 20), g=st.integers(1, 5), world=st.integers(1, 6),
       tail=st.sampled_from(list(Tail)), seed=st.integers(0, 9), epoch=st.integers(0, 3))
def test_every_index_once_per_epoch_and_one_order_on_every_rank(n, k, g, world, tail, seed, epoch):
    got = shares(n, world, tail, seed, epoch, k, g)
    order = block_order(n, k, g, torch.Generator().manual_seed(seed + epoch)) if k > 1 else \
        torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    # the ranks interleave into one global order: the epoch's (every rank computed the same)
    longest = max(len(x) for x in got)
    dealt = [x[j] for j in range(longest) for x in got if j < len(x)]
    assert dealt[: min(n, len(dealt))] == order[: len(dealt)]
    counts = collections.Counter(dealt)
    if tail is Tail.PAD:
        assert set(counts) == set(range(n)) and len(dealt) - n < world
    else:
        assert all(c == 1 for c in counts.values()) and n - len(counts) < world


def run(n, world, k, g, state, stop, batch=4):
    """``world`` ranks from ``state`` for ``stop`` batches (None: to the end): what each saw and
    rank 0's state."""
    samplers = []
    for r in range(world):
        s = DistributedSampler(range(n), world, r, seed=3, batch_size=batch, block_size=k, blocks_per_window=g)
        s.set_epoch(1)
        if state is not None:
            s.load_state_dict(state)
            s.set_epoch(state["epoch"])
        samplers.append(s)
    full = [list(s) for s in samplers]
    seen = full if stop is None else [x[: stop * batch] for x in full]
    consumed = None if stop is None else (stop * batch if stop * batch < len(full[0]) else 2**62)
    return seen, samplers[0].state_dict(consumed=consumed)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 150), k=st.integers(2, 16), g=st.integers(1, 4), world=st.integers(1, 4),
       other=st.integers(1, 5), stop=st.integers(0, 12))
def test_resume_mid_epoch_continues_with_exactly_the_unseen(n, k, g, world, other, stop):
    whole, _ = run(n, world, k, g, None, None)
    first, state = run(n, world, k, g, None, stop)
    assert state["block_size"] == k and state["blocks_per_window"] == g
    same, _ = run(n, world, k, g, state, None)
    for r in range(world):  # the same world size: the uninterrupted run's order
        assert first[r] + same[r] == whole[r], r
    if state["offset"] < n:  # another world size: exactly the samples not seen yet
        before = [i for x in first for i in x]
        rest, _ = run(n, other, k, g, state, None)
        after = [x[j] for j in range(max(map(len, rest))) for x in rest if j < len(x)]  # the dealt order
        assert not set(before) & set(after[: n - state["offset"]])
        assert sorted(before + after[: n - state["offset"]]) == list(range(n))
        assert len(after) - (n - state["offset"]) < other  # padding only


@pytest.mark.parametrize("k", [None, 1])
def test_block_size_one_or_none_is_torchs_order(k):
    for n, world, epoch in ((0, 1, 0), (13, 3, 2), (64, 4, 1), (100, 7, 5)):
        for r in range(world):
            ours = DistributedSampler(range(n), world, r, seed=9, block_size=k, blocks_per_window=3)
            theirs = TorchSampler(range(n), world, r, seed=9)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert set(ours.state_dict()) == {"epoch", "seed", "shuffle", "dataset_size", "offset"}


def test_unshuffled_is_file_order_and_bad_settings_are_named():
    assert list(DistributedSampler(range(10), 1, 0, shuffle=False, block_size=4)) == list(range(10))
    for kw, name in (({"block_size": 0}, "block_size"), ({"block_size": 4, "blocks_per_window": 0}, "blocks_per_window"),
                     ({"block_size": True}, "block_size")):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            DistributedSampler(range(10), 1, 0, **kw)
    blocked = DistributedSampler(range(10), 1, 0, block_size=4)
    plain = DistributedSampler(range(10), 1, 0)
    with pytest.raises(ValueError, match="block shuffle.*'block_size': 4.*same block_size"):
        plain.load_state_dict(blocked.state_dict())
    with pytest.raises(ValueError, match="block shuffle off"):
        blocked.load_state_dict(plain.state_dict())


def test_readahead_returns_the_same_records_and_hints_each_block_once(tmp_path, monkeypatch):
    _, _, out = pack(tmp_path, per_class=7)  # 21 records in 2 files
    plain = IndexTFRDataset(out, "train.index", pixels)
    ahead = IndexTFRDataset(out, "train.index", pixels, readahead_block=4)
    hints: list[tuple[str, int, int]] = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        hints.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    order = block_order(len(plain), 4, 2, torch.Generator().manual_seed(1))
    for i in order:
        a, b = ahead[i], plain[i]
        assert a[1] == b[1] and torch.equal(a[0], b[0]), i
    # one hint (or one per chunk) per block, covering exactly its records' bytes
    hinted: dict[str, set[int]] = collections.defaultdict(set)
    for path, offset, length in hints:
        hinted[path] |= set(range(offset, offset + length))
    wanted: dict[str, set[int]] = collections.defaultdict(set)
    for i in range(len(plain)):
        path, offset, length = plain.location(i)
        wanted[os.path.realpath(path)] |= set(range(offset, offset + length))
    assert dict(hinted) == dict(wanted)  # records of one file are adjacent: no gap bytes
    assert sum(length for _, _, length in hints) == sum(plain.location(i)[2] for i in range(len(plain)))
    # the loader picks the dataset's block size, and a different one is refused with the reason
    loader = get_data_loader(ahead, 5, 1, 0, num_workers=2, prefetch=1)
    assert loader.sampler.block_size == 4
    assert sorted(torch.cat([y for _, y in loader]).tolist()) == sorted(plain.targets)
    with pytest.raises(ValueError, match="block_size=8, but the dataset reads blocks of readahead_block=4"):
        get_data_loader(ahead, 5, 1, 0, block_size=8)


def test_block_ranges_merge_adjacent_records_per_file():
    files = np.array([0, 0, 1, 1, 0, 0], dtype=np.int32)
    offsets = np.array([0, 10, 0, 50, 100, 30], dtype=np.int64)
    lengths = np.array([10, 20, 50, 5, 7, 8], dtype=np.int64)
    ahead = BlockReadahead(files, offsets, lengths, block_size=4)
    assert ahead.ranges(0, gap=0) == [(0, 0, 30), (1, 0, 55)]
    assert ahead.ranges(1, gap=0) == [(0, 30, 38), (0, 100, 107)]
    assert ahead.ranges(1, gap=62) == [(0, 30, 107)]
    with pytest.raises(ValueError, match="readahead_block must be a positive int"):
        BlockReadahead(files, offsets, lengths, block_size=0)


class _Recorder:
    """A dataset's ``hint_ahead`` that records, per call, how many indices the consumer had taken."""

    def __init__(self) -> None:
        self.taken = 0
        self.calls: list[tuple[int | None, int]] = []

    def hint_ahead(self, index):
        self.calls.append((index, self.taken))


@pytest.mark.parametrize("lookahead", [0, 1, 5, 40])
def test_hinting_sampler_hints_every_index_lookahead_positions_before_handing_it_out(lookahead):
    order = block_order(37, 4, 2, torch.Generator().manual_seed(2))
    rec = _Recorder()
    out = []
    for index in HintingSampler(order, rec, lookahead):
        out.append(index)
        rec.taken += 1
    assert out == order and len(HintingSampler(order, rec, lookahead)) == len(order)
    assert rec.calls[0] == (None, 0)  # a pass starts by forgetting the blocks hinted
    assert rec.calls[-1] == (None, len(order))  # and ends closing what it opened
    # index at position p is hinted when p - lookahead indices were handed out (0 at the start)
    assert rec.calls[1:-1] == [(i, max(0, p - lookahead)) for p, i in enumerate(order)]
    rec.calls.clear()
    for _ in zip(range(3), HintingSampler(order, rec, lookahead)):  # a pass dropped early ends too
        pass
    assert rec.calls[-1][0] is None and len(rec.calls) == min(len(order), lookahead + 3) + 2
    with pytest.raises(ValueError, match="lookahead must be an int >= 0"):
        HintingSampler(order, rec, -1)


def _hints_to(path):
    """``os.posix_fadvise`` that appends ``pid file offset length`` to ``path`` (forked workers too)."""
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()} {os.readlink(f'/proc/self/fd/{fd}')} {offset} {length}\n")
        return real(fd, offset, length, advice)
    return record


@pytest.mark.timeout(120)
def test_loader_hints_each_block_once_per_pass_from_its_process_and_reads_the_same(tmp_path, monkeypatch):
    _, _, out = pack(tmp_path, per_class=7)  # 21 records in 2 files: blocks of 4, windows of 2 blocks
    plain = IndexTFRDataset(out, "train.index", pixels)
    ahead = IndexTFRDataset(out, "train.index", pixels, readahead_block=4)
    log = tmp_path / "hints"
    monkeypatch.setattr(os, "posix_fadvise", _hints_to(log))
    hinted = get_data_loader(ahead, 5, 1, 0, seed=3, blocks_per_window=2, num_workers=2, prefetch=1)
    reference = get_data_loader(plain, 5, 1, 0, seed=3, block_size=4, blocks_per_window=2, num_workers=2,
                                prefetch=1)
    assert isinstance(hinted.loader.sampler, HintingSampler) and hinted.loader.sampler.lookahead == 8
    assert hinted.sampler.block_size == 4  # the state is still the DistributedSampler's
    for epoch in (0, 1):
        hinted.set_epoch(epoch)
        reference.set_epoch(epoch)
        log.write_text("")
        for (x, y), (rx, ry) in zip(hinted, reference, strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)
        hints = [line.split() for line in log.read_text().splitlines()]
        assert {int(pid) for pid, *_ in hints} == {os.getpid()}  # the loader's process; no worker hinted
        per_file: dict[str, list[int]] = collections.defaultdict(list)
        for _, path, offset, length in hints:
            per_file[path] += range(int(offset), int(offset) + int(length))
        wanted: dict[str, list[int]] = collections.defaultdict(list)
        for i in range(len(plain)):
            path, offset, length = plain.location(i)
            wanted[os.path.realpath(path)] += range(offset, offset + length)
        # every record's bytes once per pass: each block hinted once, nothing else
        assert {p: sorted(b) for p, b in per_file.items()} == {p: sorted(b) for p, b in wanted.items()}
        assert ahead._fds == {}  # after the pass this process holds no record file open
    # without the loader (a worker of torch's own loader), a read hints as before
    fresh = IndexTFRDataset(out, "train.index", pixels, readahead_block=4)
    log.write_text("")
    fresh[0]
    assert len(log.read_text().splitlines()) >= 1

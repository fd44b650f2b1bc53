"""fleetlike.io.DistributedSampler: torch's indices, and a restart (any world size) sees exactly
the samples of the epoch not yet seen; files_shard / worker_shard split completely and disjointly.

The independent references: torch's own ``DistributedSampler`` (its indices, and with one
replica the epoch's global order), and ``numpy.array_split`` for the contiguous file blocks.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchSampler

from fleetlike.io import DistributedSampler, FileShardDataset, Tail, files_shard, worker_shard


def torch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's global order, from torch's sampler with one replica."""
    s = TorchSampler(range(n), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("shuffle", [True, False])
def test_indices_are_torchs(shuffle):
    for n in (0, 1, 5, 10, 13, 64):
        for world in (1, 2, 3, 4, 7):
            for drop_last in (False, True):
                for epoch in (0, 3):
                    for rank in range(world):
                        ours = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
                        theirs = TorchSampler(range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
                        ours.set_epoch(epoch)
                        theirs.set_epoch(epoch)
                        assert list(ours) == list(theirs) and len(ours) == len(theirs), (n, world, rank, drop_last)


def run_part(n, world, tail, batch, seed, epoch, state, stop):
    """Ranks in lockstep for ``stop`` batches (None: to the end) from ``state``; returns what each
    rank saw (list per rank) and the state rank 0 would save."""
    samplers = []
    for r in range(world):
        s = DistributedSampler(range(n), world, r, seed=seed, tail=tail, batch_size=batch)
        s.set_epoch(epoch)
        if state is not None:
            s.load_state_dict(state)
            s.set_epoch(state["epoch"])  # the usual loop: set_epoch of the resumed epoch keeps the position
        samplers.append(s)
    shares = [list(s) for s in samplers]
    seen = [indices if stop is None else indices[: stop * batch] for indices in shares]
    # drop/pad: equal samples per rank; even: equal batches per rank
    assert len({-(-len(x) // batch) for x in shares}) == 1, shares
    taken = [len(x) for x in seen]
    total = len(shares[0])
    consumed = None if stop is None else min(stop * batch, total)
    # a rank that took its whole share ends the epoch; the checkpointing rank is rank 0
    if stop is not None and stop * batch >= total:
        consumed = 2**62
    return seen, samplers[0].state_dict(consumed=consumed), taken


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 70), worlds=st.lists(st.integers(1, 5), min_size=3, max_size=3),
       batch=st.integers(1, 6), stops=st.lists(st.integers(0, 12), min_size=2, max_size=2),
       tail=st.sampled_from(list(Tail)), seed=st.integers(0, 3), epoch=st.integers(0, 2))
def test_restart_sees_the_rest_of_the_epoch_exactly_once(n, worlds, batch, stops, tail, seed, epoch):
    """Two stops, each restart at a random world size: every sample of the epoch is seen once,
    except what the tail policy pads or drops, and that only in the last part (< world)."""
    order = torch_order(n, seed, epoch, True)
    state = None
    seen_before: list[int] = []
    for part, (world, stop) in enumerate(zip(worlds, [*stops, None])):
        seen, new_state, _ = run_part(n, world, tail, batch, seed, epoch, state, stop)
        offset = 0 if state is None else state["offset"]
        flat = [i for rank in seen for i in rank]
        rest = order[offset:]
        if stop is not None and new_state["offset"] < n:
            # mid-epoch: exactly the next slice of the epoch's order, nothing padded or dropped
            assert sorted(flat) == sorted(order[offset:new_state["offset"]]), (part, flat, new_state)
        else:
            counts = collections.Counter(flat)
            unique = [i for i in rest if i in counts]
            if tail is Tail.PAD:
                assert set(counts) >= set(rest) and sum(counts.values()) - len(rest) < world
                extra = [i for i, c in counts.items() for _ in range(c - (1 if i in rest else 0))]
                assert set(extra) <= set(order[: len(extra)] or [])  # padding repeats the epoch's first
            else:
                assert all(c == 1 for c in counts.values()) and set(counts) <= set(rest)
                assert len(rest) - len(unique) < world  # dropped: less than one sample per rank
            seen_before += flat
            break
        assert not set(flat) & set(seen_before), "a sample seen twice across a restart"
        seen_before += flat
        state = new_state
        assert state["dataset_size"] == n and state["epoch"] == epoch


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 5), batch=st.integers(1, 5), stop=st.integers(0, 10),
       tail=st.sampled_from(list(Tail)))
def test_resume_at_the_same_world_size_is_the_uninterrupted_order(n, world, batch, stop, tail):
    full, _, _ = run_part(n, world, tail, batch, 7, 1, None, None)
    first, state, _ = run_part(n, world, tail, batch, 7, 1, None, stop)
    rest, _, _ = run_part(n, world, tail, batch, 7, 1, state, None)
    for r in range(world):
        assert first[r] + rest[r] == full[r], r


def test_even_tail_keeps_every_sample_when_batches_agree():
    # 10 samples on 3 ranks: 4, 3, 3 samples; batch 2 -> 2 batches each: nothing dropped
    shares = [list(DistributedSampler(range(10), 3, r, shuffle=False, tail="even", batch_size=2)) for r in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    # batch 3: 4 samples would be 2 batches, 3 samples 1: the extra sample is dropped
    shares = [list(DistributedSampler(range(10), 3, r, shuffle=False, tail="even", batch_size=3)) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_set_epoch_resets_and_a_finished_pass_saves_the_epoch_as_done():
    s = DistributedSampler(range(10), 2, 0, seed=1)
    s.set_epoch(1)
    theirs = TorchSampler(range(10), 2, 0, seed=1)
    theirs.set_epoch(1)
    assert list(s) == list(theirs)
    state = s.state_dict()
    assert state["offset"] == 10 and state["epoch"] == 1
    s.load_state_dict(state)
    assert len(s) == 0 and list(s) == []
    s.set_epoch(2)
    assert len(list(s)) == 5
    it = iter(s)
    next(it), next(it)
    assert s.state_dict()["offset"] == 4  # two indices handed out on each of 2 ranks


def test_bad_input_is_named():
    s = DistributedSampler(range(10), 2, 0)
    with pytest.raises(ValueError, match="saved for a dataset of 12 samples, this dataset has 10"):
        s.load_state_dict({"epoch": 0, "seed": 0, "shuffle": True, "dataset_size": 12, "offset": 3})
    with pytest.raises(KeyError, match="offset"):
        s.load_state_dict({"epoch": 0, "seed": 0, "shuffle": True, "dataset_size": 10})
    with pytest.raises(ValueError, match="tail='even'.*batch_size"):
        DistributedSampler(range(10), 2, 0, tail="even")
    with pytest.raises(ValueError, match="'pad', 'drop', 'even'"):
        DistributedSampler(range(10), 2, 0, tail="evenly")
    with pytest.raises(ValueError, match="rank=2 is outside"):
        DistributedSampler(range(10), 2, 2)
    with pytest.raises(RuntimeError, match="fleet.init"):
        DistributedSampler(range(10))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 40), size=st.integers(1, 6))
def test_files_shard_is_contiguous_first_ranks_one_more(n, size):
    files = [f"f{i}" for i in range(n)]
    if n < size:
        with pytest.warns(UserWarning, match="whole list"):
            assert files_shard(files, size, 0) == files
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shards = [files_shard(files, size, r) for r in range(size)]
    assert shards == [list(a) for a in np.array_split(np.array(files, dtype=object), size)]
    dropped = [files_shard(files, size, r, drop_last=True) for r in range(size)]
    assert {len(d) for d in dropped} == {n // size} and sum(dropped, []) == files[: n // size * size]


def _read(path: str) -> list[str]:
    return [f"{path}:{k}" for k in range(3)]


@pytest.mark.timeout(60)
def test_worker_slicing_reads_each_file_once_over_ranks_and_workers():
    files = [f"part-{i:02d}" for i in range(11)]
    got = []
    for rank in range(3):
        loader = DataLoader(FileShardDataset(files, _read, 3, rank), batch_size=None, num_workers=2)
        got += list(loader)
    assert sorted(got) == sorted(r for f in files for r in _read(f))
    blocks = [worker_shard(files, r, 3, w, 2) for r in range(3) for w in range(2)]
    assert sum(blocks, []) == files  # contiguous, ranks first, workers within
    with pytest.raises(TypeError, match="list of names"):
        files_shard("abc", 2, 0)
    with pytest.raises(ValueError, match="worker 2 of 2"):
        worker_shard(files, 0, 3, 2, 2)

"""Batches collated into reused shared-memory slots (`BatchSlots`) equal torch's
``default_collate`` batches, dtypes and nesting included; batches the training loop keeps stay
intact while their slots are refilled; a worker with no free slot (a consumer that never copies
out) falls back to new shared memory with the same values; a pass broken off leaves the next
pass correct.

Reference: torch's DataLoader with its default collate over the same dataset and sampler.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from fleetlike.io import get_data_loader
from fleetlike.io.batch_slots import BatchSlots, SlotCollate

Pair = collections.namedtuple("Pair", "a b")


class Mixed(Dataset):
    """Samples with every leaf kind ``default_collate`` handles: tensors of two dtypes, ints,
    floats, strings, a dict and a named tuple."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = (torch.arange(3 * 5 * 4, dtype=torch.int64).reshape(3, 5, 4) * (i + 1) % 251).to(torch.uint8)
        return {"image": image, "box": torch.full((2,), i / 3, dtype=torch.float32), "id": i,
                "scale": i / 7, "name": f"s{i}", "pair": Pair(i, torch.tensor([i, -i]))}, i


def assert_same(ours, theirs) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    elif isinstance(theirs, dict):
        assert type(ours) is type(theirs) and ours.keys() == theirs.keys()
        for k in theirs:
            assert_same(ours[k], theirs[k])
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b)
    else:
        assert ours == theirs


@pytest.mark.timeout(120)
def test_kept_batches_equal_default_collate_while_slots_are_reused():
    ds = Mixed(61)  # 16 batches of 4 (the last of 1) over 2 workers with 3 slots each: every slot refilled
    theirs = list(DataLoader(ds, 4, sampler=SequentialSampler(ds)))
    for prefetch in (0, 2):
        loader = get_data_loader(ds, 4, 1, 0, shuffle=False, num_workers=2, prefetch=prefetch)
        assert loader.slots is not None
        for _ in range(2):  # a second pass reuses the slots from the start
            ours = list(loader)  # every batch kept until the end of the pass
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs):
                assert_same(a, b)
                assert not a[0]["image"].is_shared()  # the loop's own memory, not a slot
            assert not loader.slots._held  # the pass over, the loader keeps no slot mapped


@pytest.mark.timeout(120)
def test_a_worker_without_a_free_slot_collates_into_new_memory():
    ds = Mixed(40)
    slots = BatchSlots(workers=2, per_worker=2)
    # torch's loader with the slot collate, its batches never copied out: after two batches a
    # worker has no free slot and must not overwrite the batches still held here
    batches = list(DataLoader(ds, 4, num_workers=2, collate_fn=SlotCollate(slots)))
    used = [slot for _, slot in batches]
    assert sorted(s for s in used if s is not None) == [0, 1, 2, 3]
    assert used.count(None) == len(batches) - 4
    for (batch, _), b in zip(batches, DataLoader(ds, 4)):
        assert_same(batch, b)


@pytest.mark.timeout(120)
def test_a_pass_broken_off_leaves_the_next_pass_correct():
    ds = Mixed(64)
    theirs = list(DataLoader(ds, 4))
    loader = get_data_loader(ds, 4, 1, 0, shuffle=False, num_workers=2, prefetch=2, persistent_workers=True)
    for stop in (3, 1):
        for i, batch in enumerate(loader):
            assert_same(batch, theirs[i])
            if i == stop:
                break
        ours = list(loader)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert_same(a, b)


def test_slots_only_without_a_collate_fn_and_with_workers():
    ds = Mixed(8)
    assert get_data_loader(ds, 4, 1, 0, num_workers=0).slots is None
    assert get_data_loader(ds, 4, 1, 0, num_workers=2, collate_fn=lambda s: s).slots is None
    with pytest.raises(ValueError, match="per_worker=0"):
        BatchSlots(workers=2, per_worker=0)


def test_a_batch_pinned_by_torchs_loader_frees_its_slot_without_another_copy():
    slots = BatchSlots(workers=1, per_worker=2)
    flags = slots.flags.numpy()
    flags[:] = 1
    batch = (torch.arange(6).reshape(2, 3), {"y": torch.ones(2)})
    assert slots.copy_out(batch, 1, copied=True) is batch  # torch's pin thread made the copy
    assert flags.tolist() == [1, 0]
    mine = slots.copy_out(batch, 0)
    assert flags.tolist() == [0, 0]
    assert_same(mine, batch)
    assert mine[0].untyped_storage().data_ptr() != batch[0].untyped_storage().data_ptr()
    assert slots.copy_out(batch, None) is batch  # a batch collated outside the slots

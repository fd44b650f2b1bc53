"""EPL's ``io.slicing``, ``io.unbalanced_io_slicing``, ``io.drop_last_files`` keys act on the
loader's default sharding and on file sharding, on real gloo ranks; references: the file list
split by hand (contiguous blocks) and torch's DistributedSampler indices."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from fleetlike import DistributedStrategy, fleet
from fleetlike.io import FileShardDataset, files_shard, get_data_loader
from fleetlike.testing import run_ranks

FILES = [f"part-{i}" for i in range(7)]


def _shard(role, options):
    s = DistributedStrategy()
    s.update(options)
    fleet.init(role, timeout=30, strategy=s)
    try:
        shard = files_shard(FILES)
    except ValueError as error:
        shard = str(error)
    loader = get_data_loader(TensorDataset(torch.arange(6)), 2, shuffle=False, prefetch=0)
    seen = [int(i) for (b,) in loader for i in b]
    per_worker = FileShardDataset(FILES, lambda f: [f]).my_files() if not isinstance(shard, str) else None
    return shard, seen, per_worker


@pytest.mark.timeout(120)
def test_epl_io_keys_act_on_the_loader_and_file_sharding():
    # fleetlike's defaults: sliced, the remainder spread (EPL's unbalanced slicing)
    results = run_ranks(_shard, 2, {}, timeout=60)
    assert [r[0] for r in results] == [FILES[:4], FILES[4:]] and [r[2] for r in results] == [FILES[:4], FILES[4:]]
    assert [r[1] for r in results] == [[0, 2, 4], [1, 3, 5]]
    # io.drop_last_files: 3 files each, the 7th dropped
    results = run_ranks(_shard, 2, {"io.drop_last_files": True}, timeout=60)
    assert [r[0] for r in results] == [FILES[:3], FILES[3:6]] and [r[2] for r in results] == [FILES[:3], FILES[3:6]]
    # io.unbalanced_io_slicing False: a list that does not divide is refused, by name
    results = run_ranks(_shard, 2, {"io.unbalanced_io_slicing": False}, timeout=60)
    assert all("7 files do not divide over 2 ranks" in r[0] and "io.drop_last_files" in r[0] for r in results)
    # io.slicing False: every rank reads everything
    results = run_ranks(_shard, 2, {"io.slicing": False}, timeout=60)
    assert all(r[0] == FILES and r[2] == FILES and r[1] == list(range(6)) for r in results)

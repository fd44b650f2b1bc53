"""The caches: FileCache (copies, LRU by bytes, one fetch when real processes race, errors) and
CachedDataset (decode once, augment every time; memory / disk across DataLoader workers / auto;
limits and errors); an ImageListDataset reading a throttled source through the file cache.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fleetlike.io import (
    CacheFullError,
    CachedDataset,
    DistributedSampler,
    FileCache,
    ImageFolder,
    ImageListDataset,
    RandomHorizontalFlip,
    ThrottledReader,
    ToTensor,
    get_file,
    set_file_cache,
)
from test_io_datasets import make_images, write_list


def make_source(root: Path, sizes: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for name, size in sizes.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return root


def test_copies_hits_and_lru_eviction_by_bytes(tmp_path):
    src = make_source(tmp_path / "src", {"a": 1000, "b": 1000, "sub/c": 1000, "d": 1000})
    cache = FileCache(src, tmp_path / "cache", max_bytes=2500)
    local = cache.get_file("a")
    assert local.read_bytes() == (src / "a").read_bytes() and local != src / "a"
    assert cache.get_file(src / "a") == local and (cache.hits, cache.fetches) == (1, 1)
    time.sleep(0.01)
    cache.get_file("b")
    time.sleep(0.01)
    cache.get_file("a")  # a is now more recent than b
    time.sleep(0.01)
    cache.get_file("sub/c")  # 3000 > 2500: the least recently used (b) goes
    cached = sorted(p.relative_to(tmp_path / "cache").as_posix() for p in (tmp_path / "cache").rglob("*")
                    if p.is_file() and ".fleetlike-cache" not in p.parts)
    assert cached == ["a", "sub/c"] and cache.store.used_bytes() <= 2500
    assert cache.read_bytes("b") == (src / "b").read_bytes() and cache.fetches == 4
    assert get_file("d", source=src, cache_dir=tmp_path / "cache2").read_bytes() == (src / "d").read_bytes()


def test_errors_are_named(tmp_path):
    src = make_source(tmp_path / "src", {"big": 5000, "small": 10})
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError, match="cache directory .*afile/cache' cannot be written"):
        FileCache(src, tmp_path / "afile" / "cache")
    cache = FileCache(src, tmp_path / "cache", max_bytes=1000)
    with pytest.raises(CacheFullError, match="'big' is 5000 bytes, more than the whole cache \\(1000 bytes\\)"):
        cache.get_file("big")
    with pytest.raises(ValueError, match="not under the source"):
        cache.get_file(tmp_path / "afile")
    with pytest.raises(FileNotFoundError, match="does not exist in the source"):
        cache.get_file("nope")
    with pytest.raises(ValueError, match="positive int of bytes"):
        FileCache(src, tmp_path / "c3", max_bytes=0)
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # the refused file left nothing behind


class _LoggingReader(ThrottledReader):
    """A slow source that appends one line per fetch to a log shared by the processes."""

    def __init__(self, log: str) -> None:
        super().__init__(200_000, latency=0.2)
        self.log = log

    def __call__(self, path):
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{os.getpid()} {path.name}\n".encode())
        os.close(fd)
        yield from super().__call__(path)


def _racer(src, cache_dir, log, barrier, out):
    cache = FileCache(src, cache_dir, max_bytes=10**6, reader=_LoggingReader(log))
    barrier.wait()
    data = [cache.read_bytes(name) for name in ("x", "y", "z")]
    out.put((cache.fetches, cache.hits, [len(d) for d in data], [hash(d) for d in data]))


@pytest.mark.timeout(60)
def test_processes_racing_for_a_file_fetch_it_once(tmp_path):
    src = make_source(tmp_path / "src", {"x": 20000, "y": 30000, "z": 10000})
    log = str(tmp_path / "fetches.log")
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(src), str(tmp_path / "cache"), log, barrier, out)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=45) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    lines = Path(log).read_text().splitlines()
    assert sorted(line.split()[1] for line in lines) == ["x", "y", "z"]  # one fetch per file on the node
    assert sum(r[0] for r in results) == 3 and sum(r[1] for r in results) == 9
    expected = [hash((src / n).read_bytes()) for n in ("x", "y", "z")]
    assert all(r[3] == expected for r in results)


class Counting(Dataset):
    """A 'decoder' that logs every decode to a file (DataLoader workers are processes)."""

    def __init__(self, n: int, log: str | None = None, shape=(3, 8, 8)) -> None:
        self.n, self.log, self.shape = n, log, shape
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        if self.log:
            with open(self.log, "a") as fh:
                fh.write(f"{i}\n")
        return torch.full(self.shape, float(i)), i


def _flip(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1) if torch.rand(1).item() < 0.5 else x


def test_memory_cache_decodes_once_and_augments_every_time():
    base = Counting(10, shape=(1, 1, 4))
    base_items = [base[i] for i in range(10)]
    base.calls = 0
    ramp = torch.arange(4.0).view(1, 1, 4)
    ds = CachedDataset(base, "memory", transforms=lambda x: _flip(x + ramp))
    torch.manual_seed(0)
    first = [ds[i] for i in range(10)]
    second = [ds[i] for i in range(10)]
    assert base.calls == 10 and (ds.hits, ds.misses) == (10, 10)
    for i in range(10):
        plain = base_items[i][0] + ramp
        for x, y in (first[i], second[i]):
            assert y == i and (torch.equal(x, plain) or torch.equal(x, plain.flip(-1)))
    flips = [not torch.equal(a[0], b[0]) for a, b in zip(first, second)]
    assert any(flips)  # the augmentation is drawn anew, not cached
    assert all(torch.equal(ds._memory[i][0], base_items[i][0]) for i in range(10))  # cached un-augmented
    # a limit keeps what fits; one sample over the limit is an error naming both sizes
    small = CachedDataset(Counting(10), "memory", cache_size=3 * (3 * 8 * 8 * 4 + 24))
    [small[i] for i in range(10)]
    assert len(small._memory) == 3 and small.memory_bytes <= small.cache_size
    with pytest.raises(CacheFullError, match="a sample is 792 bytes, more than cache_size=100"):
        CachedDataset(Counting(2), "memory", cache_size=100)[0]


@pytest.mark.timeout(60)
def test_disk_cache_is_shared_by_workers_and_auto_spills(tmp_path):
    log = str(tmp_path / "decodes.log")
    ds = CachedDataset(Counting(24, log), "disk", tmp_path / "disk", transforms=lambda x: x * 2)
    for _ in range(2):
        loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
        got = sorted(int(y) for _, ys in loader for y in ys)
        assert got == list(range(24))
    assert sorted(int(x) for x in Path(log).read_text().split()) == list(range(24))  # once each, over both passes
    x, y = ds[5]
    assert torch.equal(x, torch.full((3, 8, 8), 10.0)) and y == 5
    sample = 3 * 8 * 8 * 4 + 24
    auto = CachedDataset(Counting(10), "auto", tmp_path / "auto", cache_size=4 * sample)
    [auto[i] for i in range(10)]
    spilled = sorted(int(p.stem) for p in (tmp_path / "auto").glob("*.pkl"))
    assert sorted(auto._memory) == [0, 1, 2, 3] and spilled == list(range(4, 10))
    again = CachedDataset(Counting(10), "auto", tmp_path / "auto", cache_size=4 * sample)
    assert torch.equal(again[7][0], torch.full((3, 8, 8), 7.0)) and again.dataset.calls == 0
    with pytest.raises(ValueError, match="holds the cache of another dataset"):
        CachedDataset(Counting(11), "disk", tmp_path / "auto")
    with pytest.raises(ValueError, match="'memory', 'disk', 'auto'"):
        CachedDataset(Counting(1), "ram")
    with pytest.raises(ValueError, match="needs cache_dir"):
        CachedDataset(Counting(1), "disk")
    with pytest.raises(ValueError, match="needs cache_size"):
        CachedDataset(Counting(1), "auto", tmp_path / "a2")


@pytest.mark.timeout(60)
def test_image_list_reads_a_slow_source_through_the_cache(tmp_path):
    entries = make_images(tmp_path / "nfs", n=6)
    lst = write_list(tmp_path / "train.txt", entries)
    cache = FileCache(tmp_path / "nfs", tmp_path / "local", reader=ThrottledReader(5_000_000))
    ds = ImageListDataset(tmp_path / "nfs", lst, transform=ToTensor(), file_cache=cache)
    plain = ImageListDataset(tmp_path / "nfs", lst, transform=ToTensor())
    for _ in range(2):
        for i in range(len(ds)):
            assert torch.equal(ds[i][0], plain[i][0])
    assert (cache.fetches, cache.hits) == (6, 6)
    # a PIL sample cached, flipped after the cache
    images = ImageListDataset(tmp_path / "nfs", lst)
    flipped = CachedDataset(images, transforms=RandomHorizontalFlip(1.0))
    assert np.array_equal(np.asarray(flipped[0][0]), np.asarray(images[0][0])[:, ::-1])
    assert np.array_equal(np.asarray(flipped._memory[0][0]), np.asarray(images[0][0]))


def test_image_datasets_keep_decoded_images_in_the_cache(tmp_path):
    entries = make_images(tmp_path / "imgs", n=6)
    lst = write_list(tmp_path / "l.txt", entries)
    plain = ImageListDataset(tmp_path / "imgs", lst)
    # the flip runs after the cache: cached images are the plain decode, outputs flipped each time
    ds = ImageListDataset(tmp_path / "imgs", lst, transform=RandomHorizontalFlip(1.0), cache_type="memory")
    for _ in range(2):
        for i in range(6):
            assert np.array_equal(np.asarray(ds[i][0]), np.asarray(plain[i][0])[:, ::-1]) and ds[i][1] == entries[i][1]
    assert ds.cache.misses == 6 and ds.cache.hits == 18
    assert np.array_equal(np.asarray(ds.cache._memory[0][0]), np.asarray(plain[0][0]))
    # cache_transform: the transformed tensor is what is kept (disk), the folder layout read
    folder = ImageFolder(tmp_path / "imgs", transform=ToTensor(), cache_type="disk",
                         cache_dir=tmp_path / "decoded", cache_transform=True, target_transform=lambda y: y + 10)
    x, y = folder[2]
    assert isinstance(x, torch.Tensor) and y == folder.samples[2][1] + 10
    assert len(list((tmp_path / "decoded").glob("*.pkl"))) == 1 and torch.equal(folder[2][0], x)


def test_get_file_through_the_process_cache(tmp_path):
    src = make_source(tmp_path / "src", {"a": 100})
    set_file_cache(None)
    with pytest.raises(RuntimeError, match="set_file_cache"):
        get_file("a")
    with pytest.raises(ValueError, match="both source and cache_dir"):
        get_file("a", source=src)
    cache = FileCache(src, tmp_path / "c")
    set_file_cache(cache)
    try:
        assert get_file("a").read_bytes() == (src / "a").read_bytes() and cache.fetches == 1
    finally:
        set_file_cache(None)


@pytest.mark.timeout(90)
def test_datasets_with_caches_pickle_for_spawned_workers(tmp_path):
    """A DataLoader started with spawn pickles the dataset (its caches and their locks) for
    each worker: the batches are those of the main process, read through both caches."""
    entries = make_images(tmp_path / "nfs", n=5)
    lst = write_list(tmp_path / "l.txt", entries)
    cache = FileCache(tmp_path / "nfs", tmp_path / "local")
    ds = ImageListDataset(tmp_path / "nfs", lst, transform=ToTensor(), file_cache=cache, cache_type="disk",
                          cache_dir=tmp_path / "decoded")
    loader = DataLoader(ds, batch_size=5, num_workers=1, multiprocessing_context="spawn")
    (x, y), = list(loader)
    plain = ImageListDataset(tmp_path / "nfs", lst, transform=ToTensor())
    assert torch.equal(x, torch.stack([plain[i][0] for i in range(5)])) and y.tolist() == [e[1] for e in entries]
    assert len(list((tmp_path / "decoded").glob("*.pkl"))) == 5 and len(list((tmp_path / "local").rglob("*.jpg"))) == 5
    sampler = pickle.loads(pickle.dumps(DistributedSampler(range(9), 2, 1, shuffle=False)))
    assert list(sampler) == [1, 3, 5, 7, 0]


class _Planted:
    """What a stranger leaves in a shared cache directory: runs when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_shared_cache_directory_is_refused_and_its_planted_files_never_load(tmp_path):
    """A cache directory another user owns, or one others may write (mode 0777), may hold files a
    stranger planted: it is refused before anything in it is read; a new one is made 0700."""
    from fleetlike.io.store import UnsafeCacheDirError

    marker = tmp_path / "planted-ran"
    data = [torch.full((3,), float(i)) for i in range(4)]
    shared = tmp_path / "shared"
    shared.mkdir()
    for index in range(4):  # where the disk cache keeps sample i (and a few other guesses)
        for name in (f"{index}.pkl", f".fleetlike-cache/{index}.pkl"):
            (shared / name).parent.mkdir(exist_ok=True)
            (shared / name).write_bytes(pickle.dumps(_Planted(str(marker))))
    shared.chmod(0o777)
    cases = [("others may write", "may be written by group and others (mode 777)")]
    if os.getuid() == 0:  # another owner, as a second user's directory would be
        os.chown(shared, 65534, 65534)
        cases = [("another owner", "belongs to uid 65534")]
    for _, why in cases:
        with pytest.raises(UnsafeCacheDirError, match=re.escape(why)):
            CachedDataset(data, "disk", shared)
        with pytest.raises(UnsafeCacheDirError, match="cache_dir=os.path.expanduser"):
            FileCache(make_source(tmp_path / "src", {"a": 10}), shared)
    os.chown(shared, os.getuid(), os.getgid())
    shared.chmod(0o770)  # ours, but the group may write
    with pytest.raises(UnsafeCacheDirError, match=re.escape("may be written by group (mode 770)")):
        CachedDataset(data, "disk", shared)
    assert not marker.exists()
    fresh = tmp_path / "fresh" / "cache"
    cached = CachedDataset(data, "disk", fresh)
    assert (fresh.stat().st_mode & 0o777) == 0o700
    assert [cached[i].tolist() for i in range(4)] == [d.tolist() for d in data]

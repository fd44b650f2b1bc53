"""Light's ``io`` page, pattern by pattern, with only its import changed: ``files_path_list`` +
``get_file`` (each file fetched once, the bytes the source's), both ``LightDataset`` subclass
patterns (what is cached and what runs on every read), ``ImageFolder(cache_transform=True)``,
``get_data_loader`` in Light's positional and keyword forms and its page's example form, a
``batch_sampler``, ``enable_optimizations=False`` (torch's own DataLoader).

References: torch's DataLoader with torch's DistributedSampler / BatchSampler; the source files;
counters of the reads a dataset really made.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader, Dataset, TensorDataset
from torch.utils.data import DistributedSampler as TorchSampler

import fleetlike as light
from fleetlike.io import light as lio
from fleetlike.io.light import LightDataset


def indexed(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def labels(loader) -> list[list[int]]:
    return [b[1].tolist() for b in loader]


def test_light_io_resolves_after_import_fleetlike_as_light():
    code = "import fleetlike as light; print(light.io.get_data_loader.__module__, light.io.LightDataset.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["fleetlike.io.loader", "LightDataset"]


# ------------------------------------------------------------------ get_data_loader


def test_get_data_loader_lights_order_and_defaults_equal_torch():
    ds = indexed(11)
    for rank in (0, 1):
        torch_order = labels(DataLoader(ds, 3, sampler=TorchSampler(ds, 2, rank, shuffle=False)))
        assert labels(lio.get_data_loader(ds, 2, rank, 3)) == torch_order  # positional: shuffle=False default
        assert labels(lio.get_data_loader(ds, num_replicas=2, rank=rank, batch_size=3)) == torch_order
        assert labels(lio.get_data_loader(ds, 3, num_replicas=2, rank=rank)) == torch_order  # the page's example
        shuffled = labels(DataLoader(ds, 3, sampler=TorchSampler(ds, 2, rank, shuffle=True, seed=0)))
        assert labels(lio.get_data_loader(ds, 2, rank, 3, True)) == shuffled
        # fleetlike's own order keeps its signature; the page's example runs on it too
        assert labels(light.io.get_data_loader(ds, 3, 2, rank, shuffle=False)) == torch_order
        assert labels(light.io.get_data_loader(ds, 3, num_replicas=2, rank=rank, shuffle=False)) == torch_order
    with pytest.raises(TypeError, match=r"missing required argument\(s\) \['rank'\]"):
        lio.get_data_loader(ds, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        lio.get_data_loader(ds, 2, 0, batchsize=3)


def test_enable_optimizations_false_is_torchs_dataloader():
    ds = indexed(10)
    plain = lio.get_data_loader(ds, 2, 1, 4, enable_optimizations=False)
    assert type(plain) is DataLoader and isinstance(plain.sampler, light.io.DistributedSampler)
    assert labels(plain) == labels(DataLoader(ds, 4, sampler=TorchSampler(ds, 2, 1, shuffle=False)))
    assert type(light.io.get_data_loader(ds, 4, 1, 0, enable_optimizations=False)) is DataLoader
    assert isinstance(lio.get_data_loader(ds, 2, 1, 4), light.io.DistributedDataLoader)


def test_light_init_enable_optimizations_picks_the_loader():
    """Light's page: the loader follows light_init's params (False: torch's own DataLoader)."""
    code = (
        "import torch\nfrom torch.utils.data import TensorDataset\nfrom fleetlike import light_init\n"
        "from fleetlike.io import light as lio\nds = TensorDataset(torch.arange(4))\n"
        "def make():\n    return type(lio.get_data_loader(ds, 1, 0, 2)).__name__\n"
        "off = light_init(params={'training_framework': 'pytorch', 'enable_optimizations': False})(make)\n"
        "on = light_init(params={'training_framework': 'pytorch'})(make)\n"
        "print(off(), on(), make())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["DataLoader", "DistributedDataLoader", "DistributedDataLoader"]


def test_batch_sampler_decides_the_batches():
    ds = indexed(10)
    batches = BatchSampler(range(1, 10, 2), 2, drop_last=False)  # this rank's odd indices
    ours = lio.get_data_loader(ds, 2, 1, batch_sampler=batches)
    assert labels(ours) == labels(DataLoader(ds, batch_sampler=batches)) == [[1, 3], [5, 7], [9]]
    with pytest.raises(TypeError, match="BatchSampler, which has no position to save"):
        ours.state_dict()
    assert labels(light.io.get_data_loader(ds, batch_sampler=batches, num_replicas=2, rank=1)) == [[1, 3], [5, 7], [9]]
    with pytest.raises(ValueError, match="batch_size, shuffle cannot be given beside it"):
        light.io.get_data_loader(ds, 4, 2, 1, shuffle=True, batch_sampler=batches)


# ------------------------------------------------------------------ files_path_list + get_file


class FileDataset(Dataset):
    """Light's raw-file cache pattern, as its page writes it (only the import changed)."""

    def __init__(self, transform, files_path_list):
        self.transform = transform
        self.files_path_list = files_path_list

    def __len__(self):
        return len(self.files_path_list)

    def __getitem__(self, index):
        sample_path = light.io.get_file(self.files_path_list[index])
        sample = np.frombuffer(sample_path.read_bytes(), dtype=np.uint8).copy()
        return self.transform(sample), str(sample_path)


def test_files_path_list_and_get_file_cache_each_file_once(tmp_path, monkeypatch):
    src = tmp_path / "ceph" / "data"
    (src / "sub").mkdir(parents=True)
    files = []
    for k in range(6):
        path = src / ("sub" if k % 2 else "") / f"f{k}.bin"
        path.write_bytes(bytes([k]) * (10 + k))
        files.append(str(path))
    monkeypatch.setenv("FLEETLIKE_FILE_CACHE_DIR", str(tmp_path / "local"))
    dataset = FileDataset(torch.from_numpy, files)
    seen = {}
    for rank in (0, 1):
        loader = light.io.get_data_loader(dataset, 1, num_replicas=2, rank=rank, shuffle=False, num_workers=2)
        for epoch in (0, 1):
            for x, where in loader:
                seen.setdefault(int(x[0, 0]), set()).add(where[0])
    assert sorted(seen) == list(range(6))
    for k, where in seen.items():
        (local,) = where  # every read of file k went to one local copy
        assert str(tmp_path / "local") in local and open(local, "rb").read() == open(files[k], "rb").read()
    # a spawned worker inherits no module state: the loader hands it the dataset's cache
    spawned = light.io.get_data_loader(dataset, 1, 1, 0, shuffle=False, num_workers=1,
                                       multiprocessing_context="spawn")
    got = [(int(x[0, 0]), where[0]) for x, where in spawned]
    assert [k for k, _ in got] == list(range(6)) and all(str(tmp_path / "local") in w for _, w in got)
    cache = light.io.files_cache(files)
    assert cache.source == src.resolve()
    assert cache.get_file(files[3]).read_bytes() == bytes([3]) * 13 and cache.fetches == 0  # all cached


# ------------------------------------------------------------------ LightDataset


class Counter:
    """A transform that counts its calls and adds its call number (random augmentation's stand-in)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x + 1000 * self.calls


class RawCached(LightDataset):
    """Light's first pattern: the transform goes to the parent, the raw sample is cached."""

    def __init__(self, n, transform):
        super(RawCached, self).__init__(cache_type="auto", transforms=transform)
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.reads += 1
        return torch.tensor([index]), index


class TransformedCached(LightDataset):
    """Light's second pattern: the subclass transforms, the transformed sample is cached."""

    def __init__(self, n, transform):
        self.transform = transform
        super(TransformedCached, self).__init__(cache_type="auto")
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.reads += 1
        sample = torch.tensor([index])
        return self.transform(sample), index


def test_lightdataset_first_pattern_caches_raw_and_transforms_every_read():
    t = Counter()
    ds = RawCached(5, t)
    first = [ds[i] for i in range(5)]
    again = [ds[i] for i in range(5)]
    assert ds.reads == 5 and t.calls == 10  # read once, transformed every time
    assert [int(x) for x, _ in first] == [i + 1000 * (i + 1) for i in range(5)]
    assert [int(x) for x, _ in again] == [i + 1000 * (i + 6) for i in range(5)]
    assert ds.cache.hits == 5 and ds.cache.misses == 5
    loader = lio.get_data_loader(ds, 1, 0, 5)  # through Light's loader too
    assert labels(loader) == [[0, 1, 2, 3, 4]] and ds.reads == 5


def test_lightdataset_second_pattern_caches_the_transformed_sample():
    t = Counter()
    ds = TransformedCached(4, t)
    first = [int(ds[i][0]) for i in range(4)]
    assert [int(ds[i][0]) for i in range(4)] == first == [i + 1000 * (i + 1) for i in range(4)]
    assert ds.reads == 4 and t.calls == 4


def test_lightdataset_fields_and_its_tables_call():
    class Table(LightDataset):
        def __init__(self):
            super(Table, self).__init__(self, cache_type="auto", transforms=None)  # the page's table writes `self`

        def __len__(self):
            return 3

        def __getitem__(self, index):
            return index * 2

    ds = Table()
    assert [ds[i] for i in range(3)] == [0, 2, 4] and ds.cache.cache_type.value == "auto"

    class Uncached(RawCached):
        def __init__(self):
            LightDataset.__init__(self, need_cache=False, transforms=lambda x: -x)
            self.n, self.reads = 2, 0

    u = Uncached()
    assert int(u[1][0]) == -1 and int(u[1][0]) == -1 and u.reads == 2 and u.cache is None

    class Forgot(LightDataset):
        def __init__(self):
            self.n = 1

        def __getitem__(self, index):
            return index

    with pytest.raises(TypeError, match="did not call LightDataset.__init__"):
        Forgot()[0]
    with pytest.raises(TypeError, match="takes keyword arguments"):
        LightDataset("auto")
    with pytest.raises(ValueError, match="cache_type='ssd' is not a cache type"):
        LightDataset(cache_type="ssd")


# ------------------------------------------------------------------ ImageFolder


class Tag:
    def __init__(self):
        self.calls = 0

    def __call__(self, image):
        self.calls += 1
        return torch.from_numpy(np.asarray(image).copy())


def test_imagefolder_cache_transform_caches_by_default(tmp_path):
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (6, 5, 3), dtype=np.uint8)).save(tmp_path / c / f"{i}.png")
    for folder in (light.io.ImageFolder, lio.ImageFolder):
        t = Tag()
        dataset = folder(tmp_path, transform=t, cache_transform=True)
        first = [dataset[i][0] for i in range(4)]
        second = [dataset[i][0] for i in range(4)]
        assert t.calls == 4 and dataset.cache.hits == 4  # transformed once, then served from the cache
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        assert torch.equal(first[0], torch.from_numpy(np.array(Image.open(tmp_path / "a" / "0.png"))))
    t = Tag()
    lights = lio.ImageFolder(tmp_path, transform=t)  # Light's caches the decoded image, transforms every read
    [lights[i] for i in range(4)] + [lights[i] for i in range(4)]
    assert t.calls == 8 and lights.cache.hits == 4
    assert light.io.ImageFolder(tmp_path).cache is None  # fleetlike's own: no cache unless asked

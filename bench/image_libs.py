"""The same JPEGs in other libraries' packed formats, read as ``bench.image_input`` reads its rows.

Why a module of its own: each library is optional (the ``bench-io`` extra), so each row is built
only when its package imports, and a missing one is a printed reason, never a failed bench. Each
library writes the images with its own writer and reads them with its own loader, ``workers``
loader workers, batch ``batch``, decoded and transformed by `decode_sample` (what the fleetlike
datasets do per sample: `Decoder.array` + ``PILToTensor``), so the rows differ only in how the
bytes reach the decoder.

- **WebDataset**: tar shards (``key.jpg`` + ``key.cls``), ``webdataset.WebDataset`` split over the
  workers, batched in the workers, torch's ``DataLoader`` with ``batch_size=None``;
- **litdata**: chunks written by ``litdata.streaming.writer.BinaryWriter`` (``{"jpg": bytes,
  "cls": int}``), read in place by ``litdata.StreamingDataset`` + ``StreamingDataLoader``;
- **mosaicml-streaming**: tried; ``import streaming`` imports torchvision at package import, so it
  is a row only where both import (the reason is printed otherwise).

Example:
    >>> modes, skipped = library_modes(data, entries, tag="2000_224", workers=2, batch=64, shards=8, count=count)
    >>> sorted(modes)    # {"WebDataset, cold", "WebDataset, warm", "litdata, cold", ...}
"""

from __future__ import annotations

import importlib
import io as _io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from fleetlike.io import Decoder, PILToTensor
from fleetlike.io.transforms import takes_arrays

__all__ = ["DecodeSample", "decode_sample", "drop_cache", "library_modes", "write_shards", "write_litdata"]


class DecodeSample:
    """``transform(decoded bytes)`` as the fleetlike datasets do it: straight from the decoder's
    array where the transform takes arrays, else through the PIL image."""

    def __init__(self, transform: Callable[[Any], Any], decoder: str = "auto") -> None:
        self.transform, self.decoder = transform, Decoder(decoder)
        self.arrays = takes_arrays(transform)

    def __call__(self, data: bytes | memoryview) -> Any:
        return self.transform(self.decoder.array(data) if self.arrays else self.decoder(data))


#: every row's per-sample work: decode + ``PILToTensor``
decode_sample = DecodeSample(PILToTensor())


def drop_cache(paths: list[Path]) -> None:
    """Drop ``paths``' pages from the page cache (the next read goes to the disk)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _wds_decode(sample: tuple[bytes, bytes]) -> tuple[torch.Tensor, int]:
    return decode_sample(sample[0]), int(sample[1])


def _litdata_decode(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return decode_sample(sample["jpg"]), int(sample["cls"])


def write_shards(folder: Path, entries: list[tuple[Path, int]], shards: int) -> list[Path]:
    """The JPEGs in ``shards`` tar files (webdataset's layout: key.jpg + key.cls)."""
    paths = [folder / f"shard-{i:04d}.tar" for i in range(shards)]
    if all(p.exists() for p in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    for i, path in enumerate(paths):
        with tarfile.open(path, "w") as tar:
            for k in range(i, len(entries), shards):
                image, label = entries[k]
                for suffix, data in ((".jpg", image.read_bytes()), (".cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{k:06d}{suffix}")
                    info.size = len(data)
                    tar.addfile(info, _io.BytesIO(data))
    return paths


def write_litdata(folder: Path, entries: list[tuple[Path, int]], chunk_bytes: int) -> list[Path]:
    """The JPEGs (bytes, not re-encoded) and labels in litdata's chunks, by its ``BinaryWriter``;
    returns the files a reader opens (chunks and ``index.json``)."""
    from litdata.streaming.writer import BinaryWriter

    if not (folder / "index.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        writer = BinaryWriter(str(folder), chunk_bytes=chunk_bytes)
        for k, (image, label) in enumerate(entries):
            writer[k] = {"jpg": image.read_bytes(), "cls": label}
        writer.done()
        writer.merge()
    return sorted(folder.glob("*.bin")) + [folder / "index.json"]


def _import(name: str) -> tuple[Any, str | None]:
    """The module, or ``None`` and why not (an absent package, or one that fails at import)."""
    try:
        return importlib.import_module(name), None
    except Exception as error:  # a broken dependency raises other than ImportError (torchvision's RuntimeError)
        return None, f"{type(error).__name__}: {error}".splitlines()[0][:200]


def library_modes(data: Path, entries: list[tuple[Path, int]], *, tag: str, workers: int, batch: int,
                  shards: int, count: Callable[[Any], int]) -> tuple[dict[str, Callable[[], int]], dict[str, str]]:
    """``({row name: one pass, returning the images read}, {library: why it has no row})``.

    ``data``: the folder the formats are written under (kept between runs); ``entries``: the
    JPEG files and labels; ``tag``: names the formats' folders (``wds_<tag>``, ``litdata_<tag>``);
    ``shards``: how many files each format splits the images over."""
    modes: dict[str, Callable[[], int]] = {}
    skipped: dict[str, str] = {}

    wds, why = _import("webdataset")
    if wds is None:
        skipped["webdataset"] = str(why)
    else:
        tars = write_shards(data / f"wds_{tag}", entries, shards)

        def wds_pass() -> int:
            ds = wds.WebDataset([str(s) for s in tars], shardshuffle=False, empty_check=False) \
                .to_tuple("jpg", "cls").map(_wds_decode).batched(batch)
            return count(DataLoader(ds, batch_size=None, num_workers=workers))

        modes["WebDataset, cold"] = lambda: (drop_cache(tars), wds_pass())[1]
        modes["WebDataset, warm"] = wds_pass

    litdata, why = _import("litdata")
    if litdata is None:
        skipped["litdata"] = str(why)
    else:
        total = sum(path.stat().st_size for path, _ in entries)
        chunks = write_litdata(data / f"litdata_{tag}", entries, chunk_bytes=-(-total // shards) + (1 << 16))

        def litdata_pass() -> int:
            ds = litdata.StreamingDataset(str(chunks[-1].parent), transform=_litdata_decode)
            return count(litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers))

        modes["litdata, cold"] = lambda: (drop_cache(chunks), litdata_pass())[1]
        modes["litdata, warm"] = litdata_pass

    streaming, why = _import("streaming")
    skipped["mosaicml-streaming"] = (
        f"{why}; it is not in the bench-io extra: mosaicml-streaming 0.13 pins numpy<2.2, and its package "
        "imports torchvision at import, whose build must match torch's exactly" if streaming is None else
        "it imports, but this bench writes no row for it")
    for name, reason in skipped.items():
        print(f"bench.image_input: no {name} row: {reason}")
    return modes, skipped

"""TI-ACC's packed image input: `IndexTFRDataset` reads images from TFRecord files by an index.

Why: a folder of small JPEGs costs an open, a read and a close per image, and a cold one a
disk seek each; TI-ACC measured ResNet-50 input at 5x once images were packed. Here the images
are ``tf.train.Example`` records (``image/encoded`` bytes and ``image/class/label``) in standard
TFRecord files, and an *index* holds one line per sample, ``file offset length label``: any
sample is one ``pread`` away, so the dataset is map-style and fleetlike's resumable sampler,
rank sharding and shuffling work on it unchanged.

The index (``<name>.index``, written by ``python -m fleetlike.io.tools.img2tfrecord`` or by
`build_index` for TFRecord files written elsewhere)::

    # fleetlike tfrecord index v1: file offset length label
    train-00000-of-00002.tfrecord 0 18427 0
    train-00000-of-00002.tfrecord 18427 19011 3

``file`` is relative to ``tfrecord_dir``; ``length`` is the framed record's. Every line is checked
when the dataset is built (a line that does not parse, a file that is missing, a record that ends
past its file: the index file and line number), every record when it is read (length, checksums,
the label against the index's: the record file and its offset).

``readahead_block=k``: read under the sampler's block shuffle (`DistributedSampler`
``block_size=k``, which `get_data_loader` then picks by itself), the first read of a block of
``k`` consecutive samples asks the kernel for the whole block's bytes (`BlockReadahead`), so on
storage that charges per read a block costs a few large reads instead of ``k`` small ones. The
records returned are the same. Through `get_data_loader` the hints go ahead of the reads: the
loader's process hints each block once per pass, one window (of the rank's share) before its
first sample is handed to a worker (`HintingSampler`), so the next window arrives while the
current one is decoded.

``dataset_type="coco"`` records (``img2tfrecord --dataset_type coco``) carry a detection target:
the dataset returns ``(image, {"image_id", "boxes" (N x 4, xywh), "labels" (N)})``.

Example:
    >>> train = IndexTFRDataset("./tfrecord_train_path", "./tfrecord_train_path/train.index",
    ...                         transforms.Compose([RandomResizedCrop(224), ToTensor()]))
    >>> image, label = train[0]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from fleetlike.comm import parse_choice
from fleetlike.io.datasets import ImageReadError, OnError
from fleetlike.io.decode import ARRAY_MODES, Decoder, DecoderName
from fleetlike.io.example import ExampleError, Feature, Kind, decode_example
from fleetlike.io.loader import Skipped
from fleetlike.io.readahead import BlockReadahead
from fleetlike.io.records import RecordError, iter_records, parse_record
from fleetlike.io.transforms import takes_arrays

__all__ = ["BBOX_KEY", "COCO_LABELS_KEY", "IMAGE_ID_KEY", "IMAGE_KEY", "INDEX_HEADER", "LABEL_KEY",
           "IndexEntry", "IndexTFRDataset", "build_index", "read_index", "write_index"]

IMAGE_KEY = "image/encoded"
LABEL_KEY = "image/class/label"
IMAGE_ID_KEY = "image/id"
BBOX_KEY = "image/object/bbox"
COCO_LABELS_KEY = "image/object/class/label"
INDEX_HEADER = "# fleetlike tfrecord index v1: file offset length label"

#: one index line: (record file relative to the directory, offset, framed length, label)
IndexEntry = tuple[str, int, int, int]


def write_index(path: str | os.PathLike[str], entries: Iterable[IndexEntry]) -> int:
    """Write ``entries`` to the index ``path`` (atomically: a reader never sees half); the count."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    count = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(INDEX_HEADER + "\n")
        for name, offset, length, label in entries:
            if any(c.isspace() for c in name):
                raise ValueError(f"write_index: record file name {name!r} contains whitespace; an index line "
                                 "is space-separated")
            fh.write(f"{name} {offset} {length} {label}\n")
            count += 1
    os.replace(tmp, path)
    return count


def read_index(path: str | os.PathLike[str]) -> list[IndexEntry]:
    """The entries of an index file; a line that does not parse raises naming file and line."""
    entries = []
    with open(path, encoding="utf-8", errors="strict") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 4:
                raise ValueError(f"{os.fspath(path)}:{lineno}: cannot parse {line!r}: expected 'file offset "
                                 "length label' (4 fields)")
            name, *numbers = parts
            try:
                offset, length, label = (int(n) for n in numbers)
            except ValueError:
                raise ValueError(f"{os.fspath(path)}:{lineno}: {line!r}: offset, length and label must be "
                                 "integers") from None
            if offset < 0 or length <= 0:
                raise ValueError(f"{os.fspath(path)}:{lineno}: {line!r}: offset must be >= 0 and length > 0")
            pure = Path(name)
            if pure.is_absolute() or ".." in pure.parts:
                raise ValueError(f"{os.fspath(path)}:{lineno}: record file {name!r} leaves tfrecord_dir; "
                                 "name files relative to it")
            entries.append((name, offset, length, label))
    return entries


def _label_of(features: dict[str, Feature], key: str) -> int | None:
    feature = features.get(key)
    if feature is None or feature.kind is not Kind.INT64 or not feature.values:
        return None
    return int(feature.values[0])


def build_index(tfrecord_dir: str | os.PathLike[str], files: Sequence[str], index_file: str | os.PathLike[str],
                label_key: str = LABEL_KEY) -> int:
    """Index TFRecord ``files`` (names in ``tfrecord_dir``) written by any tool: each record's
    place and its ``label_key`` int64 feature (a record without one raises). The count."""
    def entries() -> Iterable[IndexEntry]:
        for name in files:
            path = Path(tfrecord_dir) / name
            for offset, length, data in iter_records(path):
                try:
                    label = _label_of(decode_example(data), label_key)
                except ExampleError as error:
                    raise RecordError(f"{path}: record at offset {offset} is not a tf.train.Example: {error}") from None
                if label is None:
                    raise RecordError(f"{path}: record at offset {offset} has no int64 feature {label_key!r}; "
                                      "pass label_key= the feature that holds the label")
                yield name, offset, length, label
    return write_index(index_file, entries())


class IndexTFRDataset(Dataset[Any]):
    """``(transform(image), label)`` of each sample of a TFRecord index (module docstring).

    ``tfrecord_dir``: the folder of the record files; ``tfrecord_file``: the index (a path, or a
    name inside ``tfrecord_dir``). ``decoder``: ``auto`` (simplejpeg when installed, else
    Pillow), ``pillow`` or ``simplejpeg``; ``verify``: check the record checksums (CRC-32C) on
    every read; ``on_error``: ``raise``, or ``skip`` (a `Skipped`, counted by the loader);
    ``readahead_block``: records per block read ahead (module docstring; None: none).
    """

    def __init__(self, tfrecord_dir: str | os.PathLike[str], tfrecord_file: str | os.PathLike[str],
                 transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, *, image_key: str = IMAGE_KEY,
                 label_key: str = LABEL_KEY, decoder: DecoderName | str = DecoderName.AUTO, mode: str = "RGB",
                 verify: bool = True, on_error: OnError | str = OnError.RAISE,
                 readahead_block: int | None = None) -> None:
        self.tfrecord_dir = Path(tfrecord_dir)
        if not self.tfrecord_dir.is_dir():
            raise FileNotFoundError(f"IndexTFRDataset: tfrecord_dir {str(self.tfrecord_dir)!r} is not a directory")
        index = Path(tfrecord_file)
        if not index.is_file() and (self.tfrecord_dir / index).is_file():
            index = self.tfrecord_dir / index
        if not index.is_file():
            raise FileNotFoundError(f"IndexTFRDataset: index {str(tfrecord_file)!r} does not exist (neither as a "
                                    f"path nor inside {str(self.tfrecord_dir)!r}); write it with "
                                    "python -m fleetlike.io.tools.img2tfrecord")
        self.index_file = index
        self.transform, self.target_transform = transform, target_transform
        self.image_key, self.label_key, self.verify = image_key, label_key, bool(verify)
        self.decoder = Decoder(decoder, mode)
        self.on_error = parse_choice(OnError, on_error, what="on_error", noun="error policy")
        entries = read_index(index)
        if not entries:
            raise ValueError(f"IndexTFRDataset: index {str(index)!r} lists no records")
        self.files: list[str] = sorted({e[0] for e in entries})
        file_id = {name: i for i, name in enumerate(self.files)}
        self._file = np.array([file_id[e[0]] for e in entries], dtype=np.int32)
        self._offset = np.array([e[1] for e in entries], dtype=np.int64)
        self._length = np.array([e[2] for e in entries], dtype=np.int64)
        self._label = np.array([e[3] for e in entries], dtype=np.int64)
        self._paths = [self.tfrecord_dir / name for name in self.files]
        self._check_files()
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        self.readahead_block = readahead_block
        self._readahead = None if readahead_block is None else \
            BlockReadahead(self._file, self._offset, self._length, readahead_block)

    def _check_files(self) -> None:
        ends = self._offset + self._length
        sizes = np.zeros(len(self.files), dtype=np.int64)
        for fid, name in enumerate(self.files):
            path = self.tfrecord_dir / name
            if not path.is_file():
                first = int(np.argmax(self._file == fid))
                raise FileNotFoundError(f"{self.index_file}: record file {str(path)!r} (sample {first}) "
                                        "does not exist")
            sizes[fid] = path.stat().st_size
        past = np.flatnonzero(ends > sizes[self._file])  # one pass over the samples, whatever the file count
        if past.size:
            i = int(past[0])
            path, size = self.tfrecord_dir / self.files[int(self._file[i])], int(sizes[self._file[i]])
            raise RecordError(f"{self.index_file}: sample {i} points past the end of {path}: offset "
                              f"{int(self._offset[i])} + length {int(self._length[i])} > file size {size}; "
                              "the record file is truncated or the index belongs to another file")

    def __len__(self) -> int:
        return len(self._label)

    @property
    def targets(self) -> list[int]:
        """The label of every sample, from the index (no record read)."""
        return self._label.tolist()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fds"] = {}  # a DataLoader worker opens its own descriptors
        return state

    def _fd(self, fid: int) -> int:
        if self._pid != os.getpid():  # forked: the parent's descriptors share its file offsets
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(fid)
        if fd is None:
            fd = self._fds[fid] = os.open(self._paths[fid], os.O_RDONLY)
        return fd

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for fd in getattr(self, "_fds", {}).values():
                try:
                    os.close(fd)
                except OSError:
                    pass

    def hint_ahead(self, index: int | None) -> bool:
        """Hint the block of sample ``index`` to the kernel, once per pass, from the calling
        process (`HintingSampler`, which `get_data_loader` puts in front of the sampler, calls it
        in the loader's process ahead of the reads; the workers then hint nothing). ``None``: a
        pass starts or ends, the blocks hinted are forgotten and this process's descriptors
        closed (a pass holds no file open after it, so the files can be unmounted or replaced).
        Whether it hinted (False without ``readahead_block``)."""
        if self._readahead is None:
            return False
        self._readahead.driven = True
        if index is None:
            self._readahead.forget()
            self._close_files()
            return False
        return self._readahead.hint(index % len(self), self._fd)

    def _close_files(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds, self._pid = {}, os.getpid()

    def location(self, index: int) -> tuple[Path, int, int]:
        """``(record file, offset, framed length)`` of sample ``index``."""
        return (self._paths[int(self._file[index])], int(self._offset[index]), int(self._length[index]))

    def record(self, index: int) -> dict[str, Feature]:
        """The decoded ``tf.train.Example`` of sample ``index``; `RecordError` names file and offset."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"IndexTFRDataset: index {index} out of range for {len(self)} samples")
        index %= len(self)
        fid, offset, length = int(self._file[index]), int(self._offset[index]), int(self._length[index])
        path = self._paths[fid]
        if self._readahead is not None:
            self._readahead.touch(index, self._fd)  # nothing when the loader hints ahead (hint_ahead)
        raw = os.pread(self._fd(fid), length, offset)
        data = parse_record(raw, path, offset, self.verify)
        try:
            features = decode_example(data)
        except ExampleError as error:
            raise RecordError(f"{path}: record at offset {offset} (sample {index}) is not a tf.train.Example: "
                              f"{error}") from None
        label = _label_of(features, self.label_key)
        if label is not None and label != self._label[index]:
            raise RecordError(f"{path}: record at offset {offset} (sample {index}) has label {label}, the index "
                              f"{self.index_file} says {int(self._label[index])}; the index belongs to other files")
        return features

    def _target(self, index: int, features: dict[str, Feature]) -> Any:
        if BBOX_KEY not in features:
            return int(self._label[index])
        boxes = torch.tensor(features[BBOX_KEY].values, dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor(features.get(COCO_LABELS_KEY, Feature(Kind.INT64, [])).values, dtype=torch.int64)
        return {"image_id": int(self._label[index]), "boxes": boxes, "labels": labels}

    def load(self, index: int, array: bool = False) -> tuple[Any, Any]:
        """``(decoded image, target)`` of sample ``index``, before the transforms (the image as an
        ``H x W x C`` uint8 array with ``array``: `Decoder.array`)."""
        features = self.record(index)
        image = features.get(self.image_key)
        if image is None or image.kind is not Kind.BYTES or len(image.values) != 1:
            path, offset, _ = self.location(index)  # here, not per sample: a bad record's place
            raise RecordError(f"{path}: record at offset {offset} (sample {index}) has no single bytes feature "
                              f"{self.image_key!r} (features: {sorted(features)}); pass image_key=")
        try:
            data = image.values[0]
            decoded = self.decoder.array(data) if array else self.decoder(data)
        except (OSError, ValueError) as error:
            path, offset, _ = self.location(index)
            raise ImageReadError(f"{path}: record at offset {offset} (sample {index}): the image does not "
                                 f"decode: {error}") from error
        return decoded, self._target(index, features)

    def __getitem__(self, index: int) -> Any:
        try:
            image, target = self.load(index, self.decoder.mode in ARRAY_MODES and takes_arrays(self.transform))
        except (RecordError, ImageReadError) as error:
            if self.on_error is OnError.SKIP:
                path, _, _ = self.location(index % len(self))
                return Skipped(index, str(path), str(error))
            raise
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

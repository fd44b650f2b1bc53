"""``python -m fleetlike.io.tools.img2tfrecord``: TI-ACC's ``img2tfrecord.py``.

Packs the images of a list into TFRecord files and writes their index, read by
`fleetlike.io.IndexTFRDataset`:

- ``--dataset_type ImageFold``: ``--img_list`` is ``relative/path label`` lines (``image_list``'s
  output); each record holds the file's bytes as they are (``image/encoded``, not re-encoded)
  and ``image/class/label``.
- ``--dataset_type coco``: ``--img_list`` is a COCO annotation file (``instances_*.json``); each
  record holds the image, ``image/id``, ``image/filename``, its boxes ``image/object/bbox``
  (x, y, w, h per box) and ``image/object/class/label`` (category ids); the index label is the
  image id.

Writes ``<out_dir>/<tfrecords_name>-NNNNN-of-MMMMM.tfrecord`` (``--num_files`` files, default
``max(1, --workers)``; ``--workers`` threads write them side by side) and the index
``<out_dir>/<tfrecords_name>.index`` (``--out_dir`` defaults to the current folder). Outputs are
written under a temporary name and renamed when complete; an output that is one of the inputs is
refused. A bad list line or a missing image stops the tool with the list file and line.

Example:
    $ python -m fleetlike.io.tools.img2tfrecord --img_dir val_demo --img_list val_list \\
          --tfrecords_name val_demo --dataset_type ImageFold --workers 4
    packed 50000 images (6.4 GB) into 4 files; index ./val_demo.index
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fleetlike.comm import parse_choice
from fleetlike.io.datasets import read_image_list
from fleetlike.io.example import Feature, Kind, encode_example
from fleetlike.io.records import RecordWriter
from fleetlike.io.tfrecord import (
    BBOX_KEY,
    COCO_LABELS_KEY,
    IMAGE_ID_KEY,
    IMAGE_KEY,
    LABEL_KEY,
    IndexEntry,
    write_index,
)
from fleetlike.io.tools.image_list import refuse_overwrite, run_tool

__all__ = ["DatasetType", "Sample", "img2tfrecord", "main"]


class DatasetType(str, enum.Enum):
    """TI-ACC's two list layouts."""

    IMAGEFOLD = "ImageFold"
    COCO = "coco"


#: one image to pack: (path relative to img_dir, where it was listed, index label, extra features)
Sample = tuple[str, str, int, dict[str, Any]]


def _list_lines(img_list: Path) -> list[int]:
    """The line numbers of the non-blank lines (``read_image_list`` skips blank lines)."""
    with open(img_list, "rb") as fh:
        return [n for n, line in enumerate(fh, 1) if line.strip()]


def _imagefold(img_list: Path) -> list[Sample]:
    entries = read_image_list(img_list)
    lines = _list_lines(img_list)
    return [(path, f"{img_list}:{line}", label, {LABEL_KEY: label}) for (path, label), line in zip(entries, lines)]


def _coco(img_list: Path) -> list[Sample]:
    try:
        data = json.loads(img_list.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{img_list}: --dataset_type coco reads a COCO annotation file (JSON): {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(f"{img_list}: a COCO annotation file has an 'images' list; this one has none")
    boxes: dict[int, list[tuple[list[float], int]]] = {}
    for k, ann in enumerate(data.get("annotations", [])):
        try:
            bbox = [float(v) for v in ann["bbox"]]
            boxes.setdefault(int(ann["image_id"]), []).append((bbox, int(ann["category_id"])))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{img_list}: annotations[{k}]: needs image_id, bbox (4 numbers) and "
                             f"category_id: {error!r}") from None
        if len(bbox) != 4:
            raise ValueError(f"{img_list}: annotations[{k}]: bbox has {len(bbox)} numbers, not 4 (x, y, w, h)")
    samples: list[Sample] = []
    for k, image in enumerate(data["images"]):
        try:
            image_id, name = int(image["id"]), str(image["file_name"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{img_list}: images[{k}]: needs id and file_name: {error!r}") from None
        mine = boxes.get(image_id, [])
        extra = {IMAGE_ID_KEY: image_id, "image/filename": name.encode("utf-8"),
                 BBOX_KEY: Feature(Kind.FLOAT, [v for b, _ in mine for v in b]),
                 COCO_LABELS_KEY: Feature(Kind.INT64, [c for _, c in mine])}
        samples.append((name, f"{img_list}: images[{k}]", image_id, extra))
    return samples


def _read(root: Path, sample: Sample) -> bytes:
    path = root / sample[0]
    try:
        data = path.read_bytes()
    except OSError as error:
        raise FileNotFoundError(f"{sample[1]}: image {str(path)!r} cannot be read: {error.strerror or error}") from None
    if not data:
        raise ValueError(f"{sample[1]}: image {str(path)!r} is empty")
    return data


def _write_file(root: Path, samples: Sequence[Sample], target: Path, name: str) -> tuple[list[IndexEntry], int]:
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    entries: list[IndexEntry] = []
    total = 0
    try:
        with RecordWriter(tmp) as writer:
            for sample in samples:
                data = _read(root, sample)
                total += len(data)
                offset, length = writer.write(encode_example({IMAGE_KEY: data, **sample[3]}))
                entries.append((name, offset, length, sample[2]))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    return entries, total


def img2tfrecord(img_dir: str | os.PathLike[str], img_list: str | os.PathLike[str], tfrecords_name: str,
                 dataset_type: DatasetType | str = DatasetType.IMAGEFOLD, workers: int = 0,
                 out_dir: str | os.PathLike[str] = ".", num_files: int | None = None) -> tuple[int, int, list[Path], Path]:
    """Pack the list; ``(images, image bytes, record files, index file)`` (module docstring)."""
    root, listing, out = Path(img_dir), Path(img_list), Path(out_dir)
    kind = parse_choice(DatasetType, dataset_type, what="--dataset_type", noun="dataset type")
    if not root.is_dir():
        raise FileNotFoundError(f"img2tfrecord: --img_dir {str(root)!r} is not a directory")
    if not listing.is_file():
        raise FileNotFoundError(f"img2tfrecord: --img_list {str(listing)!r} does not exist")
    if not tfrecords_name or any(c in tfrecords_name for c in "/\\") or any(c.isspace() for c in tfrecords_name):
        raise ValueError(f"img2tfrecord: --tfrecords_name {tfrecords_name!r} must be a plain name (no folder, no "
                         "spaces); the folder is --out_dir")
    if workers < 0:
        raise ValueError(f"img2tfrecord: --workers {workers}; it must be >= 0 (0: one thread)")
    files = max(1, workers) if num_files is None else num_files
    if files < 1:
        raise ValueError(f"img2tfrecord: --num_files {files}; it must be >= 1")
    samples = _imagefold(listing) if kind is DatasetType.IMAGEFOLD else _coco(listing)
    if not samples:
        raise ValueError(f"img2tfrecord: {str(listing)!r} lists no image")
    files = min(files, len(samples))
    names = [f"{tfrecords_name}-{i:05d}-of-{files:05d}.tfrecord" for i in range(files)]
    index_file = out / f"{tfrecords_name}.index"
    inputs = {listing.resolve()} | {(root / s[0]).resolve() for s in samples}
    refuse_overwrite([out / n for n in names] + [index_file], inputs, "img2tfrecord")
    out.mkdir(parents=True, exist_ok=True)
    base, extra = divmod(len(samples), files)
    blocks, start = [], 0
    for i in range(files):
        stop = start + base + (1 if i < extra else 0)
        blocks.append(samples[start:stop])
        start = stop
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda i: _write_file(root, blocks[i], out / names[i], names[i]), range(files)))
    write_index(index_file, [e for entries, _ in results for e in entries])
    return len(samples), sum(t for _, t in results), [out / n for n in names], index_file


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetlike.io.tools.img2tfrecord",
                                     description="Pack the images of a list into TFRecord files and an index.")
    parser.add_argument("--img_dir", required=True, help="the folder the list's paths are relative to")
    parser.add_argument("--img_list", required=True, help="ImageFold: 'path label' lines; coco: the annotation JSON")
    parser.add_argument("--tfrecords_name", required=True, help="name of the record files and of <name>.index")
    parser.add_argument("--dataset_type", required=True, choices=[t.value for t in DatasetType])
    parser.add_argument("--workers", type=int, default=0, help="threads writing files side by side (default 0: one)")
    parser.add_argument("--num_files", type=int, default=None, help="record files to write (default max(1, workers))")
    parser.add_argument("--out_dir", default=".", help="where to write (default: the current folder)")
    args = parser.parse_args(argv)

    def work() -> str:
        count, size, written, index = img2tfrecord(args.img_dir, args.img_list, args.tfrecords_name,
                                                   args.dataset_type, args.workers, args.out_dir, args.num_files)
        return f"packed {count} images ({size / 1e6:.1f} MB) into {len(written)} files; index {index}"

    return run_tool("img2tfrecord", work)


if __name__ == "__main__":
    sys.exit(main())

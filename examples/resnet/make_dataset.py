#!/usr/bin/env python
"""Write an ImageNet-format folder (seed 003's layout) from scikit-learn's handwritten digits.

scikit-learn ships 1797 real 8x8 images of the digits 0-9; they are upscaled (bicubic) to
``--size`` pixels, saved as RGB JPEGs, and split deterministically (every ``--val_every``-th
image of each class goes to validation), so the ResNet example, its tests and its benchmark need
no download:

    ImageNet-digits
    |-- train/digit_0/digit_0_0000.jpeg ...      (one folder per class)
    |-- val/val_00000.jpeg ...
    |-- train.txt                                ("digit_0/digit_0_0000.jpeg 0" per line)
    `-- val.txt                                  ("val_00000.jpeg 7" per line)

    python examples/resnet/make_dataset.py --out ./ImageNet-digits
    python examples/resnet/make_dataset.py --out /tmp/tiny --train_per_class 20 --size 16

Writing is atomic (a temporary sibling renamed into place), and an existing complete folder made
with the same settings is kept as it is, so every command can start with this one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["make_digits", "main"]

_MARK = "digits.json"


def _positive(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name}={text!r} is not an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"--{name}={value} must be >= 1")
        return value
    return parse


def _image(pixels: np.ndarray, size: int) -> Image.Image:
    """An 8x8 array of 0..16 -> a ``size`` x ``size`` RGB image (white digit on black)."""
    gray = Image.fromarray((pixels * (255.0 / 16.0)).round().astype(np.uint8), mode="L")
    return gray.resize((size, size), Image.BICUBIC).convert("RGB")


def make_digits(out: str | os.PathLike[str], size: int = 32, val_every: int = 6,
                train_per_class: int | None = None, quality: int = 95) -> Path:
    """Write the folder (see the module docstring) and return its path."""
    from sklearn.datasets import load_digits  # scikit-learn ships the images: nothing to download

    target = Path(out)
    settings = {"size": size, "val_every": val_every, "train_per_class": train_per_class, "quality": quality}
    mark = target / _MARK
    if mark.exists() and json.loads(mark.read_text()).get("settings") == settings:
        return target
    if target.exists() and any(target.iterdir()) and not mark.exists():
        raise FileExistsError(f"--out={target} exists and was not written by make_dataset.py; give a new "
                              "or empty directory (nothing there is overwritten)")
    digits = load_digits()
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    (tmp / "train").mkdir(parents=True)
    (tmp / "val").mkdir()
    train_lines, val_lines = [], []
    seen = {c: 0 for c in range(10)}
    taken = {c: 0 for c in range(10)}
    for pixels, label in zip(digits.images, digits.target):
        label = int(label)
        k = seen[label]
        seen[label] += 1
        image = _image(pixels, size)
        if k % val_every == val_every - 1:
            name = f"val_{len(val_lines):05d}.jpeg"
            image.save(tmp / "val" / name, quality=quality)
            val_lines.append(f"{name} {label}")
            continue
        if train_per_class is not None and taken[label] >= train_per_class:
            continue
        taken[label] += 1
        folder = tmp / "train" / f"digit_{label}"
        folder.mkdir(exist_ok=True)
        name = f"digit_{label}/digit_{label}_{k:04d}.jpeg"
        image.save(tmp / "train" / name, quality=quality)
        train_lines.append(f"{name} {label}")
    (tmp / "train.txt").write_text("\n".join(train_lines) + "\n")
    (tmp / "val.txt").write_text("\n".join(val_lines) + "\n")
    (tmp / _MARK).write_text(json.dumps({"settings": settings, "train": len(train_lines),
                                         "val": len(val_lines), "classes": 10}, indent=2))
    if target.exists():
        shutil.rmtree(target)
    os.rename(tmp, target)
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="./ImageNet-digits", help="folder to write (default: ./ImageNet-digits)")
    p.add_argument("--size", type=_positive("size"), default=32, help="image side in pixels (default: 32)")
    p.add_argument("--val_every", type=_positive("val_every"), default=6,
                   help="every N-th image of a class goes to val (default: 6, about 300 images)")
    p.add_argument("--train_per_class", type=_positive("train_per_class"), default=None,
                   help="at most this many training images per class (default: all, about 1500 in all)")
    args = p.parse_args(argv)
    if args.val_every < 2:
        p.error(f"--val_every={args.val_every} would leave no training images; give 2 or more")
    try:
        path = make_digits(args.out, args.size, args.val_every, args.train_per_class)
    except FileExistsError as exc:
        print(f"make_dataset.py: error: {exc}", file=sys.stderr)
        return 2
    info = json.loads((path / _MARK).read_text())
    print(f"make_dataset.py: {path}: {info['train']} train / {info['val']} val images, 10 classes, "
          f"{args.size}x{args.size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ImageNet list format of seed 003 (``train.txt`` / ``val.txt`` of ``relative/path label``)
read with `fleetlike.io.ImageListDataset` (or, with ``--data_format tfrecord``, the same lists
packed by ``img2tfrecord`` and read with `fleetlike.io.IndexTFRDataset`), and the transforms of
the ImageNet recipe.

Training augmentation (random resized crop, flip) is drawn from a generator seeded by
``(seed, epoch, index)`` (`EpochSeeded`), so an epoch's batches are the same whichever worker
process decodes them and after a restart: a resumed job repeats the interrupted epoch exactly.

Example:
    >>> train_set, val_set = datasets(args)
"""
from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from fleetlike import io

__all__ = ["EpochSeeded", "MEAN", "STD", "datasets", "eval_transform", "train_transform"]

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def train_transform(args):
    side = args.image_shape[1]
    steps = [io.RandomResizedCrop(side, scale=(args.lower_scale, 1.0), ratio=(args.lower_ratio, args.upper_ratio))]
    if args.random_flip:
        steps.append(io.RandomHorizontalFlip())
    return io.Compose(steps + [io.ToTensor(), io.Normalize(MEAN, STD)])


def eval_transform(image_side: int, resize_short_size: int):
    """Resize the short side, center-crop, normalize: what evaluate.py and the served model use."""
    return io.Compose([io.Resize(resize_short_size), io.CenterCrop(image_side), io.ToTensor(), io.Normalize(MEAN, STD)])


class EpochSeeded(Dataset):
    """``dataset[i]`` with torch's generator seeded by ``(seed, epoch, i)`` during the call
    (the caller's generator state is restored)."""

    def __init__(self, dataset, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + self.epoch) * 10_000_019 + index)
            return self.dataset[index]


def _list(args, name: str) -> str:
    path = os.path.join(args.data_dir, f"{name}.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data_dir={args.data_dir}: no {name}.txt there; the layout is "
                                f"train/, val/, train.txt, val.txt (examples/resnet/make_dataset.py writes one)")
    return path


def _packed(args, name: str, transform):
    """The ``name`` split packed by img2tfrecord into data_dir/tfrecord (``--data_format tfrecord``)."""
    folder = os.path.join(args.data_dir, "tfrecord")
    if not os.path.isfile(os.path.join(folder, f"{name}.index")):
        raise FileNotFoundError(
            f"--data_format=tfrecord: no {folder}/{name}.index; pack the split first:\n  python -m "
            f"fleetlike.io.tools.img2tfrecord --img_dir {args.data_dir}/{name} --img_list {args.data_dir}/{name}.txt "
            f"--tfrecords_name {name} --dataset_type ImageFold --workers 2 --out_dir {folder}")
    return io.IndexTFRDataset(folder, f"{name}.index", transform)


def datasets(args):
    """``(train, val)``: `EpochSeeded` training set and the plain validation set."""
    if getattr(args, "data_format", "folder") == "tfrecord":
        train = _packed(args, "train", train_transform(args))
        val = _packed(args, "val", eval_transform(args.image_shape[1], args.resize_short_size))
        return EpochSeeded(train, args.seed), val
    train = io.ImageListDataset(os.path.join(args.data_dir, "train"), _list(args, "train"),
                                transform=train_transform(args), num_classes=args.class_dim)
    val = io.ImageListDataset(os.path.join(args.data_dir, "val"), _list(args, "val"),
                              transform=eval_transform(args.image_shape[1], args.resize_short_size),
                              num_classes=args.class_dim)
    return EpochSeeded(train, args.seed), val

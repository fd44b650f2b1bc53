#!/usr/bin/env python
"""Seed 003's offline evaluation tool: the last FC layer's vectors for a data directory, to check
that a deployed model answers what the trained one does.

It loads what ``fleet.save_inference_model`` (``inference/``) or ``fleet.save_persistables``
(``checkpoint/``) wrote into the network of ``models/``, computes the FC output of every image of
``--list`` (``val`` or ``train``) in the list's order, one image after another in batches, prints
``batch: N`` every 100 batches as the seed does, and writes the vectors (``--out``, float32,
one row per image) with the image names beside them (``<out>.names.txt``). ``--compare`` reads
the served model's vectors for the same list (``serve.py`` writes them from the TorchScript
model alone) and reports how many differ by more than ``--atol`` and the largest difference; a
mismatch exits with status 1.

    python examples/resnet/evaluate.py --pretrained_model output/inference --data_dir ./ImageNet-digits \\
        --model ResNet18 --class_dim 10 --image_shape 3,32,32 --out vectors.npy
    python examples/resnet/serve.py --served_model output/inference/served.pt --data_dir ./ImageNet-digits \\
        --image_shape 3,32,32 --out served.npy
    python examples/resnet/evaluate.py ... --out vectors.npy --compare served.npy --atol 1e-5

Exit status: 0 equal (or nothing compared), 1 mismatch, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

from models import MODELS, get_model
from utils import config, data

from fleetlike import io
from fleetlike.fleet.checkpoint import read_file

__all__ = ["compare", "load_weights", "main", "vectors"]


class InputError(ValueError):
    """Bad flags or files (exit 2)."""


def load_weights(directory: str) -> dict[str, torch.Tensor]:
    """The model's state_dict from an inference model or a training checkpoint directory."""
    if os.path.isfile(os.path.join(directory, "inference.json")):
        return torch.load(os.path.join(directory, "state_dict.pt"), map_location="cpu", weights_only=True)
    if os.path.isfile(os.path.join(directory, "fleet.json")):
        return read_file(directory, "models.pt")[0]
    raise InputError(f"--pretrained_model={directory}: neither an inference model (inference.json) nor a "
                     "checkpoint (fleet.json); give the inference/ or checkpoint/ folder train_with_fleet.py wrote")


def build(args) -> torch.nn.Module:
    model = get_model(args.model, args.class_dim, args.small_input)
    weights = load_weights(args.pretrained_model)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise InputError(f"--pretrained_model={args.pretrained_model} does not fit --model={args.model} "
                         f"--class_dim={args.class_dim} --image_shape={','.join(map(str, args.image_shape))}: "
                         f"{' '.join(first[:3])}; give the flags the model was trained with") from None
    return model.eval()


def vectors(model: torch.nn.Module, dataset, batch_size: int, log=print) -> np.ndarray:
    """The model's outputs for every sample of ``dataset``, in order (float32, one row each)."""
    loader = io.get_data_loader(dataset, batch_size, num_replicas=1, rank=0, shuffle=False, prefetch=1)
    out = []
    with torch.no_grad():
        for batch_id, (images, _) in enumerate(loader):
            if batch_id % 100 == 0:
                log("batch: %d" % batch_id)
            out.append(model(images).float().numpy())
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def names_path(vectors_path: str) -> str:
    root, _ = os.path.splitext(vectors_path)
    return root + ".names.txt"


def compare(ours: np.ndarray, served: np.ndarray, names: list[str], atol: float) -> tuple[int, float, list[str]]:
    """``(mismatching vectors, largest absolute difference, their names)``."""
    if ours.shape != served.shape:
        raise InputError(f"--compare: the served vectors have shape {served.shape}, these {ours.shape}; "
                         "compute them for the same list and model")
    diff = np.abs(ours.astype(np.float64) - served.astype(np.float64))
    per_row = diff.max(axis=1) if diff.size else np.zeros(len(ours))
    bad = np.flatnonzero(~(per_row <= atol))     # NaN counts as a mismatch
    return len(bad), float(np.nanmax(per_row)) if len(per_row) else 0.0, [names[i] for i in bad]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained_model", required=True, help="inference/ or checkpoint/ folder")
    p.add_argument("--data_dir", default="./ImageNet", help="the ImageNet-format folder")
    p.add_argument("--list", default="val", choices=("val", "train"), help="which list to compute")
    p.add_argument("--model", default="ResNet50", help=f"network: {', '.join(MODELS)}")
    p.add_argument("--class_dim", type=int, default=1000, help="number of classes")
    p.add_argument("--image_shape", type=config.image_shape, default=(3, 224, 224), help="C,H,W")
    p.add_argument("--small_input", default="auto", choices=("auto", "True", "False"),
                   help="3x3 stem without max pool; auto: when the image side is <= 64")
    p.add_argument("--resize_short_size", type=int, default=None, help="default: side*256/224")
    p.add_argument("--batch_size", type=int, default=32, help="images per forward")
    p.add_argument("--out", default="vectors.npy", help="where the vectors go (names: <out>.names.txt)")
    p.add_argument("--compare", default=None, help="the served model's vectors (.npy) to check against")
    p.add_argument("--atol", type=float, default=1e-5, help="largest absolute difference still equal")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.model.lower() not in {m.lower() for m in MODELS}:
        p.error(f"--model={args.model!r} is not a known network; choose one of {', '.join(MODELS)}")
    for name in ("class_dim", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    if not args.atol >= 0:
        p.error(f"--atol={args.atol} must be >= 0")
    side = args.image_shape[1]
    args.small_input = side <= 64 if args.small_input == "auto" else args.small_input == "True"
    args.resize_short_size = args.resize_short_size or max(side, round(side * 256 / 224))
    try:
        list_file = os.path.join(args.data_dir, f"{args.list}.txt")
        if not os.path.isfile(list_file):
            raise InputError(f"--data_dir={args.data_dir}: no {args.list}.txt there")
        model = build(args)
        dataset = io.ImageListDataset(os.path.join(args.data_dir, args.list), list_file,
                                      transform=data.eval_transform(side, args.resize_short_size))
        names = [path for path, _ in dataset.samples]
        ours = vectors(model, dataset, args.batch_size)
        np.save(args.out, ours)
        with open(names_path(args.out), "w") as fh:
            fh.write("\n".join(names) + "\n")
        print(f"evaluate.py: {len(ours)} vectors of {ours.shape[1] if ours.ndim == 2 else 0} values -> {args.out} "
              f"(names: {names_path(args.out)})", flush=True)
        if args.compare is None:
            return 0
        if not os.path.isfile(args.compare):
            raise InputError(f"--compare={args.compare} does not exist")
        served = np.load(args.compare)
        served_names = names_path(args.compare)
        if os.path.isfile(served_names):
            theirs = open(served_names).read().split()
            if theirs != names:
                raise InputError(f"--compare: {served_names} lists other images (or another order) than "
                                 f"{list_file}; compute the served vectors for the same list")
        count, largest, which = compare(ours, served, names, args.atol)
    except (InputError, FileNotFoundError, ValueError) as exc:
        print(f"evaluate.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    summary = {"compared": len(ours), "mismatches": count, "largest_difference": largest, "atol": args.atol}
    if count:
        print(f"evaluate.py: MISMATCH: {count} of {len(ours)} vectors differ by more than {args.atol:g} "
              f"(largest difference {largest:.3g}); first: {', '.join(which[:5])}", flush=True)
    else:
        print(f"evaluate.py: equal: {len(ours)} vectors within {args.atol:g} (largest difference {largest:.3g})",
              flush=True)
    print("evaluate.py: " + json.dumps(summary), flush=True)
    return 1 if count else 0


if __name__ == "__main__":
    sys.exit(main())

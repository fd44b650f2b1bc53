#!/usr/bin/env python
"""The deployed side of evaluate.py: a plain PyTorch process that loads the served model
(``inference/served.pt``, TorchScript) and writes its answers for every image of a list.

It imports neither fleetlike nor this example's code, as a model server would: only torch,
numpy and Pillow. Preprocessing is the validation recipe (resize the short side, center crop,
scale to [0, 1], normalize with the ImageNet mean and std), written out here.

    python examples/resnet/serve.py --served_model output/inference/served.pt \\
        --data_dir ./ImageNet-digits --image_shape 3,32,32 --out served.npy
"""
import argparse
import os
import sys

import numpy as np
import torch
from PIL import Image

MEAN = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float32).view(-1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float32).view(-1, 1, 1)


def preprocess(path, side, short):
    with Image.open(path) as image:
        image = image.convert("RGB")
    w, h = image.size
    size = (short, max(1, int(short * h / w))) if w <= h else (max(1, int(short * w / h)), short)
    image = image.resize(size, Image.BILINEAR)
    w, h = image.size
    left, top = int(round((w - side) / 2.0)), int(round((h - side) / 2.0))
    image = image.crop((left, top, left + side, top + side))
    array = np.asarray(image)
    tensor = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))).float().div_(255)
    return (tensor - MEAN) / STD


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--served_model", required=True, help="served.pt written by fleet.save_inference_model")
    p.add_argument("--data_dir", required=True)
    p.add_argument("--list", default="val", choices=("val", "train"))
    p.add_argument("--image_shape", default="3,224,224")
    p.add_argument("--resize_short_size", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--out", default="served.npy")
    args = p.parse_args(argv)
    side = int(args.image_shape.split(",")[-1])
    short = args.resize_short_size or max(side, round(side * 256 / 224))
    model = torch.jit.load(args.served_model, map_location="cpu")
    model.eval()
    with open(os.path.join(args.data_dir, f"{args.list}.txt")) as fh:
        names = [line.rsplit(None, 1)[0] for line in fh if line.strip()]
    rows = []
    with torch.no_grad():
        for start in range(0, len(names), args.batch_size):
            batch = torch.stack([preprocess(os.path.join(args.data_dir, args.list, n), side, short)
                                 for n in names[start:start + args.batch_size]])
            rows.append(model(batch).float().numpy())
    np.save(args.out, np.concatenate(rows))
    root, _ = os.path.splitext(args.out)
    with open(root + ".names.txt", "w") as fh:
        fh.write("\n".join(names) + "\n")
    print(f"serve.py: {len(names)} vectors -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

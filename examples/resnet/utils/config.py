"""The command line of the ResNet example (seed 003's flag names: ``--model``, ``--data_dir``,
``--class_dim``, ``--image_shape``, ``--fp16=True``, ...).

Booleans are written as in the seed (``--fp16=True``); every value is checked here, so a bad flag
stops the job before any worker builds a model, with the flag, the value and what to give.

Example:
    >>> args = parse_args(["--model=ResNet18", "--image_shape=3,32,32"], fleet=False)
"""
from __future__ import annotations

import argparse

from models import MODELS

__all__ = ["parse_args", "str2bool", "image_shape"]

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def str2bool(text: str) -> bool:
    """``True``/``False`` (also 1/0, yes/no, on/off, any case), as the seed writes them."""
    value = str(text).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; give True or False")


def image_shape(text: str) -> tuple[int, int, int]:
    """``3,224,224`` -> (3, 224, 224); 3 channels (RGB JPEGs), square."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not C,H,W (e.g. 3,224,224)") from None
    if len(shape) != 3 or shape[0] != 3 or shape[1] != shape[2] or shape[1] < 8:
        raise argparse.ArgumentTypeError(f"{text!r}: give 3,N,N with N >= 8 (RGB, square), e.g. 3,224,224")
    return shape  # type: ignore[return-value]


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def _nonnegative(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def _epochs(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of epochs, e.g. 30,60,90") from None
    if any(b <= a for a, b in zip(values, values[1:])) or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: the epochs must be positive and increasing")
    return values


def _build(fleet: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="ResNet on an ImageNet-format folder (seed 003).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="ResNet50", help=f"network: {', '.join(MODELS)}")
    g.add_argument("--class_dim", type=_positive(int), default=1000, help="number of classes")
    g.add_argument("--image_shape", type=image_shape, default=(3, 224, 224), help="C,H,W of the network input")
    g.add_argument("--small_input", default="auto", choices=("auto", "True", "False"),
                   help="3x3 stem without max pool (CIFAR style); auto: when the image side is <= 64")
    g.add_argument("--data_dir", default="./ImageNet", help="train/, val/, train.txt, val.txt")
    g.add_argument("--data_format", default="folder", choices=("folder", "tfrecord"),
                   help="folder: the images as files; tfrecord: packed by img2tfrecord into data_dir/tfrecord "
                        "(train.index, val.index)")
    g.add_argument("--num_workers", type=_nonnegative(int), default=2, help="DataLoader worker processes")
    g.add_argument("--lower_scale", type=_positive(float), default=0.08, help="random crop: smallest area share")
    g.add_argument("--lower_ratio", type=_positive(float), default=3.0 / 4.0, help="random crop: smallest aspect")
    g.add_argument("--upper_ratio", type=_positive(float), default=4.0 / 3.0, help="random crop: largest aspect")
    g.add_argument("--resize_short_size", type=_positive(int), default=None,
                   help="validation: resize the short side to this, then center-crop (default: side*256/224)")
    g.add_argument("--random_flip", type=str2bool, default=True, help="random horizontal flip in training")
    g = p.add_argument_group("optimization")
    g.add_argument("--batch_size", type=_positive(int), default=32, help="mini-batch size per worker")
    g.add_argument("--num_epochs", type=_positive(int), default=120, help="epochs")
    g.add_argument("--lr", type=_positive(float), default=0.1, help="base learning rate")
    g.add_argument("--lr_strategy", default="piecewise_decay", choices=("piecewise_decay", "cosine_decay"),
                   help="decay after the warm-up")
    g.add_argument("--decay_epochs", type=_epochs, default=(30.0, 60.0, 90.0),
                   help="piecewise_decay: epochs where the rate is multiplied by --decay_rate")
    g.add_argument("--decay_rate", type=_positive(float), default=0.1, help="piecewise_decay factor")
    g.add_argument("--warm_up_epochs", type=_nonnegative(float), default=0.0, help="linear warm-up from 0")
    g.add_argument("--momentum_rate", type=_nonnegative(float), default=0.9, help="SGD momentum")
    g.add_argument("--l2_decay", type=_nonnegative(float), default=1e-4, help="weight decay")
    g.add_argument("--seed", type=int, default=0, help="initial weights, data order and augmentation")
    g = p.add_argument_group("output")
    g.add_argument("--model_save_dir", default="./output",
                   help="checkpoint/ (every epoch), inference/ (at the end), curves.png, history.json")
    g.add_argument("--resume", type=str2bool, default=True,
                   help="continue from model_save_dir/checkpoint when it exists")
    g.add_argument("--log_period", type=_positive(int), default=10, help="one log line every N steps")
    if fleet:
        g = p.add_argument_group("distributed strategy (fleetlike)")
        g.add_argument("--fp16", type=str2bool, default=False,
                       help="mixed precision as seed 003: decorate(init_loss_scaling=--scale_loss, dynamic)")
        g.add_argument("--amp", default=None, choices=("none", "fp16", "bf16"),
                       help="mixed precision dtype (--fp16=True is --amp=fp16)")
        g.add_argument("--scale_loss", type=_positive(float), default=128.0, help="fp16: initial loss scaling")
        g.add_argument("--use_dynamic_loss_scaling", type=str2bool, default=True, help="fp16: dynamic scaling")
        g.add_argument("--use_local_sgd", type=str2bool, default=False, help="local SGD")
        g.add_argument("--local_sgd_steps", type=_positive(int), default=1, help="local SGD: k")
        g.add_argument("--local_sgd_is_warm_steps", type=_positive(int), default=1,
                       help="local SGD: steps of plain SGD first")
        g.add_argument("--use_hierarchical_allreduce", type=str2bool, default=False,
                       help="allreduce within nodes, then across")
        g.add_argument("--forward_recompute", type=str2bool, default=False,
                       help="recompute layer1..layer4 in the backward")
        g.add_argument("--gradient_merge_steps", type=_positive(int), default=1,
                       help="> 1: accumulate this many steps' gradients per update")
        g.add_argument("--fp16_allreduce", type=str2bool, default=False, help="gradients travel as fp16")
        g.add_argument("--sync_bn", type=str2bool, default=False, help="batch norm statistics over all workers")
        g.add_argument("--prefetch", type=_nonnegative(int), default=2, help="batches fetched ahead onto the device")
    return p


def parse_args(argv=None, fleet: bool = False) -> argparse.Namespace:
    """Parse and cross-check the flags (``fleet``: the strategy flags of train_with_fleet.py)."""
    p = _build(fleet)
    args = p.parse_args(argv)
    if args.model.lower() not in {m.lower() for m in MODELS}:
        p.error(f"--model={args.model!r} is not a known network; choose one of {', '.join(MODELS)}")
    if not args.lower_ratio <= args.upper_ratio:
        p.error(f"--lower_ratio={args.lower_ratio} is above --upper_ratio={args.upper_ratio}")
    if args.lower_scale > 1:
        p.error(f"--lower_scale={args.lower_scale} must be <= 1 (a share of the image area)")
    if args.warm_up_epochs >= args.num_epochs:
        p.error(f"--warm_up_epochs={args.warm_up_epochs:g} must be below --num_epochs={args.num_epochs}")
    side = args.image_shape[1]
    args.small_input = side <= 64 if args.small_input == "auto" else args.small_input == "True"
    if args.resize_short_size is None:
        args.resize_short_size = max(side, round(side * 256 / 224))
    if args.resize_short_size < side:
        p.error(f"--resize_short_size={args.resize_short_size} is smaller than the image side {side}")
    if fleet:
        if args.fp16 and args.amp not in (None, "fp16"):
            p.error(f"--fp16=True asks for float16 but --amp={args.amp}; give one of them")
        args.amp = "fp16" if args.fp16 else (args.amp or "none")
        if args.use_local_sgd and args.gradient_merge_steps > 1:
            p.error("--use_local_sgd=True with --gradient_merge_steps > 1: fleetlike does not combine the two; "
                    "choose one")
    return args

#!/usr/bin/env python
"""Seed 003's first job as a plain single-process PyTorch script: ResNet on an ImageNet-format
folder (``train/``, ``val/``, ``train.txt``, ``val.txt``).

`train_with_fleet.py` is this script after the four steps of the fleetlike conversion
(`diff train.py train_with_fleet.py`). Every epoch ends with top-1/top-5 on the validation list
and a checkpoint in --model_save_dir/checkpoint, which the same command run again continues from.

    python examples/resnet/make_dataset.py --out ./ImageNet-digits
    python examples/resnet/train.py --model=ResNet18 --data_dir=./ImageNet-digits --class_dim=10 --image_shape=3,32,32
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

from models import get_model
from utils import config, data, schedule
from utils.progress import History, Progress, plot, topk_correct


def timed(loader):
    """``(batch, seconds waited for it)`` for each batch of ``loader``."""
    it = iter(loader)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch, time.perf_counter() - start


def evaluate(model, loader, device):
    """Top-1 hits, top-5 hits and images over the validation images."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images.to(device))
            counts[:2] += topk_correct(logits.float().cpu(), labels.cpu())
            counts[2] += labels.numel()
    model.train()
    return counts


def main():
    args = config.parse_args(fleet=False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    model = get_model(args.model, args.class_dim, args.small_input).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum_rate,
                                weight_decay=args.l2_decay)
    rank, workers = 0, 1

    train_set, val_set = data.datasets(args)
    order = torch.Generator()   # the epoch's order: randperm seeded with seed + epoch
    train_loader = torch.utils.data.DataLoader(train_set, args.batch_size, drop_last=True, num_workers=args.num_workers,
                                               sampler=torch.utils.data.RandomSampler(train_set, generator=order))
    val_loader = torch.utils.data.DataLoader(val_set, args.batch_size, num_workers=args.num_workers)
    scheduler = schedule.build(optimizer, args, len(train_loader))
    history = History()
    checkpoint = os.path.join(args.model_save_dir, "checkpoint", "checkpoint.pt")
    if args.resume and os.path.isfile(checkpoint):
        saved = torch.load(checkpoint, weights_only=False)
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("history", history)):
            obj.load_state_dict(saved[name])
        print(f"resumed from {checkpoint}: {history.next_epoch} epoch(s) done", flush=True)

    for epoch in range(history.next_epoch, args.num_epochs):
        train_set.set_epoch(epoch)
        order.manual_seed(args.seed + epoch)
        bar = Progress(epoch, args.num_epochs, len(train_loader), args.log_period, args.batch_size * workers)
        for (images, labels), waited in timed(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            scheduler.step()
            bar.step(loss.item(), scheduler.get_last_lr()[0], None, waited)
        seconds = bar.seconds
        counts = evaluate(model, val_loader, device).numpy()
        top1, top5, seen = counts[0] / counts[2], counts[1] / counts[2], int(counts[2])
        history.add(epoch=epoch, train_loss=bar.mean_loss, top1=top1, top5=top5, seconds=seconds,
                    images_per_s=bar.done * args.batch_size * workers / seconds, data_wait=bar.wait)
        print(f"epoch {epoch + 1}/{args.num_epochs}: train loss {bar.mean_loss:.4f}, val top-1 {100 * top1:.2f}% "
              f"top-5 {100 * top5:.2f}% ({seen} images), {seconds:.1f} s, "
              f"{history.epochs[-1]['images_per_s']:.1f} images/s, waited on data {bar.wait:.2f} s",
              flush=True)
        os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "history": history.state_dict()}, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)

    last = history.epochs[-1]
    print(f"validation accuracy: top-1 {100 * last['top1']:.2f}% top-5 {100 * last['top5']:.2f}% "
          f"after {len(history.epochs)} epoch(s)", flush=True)
    torch.save(model.state_dict(), os.path.join(args.model_save_dir, "model.pt"))
    history.save(os.path.join(args.model_save_dir, "history.json"))
    plot(history, os.path.join(args.model_save_dir, "curves.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

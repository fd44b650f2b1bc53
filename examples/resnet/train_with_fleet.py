#!/usr/bin/env python
"""Seed 003's first job: ResNet on an ImageNet-format folder, data parallel with fleetlike.

`train.py` is the single-process original; this is the same script after the four steps
(`diff train.py train_with_fleet.py`): import; strategy, roles, wrapped model and optimizer;
each worker reads its share of the data through `fleetlike.io` (prefetched, resumable) and the
validation counts are summed over the workers; rank 0 saves. Every epoch ends with top-1/top-5
on the validation list and a checkpoint in --model_save_dir/checkpoint; the same command run
again (after a crash, a kill -9, or to add epochs) continues from it with the same parameters
an uninterrupted run would have. At the end: the served model (--model_save_dir/inference,
TorchScript, for evaluate.py) and the curves (curves.png).

    python examples/resnet/make_dataset.py --out ./ImageNet-digits
    python -m fleetlike.launch --nproc_per_node=2 --started_port=auto examples/resnet/train_with_fleet.py \\
        --model=ResNet18 --data_dir=./ImageNet-digits --class_dim=10 --image_shape=3,32,32
    ... train_with_fleet.py --model=ResNet50 --data_dir=./ImageNet --fp16=True       # seed 003's run
    ... train_with_fleet.py ... --use_local_sgd=True --local_sgd_steps=4 | --amp=bf16 | --forward_recompute=True
"""
import os
import sys

import torch
import torch.nn.functional as F

from models import get_model
from utils import config, data, schedule
from utils.progress import History, Progress, plot, topk_correct

# Step 1: import
from fleetlike import DistributedStrategy, fleet, io, mixed_precision


def build_strategy(args):
    """The strategy flags as a DistributedStrategy (Fleet 1.x names where the seed uses them)."""
    strategy = DistributedStrategy()
    strategy.use_local_sgd = args.use_local_sgd
    if args.use_local_sgd:
        strategy.local_sgd_steps = args.local_sgd_steps
        strategy.local_sgd_is_warm_steps = args.local_sgd_is_warm_steps
    strategy.use_hierarchical_allreduce = args.use_hierarchical_allreduce
    strategy.forward_recompute = args.forward_recompute
    if args.forward_recompute:
        strategy.recompute_checkpoints = ["layer1", "layer2", "layer3", "layer4"]
    if args.gradient_merge_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": args.gradient_merge_steps, "avg": True}
    strategy.fp16_allreduce = args.fp16_allreduce
    strategy.sync_batch_norm = args.sync_bn
    if args.amp == "bf16":
        strategy.amp = True
        strategy.amp_configs = {"dtype": "bfloat16"}
    return strategy


def average_buffers(model):
    """Every worker takes the workers' mean batch-norm statistics (each saw only its own
    batches), so evaluation and the checkpoint (rank 0's) hold the same state on every worker."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    flat = torch.cat([b.detach().reshape(-1).double().cpu() for b in buffers]).numpy()
    mean = torch.from_numpy(fleet.util.all_reduce(flat, mode="sum") / fleet.worker_num())
    with torch.no_grad():
        for b, value in zip(buffers, mean.split([b.numel() for b in buffers])):
            b.copy_(value.view_as(b))


def evaluate(model, loader, device):
    """Top-1 hits, top-5 hits and images over the validation images this worker reads."""
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
    args = config.parse_args(fleet=True)
    # Step 2: strategy and cluster roles; wrap the model and the optimizer
    fleet.init(strategy=build_strategy(args))
    device = fleet.device()
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // fleet.local_size()))  # share the node's cores
    torch.manual_seed(args.seed)
    model = get_model(args.model, args.class_dim, args.small_input).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum_rate,
                                weight_decay=args.l2_decay)
    if args.amp == "fp16":
        optimizer = mixed_precision.decorate(optimizer, init_loss_scaling=args.scale_loss,
                                             use_dynamic_loss_scaling=args.use_dynamic_loss_scaling)
    model = fleet.distributed_model(model)
    optimizer = fleet.distributed_optimizer(optimizer)
    rank, workers = fleet.worker_index(), fleet.worker_num()
    print(f"worker {rank} of {workers}: pid {os.getpid()}, device {device}", flush=True)

    # Step 3: each worker reads its share of the lists (prefetched; the position is resumable)
    train_set, val_set = data.datasets(args)
    train_loader = io.get_data_loader(train_set, args.batch_size, seed=args.seed, drop_last=True,
                                      num_workers=args.num_workers, prefetch=args.prefetch)
    val_loader = io.get_data_loader(val_set, args.batch_size, sampler=range(rank, len(val_set), workers),
                                    num_workers=args.num_workers, prefetch=args.prefetch)
    scheduler = schedule.build(optimizer, args, len(train_loader))
    history = History()
    checkpoint = os.path.join(args.model_save_dir, "checkpoint")
    fleet.register_state("scheduler", scheduler)
    fleet.register_state("history", history)
    fleet.register_state("train_loader", train_loader)
    if args.resume and os.path.isdir(checkpoint):
        fleet.load_persistables(None, checkpoint)
        print(f"resumed from {checkpoint}: {history.next_epoch} epoch(s) done", flush=True)
    done = [int(n) for n in fleet.util.all_gather(history.next_epoch)]
    if len(set(done)) > 1:
        raise RuntimeError(f"the workers found checkpoints of different epochs ({done} done, by rank): "
                           f"--model_save_dir={args.model_save_dir} must be one directory every node shares")

    for epoch in range(history.next_epoch, args.num_epochs):
        train_set.set_epoch(epoch)
        train_loader.set_epoch(epoch)
        bar = Progress(epoch, args.num_epochs, len(train_loader), args.log_period, args.batch_size * workers)
        for images, labels in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            scheduler.step()
            scale = fleet.get_loss_scaling() if args.amp == "fp16" else None
            bar.step(loss.item(), scheduler.get_last_lr()[0], scale, train_loader.last_wait)
        seconds = bar.seconds
        average_buffers(model)
        counts = fleet.util.all_reduce(evaluate(model, val_loader, device).numpy(), mode="sum")
        top1, top5, seen = counts[0] / counts[2], counts[1] / counts[2], int(counts[2])
        history.add(epoch=epoch, train_loss=bar.mean_loss, top1=top1, top5=top5, seconds=seconds,
                    images_per_s=bar.done * args.batch_size * workers / seconds, data_wait=train_loader.epoch_wait)
        print(f"epoch {epoch + 1}/{args.num_epochs}: train loss {bar.mean_loss:.4f}, val top-1 {100 * top1:.2f}% "
              f"top-5 {100 * top5:.2f}% ({seen} images), {seconds:.1f} s, "
              f"{history.epochs[-1]['images_per_s']:.1f} images/s, waited on data {train_loader.epoch_wait:.2f} s",
              flush=True)
        # Step 4: rank 0 saves everything needed to resume exactly (atomic), every epoch
        if rank == 0:
            fleet.save_persistables(None, checkpoint)

    last = history.epochs[-1]
    print(f"validation accuracy: top-1 {100 * last['top1']:.2f}% top-5 {100 * last['top5']:.2f}% "
          f"after {len(history.epochs)} epoch(s)", flush=True)
    if rank == 0:
        fleet.save_inference_model(None, os.path.join(args.model_save_dir, "inference"), ["image"], ["fc"])
        history.save(os.path.join(args.model_save_dir, "history.json"))
        plot(history, os.path.join(args.model_save_dir, "curves.png"))
    fleet.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

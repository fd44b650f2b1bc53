"""A plain PyTorch DDP training script in the shape of PyTorch's examples/imagenet/main.py.

Nothing here knows fleetlike: argparse, ``main_worker``, ``train`` with AverageMeter /
ProgressMeter, ``DistributedSampler``, ``DistributedDataParallel``, ``save_checkpoint`` on rank
0. The data are synthetic (as the imagenet example's ``--dummy``), the model a small ResNet
(torchvision is not used). Run it under torchrun or fleetlike's launcher:

    torchrun --nproc_per_node=2 examples/ddp/main.py --epochs 1
    python -m fleetlike.launch --nproc_per_node=2 --accelerate_ddp examples/ddp/main.py   # accelerated
    torchrun --nproc_per_node=2 examples/ddp/accelerated.py                           # import fleetlike.auto
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim
import torch.utils.data
import torch.utils.data.distributed

parser = argparse.ArgumentParser(description="PyTorch DDP Training (synthetic data)")
parser.add_argument("--epochs", default=1, type=int, help="number of total epochs to run")
parser.add_argument("-b", "--batch-size", default=16, type=int, help="mini-batch size per process")
parser.add_argument("--lr", "--learning-rate", default=0.05, type=float, dest="lr", help="initial learning rate")
parser.add_argument("--momentum", default=0.9, type=float, help="momentum")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay", help="weight decay")
parser.add_argument("-p", "--print-freq", default=10, type=int, help="print frequency")
parser.add_argument("--samples", default=256, type=int, help="synthetic training images")
parser.add_argument("--image-size", default=16, type=int, help="synthetic image side")
parser.add_argument("--width", default=8, type=int, help="channels of the first stage")
parser.add_argument("--classes", default=10, type=int, help="number of classes")
parser.add_argument("--seed", default=0, type=int, help="seed for initializing training")
parser.add_argument("--dist-backend", default="gloo", type=str, help="distributed backend")
parser.add_argument("--checkpoint", default="checkpoint.pth.tar", type=str, help="where rank 0 saves the model")


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """resnet18's layout (4 stages of 2 basic blocks), narrow enough for CPU."""

    def __init__(self, width=8, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, inplanes = [], width
        for i in range(4):
            planes = width * 2 ** i
            layers.append(nn.Sequential(BasicBlock(inplanes, planes, 1 if i == 0 else 2), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    args = parser.parse_args()
    main_worker(args)


def main_worker(args):
    dist.init_process_group(backend=args.dist_backend, init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = ResNet(args.width, args.classes)
    model = torch.nn.parallel.DistributedDataParallel(model)

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)

    g = torch.Generator().manual_seed(1234)
    images = torch.randn(args.samples, 3, args.image_size, args.image_size, generator=g)
    target = torch.randint(0, args.classes, (args.samples,), generator=g)
    train_dataset = torch.utils.data.TensorDataset(images, target)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False,
                                               num_workers=0, sampler=train_sampler)

    start = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, args)
    if rank == 0:
        steps = args.epochs * len(train_loader)
        elapsed = time.time() - start
        print(f"done: {steps} steps in {elapsed:.2f}s, {steps / elapsed:.2f} steps/s", flush=True)
        save_checkpoint({"epoch": args.epochs, "state_dict": model.module.state_dict(),
                         "optimizer": optimizer.state_dict()}, args.checkpoint)
    dist.barrier()
    # DDP keeps the process group in reference cycles: free it now, so its gloo threads end here
    # and not in the interpreter's teardown (where torch can abort: "terminate called without an
    # active exception", pytorch/pytorch#190489)
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, args):
    batch_time = AverageMeter("Time", ":6.3f")
    losses = AverageMeter("Loss", ":.4e")
    progress = ProgressMeter(len(train_loader), [batch_time, losses], prefix=f"Epoch: [{epoch}]")
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        output = model(images)
        loss = criterion(output, target)
        losses.update(loss.item(), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_time.update(time.time() - end)
        end = time.time()
        if i % args.print_freq == 0 and dist.get_rank() == 0:
            progress.display(i + 1)


def save_checkpoint(state, filename="checkpoint.pth.tar"):
    torch.save(state, filename)


class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches, meters, prefix=""):
        digits = len(str(num_batches))
        self.batch_fmtstr = "[{:" + str(digits) + "d}/" + "{:" + str(digits) + "d}]"
        self.meters, self.prefix, self.num_batches = meters, prefix, num_batches

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch, self.num_batches)]
        entries += [str(meter) for meter in self.meters]
        print("\t".join(entries), flush=True)


if __name__ == "__main__":
    main()

"""The ResNet example's throughput: ``train_with_fleet.py`` against a plain PyTorch DDP script.

Both train ResNet18 (small-image stem) on the digits ImageNet-format folder that
``examples/resnet/make_dataset.py`` writes, on 2 CPU workers of one machine, with the same data
(``ImageListDataset`` of the list files, the example's transforms and per-sample seeded
augmentation), model, SGD, learning-rate schedule, per-worker batch and thread count (one per
worker, ``OMP_NUM_THREADS=1``):

- fleetlike: ``python -m fleetlike.launch --nproc_per_node=2 --started_port=auto
  examples/resnet/train_with_fleet.py ...`` as a user runs it (``fleetlike.io.get_data_loader``
  with prefetch, ``fleet.distributed_model`` / ``distributed_optimizer``, checkpoint each epoch);
- DDP: ``torchrun --standalone --nproc_per_node=2 bench/resnet.py --ddp_worker ...``:
  ``torch.utils.data.DataLoader`` + ``torch.utils.data.DistributedSampler`` +
  ``DistributedDataParallel`` over gloo (this file's `ddp_worker`).

Images/s is the training loop's (the epoch's images over its wall time, evaluation excluded),
from the last epoch of each run (the first warms caches and allocator); runs alternate, the
order rotating each round, and the table reports the median over ``--rounds``.

Usage (from the repository root)::

    python -m bench.resnet                     # 3 rounds, 2 epochs of 1000 images, ~5 minutes
    python -m bench.resnet --rounds 1 --epochs 2 --train_per_class 30

Writes ``docs/benchmarks/resnet.json`` and ``.png`` and (re)writes the "## ResNet example vs
PyTorch DDP" section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, median, replace_section, run_info, save_json

__all__ = ["TARGET", "ddp_worker", "main"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resnet"
TARGET = 1.0  # fleetlike images/s / DDP images/s, at least
SECTION = "## ResNet example vs PyTorch DDP"
WORLD = 2


def _recipe(args: argparse.Namespace, data: Path) -> list[str]:
    """The training flags both sides use (the example's, scripts/train.sh's digits recipe)."""
    return ["--model=ResNet18", f"--data_dir={data}", "--class_dim=10", f"--image_shape=3,{args.size},{args.size}",
            f"--batch_size={args.batch_size}", f"--num_epochs={args.epochs}", "--lr=0.1", "--lr_strategy=cosine_decay",
            "--warm_up_epochs=1", "--l2_decay=5e-4", "--lower_scale=0.6", "--random_flip=False",
            f"--num_workers={args.num_workers}", "--log_period=1000"]


# ---------------------------------------------------------------------------- DDP side


def ddp_worker(argv: list[str]) -> None:
    """One torchrun rank of the plain PyTorch DDP script (writes rank 0's epochs to --result)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(EXAMPLE))
    from models import get_model
    from utils import config, data, schedule
    from utils.progress import topk_correct

    result = argv[argv.index("--result") + 1]
    argv = [a for i, a in enumerate(argv) if a != "--result" and (i == 0 or argv[i - 1] != "--result")]
    args = config.parse_args(argv, fleet=False)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(get_model(args.model, args.class_dim, args.small_input))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum_rate, weight_decay=args.l2_decay)
    train_set, val_set = data.datasets(args)
    sampler = torch.utils.data.DistributedSampler(train_set, world, rank, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True,
                                         num_workers=args.num_workers)
    val_loader = torch.utils.data.DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                                             args.batch_size, num_workers=args.num_workers)
    scheduler = schedule.build(optimizer, args, len(loader))
    epochs = []
    for epoch in range(args.num_epochs):
        train_set.set_epoch(epoch)
        sampler.set_epoch(epoch)
        start, steps = time.perf_counter(), 0
        for images, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            scheduler.step()
            steps += 1
        seconds = time.perf_counter() - start
        model.eval()
        counts = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for images, labels in val_loader:
                counts[:2] += topk_correct(model(images), labels)
                counts[2] += labels.numel()
        model.train()
        dist.all_reduce(counts)
        epochs.append({"epoch": epoch, "seconds": seconds, "images_per_s": steps * args.batch_size * world / seconds,
                       "top1": float(counts[0] / counts[2])})
    if rank == 0:
        Path(result).write_text(json.dumps({"epochs": epochs}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PADDLE_", "FLEETLIKE_", "TORCHELASTIC")) and k not in
           {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


def _run(cmd: list[str], cwd: Path, timeout: float) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def run_fleetlike(args: argparse.Namespace, data: Path, work: Path) -> dict[str, Any]:
    out = work / "fleetlike"
    shutil.rmtree(out, ignore_errors=True)
    _run([sys.executable, "-m", "fleetlike.launch", f"--nproc_per_node={WORLD}", "--started_port=auto",
          f"--log_dir={work / 'log'}", str(EXAMPLE / "train_with_fleet.py"), *_recipe(args, data),
          f"--model_save_dir={out}", "--resume=False"], work, args.timeout)
    return json.loads((out / "history.json").read_text())


def run_ddp(args: argparse.Namespace, data: Path, work: Path) -> dict[str, Any]:
    result = work / "ddp.json"
    torchrun = Path(sys.executable).parent / "torchrun"
    _run([str(torchrun), "--standalone", f"--nproc_per_node={WORLD}", str(Path(__file__).resolve()), "--ddp_worker",
          *_recipe(args, data), "--result", str(result)], work, args.timeout)
    return json.loads(result.read_text())


def _plot(path: Path, rounds: list[dict[str, Any]], ratio: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(rounds))
    ax.bar([x - 0.2 for x in xs], [r["fleetlike"] for r in rounds], width=0.4, label="train_with_fleet.py (fleetlike)")
    ax.bar([x + 0.2 for x in xs], [r["ddp"] for r in rounds], width=0.4, label="PyTorch DDP + DataLoader")
    ax.set_xticks(list(xs), [f"round {i + 1}" for i in xs])
    ax.set_ylabel("training images/s (2 CPU workers)")
    ax.set_title(f"ResNet18, digits folder: fleetlike / DDP = {ratio:.2f}x (median)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    from bench._common import save_figure

    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--ddp_worker":
        ddp_worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (the last one is measured)")
    p.add_argument("--train_per_class", type=int, default=100, help="training images per class (10 classes)")
    p.add_argument("--size", type=int, default=32, help="image side")
    p.add_argument("--batch_size", type=int, default=32, help="per worker")
    p.add_argument("--num_workers", type=int, default=1, help="DataLoader worker processes per rank (both sides)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "resnet.json"))
    p.add_argument("--png", default=str(ROOT / "docs" / "benchmarks" / "resnet.png"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to update ('' = none)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(EXAMPLE))
    from make_dataset import make_digits

    load_before = os.getloadavg()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-resnet-") as tmp:
        work = Path(tmp)
        data = make_digits(work / "digits", size=args.size, train_per_class=args.train_per_class)
        for r in range(args.rounds):
            sides = [("fleetlike", run_fleetlike), ("ddp", run_ddp)]
            row: dict[str, Any] = {"round": r + 1}
            for name, fn in sides[r % 2:] + sides[:r % 2]:
                last = fn(args, data, work)["epochs"][-1]
                row[name], row[f"{name}_top1"] = last["images_per_s"], last["top1"]
            row["ratio"] = row["fleetlike"] / row["ddp"]
            rounds.append(row)
            print(f"round {r + 1}: fleetlike {row['fleetlike']:.1f} images/s, DDP {row['ddp']:.1f} images/s, "
                  f"ratio {row['ratio']:.3f}", flush=True)
    load_after = os.getloadavg()
    fl, ddp = median([r["fleetlike"] for r in rounds]), median([r["ddp"] for r in rounds])
    ratio = fl / ddp
    columns = [Column("round", "round"), Column("fleetlike", "fleetlike images/s", "{:.1f}"),
               Column("ddp", "DDP images/s", "{:.1f}"), Column("ratio", "ratio", "{:.3f}"),
               Column("fleetlike_top1", "fleetlike top-1", "{:.3f}"), Column("ddp_top1", "DDP top-1", "{:.3f}")]
    table_rows = rounds + [{"round": "median", "fleetlike": fl, "ddp": ddp, "ratio": ratio}]
    print(format_table(columns, table_rows))
    verdict = "meets" if ratio >= TARGET else "misses"
    print(f"fleetlike / DDP = {ratio:.3f}x ({verdict} the {TARGET:.1f}x target); load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    info = run_info("bench.resnet", argv)
    save_json(args.json, {**info, "target": TARGET, "ratio": ratio, "fleetlike_images_per_s": fl,
                          "ddp_images_per_s": ddp, "rounds": rounds, "load_average_before": load_before,
                          "load_average_after": load_after, "settings": vars(args)})
    _plot(Path(args.png), rounds, ratio)
    if args.doc:
        body = [
            SECTION, "",
            f"`{info['command']}` ({info['date']}; {info['machine']['cpus']} CPUs, {info['machine']['cpu_model']}, "
            f"torch {info['machine'].get('torch')}). ResNet18 (small-image stem) at {args.size}x{args.size} on the "
            f"digits folder ({args.train_per_class * 10} training images), {WORLD} CPU workers, batch "
            f"{args.batch_size} per worker, one thread each, {args.num_workers} DataLoader worker(s) per rank, "
            f"{args.epochs} epochs per run, the last one measured; the two sides alternate, the order rotating each "
            f"round. Load average (1 min) {load_before[0]:.2f} before and {load_after[0]:.2f} after: the machine is "
            "shared with other jobs, so the rounds vary.", "",
            format_table(columns, table_rows, markdown=True), "",
            f"fleetlike / DDP = **{ratio:.2f}x** (target >= {TARGET:.1f}x). "
            "![resnet](benchmarks/resnet.png)", "",
        ]
        replace_section(args.doc, SECTION, "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fleetlike.io's input pipeline on a generated folder of small JPEGs, side by side in one run.

The benchmark writes ``--images`` JPEGs (``--size`` pixels square, smooth random colour fields
with a little noise, quality 90; made with Pillow under ``--data``, reused when present) and an
``ImageListDataset`` list for them, then measures, each comparison interleaved rep by rep
(`bench._common.interleaved_timings`, medians):

1. **loader**: samples/s of one pass (one rank: ``num_replicas=1``) of ``get_data_loader`` vs
   ``torch.utils.data.DataLoader`` + torch's ``DistributedSampler``, the same dataset, batch and
   ``--workers`` (decode + ``ToTensor``). Target >= 1.0x.
2. **decoded cache**: ``CachedDataset(..., "memory")`` (``num_workers=0``: the memory cache lives
   in this process) warm vs cold; the cold pass decodes and fills the cache, the warm pass reads
   the cache; both apply a random flip and the float conversion after the cache. Two forms of
   the cached sample: the PIL image (then ``RandomHorizontalFlip`` + ``ToTensor``) and the
   compact uint8 tensor (``PILToTensor`` before the cache, then ``RandomHorizontalFlip`` +
   ``ConvertImageDtype``). Target >= 3x. And ``"disk"`` (PIL images) with ``--workers``
   workers (shared by the workers), warm vs cold.
3. **raw-file cache**: the images read through a `FileCache` whose reader is a `ThrottledReader`
   (``--mbps`` MB/s and ``--latency`` ms per file: a network mount), warm (every file local) vs
   cold (an empty cache: every file fetched), ``--workers`` workers.
4. **data-wait share**: a small conv net trains on the images (batch 32, ``--steps`` steps,
   torch on one thread) with ``prefetch=0`` and ``prefetch=2``, with 0 DataLoader workers (the
   training thread, or with prefetch the background thread, decodes) and with 1 worker (a
   process decodes; the prefetch thread only hands batches over); the share of the wall time
   the loop waited on data (``loader.epoch_wait / wall``) and the steps/s.

Usage (from the repository root; CPU-heavy, run it alone)::

    python -m bench.io                        # ~2-4 minutes on 2 busy cores

Writes ``docs/benchmarks/io.json`` and ``io.png``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchSampler

from bench._common import Column, format_table, interleaved_timings, median, run_info, save_json
from fleetlike.io import (
    CachedDataset,
    Compose,
    ConvertImageDtype,
    FileCache,
    ImageListDataset,
    PILToTensor,
    RandomHorizontalFlip,
    ThrottledReader,
    ToTensor,
    get_data_loader,
)

__all__ = ["make_images", "main"]

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64


def make_images(folder: Path, count: int, size: int) -> tuple[Path, int]:
    """``count`` JPEGs under folder/images/<class>/ and folder/train.txt; (list file, bytes)."""
    lst = folder / f"train_{count}_{size}.txt"
    if lst.exists():
        total = sum((folder / line.rsplit(None, 1)[0]).stat().st_size for line in lst.read_text().splitlines())
        return lst, total
    rng = np.random.default_rng(0)
    lines, total = [], 0
    for i in range(count):
        label = i % 10
        rel = f"images_{size}/c{label}/{i:05d}.jpg"
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), dtype=np.int16)
        noisy = np.clip(field + rng.integers(-12, 13, field.shape), 0, 255).astype(np.uint8)
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(noisy).save(folder / rel, quality=90)
        total += (folder / rel).stat().st_size
        lines.append(f"{rel} {label}")
    lst.write_text("\n".join(lines) + "\n")
    return lst, total


def one_pass(loader: Any) -> int:
    n = 0
    for x, _ in loader:
        n += x.shape[0]
    return n


def loaders(data: Path, lst: Path, workers: int, count: int) -> dict[str, float]:
    ds = ImageListDataset(data, lst, transform=ToTensor())
    ours = get_data_loader(ds, BATCH, 1, 0, num_workers=workers, prefetch=2, persistent_workers=workers > 0)
    theirs = DataLoader(ds, BATCH, sampler=TorchSampler(ds, 1, 0), num_workers=workers, persistent_workers=workers > 0)
    return {"get_data_loader": ours, "torch DataLoader": theirs}  # type: ignore[return-value]


def measure_loader(data: Path, lst: Path, workers: int, count: int, reps: int) -> dict[str, Any]:
    fns = {name: (lambda ld=ld: one_pass(ld)) for name, ld in loaders(data, lst, workers, count).items()}
    t = interleaved_timings(fns, reps=reps)
    ours, theirs = count / median(t["get_data_loader"]), count / median(t["torch DataLoader"])
    return {"what": f"loader, {workers} workers", "a": "get_data_loader", "a_sps": ours,
            "b": "torch DataLoader", "b_sps": theirs, "ratio": ours / theirs, "target": 1.0}


def measure_warm_cold(name: str, make: Any, reps: int, count: int, target: float | None) -> dict[str, Any]:
    """Cold: a fresh cache each rep (built outside the timing); warm: one filled cache."""
    warm = make()
    one_pass(warm())
    state: dict[str, Any] = {}

    def prepare_cold() -> None:
        state["cold"] = make()

    prepare_cold()

    def cold() -> None:
        one_pass(state["cold"]())

    cold_t, warm_t = [], []
    for rep in range(reps):
        order = [("cold", cold), ("warm", lambda: one_pass(warm()))]
        for label, fn in order if rep % 2 == 0 else order[::-1]:
            if label == "cold":
                prepare_cold()
            t0 = time.perf_counter()
            fn()
            (cold_t if label == "cold" else warm_t).append(time.perf_counter() - t0)
    w, c = count / median(warm_t), count / median(cold_t)
    return {"what": name, "a": "warm", "a_sps": w, "b": "cold", "b_sps": c, "ratio": w / c, "target": target}


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 16, 3, 2, 1)
        self.c2 = torch.nn.Conv2d(16, 32, 3, 2, 1)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(x.mean((2, 3)))


def wait_share(data: Path, lst: Path, steps: int, reps: int, workers: tuple[int, ...] = (0, 1)) -> list[dict[str, Any]]:
    """The loop with prefetch 0 and 2, for each DataLoader worker count: with 0 workers the
    prefetch thread decodes, with 1 it only hands over the worker's batches."""
    ds = ImageListDataset(data, lst, transform=Compose([RandomHorizontalFlip(), ToTensor()]))
    configs = [(w, p) for w in workers for p in (0, 2)]
    results: dict[tuple[int, int], list[tuple[float, float]]] = {c: [] for c in configs}
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for rep in range(reps):
        k = rep % len(configs)
        for w, prefetch in configs[k:] + configs[:k]:
            loader = get_data_loader(ds, 32, 1, 0, seed=rep, num_workers=w, prefetch=prefetch)
            t0 = time.perf_counter()
            for step, (x, y) in enumerate(loader):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                if step + 1 == steps:
                    break
            wall = time.perf_counter() - t0
            results[(w, prefetch)].append((loader.epoch_wait / wall, steps / wall))
    return [{"what": f"{w} workers, prefetch={p}", "workers": w, "prefetch": p,
             "share": median([r[0] for r in runs]), "steps_per_s": median([r[1] for r in runs])}
            for (w, p), runs in results.items()]


def plot(path: Path, rows: list[dict[str, Any]], waits: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw={"width_ratios": [3, 1.4]})
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["a_sps"] for r in rows], 0.4, label="fleetlike / warm")
    ax.bar(x + 0.2, [r["b_sps"] for r in rows], 0.4, label="torch / cold")
    for i, r in enumerate(rows):
        ax.text(i, max(r["a_sps"], r["b_sps"]) * 1.05, f"{r['ratio']:.2f}x", ha="center", fontsize=9)
    ax.set_xticks(x, [r["what"].replace(", ", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("samples/s")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("fleetlike.io: samples/s (ratio above)")
    bx.bar([w["what"].replace(", ", "\n") for w in waits], [100 * w["share"] for w in waits],
           color=["tab:red" if w["prefetch"] == 0 else "tab:green" for w in waits])
    bx.tick_params(axis="x", labelsize=7)
    bx.set_ylabel("% of wall time waiting on data")
    bx.set_title("training loop")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--size", type=int, default=128, help="image side in pixels")
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fleetlike-bench-io"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--mbps", type=float, default=50.0, help="throttled source, MB/s")
    p.add_argument("--latency", type=float, default=2.0, help="throttled source, ms per file")
    p.add_argument("--steps", type=int, default=40, help="training steps per data-wait run")
    p.add_argument("--only-wait", action="store_true", help="only the data-wait share (a repeat); prints, saves nothing")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "io"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = Path(args.data)
    t0 = time.perf_counter()
    lst, total = make_images(data, args.images, args.size)
    print(f"{args.images} JPEGs of {args.size}x{args.size}, {total / 2**20:.1f} MiB under {data} "
          f"({time.perf_counter() - t0:.1f}s); load average {os.getloadavg()[0]:.2f}", flush=True)
    n = args.images
    if args.only_wait:
        for row in wait_share(data, lst, args.steps, args.reps):
            print(row)
        print("load average (1, 5, 15 min): %.2f %.2f %.2f" % os.getloadavg())
        return 0
    rows = [measure_loader(data, lst, args.workers, n, args.reps)]
    print(rows[-1], flush=True)
    flip = Compose([RandomHorizontalFlip(), ToTensor()])
    plain = ImageListDataset(data, lst)

    def memory() -> Any:
        ds = CachedDataset(plain, "memory", transforms=flip)
        return lambda: get_data_loader(ds, BATCH, 1, 0, prefetch=2)

    rows.append(measure_warm_cold("decoded cache, memory (PIL images), 0 workers", memory, args.reps, n, 3.0))
    print(rows[-1], flush=True)
    compact = ImageListDataset(data, lst, transform=PILToTensor())
    tensor_flip = Compose([RandomHorizontalFlip(), ConvertImageDtype()])

    def memory_u8() -> Any:
        ds = CachedDataset(compact, "memory", transforms=tensor_flip)
        return lambda: get_data_loader(ds, BATCH, 1, 0, prefetch=2)

    rows.append(measure_warm_cold("decoded cache, memory (uint8 tensors), 0 workers", memory_u8, args.reps, n, 3.0))
    print(rows[-1], flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="fleetlike-bench-io-"))
    try:
        def disk() -> Any:
            d = Path(tempfile.mkdtemp(dir=scratch))
            ds = CachedDataset(plain, "disk", d, transforms=flip)
            return lambda: get_data_loader(ds, BATCH, 1, 0, num_workers=args.workers, prefetch=2)

        rows.append(measure_warm_cold(f"decoded cache, disk, {args.workers} workers", disk, args.reps, n, None))
        print(rows[-1], flush=True)
        reader = ThrottledReader(args.mbps * 1e6, latency=args.latency / 1000)

        def files() -> Any:
            cache = FileCache(data, Path(tempfile.mkdtemp(dir=scratch)), reader=reader)
            ds = ImageListDataset(data, lst, transform=ToTensor(), file_cache=cache)
            return lambda: get_data_loader(ds, BATCH, 1, 0, num_workers=args.workers, prefetch=2)

        rows.append(measure_warm_cold(f"raw-file cache, {args.mbps:g} MB/s + {args.latency:g} ms/file, "
                                      f"{args.workers} workers", files, args.reps, n, None))
        print(rows[-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    waits = wait_share(data, lst, args.steps, args.reps)
    load = os.getloadavg()
    cols = [Column("what", "comparison"), Column("a", "a"), Column("a_sps", "a samples/s", "{:.0f}"),
            Column("b", "b"), Column("b_sps", "b samples/s", "{:.0f}"), Column("ratio", "a/b", "{:.2f}x"),
            Column("target", "target", lambda v: f">= {v:g}x")]
    table = format_table(cols, rows, markdown=True)
    wcols = [Column("what", "training loop"), Column("share", "waiting on data", lambda v: f"{100 * v:.1f}%"),
             Column("steps_per_s", "steps/s", "{:.1f}")]
    wtable = format_table(wcols, waits, markdown=True)
    print(table + "\n\n" + wtable)
    print(f"load average (1, 5, 15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    out = Path(args.out)
    save_json(out.with_suffix(".json"), {**run_info("bench.io", argv if argv is not None else sys.argv[1:]),
                                          "images": n, "size": args.size, "bytes": total, "batch": BATCH,
                                          "workers": args.workers, "load_average": list(load),
                                          "rows": rows, "wait_share": waits})
    plot(out.with_suffix(".png"), rows, waits)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Packed image input vs a folder of small files, side by side in one run (images/s).

The same ``--images`` JPEGs (``--size`` pixels square, made by ``bench.io.make_images`` under
``--data``) are read one pass each, through ``get_data_loader`` (batch 64, ``--workers`` loader
workers, one rank), decoded and turned into a uint8 tensor (``PILToTensor``), as:

- **folder, cold**: ``ImageListDataset`` over the files, their pages dropped from the page cache
  before the pass (``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file, after an ``fsync``);
  it decodes with the same run-time decoder as the packed dataset;
- **folder, warm**: the same, the files in the page cache;
- **packed, cold** / **packed, warm**: ``IndexTFRDataset`` over the TFRecord files that
  ``img2tfrecord`` wrote from the same list (cold: the record files' pages dropped);
- **packed, warm, Pillow decoder**: the decoder forced to Pillow (the run-time choice is
  simplejpeg when installed);
- **WebDataset, cold** / **warm**, **litdata, cold** / **warm**: the same JPEGs in each library's
  own format, written by its own writer and read by its own loader (``bench.image_libs``), decoded
  by the same decoder; a library that does not import (the ``bench-io`` extra) is skipped with
  the reason printed and recorded (mosaicml-streaming: see the section);
- **decode bound**: the JPEG bytes already in memory (a list in the dataset), the same loader,
  workers and decoder: what the machine can decode, with nothing read.

Every mode runs once to warm up, then ``--reps`` passes interleaved (``interleaved_timings``);
the table gives the median images/s and the ratios the goals are stated in. Writes
``docs/benchmarks/image_input.json`` / ``.png`` and the section of ``docs/BENCHMARKS.md``.

Usage (from the repository root; CPU-heavy, run it alone)::

    python -m bench.image_input                  # ~1-2 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
from importlib import metadata
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from bench._common import Column, format_table, interleaved_timings, median, replace_section, run_info, save_figure, save_json
from bench.image_libs import drop_cache, library_modes
from bench.io import make_images
from fleetlike.io import Decoder, ImageListDataset, IndexTFRDataset, PILToTensor, get_data_loader
from fleetlike.io.tools.img2tfrecord import img2tfrecord

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64
SECTION = "## Packed image input (`IndexTFRDataset`) vs small files"
LIBRARIES = ("WebDataset", "litdata")
COLUMNS = [Column("mode", "mode"), Column("images_s", "images/s", "{:.0f}"),
           Column("vs_folder_cold", "x folder cold", "{:.2f}"), Column("vs_bound", "x decode bound", "{:.2f}")]


class InMemory(Dataset[Any]):
    """The decode bound: the JPEG bytes held in memory, decoded as the other datasets do."""

    def __init__(self, blobs: list[bytes], labels: list[int]) -> None:
        self.blobs, self.labels, self.decoder, self.transform = blobs, labels, Decoder("auto"), PILToTensor()

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.decoder(self.blobs[index])), self.labels[index]


def version(package: str) -> str | None:
    """``package``'s installed version, or ``None``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def count(loader: Any) -> int:
    n = 0
    for x, _ in loader:
        n += x.shape[0]
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--data", default="/tmp/fleetlike-bench-image-input")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "image_input"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to update ('' = none)")
    args = p.parse_args(argv)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    listing, total = make_images(data, args.images, args.size)
    lines = [line.rsplit(None, 1) for line in listing.read_text().splitlines()]
    entries = [(data / rel, int(label)) for rel, label in lines]
    packed = data / f"packed_{args.images}_{args.size}"
    if not (packed / "train.index").exists():
        img2tfrecord(data, listing, "train", "ImageFold", workers=args.workers, out_dir=packed)
    records = sorted(packed.glob("*.tfrecord"))
    folder_files = [path for path, _ in entries]
    transform = PILToTensor()

    def loader(ds: Dataset[Any], workers: int = args.workers) -> Any:
        return get_data_loader(ds, BATCH, 1, 0, num_workers=workers, prefetch=2, persistent_workers=False)

    folder_ds = ImageListDataset(data, listing, transform=transform)
    packed_ds = IndexTFRDataset(packed, "train.index", transform)
    pillow_ds = IndexTFRDataset(packed, "train.index", transform, decoder="pillow")
    memory_ds = InMemory([p.read_bytes() for p in folder_files], [label for _, label in entries])

    def cold(files: list[Path], ds: Dataset[Any]) -> Any:
        def run() -> int:
            drop_cache(files)
            return count(loader(ds))
        return run

    modes: dict[str, Any] = {
        "folder, cold": cold(folder_files, folder_ds),
        "folder, warm": lambda: count(loader(folder_ds)),
        "packed, cold": cold(records, packed_ds),
        "packed, warm": lambda: count(loader(packed_ds)),
        "packed, warm, Pillow decoder": lambda: count(loader(pillow_ds)),
    }
    lib_modes, skipped = library_modes(data, entries, tag=f"{args.images}_{args.size}", workers=args.workers,
                                       batch=BATCH, shards=max(2, args.workers) * 4, count=count)
    modes.update(lib_modes)
    modes["decode bound (bytes in memory)"] = lambda: count(loader(memory_ds))
    for name, fn in modes.items():  # each reads every image once per pass
        assert fn() == args.images, name
    times = interleaved_timings(modes, reps=args.reps, warmup=0)
    rows = [{"mode": name, "images_s": args.images / median(t), "seconds": median(t)} for name, t in times.items()]
    speed = {r["mode"]: r["images_s"] for r in rows}
    bound = speed["decode bound (bytes in memory)"]
    for r in rows:
        r["vs_folder_cold"] = r["images_s"] / speed["folder, cold"]
        r["vs_bound"] = r["images_s"] / bound
    columns = COLUMNS
    print(format_table(columns, rows))
    info = run_info("bench.image_input", argv if argv is not None else sys.argv[1:])
    payload = {**info, "images": args.images, "size": args.size, "bytes": total, "workers": args.workers,
               "batch": BATCH, "reps": args.reps, "decoder": Decoder("auto").name, "rows": rows,
               "libraries": {name: version(name) for name in ("webdataset", "litdata", "mosaicml-streaming")},
               "skipped": skipped,
               "samples_s": {k: [args.images / x for x in v] for k, v in times.items()}}
    out = Path(args.out)
    save_json(out.with_suffix(".json"), payload)
    plot(out.with_suffix(".png"), rows)
    if args.doc:
        replace_section(args.doc, SECTION, section(payload, columns, rows))


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["mode"] for r in rows]
    ax.barh(names[::-1], [r["images_s"] for r in rows][::-1], color="#4c72b0")
    ax.set_xlabel("images/s (median of the passes)")
    ax.set_title("224x224 JPEGs, 2 loader workers, decode + PILToTensor")
    fig.tight_layout()
    save_figure(fig, path)


def section(payload: dict[str, Any], columns: list[Column], rows: list[dict[str, Any]]) -> str:
    m = payload["machine"]
    return "\n".join([
        SECTION, "",
        f"`{payload['command']}` ({payload['date']}; {m['cpus']} CPUs, {m['cpu_model']}, shared with other jobs): "
        f"{payload['images']} JPEGs of {payload['size']}x{payload['size']} ({payload['bytes'] / 1e6:.1f} MB), one "
        f"pass each through `get_data_loader` (batch {payload['batch']}, {payload['workers']} workers), decode + "
        f"`PILToTensor`, median of {payload['reps']} interleaved passes; JPEG decoder chosen at run time: "
        f"`{payload['decoder']}`. Cold: the files' pages dropped (`posix_fadvise(DONTNEED)`) before each pass.",
        "", format_table(columns, rows, markdown=True), "",
        "![packed vs folder](benchmarks/image_input.png)", "",
        reading(rows, payload["skipped"], payload["samples_s"]),
    ]) + "\n"


def reading(rows: list[dict[str, Any]], skipped: dict[str, str], passes: dict[str, list[float]]) -> str:
    """The goals (packed cold >= 3x folder cold; packed warm within 10 % of the decode bound and
    not slower than the best library row) against this run's figures (``passes``: images/s of
    every pass, by mode)."""
    r = {row["mode"]: row for row in rows}
    packed_cold, packed_warm = r["packed, cold"], r["packed, warm"]

    def spread(mode: str) -> str:
        return f"passes {min(passes[mode]):.0f}-{max(passes[mode]):.0f}"

    others = [row for row in rows if row["mode"].split(",")[0] in LIBRARIES]
    other = max(others, key=lambda row: row["images_s"], default=None)
    lines = [f"Reading: packed, cold is {packed_cold['vs_folder_cold']:.2f}x the folder read cold (goal 3x); "
             f"packed, warm reaches {packed_warm['vs_bound']:.0%} of the decode bound (goal >= 90%; "
             f"{spread('packed, warm')})"]
    if other is not None:
        lines.append(f"and {packed_warm['images_s'] / other['images_s']:.2f}x the best library row "
                     f"({other['mode']}, {other['images_s']:.0f} images/s, {spread(other['mode'])}; goal >= 1)")
    lines.append(f"and {packed_warm['images_s'] / r['folder, warm']['images_s']:.2f}x the folder read warm")
    text = ", ".join(lines) + ". "
    folder_ratio = r["folder, warm"]["images_s"] / r["folder, cold"]["images_s"]
    decoder_ratio = packed_warm["images_s"] / r["packed, warm, Pillow decoder"]["images_s"]
    text += (f"Here a cold read is cheap: dropping the files' pages costs the folder only {folder_ratio:.2f}x "
             "(warm / cold; TI-ACC's 70.8 -> 350.5 images/s comes from another machine and storage), so the packed format's "
             "gain over small files is bounded by that; decode is the cost left, and the run-time decoder "
             f"(`simplejpeg`) gives {decoder_ratio:.2f}x Pillow on the same records. The decode bound goes "
             "through `get_data_loader` (a shuffled sampler, as the packed and folder rows); the library rows "
             "use their own loaders and read their files in order, so a library row can pass it.")
    for name, reason in skipped.items():
        text += f" No {name} row: {reason}."
    return text


if __name__ == "__main__":
    main()

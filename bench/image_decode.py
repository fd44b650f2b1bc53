"""Per-image JPEG decode and transform times of the decoders that install here (µs, one process).

Why: on the local disk and a fast volume every reader of ``bench.image_input`` is decode-bound, so
the decoder and what happens between the decoder and the batch set the images/s. Each row decodes
the same ``--images`` JPEGs (``bench.io.make_images``, ``--sizes`` pixels square) one after the
other in one process with one torch thread, ``--reps`` interleaved rounds, the median per image:

- **Pillow** (``Image.open`` + ``convert("RGB")``) and **simplejpeg** (libjpeg-turbo's
  ``decode_jpeg``), both with the accurate DCT and upsampling (the same pixels); **simplejpeg,
  fast DCT + upsampling** (``fastdct=True, fastupsample=True``: other pixels, not used by
  fleetlike);
- **DCT-domain scaling to half size** (what a transform that shrinks an image 2x or more could
  ask of the decoder): Pillow's ``Image.draft`` and simplejpeg's ``min_height``/``min_width``;
- **torchvision** ``io.decode_jpeg``: a row where ``torchvision`` imports beside the installed
  torch (the reason is recorded otherwise);
- the paths from bytes to the tensor fleetlike's datasets hand to the collate: ``Decoder`` (PIL
  image) + ``PILToTensor`` against ``Decoder.array`` + ``PILToTensor`` (no PIL image), for the
  bench's transform and for the ResNet example's training transform
  (``RandomResizedCrop(224)``, flip, ``ToTensor``, ``Normalize``), and the collate's copy per
  image (a batch of 64 stacked; in a DataLoader worker torch's collate makes the batch a new
  shared-memory segment, fleetlike's loader a reused slot, which its process copies out).

Writes ``docs/benchmarks/image_decode.json`` / ``.png`` and the section of docs/BENCHMARKS.md.

Usage (from the repository root; one CPU, under the machine's CPU lock when it is shared)::

    python -m bench.image_decode                    # ~1 minute
"""

from __future__ import annotations

import argparse
import io as _io
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from bench._common import Column, format_table, median, replace_section, run_info, save_figure, save_json
from bench.io import make_images
from fleetlike.io import Compose, Decoder, Normalize, PILToTensor, RandomHorizontalFlip, RandomResizedCrop, ToTensor
from fleetlike.io.batch_slots import BatchSlots, SlotCollate

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## JPEG decoders and the path to the tensor (per image)"
COLUMNS = [Column("size", "image"), Column("row", "decoder / path"), Column("us", "µs per image", "{:.0f}"),
           Column("images_s", "images/s (one core)", "{:.0f}"), Column("vs_pillow", "x Pillow", "{:.2f}")]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def torchvision_decoder() -> tuple[Callable[[bytes], Any] | None, str | None]:
    """torchvision's ``decode_jpeg`` on bytes, or None and why it is not usable here."""
    try:
        from torchvision.io import decode_jpeg
    except Exception as error:  # a build for another torch raises RuntimeError at import
        return None, f"{type(error).__name__}: {error}".splitlines()[0][:200]

    def decode(data: bytes) -> Any:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return decode, None


def rows_for(blobs: list[bytes], size: int) -> dict[str, Callable[[int], Any]]:
    """Every row's work on image ``i`` (``size`` x ``size`` JPEGs)."""
    import simplejpeg
    from PIL import Image

    pil_decoder, decoder = Decoder("pillow"), Decoder("auto")

    def pillow(i: int) -> Any:
        with Image.open(_io.BytesIO(blobs[i])) as image:
            return image.convert("RGB")

    def draft(i: int) -> Any:
        with Image.open(_io.BytesIO(blobs[i])) as image:
            image.draft("RGB", (image.width // 2, image.height // 2))
            return image.convert("RGB")

    train = Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(), Normalize(MEAN, STD)])
    to_tensor = PILToTensor()
    rows: dict[str, Callable[[int], Any]] = {
        "Pillow": pillow,
        "simplejpeg": lambda i: simplejpeg.decode_jpeg(blobs[i]),
        "simplejpeg, fast DCT + upsampling": lambda i: simplejpeg.decode_jpeg(blobs[i], fastdct=True, fastupsample=True),
        "Pillow, draft to half size": draft,
        "simplejpeg, scaled to half size": lambda i: simplejpeg.decode_jpeg(blobs[i], min_height=size // 2,
                                                                            min_width=size // 2),
        "Decoder('pillow') + PILToTensor": lambda i: to_tensor(pil_decoder(blobs[i])),
        "Decoder (PIL image) + PILToTensor": lambda i: to_tensor(decoder(blobs[i])),
        "Decoder.array + PILToTensor": lambda i: to_tensor(decoder.array(blobs[i])),
        "Decoder (PIL image) + train transform": lambda i: train(decoder(blobs[i])),
        "Decoder.array + train transform": lambda i: train(decoder.array(blobs[i])),
    }
    tv, _ = torchvision_decoder()
    if tv is not None:
        rows["torchvision.io.decode_jpeg"] = lambda i: tv(blobs[i])
    return rows


class _Worker:
    """What ``get_worker_info()`` returns in a DataLoader worker (the fields read here)."""

    id = 0


def collate_us(blobs: list[bytes], batch: int = 64) -> dict[str, float]:
    """µs per image of the collate into a batch of ``batch``: in this process's memory; in
    shared memory as torch's ``default_collate`` does it in a DataLoader worker (a new segment per
    batch); into a reused slot as fleetlike's loader does it in a worker (`BatchSlots`), and the
    copy out of the slot that the loader's process then makes."""
    from torch.utils.data._utils import worker

    decoder, to_tensor = Decoder("auto"), PILToTensor()
    samples = [(to_tensor(decoder.array(b)), 0) for b in blobs[:batch]]
    slots = BatchSlots(workers=1, per_worker=1)
    slotted = SlotCollate(slots)
    received: list[Any] = []

    def into_slot() -> None:
        received[:] = [slotted(samples)]
        slots.release(0)

    out = {}
    for name, info, fn in ((f"collate, batch of {batch} (per image)", None, lambda: default_collate(samples)),
                           (f"collate in a worker, shared memory, batch of {batch} (per image)", _Worker(),
                            lambda: default_collate(samples)),
                           (f"collate in a worker, reused slot, batch of {batch} (per image)", _Worker(), into_slot),
                           (f"copy out of the slot, batch of {batch} (per image)", None,
                            lambda: slots.copy_out(received[0][0], 0))):
        saved, worker._worker_info = worker._worker_info, info  # what get_worker_info() reads
        try:
            fn()
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        finally:
            worker._worker_info = saved
        out[name] = median(times) / len(samples) * 1e6
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--sizes", default="224,448")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--data", default="/tmp/fleetlike-bench-image-input")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "image_decode"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to update ('' = none)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as in a DataLoader worker
    data = Path(args.data)
    rows: list[dict[str, Any]] = []
    for size in (int(s) for s in args.sizes.split(",")):
        listing, _ = make_images(data, args.images, size)
        blobs = [(data / line.rsplit(None, 1)[0]).read_bytes() for line in listing.read_text().splitlines()]
        work = rows_for(blobs, size)
        times: dict[str, list[float]] = {name: [] for name in work}
        for name, fn in work.items():  # warm-up
            fn(0)
        for rep in range(args.reps):
            names = list(work)
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                torch.manual_seed(rep)
                t0 = time.perf_counter()
                for i in range(len(blobs)):
                    work[name](i)
                times[name].append((time.perf_counter() - t0) / len(blobs) * 1e6)
        per = {name: median(v) for name, v in times.items()} | collate_us(blobs)
        for name, us in per.items():
            rows.append({"size": f"{size}x{size}", "row": name, "us": us, "images_s": 1e6 / us,
                         "vs_pillow": per["Pillow"] / us if not name.startswith(("collate", "copy out")) else None})
    _, tv_reason = torchvision_decoder()
    print(format_table(COLUMNS, rows))
    if tv_reason:
        print(f"bench.image_decode: no torchvision row: {tv_reason}")
    info = run_info("bench.image_decode", argv if argv is not None else sys.argv[1:])
    payload = {**info, "images": args.images, "reps": args.reps, "rows": rows, "torchvision": tv_reason,
               "versions": versions()}
    out = Path(args.out)
    save_json(out.with_suffix(".json"), payload)
    plot(out.with_suffix(".png"), rows)
    if args.doc:
        replace_section(args.doc, SECTION, section(payload, rows))


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("pillow", "simplejpeg", "torchvision", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        shown = [r for r in rows if r["size"] == size][::-1]
        ax.barh([r["row"] for r in shown], [r["us"] for r in shown], color="#4c72b0")
        ax.set_xlabel("µs per image (one core)")
        ax.set_title(f"{size} JPEGs", fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def section(payload: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    m, v = payload["machine"], payload["versions"]
    tv = (f"No torchvision row: {payload['torchvision']} (torchvision 0.28.0 on PyPI is a CUDA build, which does "
          "not load beside the CPU torch 2.13.0; 0.29 needs torch >= 2.14)." if payload["torchvision"] else "")

    def us(size: str, row: str) -> float:
        return next(r["us"] for r in rows if r["size"] == size and r["row"] == row)

    size = rows[0]["size"]
    saved = us(size, "Decoder (PIL image) + PILToTensor") - us(size, "Decoder.array + PILToTensor")
    reading = (f"Reading ({size}): simplejpeg decodes in {us(size, 'simplejpeg'):.0f} µs against Pillow's "
               f"{us(size, 'Pillow'):.0f} µs; from bytes to the tensor, `Decoder.array` + `PILToTensor` takes "
               f"{us(size, 'Decoder.array + PILToTensor'):.0f} µs against {us(size, 'Decoder (PIL image) + PILToTensor'):.0f}"
               f" µs through the PIL image ({saved:.0f} µs saved per image: the PIL image's copy and its conversion "
               "back to an array). In a loader worker torch's collate copies into a new shared-memory batch, "
               f"{us(size, 'collate in a worker, shared memory, batch of 64 (per image)'):.0f} µs per image "
               f"(against {us(size, 'collate, batch of 64 (per image)'):.0f} µs in the process's own memory): the "
               "kernel allocates and zeroes the new segment's pages; fleetlike's loader collates into a reused "
               f"slot, {us(size, 'collate in a worker, reused slot, batch of 64 (per image)'):.0f} µs, and its "
               f"process copies the batch out, {us(size, 'copy out of the slot, batch of 64 (per image)'):.0f} µs. "
               f"DCT-domain scaling to half size (where a transform shrinks an image 2x or more) takes simplejpeg "
               f"{us(size, 'simplejpeg, scaled to half size'):.0f} µs and Pillow's draft "
               f"{us(size, 'Pillow, draft to half size'):.0f} µs; fleetlike does not use it (it changes the pixels "
               "against a full decode and a resize, and the ResNet example's crops are resized up as often as "
               "down).")
    return "\n".join([
        SECTION, "",
        f"`{payload['command']}` ({payload['date']}; {m['cpus']} CPUs, {m['cpu_model']}; one process, one torch "
        f"thread; Pillow {v['pillow']}, simplejpeg {v['simplejpeg']}, torch {v['torch']}): {payload['images']} JPEGs "
        f"per size (`bench.io.make_images`, quality 90), median of {payload['reps']} interleaved rounds. "
        "*x Pillow* is against Pillow's decode of the same image.",
        "", format_table(COLUMNS, rows, markdown=True), "",
        "![decoders](benchmarks/image_decode.png)", "", reading + (" " + tv if tv else ""),
    ]) + "\n"


if __name__ == "__main__":
    main()

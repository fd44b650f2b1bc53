"""What the sampler's block shuffle gives up in randomness: how mixed its batches are.

A fully shuffled epoch draws each batch from the whole dataset; the block shuffle
(`DistributedSampler` ``block_size=k``, ``blocks_per_window=g``) draws it from the ``g`` blocks of
one window. This counts, over one epoch of ``--classes`` x ``--per-class`` samples cut into batches
of ``--batch``, for the plain shuffle and each ``k``/``g``:

- **blocks/batch**: distinct blocks of ``k`` consecutive records a batch holds (the plain
  shuffle's figure is for blocks of 64);
- **classes/batch, files in class order**: distinct labels per batch when the records were
  packed sorted by class, as ``img2tfrecord`` writes a class-sorted image list: a block is then
  one or two classes, so a batch holds about ``g`` * 1-2 classes;
- **classes/batch, files in shuffled order**: the same when the list was shuffled before packing
  (``shuf list.txt``): a block is a random sample, and the batches mix as the plain shuffle's;
- **records read ahead**: ``g * k``, the records one window reads ahead (per rank).

Writes ``docs/benchmarks/block_shuffle_mix.json`` / ``.png`` and the section of
``docs/BENCHMARKS.md``.

Usage (from the repository root; a few seconds, one process)::

    python -m bench.block_shuffle_mix
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench._common import Column, format_table, replace_section, run_info, save_figure, save_json
from fleetlike.io.sampler import block_order

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Block shuffle: how mixed the batches are"
CONFIGS = ((None, None), (16, 8), (64, 8), (64, 32), (256, 8), (256, 32))
COLUMNS = [Column("setting", "order"), Column("blocks", "blocks/batch", "{:.1f}"),
           Column("classes_sorted", "classes/batch, files in class order", "{:.1f}"),
           Column("classes_shuffled", "classes/batch, files in shuffled order", "{:.1f}"),
           Column("ahead", "records read ahead", "{}")]


def per_batch(order: np.ndarray, values: np.ndarray, batch: int) -> float:
    """Mean distinct ``values`` over the full batches of ``order``."""
    full = len(order) // batch * batch
    rows = np.sort(values[order[:full]].reshape(-1, batch), axis=1)
    return float(np.mean(1 + np.count_nonzero(np.diff(rows, axis=1), axis=1)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "block_shuffle_mix"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to update ('' = none)")
    args = p.parse_args(argv)
    n = args.classes * args.per_class
    sorted_labels = np.repeat(np.arange(args.classes), args.per_class)       # record i's class, class-sorted files
    shuffled_labels = np.random.default_rng(args.seed).permutation(sorted_labels)  # the list shuffled before packing
    rows = []
    for k, g in CONFIGS:
        gen = torch.Generator().manual_seed(args.seed)
        order = np.asarray(torch.randperm(n, generator=gen).tolist() if k is None else block_order(n, k, g, gen))
        rows.append({"setting": "plain shuffle" if k is None else f"block_size={k}, blocks_per_window={g}",
                     "block_size": k, "blocks_per_window": g,
                     "blocks": per_batch(order, np.arange(n) // (k or 64), args.batch),
                     "classes_sorted": per_batch(order, sorted_labels, args.batch),
                     "classes_shuffled": per_batch(order, shuffled_labels, args.batch),
                     "ahead": "-" if k is None else k * g})
    print(format_table(COLUMNS, rows))
    payload = {**run_info("bench.block_shuffle_mix", argv if argv is not None else sys.argv[1:]),
               "classes": args.classes, "per_class": args.per_class, "batch": args.batch, "rows": rows}
    out = Path(args.out)
    save_json(out.with_suffix(".json"), payload)
    plot(out.with_suffix(".png"), rows)
    if args.doc:
        replace_section(args.doc, SECTION, section(payload, rows))


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r["classes_sorted"] for r in rows], 0.4, label="files in class order")
    ax.barh(y + 0.2, [r["classes_shuffled"] for r in rows], 0.4, label="files in shuffled order")
    ax.set_yticks(y, [r["setting"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("distinct classes per batch (mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def section(payload: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    plain = rows[0]
    default = next(r for r in rows if r["block_size"] == 64 and r["blocks_per_window"] == 8)
    return "\n".join([
        SECTION, "",
        f"`{payload['command']}` ({payload['date']}): one epoch of {payload['classes']} classes x "
        f"{payload['per_class']} samples in batches of {payload['batch']}, the plain shuffle against the "
        "sampler's block shuffle (`DistributedSampler(block_size=k, blocks_per_window=g)`); a count, no "
        "timing. Files in class order: the records packed from a class-sorted list (as `img2tfrecord` "
        "writes `image_list`'s); files in shuffled order: the list shuffled before packing.", "",
        format_table(COLUMNS, rows, markdown=True), "",
        "![classes per batch](benchmarks/block_shuffle_mix.png)", "",
        f"Reading: with files in class order a block is one or two classes, so a batch under "
        f"`block_size=64, blocks_per_window=8` holds {default['classes_sorted']:.1f} classes against the plain "
        f"shuffle's {plain['classes_sorted']:.1f}; packed from a shuffled list it holds "
        f"{default['classes_shuffled']:.1f}, as mixed as the plain shuffle. Shuffle the list before packing "
        "when the block shuffle will read it; a larger window mixes more blocks at the cost of more records "
        "read ahead.",
    ]) + "\n"


if __name__ == "__main__":
    main()

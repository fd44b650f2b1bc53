"""The ResNet example reading the folder vs the same images packed (``--data_format tfrecord``).

``train_with_fleet.py`` on 2 CPU workers (``bench.resnet``'s digits recipe: ResNet18, 32x32
JPEGs), once with ``--data_format folder`` and once with ``--data_format tfrecord`` (the lists
packed by ``img2tfrecord`` into ``data_dir/tfrecord``), alternating over ``--rounds``; the table
gives the last epoch's training images/s (median over rounds) and the final top-1 of each.

Usage (from the repository root)::

    python -m bench.resnet_formats               # 2 rounds, ~3 minutes on 2 cores

Writes ``docs/benchmarks/resnet_formats.json`` and the section of ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._common import Column, format_table, median, replace_section, run_info, save_json
from bench.resnet import EXAMPLE, ROOT, WORLD, _recipe, _run
from fleetlike.io.tools.img2tfrecord import img2tfrecord

__all__ = ["main"]

SECTION = "## ResNet example: folder vs packed input (`--data_format`)"
FORMATS = ("folder", "tfrecord")


def run(args: argparse.Namespace, data: Path, work: Path, fmt: str) -> dict[str, Any]:
    out = work / fmt
    shutil.rmtree(out, ignore_errors=True)
    _run([sys.executable, "-m", "fleetlike.launch", f"--nproc_per_node={WORLD}", "--started_port=auto",
          f"--log_dir={work / 'log'}", str(EXAMPLE / "train_with_fleet.py"), *_recipe(args, data),
          f"--data_format={fmt}", f"--model_save_dir={out}", "--resume=False"], work, args.timeout)
    return json.loads((out / "history.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (the last one is measured)")
    p.add_argument("--train_per_class", type=int, default=100)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--num_workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "resnet_formats.json"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"), help="Markdown file to update ('' = none)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(EXAMPLE))
    from make_dataset import make_digits

    results: dict[str, list[dict[str, Any]]] = {f: [] for f in FORMATS}
    with tempfile.TemporaryDirectory(prefix="bench-resnet-formats-") as tmp:
        work = Path(tmp)
        data = make_digits(work / "digits", size=args.size, train_per_class=args.train_per_class)
        for split in ("train", "val"):
            img2tfrecord(data / split, data / f"{split}.txt", split, "ImageFold", workers=2, out_dir=data / "tfrecord")
        for r in range(args.rounds):
            for fmt in (FORMATS if r % 2 == 0 else FORMATS[::-1]):
                last = run(args, data, work, fmt)["epochs"][-1]
                results[fmt].append(last)
                print(f"round {r + 1} {fmt}: {last['images_per_s']:.1f} images/s, top-1 {100 * last['top1']:.2f}%",
                      flush=True)
    info = run_info("bench.resnet_formats", argv if argv is not None else sys.argv[1:])
    payload = {**info, "rounds": args.rounds, "epochs": args.epochs, "train_per_class": args.train_per_class,
               "size": args.size, "runs": results}
    save_json(args.json, payload)
    text = section(payload)
    print(text)
    if args.doc:
        replace_section(args.doc, SECTION, text)
    return 0


def section(payload: dict[str, Any]) -> str:
    """The BENCHMARKS section of a run (``payload``: what `main` saved)."""
    runs = payload["runs"]
    rows = [{"format": f, "images_s": median([e["images_per_s"] for e in runs[f]]),
             "range": f"{min(e['images_per_s'] for e in runs[f]):.1f}-{max(e['images_per_s'] for e in runs[f]):.1f}",
             "top1": 100 * runs[f][-1]["top1"]} for f in FORMATS]
    columns = [Column("format", "--data_format"), Column("images_s", "training images/s", "{:.1f}"),
               Column("range", "range over runs"), Column("top1", "top-1 %", "{:.2f}")]
    m = payload["machine"]
    ratio = rows[1]["images_s"] / rows[0]["images_s"]
    same = abs(rows[0]["top1"] - rows[1]["top1"]) < 1e-9
    return "\n".join([
        SECTION, "",
        f"`{payload['command']}` ({payload['date']}; {m['cpus']} CPUs, shared): `train_with_fleet.py` on {WORLD} "
        f"CPU workers, ResNet18 on {payload['train_per_class'] * 10} digits JPEGs of {payload['size']}x"
        f"{payload['size']}, {payload['epochs']} epochs, the last epoch's training images/s (median of "
        f"{payload['rounds']} alternating runs) and the final top-1.", "",
        format_table(columns, rows, markdown=True), "",
        f"Reading: packed / folder = {ratio:.2f}x images/s (medians of {payload['rounds']} runs each on cores shared "
        "with other jobs: see the range). Top-1: "
        + ("the same from both formats (the same decoded images are trained on; `tests/test_examples_resnet.py` "
           "checks the parameters are equal)." if same else f"{rows[0]['top1']:.2f}% vs {rows[1]['top1']:.2f}%."),
    ]) + "\n"


if __name__ == "__main__":
    sys.exit(main())

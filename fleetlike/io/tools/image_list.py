"""``python -m fleetlike.io.tools.image_list``: TI-ACC's ``general_image_list.py``.

Writes the image list ``img2tfrecord`` packs: one line ``relative/path label`` per image of
``--img_dir/<class>/...`` (classes and files in sorted order, as torchvision's ImageFolder).
``--label_str2int`` gives the class name -> label mapping (a pickled dict, TI-ACC's format, or
JSON); without it the classes are numbered 0..n-1 in sorted order and the mapping is saved
beside the list as ``<img_list>.label_str2int.pkl``. An output that is one of the inputs (an
image, the mapping) is refused.

Example:
    $ python -m fleetlike.io.tools.image_list --img_dir val_demo/ --img_list val_list
    wrote 50000 lines (1000 classes) to val_list; labels in val_list.label_str2int.pkl
"""

from __future__ import annotations

import argparse
import io as _io
import json
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from fleetlike.io.datasets import IMAGE_EXTENSIONS

__all__ = ["image_list", "load_label_map", "main", "refuse_overwrite", "run_tool"]


class _MappingUnpickler(pickle.Unpickler):
    """A label map is a dict of str -> int: nothing else is loaded from the file."""

    def find_class(self, module: str, name: str) -> type:
        raise pickle.UnpicklingError(f"a label_str2int file holds a dict of str -> int; it refers to {module}.{name}")


def load_label_map(path: str | os.PathLike[str]) -> dict[str, int]:
    """The class name -> label mapping in ``path`` (pickled dict or JSON object), checked."""
    raw = Path(path).read_bytes()
    try:
        mapping = _MappingUnpickler(_io.BytesIO(raw)).load() if raw[:1] == b"\x80" else json.loads(raw)
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ValueError(f"--label_str2int {os.fspath(path)}: not a pickled dict or a JSON object: {error}") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"--label_str2int {os.fspath(path)}: holds a {type(mapping).__name__}, not a dict")
    for name, label in mapping.items():
        if not isinstance(name, str) or isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"--label_str2int {os.fspath(path)}: entry {name!r}: {label!r}; each entry maps a "
                             "class name (str) to a label (int >= 0)")
    return mapping


def refuse_overwrite(outputs: Sequence[Path], inputs: set[Path], tool: str) -> None:
    """Raise if an output path is one of the inputs (resolved, so links and ``..`` count)."""
    for out in outputs:
        resolved = out.resolve()
        if resolved in inputs:
            raise ValueError(f"{tool}: the output {str(out)!r} is one of the inputs ({resolved}); writing it "
                             "would destroy that input. Choose another output name or folder")


def image_list(img_dir: str | os.PathLike[str], img_list: str | os.PathLike[str],
               label_str2int: str | os.PathLike[str] | None = None) -> tuple[int, int, Path]:
    """Write the list; ``(lines, classes, mapping file)``."""
    root = Path(img_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"image_list: --img_dir {str(root)!r} is not a directory")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"image_list: {str(root)!r} has no class folders (img_dir/<class>/<image>)")
    mapping_file = Path(label_str2int) if label_str2int is not None else Path(f"{os.fspath(img_list)}.label_str2int.pkl")
    if label_str2int is not None:
        mapping = load_label_map(mapping_file)
        missing = [c for c in classes if c not in mapping]
        if missing:
            raise ValueError(f"image_list: class folder(s) {missing[:5]} of {str(root)!r} are not in --label_str2int "
                             f"{str(mapping_file)!r}; add them or remove the folders")
    else:
        mapping = {c: i for i, c in enumerate(classes)}
    lines, inputs = [], {mapping_file.resolve()} if label_str2int is not None else set()
    lowered = tuple(e.lower() for e in IMAGE_EXTENSIONS)
    for name in classes:
        for dirpath, _, files in sorted(os.walk(root / name, followlinks=True)):
            for f in sorted(files):
                if f.lower().endswith(lowered):
                    full = Path(dirpath) / f
                    inputs.add(full.resolve())
                    lines.append(f"{full.relative_to(root).as_posix()} {mapping[name]}\n")
    if not lines:
        raise FileNotFoundError(f"image_list: no image (ending in {', '.join(IMAGE_EXTENSIONS)}) under {str(root)!r}")
    outputs = [Path(img_list)] + ([] if label_str2int is not None else [mapping_file])
    refuse_overwrite(outputs, inputs, "image_list")
    tmp = Path(f"{os.fspath(img_list)}.tmp{os.getpid()}")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, img_list)
    if label_str2int is None:
        with open(mapping_file, "wb") as fh:
            pickle.dump(mapping, fh, protocol=4)
    return len(lines), len(classes), mapping_file


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetlike.io.tools.image_list",
                                     description="Write an image list ('relative/path label' lines) of a class folder tree.")
    parser.add_argument("--img_dir", required=True, help="folder of class folders: img_dir/<class>/<image>")
    parser.add_argument("--img_list", required=True, help="the list file to write")
    parser.add_argument("--label_str2int", default=None,
                        help="class name -> label mapping (pickled dict or JSON); default: sorted classes numbered "
                             "0..n-1, saved as <img_list>.label_str2int.pkl")
    args = parser.parse_args(argv)

    def work() -> str:
        count, classes, mapping = image_list(args.img_dir, args.img_list, args.label_str2int)
        return f"wrote {count} lines ({classes} classes) to {args.img_list}; labels in {mapping}"

    return run_tool("image_list", work)


def run_tool(tool: str, work: Callable[[], str]) -> int:
    """A tool's exit status: 0 with ``work()``'s summary printed, 2 with its input error printed."""
    try:
        summary = work()
    except (OSError, ValueError) as error:
        print(f"{tool}: error: {error}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

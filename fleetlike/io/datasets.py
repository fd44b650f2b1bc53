"""Image datasets: Paddle's ``path label`` lists and an ImageFolder (decoded by `Decoder`:
simplejpeg for JPEGs when installed, else Pillow; the same pixels either way).

`ImageListDataset` reads seed 003's ImageNet layout: a ``train.txt`` / ``val.txt`` whose lines
are ``relative/path label``; `ImageFolder` reads torchvision's ``root/class_name/image`` layout.
Both return ``(transform(image), label)``, read the file bytes through a `FileCache` when one is
given (a slow source such as a network mount is fetched once per node), and keep decoded images
in a `CachedDataset` when ``cache_type`` is given (as Light's ImageFolder): the transform then
runs after the cache (random augmentation stays random), or before it with
``cache_transform=True`` (for a deterministic transform such as a resize).

Bad input is named where it is: a list line that does not parse (file, line number, the line),
a label that is not an int or is outside ``[0, num_classes)``, a missing or undecodable image
(path and index), an image whose path resolves outside the data root (a symlink pointing
elsewhere: `DataRootError`, never skipped, naming the path and where it points). ``on_error="skip"`` returns a `Skipped` for an unreadable image instead;
`get_data_loader` leaves it out of the batch and reports the count at the end of the pass.

Example:
    >>> train = ImageListDataset("data/ILSVRC2012", "data/ILSVRC2012/train.txt", transform=t, num_classes=1000)
    >>> train[0]
    (tensor(...), 65)
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Protocol

from torch.utils.data import Dataset

from fleetlike.comm import parse_choice
from fleetlike.io.cached import CachedDataset, CacheType
from fleetlike.io.decode import ARRAY_MODES, Decoder, DecoderName
from fleetlike.io.loader import Skipped
from fleetlike.io.pillow import pil
from fleetlike.io.transforms import takes_arrays

__all__ = ["DataRootError", "IMAGE_EXTENSIONS", "ImageFolder", "ImageListDataset", "ImageReadError", "OnError", "inside_root",
           "read_image_list"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class ImageReadError(OSError):
    """An image that is missing or does not decode (names the path and the sample index)."""


class DataRootError(ValueError):
    """A sample's path resolves outside the data root (through a symlink). The list's own paths
    are kept inside the root (no absolute path, no ``..``); a link inside the root that points
    elsewhere would reach the same files (another user's, ``/etc``), so it is refused as well,
    whatever ``on_error`` says: it is not an unreadable image but a root that is not what it
    seems. A root that is itself a link is followed (the check is against where it points)."""


def inside_root(root: Path, path: Path) -> Path:
    """``path`` resolved, or `DataRootError` when that is outside ``root`` (resolved)."""
    real, base = path.resolve(), root.resolve()
    if real != base and base not in real.parents:
        raise DataRootError(
            f"{str(path)!r} resolves to {str(real)!r}, outside the data root {str(base)!r} (a symbolic link "
            "points out of it); put the files inside the root, or give the folder that holds them as the root")
    return real


class OnError(str, enum.Enum):
    """What an unreadable image does: ``raise`` (default) or ``skip`` (counted, reported)."""

    RAISE = "raise"
    SKIP = "skip"


class ByteSource(Protocol):
    def read_bytes(self, path: str | os.PathLike[str]) -> bytes: ...


def read_image_list(list_file: str | os.PathLike[str], num_classes: int | None = None) -> list[tuple[str, int]]:
    """``[(relative path, label)]`` from a ``path label`` list; blank lines are skipped and a
    path may contain spaces (the label is the last field)."""
    entries = []
    with open(list_file, "rb") as fh:
        for lineno, data in enumerate(fh, 1):
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{list_file}:{lineno}: byte {data[exc.start]:#04x} at column {exc.start + 1} "
                                 "is not UTF-8; save the list as UTF-8") from None
            line = raw.strip()
            if not line:
                continue
            parts = line.rsplit(None, 1)
            if len(parts) != 2:
                raise ValueError(f"{list_file}:{lineno}: cannot parse {line!r}: expected 'relative/path label'")
            path, label_text = parts
            try:
                label = int(label_text)
            except ValueError:
                raise ValueError(f"{list_file}:{lineno}: label {label_text!r} in {line!r} is not an int") from None
            if label < 0 or (num_classes is not None and label >= num_classes):
                bound = f"[0, {num_classes})" if num_classes is not None else ">= 0"
                raise ValueError(f"{list_file}:{lineno}: label {label} in {line!r} is outside {bound}; fix the "
                                 "list or num_classes")
            pure = PurePosixPath(path)
            if pure.is_absolute() or ".." in pure.parts or PureWindowsPath(path).drive:
                raise ValueError(f"{list_file}:{lineno}: path {path!r} leaves the data root (absolute, or "
                                 "with '..'); list paths relative to the root, inside it")
            entries.append((path, label))
    return entries


class _Decoded(Dataset[Any]):
    """What the decoded cache holds: ``(image, label)``, transformed first with cache_transform."""

    def __init__(self, images: _Images) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Any:
        return self.images.read(index, self.images.cache_transform)


class _Images(Dataset[Any]):
    """Decoding, errors, the byte source and the decoded cache shared by both datasets."""

    def __init__(self, root: str | os.PathLike[str], samples: list[tuple[str, int]],
                 transform: Callable[[Any], Any] | None, target_transform: Callable[[int], Any] | None,
                 on_error: OnError | str, file_cache: ByteSource | None, mode: str,
                 cache: dict[str, Any]) -> None:
        self.root = Path(root)
        self._real_root = self.root.resolve()
        self.samples = samples
        self.transform, self.target_transform = transform, target_transform
        self.on_error = parse_choice(OnError, on_error, what="on_error", noun="error policy")
        self.file_cache, self.mode = file_cache, mode
        self.decoder = Decoder(DecoderName.AUTO, mode)  # the fastest installed (simplejpeg for JPEGs), else Pillow
        self.cache_transform = bool(cache.pop("cache_transform"))
        if self.cache_transform and cache["cache_type"] is None:
            cache["cache_type"] = CacheType.MEMORY  # Light's: asking to cache the transform's output caches
        self.cache: CachedDataset | None = None
        if cache["cache_type"] is not None:
            after = None if self.cache_transform else transform
            self.cache = CachedDataset(_Decoded(self), transforms=after, **cache)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def targets(self) -> list[int]:
        return [label for _, label in self.samples]

    def path(self, index: int) -> Path:
        return self.root / self.samples[index][0]

    def _arrays(self) -> bool:
        """Whether the transform takes the decoded array (then the PIL image is never made)."""
        return self.mode in ARRAY_MODES and takes_arrays(self.transform)

    def load(self, index: int, array: bool = False) -> Any:
        """The decoded PIL image of sample ``index`` (no transform), or with ``array`` its
        ``H x W x C`` uint8 array (`Decoder.array`); raises `ImageReadError`."""
        path = self.path(index)
        inside_root(self._real_root, path)
        Image = pil()
        try:
            data = self.file_cache.read_bytes(path) if self.file_cache is not None else path.read_bytes()
            return self.decoder.array(data) if array else self.decoder(data)
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            raise ImageReadError(f"sample {index}: cannot read image {path}: {error}") from error

    def read(self, index: int, transform: bool) -> Any:
        """``(image, label)`` (the image transformed if ``transform``), or a `Skipped`."""
        try:
            image: Any = self.load(index, transform and self._arrays())
        except ImageReadError as error:
            if self.on_error is OnError.SKIP:
                return Skipped(index, str(self.path(index)), str(error.__cause__ or error))
            raise
        if transform and self.transform is not None:
            image = self.transform(image)
        return image, self.samples[index][1]

    def __getitem__(self, index: int) -> Any:
        sample = self.read(index, True) if self.cache is None else self.cache[index]
        if isinstance(sample, Skipped) or self.target_transform is None:
            return sample
        return sample[0], self.target_transform(sample[1])


class ImageListDataset(_Images):
    """Paddle's image list: ``root/<path>`` with the label on the same line of ``list_file``.

    ``num_classes`` bounds the labels; ``on_error`` in raise / skip; ``file_cache``: a
    `FileCache` over a slow ``root``; ``mode``: Pillow's mode to convert to.
    Decoded cache (`CachedDataset`): ``cache_type`` None (none), memory, disk or auto, with
    ``cache_dir``, ``cache_size`` (bytes) and ``cache_transform`` (cache the transformed image).

    Example:
        >>> ds = ImageListDataset("data", "data/val.txt", transform=Compose([Resize(256), CenterCrop(224), ToTensor()]))
    """

    def __init__(self, root: str | os.PathLike[str], list_file: str | os.PathLike[str],
                 transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[int], Any] | None = None, *, num_classes: int | None = None,
                 on_error: OnError | str = OnError.RAISE, file_cache: ByteSource | None = None,
                 mode: str = "RGB", cache_type: CacheType | str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, cache_size: int | None = None,
                 cache_transform: bool = False) -> None:
        self.list_file = Path(list_file)
        super().__init__(root, read_image_list(list_file, num_classes), transform, target_transform,
                         on_error, file_cache, mode, {"cache_type": cache_type, "cache_dir": cache_dir,
                                                      "cache_size": cache_size, "cache_transform": cache_transform})


class ImageFolder(_Images):
    """torchvision's layout: ``root/<class>/<image>``, classes sorted by name, labels 0..n-1
    (``classes``, ``class_to_idx``, ``samples``, ``targets`` as torchvision's).
    Decoded cache (`CachedDataset`): ``cache_type`` None (none), memory, disk or auto, with
    ``cache_dir``, ``cache_size`` (bytes) and ``cache_transform`` (cache the transformed image;
    without a ``cache_type`` it caches in memory, as Light's ImageFolder).

    Example:
        >>> ds = ImageFolder("data/train", transform=t, file_cache=FileCache(...), cache_type="memory")
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[int], Any] | None = None, *,
                 extensions: tuple[str, ...] = IMAGE_EXTENSIONS, on_error: OnError | str = OnError.RAISE,
                 file_cache: ByteSource | None = None, mode: str = "RGB",
                 cache_type: CacheType | str | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 cache_size: int | None = None, cache_transform: bool = False) -> None:
        base = Path(root)
        if not base.is_dir():
            raise FileNotFoundError(f"ImageFolder: root {str(base)!r} is not a directory")
        self.classes = sorted(e.name for e in os.scandir(base) if e.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"ImageFolder: {str(base)!r} has no class folders (root/<class>/<image>)")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        lowered = tuple(e.lower() for e in extensions)
        samples = []
        for name in self.classes:
            for dirpath, _, files in sorted(os.walk(base / name, followlinks=True)):
                for f in sorted(files):
                    if f.lower().endswith(lowered):
                        samples.append((os.path.relpath(os.path.join(dirpath, f), base), self.class_to_idx[name]))
        if not samples:
            raise FileNotFoundError(f"ImageFolder: no file ending in {', '.join(extensions)} under {str(base)!r}")
        super().__init__(root, samples, transform, target_transform, on_error, file_cache, mode,
                         {"cache_type": cache_type, "cache_dir": cache_dir, "cache_size": cache_size,
                          "cache_transform": cache_transform})

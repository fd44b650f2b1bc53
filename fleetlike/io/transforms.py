"""The few image transforms an ImageNet-style job needs, on Pillow and torch (torchvision's names).

Why: torchvision must match the installed torch build exactly, and on a CPU-only machine the
wheel that pip picks often does not (it fails to import). These classes take and return what
torchvision's do (a PIL image, then a float tensor ``C x H x W`` in [0, 1]), so a script can use
``torchvision.transforms`` where it works and these where it does not; any callable is accepted
wherever a transform is. Random transforms draw from torch's generator, which the DataLoader
seeds per worker.

Decoded arrays: every image class here also takes the ``H x W x C`` uint8 numpy array a JPEG
decoder returns, with the same result as on the PIL image made from it, bit for bit: crops and
flips are views of the array, a resize goes through Pillow from the (cropped) array, and
`PILToTensor` / `ToTensor` make the ``C x H x W`` tensor with one copy. Where a whole pipeline
does (`takes_arrays`), the datasets (`ImageListDataset`, `ImageFolder`, `IndexTFRDataset`) decode
straight to the array and skip the PIL image and its two copies (figures: docs/data.md).

Example:
    >>> train_t = Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToTensor(),
    ...                    Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fleetlike.io.pillow import BILINEAR, pil

__all__ = ["CenterCrop", "Compose", "ConvertImageDtype", "Normalize", "PILToTensor", "RandomHorizontalFlip",
           "RandomResizedCrop", "Resize", "ToTensor", "takes_arrays"]


def takes_arrays(transform: Any) -> bool:
    """Whether ``transform`` gives the same result from a decoded ``H x W x C`` uint8 array as
    from the PIL image of it: a `PILToTensor` / `ToTensor`, or a `Compose` whose transforms up to
    its first of those all accept arrays (``accepts_arrays = True``: every image class here). A
    transform of another library, or a pipeline that ends on an image, is given the PIL image."""
    steps = transform.transforms if isinstance(transform, Compose) else [transform]
    for step in steps:
        if not getattr(step, "accepts_arrays", False):
            return False
        if getattr(step, "makes_tensor", False):
            return True
    return False


def _image_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of a PIL image or an ``H x W [x C]`` array (Pillow's order)."""
    if isinstance(image, np.ndarray):
        return int(image.shape[1]), int(image.shape[0])
    return image.size


def _to_pil(array: np.ndarray) -> Any:
    """The PIL image of an ``H x W x C`` uint8 array (C = 1: mode L)."""
    array = np.ascontiguousarray(array[:, :, 0] if array.ndim == 3 and array.shape[2] == 1 else array)
    return pil().fromarray(array)


def _size(size: int | Sequence[int], what: str) -> tuple[int, int]:
    """``(height, width)``; an int is a square (crops) or the shorter side (Resize handles it)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size):
        return int(size[0]), int(size[1])
    raise ValueError(f"{what}: size={size!r}; give a positive int or (height, width)")


class Compose:
    """Apply transforms in order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class PILToTensor:
    """PIL image (or HxWxC array) -> tensor ``C x H x W`` of the same dtype (uint8 stays uint8:
    a quarter of the float32 bytes, the compact form to keep in a `CachedDataset`). An array
    (a view of one: a crop, a flip) is copied once, into the channel-first layout."""

    accepts_arrays = makes_tensor = True

    def __call__(self, image: Any) -> torch.Tensor:
        if isinstance(image, np.ndarray):
            array = image[:, :, None] if image.ndim == 2 else image
            if array.flags.writeable and all(s >= 0 for s in array.strides):  # torch's copy is the faster
                return torch.from_numpy(array).permute(2, 0, 1).contiguous()
            return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))  # a flip's negative strides
        array = np.array(image)  # a writable copy torch may own
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class ConvertImageDtype:
    """A uint8 image tensor to ``dtype`` in [0, 1] (a float tensor is only cast)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.uint8 and self.dtype.is_floating_point:
            return tensor.to(self.dtype).div_(255)
        return tensor.to(self.dtype)


class ToTensor:
    """PIL image (or HxWxC uint8 array, or a uint8 ``C x H x W`` tensor) -> float tensor
    ``C x H x W`` in [0, 1]."""

    accepts_arrays = makes_tensor = True

    def __call__(self, image: Any) -> torch.Tensor:
        tensor = image if isinstance(image, torch.Tensor) else PILToTensor()(image)
        return tensor.float().div_(255) if tensor.dtype == torch.uint8 else tensor.float()


class Normalize:
    """``(x - mean) / std`` per channel of a ``C x H x W`` tensor."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != len(std) or any(s <= 0 for s in std):
            raise ValueError(f"Normalize: mean {list(mean)} and std {list(std)} need one positive std per mean")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std


class Resize:
    """An int resizes the shorter side to it (aspect kept), as torchvision; ``(h, w)`` exactly."""

    accepts_arrays = True

    def __init__(self, size: int | Sequence[int], interpolation: int = BILINEAR) -> None:
        _size(size, "Resize")
        self.size, self.interpolation = size, interpolation

    def __call__(self, image: Any) -> Any:
        """The resized PIL image (an array goes through Pillow: a PIL image comes out)."""
        w, h = _image_size(image)
        if isinstance(self.size, int):
            short = self.size
            if w <= h:
                target = (short, max(1, int(short * h / w)))
            else:
                target = (max(1, int(short * w / h)), short)
        else:
            target = (self.size[1], self.size[0])
        if isinstance(image, np.ndarray):
            image = _to_pil(image)
        return image.resize(target, self.interpolation)


class CenterCrop:
    """Crop the center ``(h, w)``."""

    accepts_arrays = True

    def __init__(self, size: int | Sequence[int]) -> None:
        self.height, self.width = _size(size, "CenterCrop")

    def __call__(self, image: Any) -> Any:
        w, h = _image_size(image)
        left, top = int(round((w - self.width) / 2.0)), int(round((h - self.height) / 2.0))
        if not isinstance(image, np.ndarray):
            return image.crop((left, top, left + self.width, top + self.height))
        if 0 <= left and 0 <= top and left + self.width <= w and top + self.height <= h:
            return image[top:top + self.height, left:left + self.width]
        out = np.zeros((self.height, self.width) + image.shape[2:], dtype=image.dtype)  # Pillow pads with 0
        y0, x0 = max(top, 0), max(left, 0)
        y1, x1 = min(top + self.height, h), min(left + self.width, w)
        if y1 > y0 and x1 > x0:
            out[y0 - top:y1 - top, x0 - left:x1 - left] = image[y0:y1, x0:x1]
        return out


class RandomHorizontalFlip:
    """Mirror with probability ``p`` (a PIL image, or a tensor ``... x H x W``)."""

    accepts_arrays = True

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: Any) -> Any:
        if torch.rand(1).item() >= self.p:
            return image
        if isinstance(image, torch.Tensor):
            return image.flip(-1)
        if isinstance(image, np.ndarray):
            return image[:, ::-1]
        return image.transpose(pil().FLIP_LEFT_RIGHT)


class RandomResizedCrop:
    """A random crop of ``scale`` of the area and ``ratio`` aspect, resized to ``size``
    (torchvision's algorithm: 10 tries, then the center crop)."""

    accepts_arrays = True

    def __init__(self, size: int | Sequence[int], scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), interpolation: int = BILINEAR) -> None:
        self.height, self.width = _size(size, "RandomResizedCrop")
        self.scale, self.ratio, self.interpolation = scale, ratio, interpolation

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """``(left, top, w, h)`` of the crop for an image of ``width`` x ``height``."""
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,)).item())
                left = int(torch.randint(0, width - w + 1, (1,)).item())
                return left, top, w, h
        ratio = width / height
        if ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif ratio > max(self.ratio):
            w, h = int(round(height * max(self.ratio))), height
        else:
            w, h = width, height
        return (width - w) // 2, (height - h) // 2, w, h

    def __call__(self, image: Any) -> Any:
        """The resized crop: a PIL image, or from an array the crop's view when it has the output
        size already (Pillow's resize to the same size is a copy), else the PIL image resized."""
        left, top, w, h = self.box(*_image_size(image))
        if not isinstance(image, np.ndarray):
            crop = image.crop((left, top, left + w, top + h))
            return crop.resize((self.width, self.height), self.interpolation)
        view = image[top:top + h, left:left + w]
        if (w, h) == (self.width, self.height):
            return view
        return _to_pil(view).resize((self.width, self.height), self.interpolation)

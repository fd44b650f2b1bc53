"""The few image transforms an ImageNet-style job needs, on Pillow and torch (torchvision's names).

Why: torchvision must match the installed torch build exactly, and on a CPU-only machine the
wheel that pip picks often does not (it fails to import). These classes take and return what
torchvision's do (a PIL image, then a float tensor ``C x H x W`` in [0, 1]), so a script can use
``torchvision.transforms`` where it works and these where it does not; any callable is accepted
wherever a transform is. Random transforms draw from torch's generator, which the DataLoader
seeds per worker.

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
           "RandomResizedCrop", "Resize", "ToTensor"]


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
    a quarter of the float32 bytes, the compact form to keep in a `CachedDataset`)."""

    def __call__(self, image: Any) -> torch.Tensor:
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

    def __init__(self, size: int | Sequence[int], interpolation: int = BILINEAR) -> None:
        _size(size, "Resize")
        self.size, self.interpolation = size, interpolation

    def __call__(self, image: Any) -> Any:
        w, h = image.size
        if isinstance(self.size, int):
            short = self.size
            if w <= h:
                target = (short, max(1, int(short * h / w)))
            else:
                target = (max(1, int(short * w / h)), short)
        else:
            target = (self.size[1], self.size[0])
        return image.resize(target, self.interpolation)


class CenterCrop:
    """Crop the center ``(h, w)``."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.height, self.width = _size(size, "CenterCrop")

    def __call__(self, image: Any) -> Any:
        w, h = image.size
        left, top = int(round((w - self.width) / 2.0)), int(round((h - self.height) / 2.0))
        return image.crop((left, top, left + self.width, top + self.height))


class RandomHorizontalFlip:
    """Mirror with probability ``p`` (a PIL image, or a tensor ``... x H x W``)."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: Any) -> Any:
        if torch.rand(1).item() >= self.p:
            return image
        return image.flip(-1) if isinstance(image, torch.Tensor) else image.transpose(pil().FLIP_LEFT_RIGHT)


class RandomResizedCrop:
    """A random crop of ``scale`` of the area and ``ratio`` aspect, resized to ``size``
    (torchvision's algorithm: 10 tries, then the center crop)."""

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
        left, top, w, h = self.box(*image.size)
        crop = image.crop((left, top, left + w, top + h))
        return crop.resize((self.width, self.height), self.interpolation)

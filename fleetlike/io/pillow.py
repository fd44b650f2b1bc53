"""Pillow, imported when an image is first decoded or transformed, never at ``import fleetlike.io``.

Why: the sampler, the loader and the caches need no image library, and Pillow is an optional
extra (``pip install 'fleetlike[vision]'``); a job that reads tensors should not need it. The
first image call without Pillow raises an ImportError that says how to install it.

Example:
    >>> Image = pil()
    >>> Image.open(path)
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["BILINEAR", "is_image", "pil"]

#: ``PIL.Image.Resampling.BILINEAR`` (a plain int, so a default argument needs no import)
BILINEAR = 2


def pil() -> ModuleType:
    """``PIL.Image``, or an ImportError naming the extra to install."""
    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError(
            "fleetlike.io decodes and transforms images with Pillow, which is not installed: "
            "pip install 'fleetlike[vision]' (or pip install Pillow)"
        ) from error
    return Image


def is_image(obj: Any) -> bool:
    """Whether ``obj`` is a PIL image (without importing Pillow: if it is not loaded, none is)."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(obj, module.Image)

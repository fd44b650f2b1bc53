"""Image bytes to a PIL image with the fastest decoder installed, chosen at run time.

Why: once the bytes come from a packed file instead of one small file each, decoding is the
input pipeline's cost. ``simplejpeg`` (libjpeg-turbo's SIMD decoder) decodes a baseline JPEG
faster than Pillow's build of libjpeg (figures: docs/BENCHMARKS.md, ``bench/image_input.py``);
it is used for JPEGs when installed (``pip install simplejpeg``), and Pillow decodes everything
else (PNG, BMP, ...), a JPEG simplejpeg refuses (CMYK, 12-bit), and everything when simplejpeg
is absent. The result is the same RGB/L PIL image either way, so transforms are unchanged.
`Decoder.array` gives the pixels as an ``H x W x C`` uint8 array instead, without the PIL image
(simplejpeg's output as it is): the datasets use it where the transform takes arrays
(`fleetlike.io.transforms.takes_arrays`), which saves the image's two copies per sample.

Example:
    >>> decoder = Decoder("auto")
    >>> decoder.name
    'simplejpeg'
    >>> image = decoder(jpeg_bytes)          # PIL.Image in RGB
    >>> decoder.array(jpeg_bytes).shape      # (height, width, 3), uint8
"""

from __future__ import annotations

import enum
import io as _io
from types import ModuleType
from typing import Any

import numpy as np

from fleetlike.comm import parse_choice
from fleetlike.io.pillow import pil

__all__ = ["ARRAY_MODES", "DecoderName", "Decoder", "available_decoders"]

_JPEG_MAGIC = b"\xff\xd8\xff"
_SIMPLE_MODES = {"RGB": "RGB", "L": "GRAY"}
#: the modes `Decoder.array` decodes to (uint8, 3 or 1 channels)
ARRAY_MODES = tuple(_SIMPLE_MODES)


class DecoderName(str, enum.Enum):
    """``auto`` (the fastest installed), or one decoder by name."""

    AUTO = "auto"
    PILLOW = "pillow"
    SIMPLEJPEG = "simplejpeg"


def _simplejpeg() -> ModuleType | None:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def available_decoders() -> list[str]:
    """The decoders this process can use, fastest first."""
    return (["simplejpeg"] if _simplejpeg() is not None else []) + ["pillow"]


class Decoder:
    """Decode image bytes into a PIL image in ``mode`` (picklable: DataLoader workers re-import)."""

    def __init__(self, name: DecoderName | str = DecoderName.AUTO, mode: str = "RGB") -> None:
        self.choice = parse_choice(DecoderName, name, what="decoder", noun="decoder")
        self.mode = mode
        if self.choice is DecoderName.SIMPLEJPEG and _simplejpeg() is None:
            raise ImportError("decoder='simplejpeg' is not installed: pip install simplejpeg (or decoder='auto')")
        if self.choice is DecoderName.SIMPLEJPEG and mode not in _SIMPLE_MODES:
            raise ValueError(f"decoder='simplejpeg' decodes to RGB or L, not mode={mode!r}; use decoder='pillow'")
        self._simple: ModuleType | None = None
        self._ready = False

    @property
    def name(self) -> str:
        """The decoder JPEGs go to (``pillow`` when simplejpeg is absent or cannot give ``mode``)."""
        self._prepare()
        return "simplejpeg" if self._simple is not None else "pillow"

    def _prepare(self) -> None:
        if not self._ready:
            if self.choice is not DecoderName.PILLOW and self.mode in _SIMPLE_MODES:
                self._simple = _simplejpeg()
            self._ready = True

    def __getstate__(self) -> dict[str, Any]:
        return {"choice": self.choice, "mode": self.mode}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.choice, self.mode = state["choice"], state["mode"]
        self._simple, self._ready = None, False

    def _simple_array(self, data: bytes | memoryview) -> np.ndarray | None:
        """simplejpeg's ``H x W x C`` array, or None where Pillow is to decode the bytes."""
        self._prepare()
        if self._simple is None or bytes(data[:3]) != _JPEG_MAGIC:
            return None
        try:
            return self._simple.decode_jpeg(data, colorspace=_SIMPLE_MODES[self.mode])
        except (ValueError, OSError):  # CMYK, 12-bit or damaged: Pillow decodes it or names the fault
            if self.choice is DecoderName.SIMPLEJPEG:
                raise
            return None

    def __call__(self, data: bytes | memoryview) -> Any:
        """The decoded image; OSError/ValueError from the decoder when the bytes are not an image."""
        array = self._simple_array(data)
        Image = pil()
        if array is not None:
            return Image.fromarray(array[:, :, 0] if array.ndim == 3 and self.mode == "L" else array)
        with Image.open(_io.BytesIO(data)) as image:
            return image.convert(self.mode)

    def array(self, data: bytes | memoryview) -> np.ndarray:
        """The decoded pixels, ``H x W x C`` uint8 (C = 3 for RGB, 1 for L): the same values as
        ``np.asarray(self(data))``, without making the PIL image where simplejpeg decodes."""
        if self.mode not in ARRAY_MODES:
            raise ValueError(f"Decoder.array decodes to the modes {', '.join(ARRAY_MODES)}, not mode={self.mode!r}; "
                             "call the decoder for a PIL image")
        array = self._simple_array(data)
        if array is None:
            array = np.array(self(data))
        return array[:, :, None] if array.ndim == 2 else array

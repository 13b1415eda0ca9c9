"""JPEG decoding with libjpeg-turbo straight into a NumPy array, scaled in the DCT domain.

The fast path of `globalloader.vision` for JPEG bytes, through simplejpeg (its wheels carry their
own libjpeg-turbo, so no system library is needed; measured as fast as PyTurboJPEG, see
benchmarks/decode.py). Pillow stays the decoder of everything else, and of any JPEG this path
declines: CMYK and YCCK files (Pillow knows Adobe's inverted CMYK), images over Pillow's
decompression-bomb limit (Pillow raises or warns as it always did), and bytes that libjpeg-turbo
reports anything wrong with, even a recoverable warning (Pillow decides whether they are corrupt, so
a sample is never rejected here that the Pillow path would accept).

libjpeg-turbo decodes at 1/2, 1/4 or 1/8 scale by shortening the inverse DCT, several times less
pixel work than a full decode. `dct_factor` picks the largest factor at which the crop still keeps
at least the output's pixels, and the Pillow path uses the same rule, so both give the same image.
The whole image is decoded at that scale: decoding only the crop's rows and columns needs
libjpeg's scanline API (TurboJPEG 3's cropping region), which neither simplejpeg nor Pillow
expose, and TurboJPEG 2's lossless crop re-reads and re-encodes the file, which costs more than
the full decode (benchmarks/decode.py); the resample then reads only the crop's region.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np

from globalloader import _scratch

# A JPEG starts with SOI (FF D8) and then a marker (FF).
_SOI = b"\xff\xd8\xff"
# The reduced scales libjpeg-turbo decodes fastest (a shortened IDCT), largest first.
DCT_FACTORS: tuple[int, ...] = (8, 4, 2)
# simplejpeg's output colorspace for a Pillow mode; None keeps the file's (gray or RGB).
_COLORSPACE = {"RGB": "RGB", "L": "GRAY"}
# The file colorspaces decoded here; CMYK and YCCK go to Pillow.
_DECODED = frozenset({"Gray", "YCbCr", "RGB"})


@functools.cache
def _simplejpeg() -> Any:
    """simplejpeg if installed (the `vision` extra), else None: Pillow then decodes everything."""
    try:
        return importlib.import_module("simplejpeg")
    except ImportError:
        return None


def dct_factor(crop_w: float, crop_h: float, out_w: int, out_h: int) -> int:
    """The largest of 8, 4, 2 at which a crop_w x crop_h region still has >= out_w x out_h pixels,
    else 1 (a full decode: the crop is smaller than twice the output, or is even upsampled)."""
    return next((f for f in DCT_FACTORS if crop_w >= out_w * f and crop_h >= out_h * f), 1)


class JpegHeader:
    """What the header says: the full size, and the colorspace to ask libjpeg-turbo for."""

    __slots__ = ("colorspace", "height", "width")

    def __init__(self, width: int, height: int, colorspace: str) -> None:
        self.width, self.height, self.colorspace = width, height, colorspace

    def decode(self, data: Any, factor: int, scratch: bool = False) -> np.ndarray | None:
        """uint8 HWC pixels at 1/factor scale (ceil(width / factor) wide), or None if libjpeg-turbo
        reported anything, corruption or a warning: the caller then lets Pillow decide.

        With `scratch` the pixels land in this thread's scratch array (`globalloader._scratch`:
        no page faults of fresh memory), valid only until the thread's next scratch decode: for a
        caller that copies what it needs (the crop's resample) and drops the array.
        """
        simplejpeg = _simplejpeg()
        height, width = -(-self.height // factor), -(-self.width // factor)
        size = height * width * (1 if self.colorspace == "GRAY" else 3)
        buffer = _scratch.array("jpeg", size, np.uint8) if scratch else None
        try:
            array: np.ndarray = simplejpeg.decode_jpeg(
                data,
                self.colorspace,
                min_height=height,
                min_width=width,
                min_factor=factor,
                buffer=buffer,
                strict=True,
            )
        except ValueError:
            return None
        return array


def read_header(data: Any, mode: str | None, max_pixels: int | None) -> JpegHeader | None:
    """The header of JPEG bytes this path decodes into `mode`, or None to leave them to Pillow.

    None for: simplejpeg not installed, not a JPEG, a mode other than RGB, L or None, CMYK/YCCK
    files, more than `max_pixels` pixels, or a header libjpeg-turbo cannot read.
    """
    simplejpeg = _simplejpeg()
    if simplejpeg is None or (mode is not None and mode not in _COLORSPACE):
        return None
    if bytes(memoryview(data)[:3]) != _SOI:
        return None
    try:
        height, width, file_colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if file_colorspace not in _DECODED or (max_pixels is not None and width * height > max_pixels):
        return None
    keep = "GRAY" if file_colorspace == "Gray" else "RGB"
    return JpegHeader(width, height, keep if mode is None else _COLORSPACE[mode])

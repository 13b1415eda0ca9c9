"""The crop's resample without antialiasing (`antialias=False`): one bilinear affine warp.

OpenCV (opencv-python-headless, in the `vision` extra) warps the decoded array straight to the
output size, with the crop, the scale and the horizontal flip folded into one matrix: no
intermediate copy, and several times less work than Pillow's antialiased resize, because each
output pixel reads 2x2 source pixels whatever the scale (benchmarks/decode.py). That is also the
price: shrinking by more than 2x aliases, which is why the decoder first scales in the DCT domain
(`_jpeg.dct_factor`), leaving less than 2x on the crop's tighter side.

Pillow's `Image.transform(AFFINE, BILINEAR)` computes the same warp: it is the reference (and the
path without OpenCV, with `decoder="pillow"`, or for images OpenCV cannot address). The two agree
within one grey level (OpenCV's interpolation weights are 5-bit fixed point).

OpenCV runs on one thread (`cv2.setNumThreads(1)`, set once, process-wide, when globalloader first
uses it): one sample is one thread's work, the loader's workers are the parallelism, and OpenCV's
own thread pool on top of them would oversubscribe the cores.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import numpy as np

from globalloader import _extras

# warpAffine keeps source coordinates in 16-bit integers: larger images go to Pillow.
_OPENCV_MAX_SIDE = 32767
# Pillow modes whose pixels OpenCV may interpolate (palette indices, for one, may not be).
_OPENCV_MODES = frozenset({"RGB", "L"})


@functools.cache
def opencv() -> Any:
    """OpenCV, on one thread, if installed (the `vision` extra), else None: Pillow then warps."""
    try:
        cv2 = importlib.import_module("cv2")
    except ImportError:
        return None
    cv2.setNumThreads(1)
    return cv2


def mirror(image: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`image` (rows x columns, channels last if any) mirrored left-right into `out` (C-contiguous,
    of its shape; `image` itself mirrors in place). OpenCV's SIMD flip when installed; NumPy's
    copy otherwise, which walks 3-byte pixels backwards some 30 times slower."""
    cv2 = opencv()
    if cv2 is None or not image.size:
        out[...] = image[:, ::-1]  # NumPy buffers an overlapping source
        return out
    mirrored: np.ndarray = cv2.flip(image, 1, dst=out)
    return mirrored.reshape(image.shape)  # OpenCV drops a last axis of 1


def warp(
    pixels: Any,
    size_wh: tuple[int, int],
    box: tuple[float, float, float, float],
    flip: bool,
    use_opencv: bool = True,
) -> Any:
    """Bilinear resample of `box` (left, top, right, bottom) of `pixels` (a uint8 HWC array or a
    Pillow image) to `size_wh`, mirrored left-right if `flip`: a uint8 array from OpenCV (when
    `use_opencv` and installed), else a Pillow image. Pixel centres map to pixel centres."""
    cv2 = opencv() if use_opencv else None
    if cv2 is not None and not isinstance(pixels, np.ndarray) and pixels.mode in _OPENCV_MODES:
        pixels = np.asarray(pixels)
    if cv2 is not None and isinstance(pixels, np.ndarray) and max(pixels.shape[:2]) <= _OPENCV_MAX_SIDE:
        left, top, right, bottom = box
        scale_x, scale_y = (right - left) / size_wh[0], (bottom - top) / size_wh[1]
        if scale_x >= 1 and scale_y >= 1 and all(float(v).is_integer() for v in box):
            # Shrinking a whole-pixel box reads only inside it: resize its view (a third of the
            # warp's time: per-axis tables), then mirror the small output.
            region = pixels[int(top) : int(bottom), int(left) : int(right)]
            out = cv2.resize(region, size_wh, interpolation=cv2.INTER_LINEAR)
            return cv2.flip(out, 1) if flip else out
        # Output pixel x reads source x' = left + (x + 0.5) * scale_x - 0.5 (mirrored: width - x).
        if flip:
            row_x = (-scale_x, 0.0, left + (size_wh[0] - 0.5) * scale_x - 0.5)
        else:
            row_x = (scale_x, 0.0, left + 0.5 * scale_x - 0.5)
        matrix = np.array([row_x, (0.0, scale_y, top + 0.5 * scale_y - 0.5)])
        flags = cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP
        return cv2.warpAffine(pixels, matrix, size_wh, flags=flags, borderMode=cv2.BORDER_REPLICATE)
    return _pillow_warp(pixels, size_wh, box, flip)


def _pillow_warp(pixels: Any, size_wh: tuple[int, int], box: tuple[float, float, float, float], flip: bool) -> Any:
    """The reference: Pillow's affine transform, on the box's region (plus a pixel either side)."""
    pil = _extras.require("PIL.Image", "vision")
    left, top, right, bottom = box
    if isinstance(pixels, np.ndarray):
        height, width = pixels.shape[:2]
        x0, y0 = max(math.floor(left) - 2, 0), max(math.floor(top) - 2, 0)
        x1, y1 = min(math.ceil(right) + 2, width), min(math.ceil(bottom) + 2, height)
        region = pixels[y0:y1, x0:x1]
        image = pil.fromarray(np.ascontiguousarray(region[:, :, 0] if region.shape[2] == 1 else region))
        left, top, right, bottom = left - x0, top - y0, right - x0, bottom - y0
    else:
        image = pixels
    scale_x, scale_y = (right - left) / size_wh[0], (bottom - top) / size_wh[1]
    data = (scale_x, 0.0, left, 0.0, scale_y, top)
    out = image.transform(size_wh, pil.Transform.AFFINE, data, pil.Resampling.BILINEAR)
    return out.transpose(pil.Transpose.FLIP_LEFT_RIGHT) if flip else out

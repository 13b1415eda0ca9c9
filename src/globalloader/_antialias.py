"""The crop's antialiased resample on torch's SIMD kernel: Pillow's filter, several times faster.

`RandomResizedCropFlipNormalize` resamples the crop with Pillow's antialiased bilinear filter (a
triangle stretched over the shrink factor). Pillow computes it in plain C; torch's
`interpolate(mode="bilinear", antialias=True)` on uint8 channels-last images runs the same filter
(the same support, weights and fixed-point rounding, ported from Pillow-SIMD) with AVX2, 3 to 5
times faster on a 224x224 output (benchmarks/decode.py), within one grey level of Pillow's.

Torch resamples a whole tensor, so its filter stops at the crop's edges (as torchvision's
`resized_crop` does): the Pillow reference is `image.crop(box).resize(size)`, not
`resize(size, box=...)`, which also reads the pixels just outside the box. Used only where the
process that makes the transform has imported torch (torch is never imported for this: a job that
does not use torch pays neither its import nor its memory), and only on x86 CPUs with AVX2 (or
AVX-512): there the uint8 kernel is SIMD and runs on the calling thread, not torch's intra-op
thread pool, so a worker forked from a process that used those threads is safe
(tests/test_antialias.py); no process-wide torch setting is touched.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import numpy as np

from globalloader import _warp

# The CPU capabilities for which torch runs the uint8 kernel with SIMD on the calling thread; its
# generic path elsewhere is not measured to beat Pillow's and may use the intra-op thread pool.
_SIMD = frozenset({"AVX2", "AVX512"})


def available() -> bool:
    """Whether this process may resample on torch's SIMD kernel: it has imported torch and the
    kernel is SIMD on this CPU. Asked once, where a transform is made, and kept with it, so that
    its workers (a spawned one imports torch for it) compute the values the maker's process would."""
    torch = sys.modules.get("torch")
    return torch is not None and _simd(torch)


@functools.cache
def _simd(torch: Any) -> bool:
    return torch.backends.cpu.get_cpu_capability() in _SIMD


def resize(
    image: np.ndarray,
    size_wh: tuple[int, int],
    box: tuple[int, int, int, int],
    flip: bool = False,
    planar: bool = False,
) -> np.ndarray | None:
    """uint8 HWC `image[top:bottom, left:right]` resized to `size_wh` with Pillow's antialiased
    bilinear filter (mirrored left-right if `flip`), or None when this path does not apply (not 3
    channels, a box off whole pixels or empty): the caller then resamples with Pillow. Only for a
    caller that `available()` said may use torch.

    The result is a new C-contiguous HWC array; with `planar`, an HWC view of C-contiguous channel
    planes (what the kernel writes), for a caller that wants CHW: its transpose(2, 0, 1) is free.
    """
    left, top, right, bottom = box
    if (
        image.ndim != 3
        or image.shape[2] != 3
        or image.dtype != np.uint8
        or not all(isinstance(v, int) for v in box)
        or not (0 <= left < right <= image.shape[1] and 0 <= top < bottom <= image.shape[0])
    ):
        return None
    # Imported already, except in a spawned worker (sys.modules first: this runs once per sample).
    torch = sys.modules.get("torch") or importlib.import_module("torch")
    # One copy of the crop: the kernel is fast on contiguous channels-last input only (a strided
    # view takes a generic path, tens of times slower), and torch wraps only writable memory.
    region = np.array(image[top:bottom, left:right], order="C")
    source = torch.from_numpy(region.transpose(2, 0, 1)[None])  # NCHW view, channels-last strides
    out = torch.nn.functional.interpolate(
        source, size=(size_wh[1], size_wh[0]), mode="bilinear", align_corners=False, antialias=True
    )
    planes = out.numpy()[0]  # the kernel writes channel planes (NCHW), whatever the input's layout
    if planar:
        if flip:  # each row of the (C*H, W) stack mirrored, in place
            rows = planes.reshape(-1, planes.shape[2])
            _warp.mirror(rows, out=rows)
        return planes.transpose(1, 2, 0)
    # Interleaving the planes is a loop 3 pixels long in NumPy: OpenCV's merge is 15 times faster.
    cv2 = _warp.opencv()
    hwc = planes.transpose(1, 2, 0)
    pixels: np.ndarray = cv2.merge(tuple(planes)) if cv2 is not None else np.ascontiguousarray(hwc)
    return _warp.mirror(pixels, out=pixels) if flip else pixels

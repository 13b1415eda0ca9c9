"""Synthetic photo-like JPEGs, for tests, the demo and benchmarks without downloading a dataset.

The pictures are made to cost what real photos cost: smooth colour gradients, a few soft and a
few sharp-edged shapes, a luminance texture and film-like grain. At quality 90 a 500x375 image
is about 60-120 KB and decodes about as fast as a real photo of that size, whereas flat colour
would compress to a few KB and make decode benchmarks meaningless. Each class has its own colour
cast, so a small model can learn something from the labels.

Everything is seeded per image (`seed`, index), so a folder is the same whatever order or
machine made it. Pixel work is done in Pillow's C code and in 2-D uint8 NumPy operations, which
keeps generation near 2 ms per image plus the JPEG encode.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from globalloader import _extras
from globalloader._paths import build_once
from globalloader.errors import ArgumentError, check_int

__all__ = ["make_image", "make_jpeg_bytes", "make_jpeg_folder"]

# Bump when the picture recipe changes, so folders made by an older recipe are rebuilt.
_RECIPE = 1
_CLASS_DIR = re.compile(r"class_\d+")


def _pil() -> Any:
    return _extras.require("PIL.Image", "vision")


def _check_size(size: tuple[int, int]) -> tuple[int, int]:
    if len(size) != 2 or any(not isinstance(v, (int, np.integer)) or v < 8 for v in size):
        raise ArgumentError(f"size must be a (width, height) pair of ints >= 8, got {size!r}")
    return int(size[0]), int(size[1])


def _class_tint(label: int, classes: int) -> np.ndarray:
    """A fixed, saturated RGB colour per class (evenly spaced hues)."""
    hue = 6.0 * label / max(classes, 1)
    channel_hue = (hue - np.array([0.0, 2.0, 4.0])) % 6.0
    weight = np.clip(np.abs(channel_hue - 3.0) - 1.0, 0.0, 1.0)
    return 40.0 + 175.0 * weight


def _make_pil(rng: np.random.Generator, size: tuple[int, int], label: int, classes: int) -> Any:
    pil = _pil()
    from PIL import ImageChops, ImageDraw

    width, height = size
    small_w, small_h = max(width // 4, 2), max(height // 4, 2)

    # Smooth gradients: a 3x4 grid of colours, pulled toward the class colour, blown up.
    grid = 0.6 * rng.uniform(0, 255, (3, 4, 3)) + 0.4 * _class_tint(label, classes)
    small = pil.fromarray(grid.astype(np.uint8), "RGB").resize((small_w, small_h), pil.Resampling.BILINEAR)

    # Shape parameters come from one draw: each Generator call costs microseconds of overhead.
    n_soft, n_sharp = int(rng.integers(3, 8)), int(rng.integers(1, 4))
    params = rng.random((n_soft + n_sharp, 12))
    colours = [tuple(int(c) for c in row) for row in (params[:, :3] * 256).astype(np.uint8)]

    # Soft shapes: drawn at quarter resolution, their edges blur when scaled up.
    draw = ImageDraw.Draw(small)
    span = np.array([small_w, small_h] * 4) * 1.5
    lo = -np.array([small_w, small_h] * 4) * 0.25
    for k in range(n_soft):
        xy = (lo + params[k, 4:] * span).astype(int).tolist()
        if params[k, 3] < 0.5:
            x0, x1 = sorted(xy[0:4:2])
            y0, y1 = sorted(xy[1:4:2])
            draw.ellipse((x0, y0, x1, y1), fill=colours[k])
        else:
            draw.polygon(list(zip(xy[0::2], xy[1::2], strict=True)), fill=colours[k])
    img = small.resize((width, height), pil.Resampling.BILINEAR)

    # Sharp-edged triangles at full resolution, like objects in focus.
    draw = ImageDraw.Draw(img)
    for k in range(n_soft, n_soft + n_sharp):
        xy = (params[k, 4:10] * np.array([width, height] * 3)).astype(int).tolist()
        draw.polygon(list(zip(xy[0::2], xy[1::2], strict=True)), fill=colours[k])

    # Luminance texture (value noise with 3-pixel cells) plus grain; its strength varies per
    # image, which spreads file sizes the way scene content does.
    cells = 3
    tiny = rng.integers(0, 256, (height // cells + 1, width // cells + 1), dtype=np.uint8)
    texture = pil.fromarray(tiny, "L").resize((width, height), pil.Resampling.BILINEAR)
    texture_amp = int(rng.integers(48, 192))
    texture = texture.point([v * texture_amp // 256 for v in range(256)])
    grain_bits = int(rng.integers(4, 7))
    grain = np.frombuffer(rng.bytes(width * height), np.uint8).reshape(height, width)
    noise = np.asarray(texture) + (grain >> (8 - grain_bits))  # <= 191 + 63: no uint8 overflow
    noise_l = pil.fromarray(noise, "L")
    offset = texture_amp // 2 + (1 << (grain_bits - 1))
    # Saturating add in Pillow: one pass, and NumPy is slow on 3-channel innermost axes.
    return ImageChops.add(img, pil.merge("RGB", (noise_l, noise_l, noise_l)), 1.0, -offset)


def make_image(
    rng: np.random.Generator,
    size: tuple[int, int] = (500, 375),
    label: int = 0,
    classes: int = 1,
) -> np.ndarray:
    """One photo-like uint8 HWC picture of `size` (width, height), tinted for `label`."""
    return np.asarray(_make_pil(rng, _check_size(size), label, classes))


def make_jpeg_bytes(
    rng: np.random.Generator,
    size: tuple[int, int] = (500, 375),
    quality: int = 90,
    label: int = 0,
    classes: int = 1,
) -> bytes:
    """One photo-like picture encoded as JPEG (4:2:0, as cameras and ImageNet files are)."""
    if not 1 <= quality <= 100:
        raise ArgumentError(f"quality must be in 1..100, got {quality!r}")
    buffer = io.BytesIO()
    _make_pil(rng, _check_size(size), label, classes).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _layout(root: Path, n: int, classes: int) -> list[tuple[Path, int]]:
    """(path, label) of image i: labels round-robin, so classes differ in size by one at most."""
    class_width = max(2, len(str(classes - 1)))
    image_width = max(6, len(str(n - 1)))
    return [
        (root / f"class_{i % classes:0{class_width}d}" / f"img_{i:0{image_width}d}.jpg", i % classes) for i in range(n)
    ]


def _count(root: Path) -> int:
    """The JPEGs in the class folders of `root`."""
    return sum(
        sum(1 for f in os.scandir(d.path) if f.name.endswith(".jpg"))
        for d in os.scandir(root)
        if d.is_dir() and _CLASS_DIR.fullmatch(d.name)
    )


def _clear(root: Path) -> None:
    """Remove what an earlier build made, leaving the user's other files alone."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False) and _CLASS_DIR.fullmatch(entry.name):
            shutil.rmtree(entry.path)


def make_jpeg_folder(
    root: str | os.PathLike[str],
    n: int = 5000,
    size: tuple[int, int] = (500, 375),
    classes: int = 10,
    quality: int = 90,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Make (once) an ImageFolder tree `root/class_XX/img_XXXXXX.jpg` of `n` synthetic photos.

    A second call with the same parameters returns at once without touching the files
    (`_paths.build_once`). Image i is seeded by (seed, i) and labelled i % classes.
    """
    check_int(n, "n", 1)
    check_int(classes, "classes", 1)
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ArgumentError(f"quality must be an int in 1..100, got {quality!r}")
    check_int(seed, "seed")
    size = _check_size(size)
    _pil()  # fail early, before any file is touched, when Pillow is missing
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    params = {"recipe": _RECIPE, "n": n, "size": list(size), "classes": classes, "quality": quality, "seed": seed}

    def build() -> None:
        _clear(root)
        layout = _layout(root, n, classes)
        for folder in sorted({path.parent for path, _ in layout}):
            folder.mkdir()
        for i, (path, label) in enumerate(
            tqdm(layout, desc=f"synthetic JPEGs in {root.name}", unit="img", disable=not progress)
        ):
            rng = np.random.default_rng([seed, i])
            path.write_bytes(make_jpeg_bytes(rng, size, quality, label, classes))

    build_once(root, "synthetic", params, lambda: _count(root) == n, build)
    return root

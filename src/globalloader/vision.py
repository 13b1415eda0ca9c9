"""Image decoding and augmentation on libjpeg-turbo, Pillow and NumPy, for loaders without torchvision.

Speed comes from doing as little pixel work as possible: JPEGs are decoded by libjpeg-turbo straight
into a NumPy array (simplejpeg, in the `vision` extra; Pillow decodes other formats, and JPEGs
when simplejpeg is missing or `decoder="pillow"`: the same shapes, dtypes and values within a grey
level or two), at 1/2, 1/4 or 1/8 scale when the crop still keeps the output's pixels ("draft");
the crop is resampled reading only inside it (`globalloader._antialias`, `globalloader._warp`),
the flip runs on the small output, and `normalize` makes one or two float32 passes (or is left to
the training step: `normalize=False` and `globalloader.torch.normalize_batch`).

Functions take and return the same kind of image they are given (Pillow image or uint8 HWC array).
Random functions draw from a caller's `numpy.random.Generator`, so the dataset chain decides the
seeding and results are reproducible. Arrays made here may be read-only views: a decoded sample can
be shared between jobs, so transforms never write into their input.

The record-level classes (`Decode`, `RandomResizedCropFlipNormalize`, `RandomCropFlipNormalize`) are
frozen dataclasses: they pickle to worker processes and their repr identifies the transform, which
lets the service recognise the same deterministic prefix across jobs.
"""

from __future__ import annotations

import dataclasses
import io
import math
import operator
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from globalloader import _antialias, _extras, _jpeg, _scratch, _slots, _warp
from globalloader.errors import ArgumentError, CorruptSampleError

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
    "IMAGE_FIELDS",
    "Decode",
    "RandomCropFlipNormalize",
    "RandomResizedCropFlipNormalize",
    "center_crop",
    "decode_image",
    "hflip",
    "normalize",
    "random_crop",
    "random_resized_crop",
    "random_resized_crop_box",
    "resize_shorter",
    "sample_name",
    "to_array",
]

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

_ENCODED = (bytes, bytearray, memoryview)
# normalize leaves images of up to this many channels to OpenCV (gray, gray + alpha, RGB, RGBA):
# OpenCV reads a NumPy array's last axis as its channels only up to a limit.
_OPENCV_MAX_CHANNELS = 4
# The extensions of image members in WebDataset tar shards (the field names TarShards gives them).
IMAGE_EXTENSIONS: tuple[str, ...] = (
    "jpg",
    "jpeg",
    "png",
    "webp",
    "ppm",
    "pgm",
    "pbm",
    "pnm",
    "bmp",
    "tif",
    "tiff",
    "gif",
)
# Where a record keeps its image when no field is named, in this order: ImageFolder's "image",
# then the image extensions.
IMAGE_FIELDS: tuple[str, ...] = ("image", *IMAGE_EXTENSIONS)
# Which decoder the record transforms use for JPEG bytes: "auto" is libjpeg-turbo through simplejpeg
# when installed (else Pillow); "pillow" always Pillow (the reference the fast path is tested against).
DECODERS: tuple[str, ...] = ("auto", "pillow")


@cache  # called a few times per sample: the import machinery costs more than the flip
def _pil() -> Any:
    return _extras.require("PIL.Image", "vision")


def _decode_errors() -> tuple[type[BaseException], ...]:
    # What Pillow raises for bad bytes: unidentified or truncated files (OSError), malformed
    # headers (SyntaxError, ValueError, struct.error, EOFError, IndexError) and oversized images.
    return (
        OSError,
        SyntaxError,
        ValueError,
        EOFError,
        IndexError,
        struct.error,
        _pil().DecompressionBombError,
    )


# ---------------------------------------------------------------------------------------- decoding


def _open(data: Any, name: str) -> PILImage.Image:
    """Parse only the header, so the size is known before paying for the decode."""
    if not isinstance(data, (*_ENCODED, np.ndarray)):
        raise ArgumentError(f"{name}: expected encoded image bytes, got {type(data).__name__}")
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).data
    pil = _pil()
    try:
        return pil.open(io.BytesIO(data))
    except pil.UnidentifiedImageError as exc:
        head = bytes(memoryview(data)[:8])
        raise CorruptSampleError(
            f"cannot decode image {name}: not a known image format (starts with {head!r})"
        ) from exc
    except _decode_errors() as exc:
        raise CorruptSampleError(f"cannot decode image {name}: {exc}") from exc


def _finish(
    img: PILImage.Image, name: str, mode: str | None, min_size: tuple[int, int] | None
) -> tuple[PILImage.Image, float]:
    """Decode pixels, at 1/2, 1/4 or 1/8 scale if `min_size` (w, h) still fits; give the scale."""
    scale = 1.0
    try:
        if min_size is not None:
            full_width = img.size[0]
            drafted = img.draft(mode, min_size)  # None unless the format scales in the decoder
            if drafted is not None:
                scale = full_width / drafted[1][2]
        img.load()
        if mode is not None and img.mode != mode:
            img = img.convert(mode)
    except _decode_errors() as exc:
        raise CorruptSampleError(f"cannot decode image {name}: {exc}") from exc
    return img, scale


def _open_any(data: Any, name: str, mode: str | None, decoder: str) -> _jpeg.JpegHeader | PILImage.Image:
    """Read only the header: libjpeg-turbo's for the JPEGs it decodes here, else Pillow's."""
    if decoder == "auto":
        header = _jpeg.read_header(_buffer(data), mode, _pil().MAX_IMAGE_PIXELS)
        if header is not None:
            return header
    return _open(data, name)


def _size(opened: _jpeg.JpegHeader | PILImage.Image) -> tuple[int, int]:
    """(width, height) of the full image."""
    return (opened.width, opened.height) if isinstance(opened, _jpeg.JpegHeader) else opened.size


def _decode_scaled(
    data: Any,
    name: str,
    mode: str | None,
    opened: _jpeg.JpegHeader | PILImage.Image,
    factor: int,
    scratch: bool = False,
) -> tuple[PILImage.Image | np.ndarray, float]:
    """Pixels at 1/factor scale and the scale got: libjpeg-turbo's uint8 HWC array (`scratch`: in
    the thread's reused buffer, see `JpegHeader.decode`), else Pillow's image.

    Pillow is asked for (width // factor, height // factor), for which its draft picks exactly
    `factor`, so the two decoders agree; Pillow also decodes what libjpeg-turbo declined.
    """
    if isinstance(opened, _jpeg.JpegHeader):
        array = opened.decode(_buffer(data), factor, scratch)
        if array is not None:
            return array, float(factor)
        opened = _open(data, name)
    width, height = opened.size
    return _finish(opened, name, mode, (width // factor, height // factor) if factor > 1 else None)


def _buffer(data: Any) -> Any:
    """Encoded bytes as a buffer (a 1-D uint8 array becomes a view of its memory)."""
    return np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else data


def decode_image(
    data: bytes | bytearray | memoryview | np.ndarray,
    name: str = "<bytes>",
    mode: str | None = "RGB",
    *,
    min_size: tuple[int, int] | None = None,
) -> PILImage.Image:
    """Decode encoded image bytes to a Pillow image in `mode` (None keeps the file's mode).

    `min_size` (width, height) lets a JPEG decode at 1/2, 1/4 or 1/8 scale while staying at least
    that large: several times cheaper than a full decode when the image is then shrunk anyway.
    Raises CorruptSampleError naming `name` for corrupt or truncated bytes.
    """
    img, _ = _finish(_open(data, name), name, mode, min_size)
    return img


def to_array(img: PILImage.Image | np.ndarray) -> np.ndarray:
    """A uint8 HWC array (HxWx1 for one-channel images); read-only, as Pillow exports it."""
    array = img if isinstance(img, np.ndarray) else np.asarray(img)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.dtype != np.uint8 or array.ndim != 3:
        raise ArgumentError(
            f"to_array: expected an 8-bit image, got dtype {array.dtype} and shape {array.shape}; "
            "convert it to 'RGB' or 'L' first"
        )
    return array


# ----------------------------------------------------------------------------------- geometry


def _hw(size: int | Sequence[int], name: str = "size") -> tuple[int, int]:
    """An int or (height, width) pair as a checked (height, width) tuple."""
    try:
        if isinstance(size, Sequence):
            if len(size) != 2:
                raise TypeError
            height, width = operator.index(size[0]), operator.index(size[1])
        else:
            height = width = operator.index(size)
    except TypeError:
        raise ArgumentError(f"{name} must be an int or a (height, width) pair, got {size!r}") from None
    if height <= 0 or width <= 0:
        raise ArgumentError(f"{name} must be positive, got {size!r}")
    return height, width


def _image_hw(img: Any) -> tuple[int, int]:
    if isinstance(img, np.ndarray):
        if img.ndim != 3:
            raise ArgumentError(f"expected an HWC array, got shape {img.shape}")
        return img.shape[0], img.shape[1]
    if not isinstance(img, _pil().Image):
        raise ArgumentError(f"expected a Pillow image or a uint8 HWC array, got {type(img).__name__}")
    return img.size[1], img.size[0]


def _check_fits(img_hw: tuple[int, int], crop_hw: tuple[int, int], what: str) -> None:
    if crop_hw[0] > img_hw[0] or crop_hw[1] > img_hw[1]:
        raise ArgumentError(
            f"{what}: crop {crop_hw[0]}x{crop_hw[1]} (HxW) is larger than the image "
            f"{img_hw[0]}x{img_hw[1]}; resize the image first"
        )


def _crop(img: Any, top: int, left: int, height: int, width: int) -> Any:
    if isinstance(img, np.ndarray):
        return img[top : top + height, left : left + width]  # a view: no copy
    return img.crop((left, top, left + width, top + height))


def _shorter_to(width: int, height: int, size: int) -> tuple[int, int]:
    """(w, h) with the shorter side `size` and the aspect kept (long side truncated)."""
    if width <= height:
        return size, max(1, int(size * height / width))
    return max(1, int(size * width / height)), size


def _resample(resample: int | None) -> int:
    return _pil().Resampling.BILINEAR if resample is None else resample


def resize_shorter(img: Any, size: int, resample: int | None = None) -> Any:
    """Resize so the shorter side is `size` (the ImageNet "resize 256" step); bilinear by default.

    Returns the input unchanged when it already has that size.
    """
    (size, _) = _hw(size)
    height, width = _image_hw(img)
    target = _shorter_to(width, height, size)
    if target == (width, height):
        return img
    if isinstance(img, np.ndarray):
        return to_array(_array_to_pil(img).resize(target, _resample(resample)))
    return img.resize(target, _resample(resample))


def center_crop(img: Any, size: int | Sequence[int]) -> Any:
    """The central (height, width) region, rounded like torchvision; an array crop is a view."""
    crop_hw = _hw(size)
    img_hw = _image_hw(img)
    _check_fits(img_hw, crop_hw, "center_crop")
    top = round((img_hw[0] - crop_hw[0]) / 2.0)
    left = round((img_hw[1] - crop_hw[1]) / 2.0)
    return _crop(img, top, left, *crop_hw)


def random_crop(img: Any, size: int | Sequence[int], rng: np.random.Generator) -> Any:
    """A uniformly placed (height, width) region; draws top then left from `rng`."""
    crop_hw = _hw(size)
    img_hw = _image_hw(img)
    _check_fits(img_hw, crop_hw, "random_crop")
    top = int(rng.integers(0, img_hw[0] - crop_hw[0] + 1))
    left = int(rng.integers(0, img_hw[1] - crop_hw[1] + 1))
    return _crop(img, top, left, *crop_hw)


def random_resized_crop_box(
    width: int,
    height: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """(left, top, w, h) of an Inception-style crop, with torchvision's sampling rules.

    Up to 10 tries of an area fraction uniform in `scale` and a log-uniform aspect ratio in
    `ratio`; if none fits, the largest centred crop whose aspect lies within `ratio`.
    Separate from the resize so a JPEG can be decoded at reduced scale for the chosen box.
    """
    if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
        raise ArgumentError(
            f"random_resized_crop: need 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1], "
            f"got scale={scale!r}, ratio={ratio!r}"
        )
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    aspect = width / height
    # `ratio` (or the size) may hold NumPy scalars, whose round() need not give a Python int.
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))  # noqa: RUF046
    elif aspect > ratio[1]:
        w, h = int(round(height * ratio[1])), height  # noqa: RUF046
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def random_resized_crop(
    img: Any,
    size: int | Sequence[int],
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    resample: int | None = None,
) -> Any:
    """Crop a random area and aspect (see `random_resized_crop_box`) and resize it to `size`.

    The filter reads only inside the crop (torchvision's `resized_crop`), as in
    `RandomResizedCropFlipNormalize`.
    """
    out_h, out_w = _hw(size)
    img_h, img_w = _image_hw(img)
    left, top, w, h = random_resized_crop_box(img_w, img_h, rng, scale, ratio)
    as_array = isinstance(img, np.ndarray)
    crop = _region_to_pil(img, left, top, left + w, top + h) if as_array else img.crop((left, top, left + w, top + h))
    out = crop.resize((out_w, out_h), _resample(resample))
    return to_array(out) if as_array else out


def hflip(img: Any, rng: np.random.Generator, p: float = 0.5) -> Any:
    """Mirror left-right with probability `p`; always draws one `rng.random()`.

    An array comes back as a view with a negative stride (no copy); `normalize` handles it.
    """
    flip = rng.random() < p
    if not flip:
        return img
    if isinstance(img, np.ndarray):
        return img[:, ::-1]
    return img.transpose(_pil().Transpose.FLIP_LEFT_RIGHT)


def _array_to_pil(array: np.ndarray) -> PILImage.Image:
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    return _pil().fromarray(np.ascontiguousarray(array))


def _resize_region(
    image: PILImage.Image | np.ndarray, size_wh: tuple[int, int], box: tuple[float, float, float, float]
) -> PILImage.Image:
    """Bilinear resize of `box` (left, top, right, bottom) to `size_wh`, reading only that region.

    A decoded array is handed to Pillow as the box plus the filter's reach (so the result is
    exactly a resize of the whole image with `box=`), never copied whole.
    """
    if not isinstance(image, np.ndarray):
        return image.resize(size_wh, _resample(None), box=box)
    left, top, right, bottom = box
    # Bilinear reaches 1 source pixel per output step, more when shrinking; +1 for rounding.
    reach_x = math.ceil(max((right - left) / size_wh[0], 1.0)) + 1
    reach_y = math.ceil(max((bottom - top) / size_wh[1], 1.0)) + 1
    height, width = image.shape[:2]
    x0, y0 = max(int(left) - reach_x, 0), max(int(top) - reach_y, 0)
    x1, y1 = min(math.ceil(right) + reach_x, width), min(math.ceil(bottom) + reach_y, height)
    region = _region_to_pil(image, x0, y0, x1, y1)
    return region.resize(size_wh, _resample(None), box=(left - x0, top - y0, right - x0, bottom - y0))


def _whole_pixels(box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    """A crop box on whole pixels of the decoded image: the box drawn on the full image, divided by
    the DCT scale, has its edges rounded to the nearest pixel edge (at most half a decoded pixel
    off; a no-op at full scale). Keeps at least one pixel per side."""
    left, top, right, bottom = (round(v) for v in box)
    return left, top, max(right, left + 1), max(bottom, top + 1)


def _resize_crop(
    image: PILImage.Image | np.ndarray,
    size_wh: tuple[int, int],
    box: tuple[int, int, int, int],
    flip: bool,
    fast: bool,
    planar: bool = False,
) -> PILImage.Image | np.ndarray:
    """The crop `box` (left, top, right, bottom, whole pixels) resized to `size_wh` with the
    antialiased bilinear filter reading only inside it, then mirrored left-right if `flip`: with
    `fast` on torch's kernel when it applies (`_antialias.resize`; `planar` for a CHW output),
    else Pillow's `crop` then `resize`."""
    if isinstance(image, np.ndarray):
        if fast:
            out = _antialias.resize(image, size_wh, box, flip, planar)
            if out is not None:
                return out
        image = _region_to_pil(image, *box)
    else:
        image = image.crop(box)
    image = image.resize(size_wh, _resample(None))
    return image.transpose(_pil().Transpose.FLIP_LEFT_RIGHT) if flip else image


def _region_to_pil(image: np.ndarray, x0: int, y0: int, x1: int, y1: int) -> PILImage.Image:
    """`image[y0:y1, x0:x1]` as a Pillow image in one copy.

    An RGB array's rows are read in place by Pillow's raw unpacker, told the array's row stride,
    so the region is copied once, into Pillow's 3-band RGB (which Pillow resamples a quarter
    faster than 4-band RGBX). `fromarray` would copy it twice (a contiguous copy, then the unpack)
    at several times the cost. Other layouts go through `fromarray`.
    """
    if image.ndim == 3 and image.shape[2] == 3 and image.flags.c_contiguous:
        row = image.strides[0]
        rows = image.data.cast("B")[y0 * row + x0 * 3 :]
        return _pil().frombuffer("RGB", (x1 - x0, y1 - y0), rows, "raw", "RGB", row, 1)
    return _array_to_pil(image[y0:y1, x0:x1])


# ---------------------------------------------------------------------------------- normalize


@lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """float32 (scale, offset) per channel with x*scale + offset == (x/255 - mean) / std."""
    mean64, std64 = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    if np.any(std64 <= 0):
        raise ArgumentError(f"normalize: std must be positive, got {std!r}")
    scale = (1.0 / (255.0 * std64)).astype(np.float32)
    offset = (-mean64 / std64).astype(np.float32)
    scale.flags.writeable = offset.flags.writeable = False
    return scale, offset


@lru_cache(maxsize=64)
def _affine_rows(mean: tuple[float, ...], std: tuple[float, ...], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) tiled along one image row, so an HWC image is a 2-D (H, W*C) problem."""
    scale, offset = _affine(mean, std)
    rows = np.tile(scale, width), np.tile(offset, width)
    rows[0].flags.writeable = rows[1].flags.writeable = False
    return rows


@lru_cache(maxsize=16)
def _affine_matrix(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(scale, offset) as the 3 x 4 matrix of OpenCV's per-pixel affine `transform`: diagonal
    scale, offset in the last column."""
    scale, offset = _affine(mean, std)
    matrix = np.zeros((len(scale), len(scale) + 1), np.float32)
    matrix[np.arange(len(scale)), np.arange(len(scale))] = scale
    matrix[:, -1] = offset
    matrix.flags.writeable = False
    return matrix


def _float_pixels(array: np.ndarray) -> np.ndarray:
    """`array`'s values as float32, in this thread's scratch (see `_scratch`) when it fits."""
    scratch = _scratch.array("normalize", array.size, np.float32)
    if scratch is None:
        return array.astype(np.float32)
    pixels = scratch.reshape(array.shape)
    np.copyto(pixels, array)
    return pixels


def _written(result: np.ndarray, out: np.ndarray) -> None:
    """Make sure an OpenCV call's result is in `out` (it reallocates a `dst` it cannot use)."""
    if result is not out:  # OpenCV returns the `dst` object itself when it wrote there
        np.copyto(out, result.reshape(out.shape))


def normalize(
    array: np.ndarray,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    chw: bool = False,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """float32 `(array / 255 - mean) / std` from a uint8 HWC array, HWC or (chw=True) CHW.

    Precomputed float32 scale and offset, no float64 temporaries. With OpenCV (up to 4
    channels): one affine pass per pixel (HWC) or per channel plane (CHW). Otherwise one NumPy
    multiply and one in-place add, along whole rows (an HWC image viewed as H x W*C with tiled
    constants) because NumPy is several times slower when its inner loop is 3 channels long.
    OpenCV rounds the exact value once, NumPy the product and then the sum: they differ by at
    most a rounding step of the product (2.4e-7 for ImageNet's constants). `out` (float32,
    output shape) lets the caller write straight into a batch buffer.
    """
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 3:
        raise ArgumentError(
            "normalize: expected a uint8 HWC array, got "
            + (f"dtype {array.dtype}, shape {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__)
        )
    height, width, channels = array.shape
    mean_t, std_t = tuple(float(m) for m in mean), tuple(float(s) for s in std)
    if len(mean_t) != channels or len(std_t) != channels:
        raise ArgumentError(f"normalize: {channels} channels but mean has {len(mean_t)} and std {len(std_t)} values")
    shape = (channels, height, width) if chw else (height, width, channels)
    if out is None:
        out = _slots.empty(shape, np.float32)
    elif out.dtype != np.float32 or out.shape != shape:
        raise ArgumentError(f"normalize: out must be float32 of shape {shape}, got {out.dtype} {out.shape}")
    if array.strides[1] < 0 and _warp.opencv() is not None and out.flags.c_contiguous:
        # hflip's mirrored view: normalize the pixels as stored, along whole rows, then mirror
        # the result in place (OpenCV: microseconds), not NumPy's loop over a negative stride.
        normalize(array[:, ::-1], mean_t, std_t, chw, out)
        rows = out.reshape(-1, width) if chw else out  # CHW: every row of every plane
        _warp.mirror(rows, out=rows)
        return out
    scale, offset = _affine(mean_t, std_t)
    cv2 = _warp.opencv() if channels <= _OPENCV_MAX_CHANNELS and array.size and out.flags.c_contiguous else None
    if cv2 is not None:
        # OpenCV's passes read uint8 and write float32 once, about half NumPy's time (which
        # passes over the float output twice), all with one rounding of the exact value, so an
        # HWC and a CHW output hold the same numbers.
        if chw or channels == 1:
            planes: Sequence[np.ndarray] = list(array.transpose(2, 0, 1))
            if not all(plane.flags.c_contiguous for plane in planes):
                planes = cv2.split(array)
            for plane, target, a, b in zip(planes, out.reshape(channels, height, width), scale, offset, strict=True):
                _written(cv2.addWeighted(plane, float(a), plane, 0.0, float(b), dst=target, dtype=cv2.CV_32F), target)
        else:  # the per-pixel affine, over a float copy of the pixels
            _written(cv2.transform(_float_pixels(array), _affine_matrix(mean_t, std_t), dst=out), out)
    elif chw:
        np.multiply(array.transpose(2, 0, 1), scale[:, None, None], out=out)
        out += offset[:, None, None]
    elif array.strides[2] == 1 and array.strides[1] == channels and out.flags.c_contiguous:
        scale_row, offset_row = _affine_rows(mean_t, std_t, width)
        rows_out = out.reshape(height, width * channels)
        np.multiply(array.reshape(height, width * channels), scale_row, out=rows_out)
        rows_out += offset_row
    else:  # strided otherwise (or mirrored, without OpenCV): one long loop per channel
        for c in range(channels):
            plane = out[:, :, c]
            np.multiply(array[:, :, c], scale[c], out=plane)
            plane += offset[c]
    return out


# ---------------------------------------------------------------------- record-level transforms


def sample_name(record: Mapping[str, Any]) -> str:
    """How errors name a record: its `__key__`, and its `__url__` when it has one."""
    key = record.get("__key__")
    name = f"sample {key!r}" if key is not None else "sample without __key__"
    url = record.get("__url__")
    return f"{name} in {url}" if url else name


def _image_field(record: Mapping[str, Any], field: str | None, transform: str) -> str:
    """The field holding the image: `field`, or with None the first of IMAGE_FIELDS present.

    A missing field is a mistake in the chain, not a bad sample, so it raises ArgumentError
    (which `on_error="skip"` must not hide) listing the fields the record has.
    """
    if not isinstance(record, Mapping):
        raise ArgumentError(f"{transform}: expected a dict record, got {type(record).__name__}")
    if field is not None:
        if field in record:
            return field
        wanted = f"no field {field!r}"
    else:
        found = next((name for name in IMAGE_FIELDS if name in record), None)
        if found is not None:
            return found
        wanted = f"no image field (looked for {', '.join(IMAGE_FIELDS)})"
    raise ArgumentError(
        f"{transform}: {sample_name(record)} has {wanted}; its fields are {sorted(map(str, record))}; "
        f"name the image's field: {transform}(field=...)"
    )


def _check_field(field: Any, transform: str) -> None:
    if field is not None and not isinstance(field, str):
        raise ArgumentError(f"{transform}: field must be a str or None (find the image), got {field!r}")


def _is_encoded(value: Any) -> bool:
    return isinstance(value, _ENCODED) or (isinstance(value, np.ndarray) and value.ndim == 1)


def _as_pil(value: Any, name: str, mode: str | None) -> PILImage.Image:
    """An already decoded field (Pillow image or uint8 array) as a Pillow image in `mode`."""
    if isinstance(value, np.ndarray):
        img = _array_to_pil(value)
    elif isinstance(value, _pil().Image):
        img = value
    else:
        raise ArgumentError(
            f"{name}: expected encoded bytes, a Pillow image or a uint8 array, got {type(value).__name__}"
        )
    return img.convert(mode) if mode is not None and img.mode != mode else img


def _check_decoder(decoder: Any, transform: str) -> None:
    if decoder not in DECODERS:
        raise ArgumentError(f"{transform}: decoder must be one of {DECODERS}, got {decoder!r}")


def _check_flag(value: Any, name: str, transform: str) -> None:
    if not isinstance(value, bool):
        raise ArgumentError(f"{transform}: {name} must be True or False, got {value!r}")


def _tuple2(value: Sequence[float], name: str) -> tuple[float, float]:
    if len(value) != 2:
        raise ArgumentError(f"{name} must be a (low, high) pair, got {value!r}")
    return float(value[0]), float(value[1])


@dataclass(frozen=True)
class Decode:
    """Record -> record with `field` decoded to a uint8 HWC array, optionally resized.

    Deterministic (the shareable prefix, e.g. `Decode(resize=256)`): the same bytes always give
    the same array, so the service decodes each sample once for every job. `resize` sets the
    shorter side; with `draft` a large JPEG is decoded at 1/2, 1/4 or 1/8 scale first (the
    largest that still covers the target). JPEGs decode with libjpeg-turbo (`decoder="auto"`)
    or Pillow (`decoder="pillow"`); see the module's docstring. Corrupt bytes raise
    CorruptSampleError naming the record's `__key__` (and `__url__`).

    `field` None (the default) finds the image: the first of IMAGE_FIELDS the record has ("image"
    for ImageFolder, "jpg", "png"... for tar shards); the result stays in that field. A record
    without it raises ArgumentError listing the record's fields.
    """

    field: str | None = None
    resize: int | None = None
    mode: str | None = "RGB"
    draft: bool = True
    decoder: str = "auto"

    def __post_init__(self) -> None:
        _check_field(self.field, "Decode")
        _check_decoder(self.decoder, "Decode")
        if self.resize is not None and (
            not isinstance(self.resize, int) or isinstance(self.resize, bool) or self.resize <= 0
        ):
            raise ArgumentError(f"Decode: resize must be a positive int (the shorter side), got {self.resize!r}")

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        field = _image_field(record, self.field, "Decode")
        value = record[field]
        name = sample_name(record)
        if not _is_encoded(value):  # already decoded: arrays are taken to be in `mode`
            image = value if isinstance(value, np.ndarray) else _as_pil(value, name, self.mode)
            if self.resize is not None:
                image = resize_shorter(image, self.resize)
            return {**record, field: to_array(image)}
        opened = _open_any(value, name, self.mode, self.decoder)
        if self.resize is None:
            pixels, _ = _decode_scaled(value, name, self.mode, opened, 1)
            return {**record, field: to_array(pixels)}
        width, height = _size(opened)
        target = _shorter_to(width, height, self.resize)
        factor = _jpeg.dct_factor(width, height, *target) if self.draft and target[0] < width else 1
        pixels, scale = _decode_scaled(value, name, self.mode, opened, factor)
        if _image_hw(pixels)[::-1] != target:
            pixels = _resize_region(pixels, target, (0.0, 0.0, width / scale, height / scale))
        return {**record, field: to_array(pixels)}


@dataclass(frozen=True)
class RandomResizedCropFlipNormalize:
    """The ImageNet training transform: random resized crop, horizontal flip, normalize.

    `field` may hold encoded bytes, a Pillow image or a uint8 array; it becomes a float32 array,
    (size, size, 3) or, with `chw`, (3, size, size), normalized with `mean` and `std`; with
    `normalize=False` a uint8 array of the same shape (0..255), to normalize on the device in the
    training step (`globalloader.torch.normalize_batch`). From bytes, the crop box is drawn from
    the header's size before decoding, so a JPEG is decoded at the smallest DCT scale (1/2, 1/4,
    1/8) at which the crop still has at least `size` pixels (`draft`); then one bilinear resample
    of the crop to `size` (its edges on whole decoded pixels; the filter reads only inside it, as
    torchvision's `resized_crop`), the flip on the output and one normalize pass. Draws, in
    order: the crop (see `random_resized_crop_box`), then the flip, with either `decoder`.
    `field` None finds the image as `Decode` does.

    The resample is antialiased, as torchvision's `antialias=True` (Pillow's filter; with
    `decoder="auto"` torch's kernel, within a grey level, when the process that makes the transform
    has imported torch). `antialias=False` trades that for speed, as torchvision's does: one
    bilinear warp (the flip folded in) reading 2x2 source pixels per output pixel, so detail finer
    than the output's pixels aliases and values differ by up to tens of grey levels at sharp edges;
    OpenCV computes it when installed (then on one thread, process-wide), Pillow with
    `decoder="pillow"`, within one grey level of each other.
    """

    field: str | None = None
    size: int | tuple[int, int] = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    chw: bool = False
    mode: str | None = "RGB"
    draft: bool = True
    normalize: bool = True
    decoder: str = "auto"
    antialias: bool = True
    _torch_resample: bool = dataclasses.field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        _check_field(self.field, type(self).__name__)
        _check_decoder(self.decoder, type(self).__name__)
        _check_flag(self.normalize, "normalize", type(self).__name__)
        _check_flag(self.antialias, "antialias", type(self).__name__)
        # Chosen here and kept (pickled to workers, part of the fingerprint): torch's kernel and
        # Pillow's differ by up to a grey level, so every process of a job must use the same one.
        object.__setattr__(self, "_torch_resample", self.decoder == "auto" and _antialias.available())
        _hw(self.size)
        if not isinstance(self.size, int):
            object.__setattr__(self, "size", tuple(self.size))  # hashable, like the rest
        scale, ratio = _tuple2(self.scale, "scale"), _tuple2(self.ratio, "ratio")
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
            raise ArgumentError(
                f"need 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1], "
                f"got scale={self.scale!r}, ratio={self.ratio!r}"
            )
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        _affine(self.mean, self.std)

    def __call__(self, record: Mapping[str, Any], *, rng: np.random.Generator) -> dict[str, Any]:
        field = _image_field(record, self.field, type(self).__name__)
        value = record[field]
        name = sample_name(record)
        out_h, out_w = _hw(self.size)
        if _is_encoded(value):
            opened = _open_any(value, name, self.mode, self.decoder)
            width, height = _size(opened)
            left, top, w, h = random_resized_crop_box(width, height, rng, self.scale, self.ratio)
            factor = _jpeg.dct_factor(w, h, out_w, out_h) if self.draft else 1
            # The resample copies the region it reads, so the decode may use the scratch buffer.
            pixels, s = _decode_scaled(value, name, self.mode, opened, factor, scratch=True)
            if self.antialias and s != 1:  # a scaled decode is ceil(size / factor): both decoders
                s = factor
            box = (left / s, top / s, (left + w) / s, (top + h) / s)
        else:
            pixels = value if _in_mode(value, self.mode) else _as_pil(value, name, self.mode)
            height, width = _image_hw(pixels)
            left, top, w, h = random_resized_crop_box(width, height, rng, self.scale, self.ratio)
            box = (left, top, left + w, top + h)
        if self.antialias:
            # The flip on the small output (one draw, as hflip's), into a contiguous array.
            flip = rng.random() < self.flip_p
            img = _resize_crop(pixels, (out_w, out_h), _whole_pixels(box), flip, self._torch_resample, self.chw)
        else:  # one warp, the flip folded in; the same one draw as hflip's
            img = _warp.warp(pixels, (out_w, out_h), box, rng.random() < self.flip_p, self.decoder == "auto")
        return {**record, field: _output(to_array(img), self)}


def _in_mode(value: Any, mode: str | None) -> bool:
    """Whether `value` is a uint8 HWC array already in `mode` (so Pillow need not convert it)."""
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.ndim != 3:
        return False
    return mode is None or value.shape[2] == {"RGB": 3, "L": 1}.get(mode)


def _output(array: np.ndarray, transform: RandomResizedCropFlipNormalize | RandomCropFlipNormalize) -> np.ndarray:
    """The transform's result: float32 normalized, or with normalize=False the uint8 pixels
    (contiguous, HWC or CHW); both with the layout `chw` asks for."""
    if transform.normalize:
        return normalize(array, transform.mean, transform.std, transform.chw)
    pixels = array.transpose(2, 0, 1) if transform.chw else array
    out = _slots.empty(pixels.shape, pixels.dtype)
    if not transform.chw and array.strides[1] < 0:  # hflip's view: the stored pixels mirrored
        return _warp.mirror(array[:, ::-1], out=out)
    np.copyto(out, pixels)
    return out


@dataclass(frozen=True)
class RandomCropFlipNormalize:
    """Random crop, horizontal flip and normalize of an already decoded and resized uint8 array.

    The per-job half of a shared pipeline: after a shared `Decode(resize=256)`, each job crops its
    own `size` region (a view), flips and normalizes in one pass to float32 (HWC, or CHW with
    `chw`; uint8 with `normalize=False`). Draws, in order: crop top, crop left, flip. `field`
    None finds the image as `Decode` does.
    """

    field: str | None = None
    size: int | tuple[int, int] = 224
    flip_p: float = 0.5
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    chw: bool = False
    normalize: bool = True

    def __post_init__(self) -> None:
        _check_field(self.field, type(self).__name__)
        _check_flag(self.normalize, "normalize", type(self).__name__)
        _hw(self.size)
        if not isinstance(self.size, int):
            object.__setattr__(self, "size", tuple(self.size))  # hashable, like the rest
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        _affine(self.mean, self.std)

    def __call__(self, record: Mapping[str, Any], *, rng: np.random.Generator) -> dict[str, Any]:
        field = _image_field(record, self.field, type(self).__name__)
        value = record[field]
        if _is_encoded(value):
            raise ArgumentError(
                f"{sample_name(record)}: field {field!r} holds encoded bytes; "
                f"map Decode(field={field!r}, resize=...) before RandomCropFlipNormalize"
            )
        array = value if isinstance(value, np.ndarray) else to_array(value)
        crop_hw = _hw(self.size)
        if array.ndim != 3 or crop_hw[0] > array.shape[0] or crop_hw[1] > array.shape[1]:
            raise ArgumentError(
                f"{sample_name(record)}: image of shape {array.shape} cannot be cropped to "
                f"{crop_hw[0]}x{crop_hw[1]}; resize it first (Decode(resize=...))"
            )
        array = hflip(random_crop(array, crop_hw, rng), rng, self.flip_p)
        return {**record, field: _output(array, self)}

"""The libjpeg-turbo path of globalloader.vision (globalloader._jpeg) against the Pillow path.

Both decoders run on the same real JPEG files made here; the Pillow path (`decoder="pillow"`) is
the reference: same shapes and dtypes, values within one grey level, the same random draws.
"""

from __future__ import annotations

import dataclasses
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import simplejpeg  # the `test` extra installs it: without it these tests would compare Pillow to itself
from PIL import Image

from globalloader import _jpeg, _scratch, vision
from globalloader.errors import ArgumentError, CorruptSampleError
from globalloader.vision import Decode, RandomResizedCropFlipNormalize


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth shapes plus grain: JPEG keeps it well, and a crop's position shows in its pixels."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([255 * y / max(height, 1), 255 * x / max(width, 1), 128 + 90 * np.sin(x / 9.0 + y / 13.0)], 2)
    noise = np.random.default_rng(seed).normal(0, 6, base.shape)
    return (base + noise).clip(0, 255).astype(np.uint8)


def jpeg(array: np.ndarray, mode: str | None = None, **options: object) -> bytes:
    img = Image.fromarray(array)
    if mode is not None:
        img = img.convert(mode)
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", **{"quality": 90, **options})
    return buffer.getvalue()


def crop_both(transform: RandomResizedCropFlipNormalize, data: bytes, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(libjpeg-turbo output, Pillow output) for the same record and seed; the rngs end equal."""
    fast_rng, pil_rng = np.random.default_rng(seed), np.random.default_rng(seed)
    fast = transform({"__key__": "k", "jpg": data}, rng=fast_rng)["jpg"]
    pillow = dataclasses.replace(transform, decoder="pillow")
    slow = pillow({"__key__": "k", "jpg": data}, rng=pil_rng)["jpg"]
    assert fast_rng.random() == pil_rng.random(), "both paths must draw the same numbers"
    return fast, slow


def assert_close_uint8(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.uint8 and a.shape == b.shape
    assert np.abs(a.astype(int) - b).max() <= 1


# --------------------------------------------------------------------------------- DCT scale


@pytest.mark.parametrize(
    ("crop", "out", "factor"),
    [
        ((1792, 1792), (224, 224), 8),  # exactly 8x: still >= 224 pixels at 1/8
        ((1791, 1792), (224, 224), 4),  # one pixel short of 8x in height
        ((900, 448), (224, 224), 2),  # width allows 4, height only 2
        ((447, 1000), (224, 224), 1),  # under 2x: a full decode
        ((100, 80), (224, 224), 1),  # upsampled: a full decode
        ((1, 1), (1, 1), 1),
        ((16, 8), (2, 1), 8),  # the output's own aspect counts per side
    ],
)
def test_dct_factor_is_the_largest_that_still_covers_the_output(crop, out, factor):
    assert _jpeg.dct_factor(*crop, *out) == factor
    if factor > 1:  # the scaled crop keeps the output's pixels ...
        assert crop[0] / factor >= out[0] and crop[1] / factor >= out[1]
    if factor < 8:  # ... and twice that scale would not
        assert crop[0] / (2 * factor) < out[0] or crop[1] / (2 * factor) < out[1]


@pytest.mark.parametrize(("width", "height"), [(1600, 1200), (1001, 777), (17, 9)])
@pytest.mark.parametrize("factor", [1, 2, 4, 8])
def test_the_header_decodes_at_the_asked_scale_like_pillows_draft(width, height, factor):
    data = jpeg(photo(height, width))
    header = _jpeg.read_header(data, "RGB", None)
    assert header is not None and (header.width, header.height) == (width, height)
    array = header.decode(data, factor)
    assert array.shape == (-(-height // factor), -(-width // factor), 3)
    img = Image.open(io.BytesIO(data))
    if factor > 1:
        img.draft("RGB", (width // factor, height // factor))
    assert np.array_equal(array, np.asarray(img.convert("RGB")))


def test_large_crops_decode_at_reduced_scale(monkeypatch):
    # Count the real decodes and their scales (the function still runs).
    scales = []
    real = simplejpeg.decode_jpeg

    def counting(data, *args, **kwargs):
        out = real(data, *args, **kwargs)
        scales.append(1600 // out.shape[1])
        return out

    monkeypatch.setattr(simplejpeg, "decode_jpeg", counting)
    data = jpeg(photo(1200, 1600))
    transform = RandomResizedCropFlipNormalize(size=64)
    boxes = []
    for seed in range(10):
        transform({"__key__": "k", "jpg": data}, rng=np.random.default_rng(seed))
        _, _, w, h = vision.random_resized_crop_box(1600, 1200, np.random.default_rng(seed))
        boxes.append(_jpeg.dct_factor(w, h, 64, 64))
    assert scales == boxes and max(scales) == 8
    Decode(resize=256)({"__key__": "k", "jpg": data})
    assert scales[-1] == 4  # 1600x1200 -> 341x256: 1/4 scale is 400x300
    RandomResizedCropFlipNormalize(size=64, draft=False)({"__key__": "k", "jpg": data}, rng=np.random.default_rng(0))
    assert scales[-1] == 1


# ------------------------------------------------------------------------- same as Pillow's


@pytest.mark.parametrize(("height", "width"), [(375, 500), (1200, 1600), (777, 1001), (9, 17), (1, 1)])
@pytest.mark.parametrize("size", [224, 32, (40, 56)])
def test_random_resized_crop_matches_the_pillow_path(height, width, size):
    data = jpeg(photo(height, width))
    transform = RandomResizedCropFlipNormalize(size=size, normalize=False)
    for seed in range(6):
        fast, slow = crop_both(transform, data, seed)
        assert_close_uint8(fast, slow)
    # Normalized: the same within one grey level in normalized units (1 / (255 * std)).
    normalized = RandomResizedCropFlipNormalize(size=size, chw=True)
    fast, slow = crop_both(normalized, data, 3)
    assert fast.dtype == np.float32 and fast.shape == slow.shape == (3, *vision._hw(size))
    assert np.abs(fast - slow).max() <= 1.0 / (255 * min(vision.IMAGENET_STD)) + 1e-5


@pytest.mark.parametrize(
    "options",
    [{"progressive": True}, {"subsampling": 0}, {"subsampling": 1}, {"optimize": True, "quality": 60}],
    ids=["progressive", "444", "422", "optimized_q60"],
)
def test_other_jpeg_encodings_match_the_pillow_path(options):
    data = jpeg(photo(600, 800), **options)
    assert _jpeg.read_header(data, "RGB", None) is not None
    transform = RandomResizedCropFlipNormalize(size=96, normalize=False)
    for seed in range(4):
        assert_close_uint8(*crop_both(transform, data, seed))
    assert_close_uint8(
        Decode(resize=150)({"jpg": data})["jpg"], Decode(resize=150, decoder="pillow")({"jpg": data})["jpg"]
    )


@pytest.mark.parametrize(("height", "width"), [(1001, 777), (1200, 1600)])
def test_whole_image_crops_reach_the_scaled_edge(height, width):
    # scale=(1, 1) with the image's own aspect: the box is the whole image, whose right and
    # bottom edges fall inside the last decoded pixel at 1/8 scale (1001 / 8 = 125.125).
    data = jpeg(photo(height, width))
    ratio = (width / height, width / height)
    transform = RandomResizedCropFlipNormalize(size=(height // 8, width // 8), scale=(1.0, 1.0), ratio=ratio)
    fast, slow = crop_both(dataclasses.replace(transform, normalize=False), data, 0)
    assert_close_uint8(fast, slow)
    centred = RandomResizedCropFlipNormalize(size=16, scale=(1.5, 2.0), normalize=False)  # never fits: centre
    assert_close_uint8(*crop_both(centred, data, 1))


def test_a_crop_of_a_decoded_array_reads_only_its_region_and_equals_pillows():
    array = photo(300, 400)
    transform = RandomResizedCropFlipNormalize(size=48, normalize=False)
    for seed in range(20):
        from_array = transform({"__key__": "k", "image": array}, rng=np.random.default_rng(seed))["image"]
        from_pil = transform({"__key__": "k", "image": Image.fromarray(array)}, rng=np.random.default_rng(seed))[
            "image"
        ]
        assert_close_uint8(from_array, from_pil)


@pytest.mark.parametrize("resize", [None, 256, 100, 2000])
def test_decode_matches_the_pillow_path(resize):
    data = jpeg(photo(1200, 1600))
    fast = Decode(resize=resize)({"__key__": "k", "jpg": data})["jpg"]
    slow = Decode(resize=resize, decoder="pillow")({"__key__": "k", "jpg": data})["jpg"]
    assert_close_uint8(fast, slow)


def test_encoded_bytes_in_a_numpy_array_take_the_same_path():
    data = jpeg(photo(200, 300))
    as_array = np.frombuffer(data, np.uint8)
    assert np.array_equal(Decode(resize=64)({"jpg": as_array})["jpg"], Decode(resize=64)({"jpg": data})["jpg"])
    a, b = crop_both(RandomResizedCropFlipNormalize(size=32), data, 4)
    c = RandomResizedCropFlipNormalize(size=32)({"jpg": as_array}, rng=np.random.default_rng(4))["jpg"]
    assert np.array_equal(a, c) and np.abs(a - b).max() < 0.02


# --------------------------------------------------------------------------- colour spaces


def test_grayscale_jpegs():
    data = jpeg(photo(120, 160), mode="L")
    rgb = Decode()({"jpg": data})["jpg"]
    assert rgb.shape == (120, 160, 3) and np.array_equal(rgb[:, :, 0], rgb[:, :, 2])
    assert_close_uint8(rgb, Decode(decoder="pillow")({"jpg": data})["jpg"])
    kept = Decode(mode=None)({"jpg": data})["jpg"]
    assert kept.shape == (120, 160, 1)
    assert_close_uint8(kept, Decode(mode=None, decoder="pillow")({"jpg": data})["jpg"])
    gray = RandomResizedCropFlipNormalize(size=32, mode="L", mean=(0.5,), std=(0.25,), normalize=False)
    fast, slow = crop_both(gray, data, 2)
    assert fast.shape == (32, 32, 1)
    assert_close_uint8(fast, slow)


def test_colour_jpeg_to_gray_is_the_luma_pillow_gives():
    data = jpeg(photo(120, 160))
    fast = Decode(mode="L", resize=60)({"jpg": data})["jpg"]
    slow = Decode(mode="L", resize=60, decoder="pillow")({"jpg": data})["jpg"]
    assert fast.shape == slow.shape == (60, 80, 1)
    assert np.abs(fast.astype(int) - slow).max() <= 2  # libjpeg's Y vs Pillow's RGB -> L


def test_cmyk_jpegs_are_left_to_pillow():
    data = jpeg(photo(60, 80), mode="CMYK")
    assert _jpeg.read_header(data, "RGB", None) is None
    fast = Decode()({"jpg": data})["jpg"]
    assert fast.shape == (60, 80, 3)
    assert np.array_equal(fast, Decode(decoder="pillow")({"jpg": data})["jpg"])
    a, b = crop_both(RandomResizedCropFlipNormalize(size=24), data, 0)
    assert np.array_equal(a, b)


# ---------------------------------------------------------------------------- bad bytes


def truncated() -> bytes:
    data = jpeg(photo(200, 300))
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "data",
    [b"\xff\xd8\xff", b"\xff\xd8\xff\xe0garbage", b"\xff\xd8\xff\xdb" + bytes(300), truncated()],
    ids=["soi_only", "garbage", "zeros", "truncated"],
)
@pytest.mark.parametrize("decoder", ["auto", "pillow"])
def test_corrupt_jpeg_bytes_are_a_corrupt_sample_naming_it(data, decoder):
    record = {"__key__": "n01/img_7", "__url__": "shard-000003.tar", "jpg": data}
    with pytest.raises(CorruptSampleError, match=r"n01/img_7.*shard-000003\.tar"):
        Decode(resize=64, decoder=decoder)(record)
    with pytest.raises(CorruptSampleError, match=r"n01/img_7"):
        Decode(decoder=decoder)(record)
    with pytest.raises(CorruptSampleError, match=r"n01/img_7"):
        RandomResizedCropFlipNormalize(size=32, decoder=decoder)(record, rng=np.random.default_rng(0))


def test_a_jpeg_with_a_recoverable_fault_decodes_as_pillow_decodes_it():
    # Junk bytes before the end marker: libjpeg-turbo warns ("extraneous bytes"), Pillow decodes.
    data = jpeg(photo(64, 64))
    assert data.endswith(b"\xff\xd9")
    damaged = data[:-2] + b"\x00\x01\x02\x03" + data[-2:]
    with pytest.raises(ValueError, match="extraneous"):
        simplejpeg.decode_jpeg(damaged, strict=True)
    fast = Decode()({"jpg": damaged})["jpg"]
    assert np.array_equal(fast, Decode(decoder="pillow")({"jpg": damaged})["jpg"])


def test_the_decompression_bomb_limit_holds_on_both_paths(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow raises above twice the limit
    data = jpeg(photo(100, 100))
    for decoder in ("auto", "pillow"):
        with pytest.raises(CorruptSampleError, match="'big'"):
            Decode(decoder=decoder)({"__key__": "big", "jpg": data})
        with pytest.raises(CorruptSampleError, match="'big'"):
            RandomResizedCropFlipNormalize(size=8, decoder=decoder)(
                {"__key__": "big", "jpg": data}, rng=np.random.default_rng(0)
            )


# ----------------------------------------------------------------------- seeds and outputs


def test_the_random_crop_is_seed_driven_and_the_same_on_both_paths():
    data = jpeg(photo(375, 500))
    transform = RandomResizedCropFlipNormalize(size=48, normalize=False)
    outputs = []
    for seed in range(8):
        fast, slow = crop_both(transform, data, seed)
        again = transform({"jpg": data}, rng=np.random.default_rng(seed))["jpg"]
        assert np.array_equal(fast, again)
        assert_close_uint8(fast, slow)
        outputs.append(fast.tobytes())
    assert len(set(outputs)) == 8


def test_scratch_decodes_reuse_one_buffer_per_thread_and_equal_fresh_ones(monkeypatch):
    small, large, gray = jpeg(photo(90, 120)), jpeg(photo(375, 500, seed=1)), jpeg(photo(61, 77), mode="L")

    def kept() -> np.ndarray:  # the start of this thread's JPEG scratch buffer
        return _scratch.array("jpeg", 1, np.uint8)

    for data in (small, large, small, gray, large):
        header = _jpeg.read_header(data, None, None)
        fresh, scratch = header.decode(data, 2), header.decode(data, 2, scratch=True)
        assert np.array_equal(fresh, scratch) and not np.shares_memory(fresh, kept())
        assert np.shares_memory(scratch, kept())
    monkeypatch.setattr(_scratch, "LIMIT", 1000)  # beyond it: an array of its own
    header = _jpeg.read_header(large, "RGB", None)
    assert not np.shares_memory(header.decode(large, 1, scratch=True), kept())


def test_crops_in_threads_equal_crops_in_sequence():
    # Each thread decodes into its own scratch buffer (libjpeg-turbo runs without the GIL): any
    # sharing between threads would show as another image's pixels in an output.
    images = [jpeg(photo(h, w, seed=h)) for h, w in ((375, 500), (120, 90), (768, 1024), (33, 47))]
    transform = RandomResizedCropFlipNormalize(size=64, normalize=False)

    def crop(i: int) -> np.ndarray:
        return transform({"jpg": images[i % len(images)]}, rng=np.random.default_rng(i))["jpg"]

    expected = [crop(i) for i in range(64)]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert all(np.array_equal(a, b) for a, b in zip(pool.map(crop, range(64)), expected, strict=True))


@pytest.mark.parametrize("chw", [False, True])
def test_normalize_false_gives_the_uint8_the_float_output_is_made_from(chw):
    data = jpeg(photo(375, 500))
    raw = RandomResizedCropFlipNormalize(size=(40, 56), chw=chw, normalize=False)
    out = raw({"jpg": data}, rng=np.random.default_rng(9))["jpg"]
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    assert out.shape == ((3, 40, 56) if chw else (40, 56, 3))
    normalized = RandomResizedCropFlipNormalize(size=(40, 56), chw=chw)({"jpg": data}, rng=np.random.default_rng(9))
    hwc = out.transpose(1, 2, 0) if chw else out
    expected = vision.normalize(np.ascontiguousarray(hwc), chw=chw)
    np.testing.assert_array_equal(normalized["jpg"], expected)


def test_random_crop_flip_normalize_can_leave_uint8():
    array = photo(64, 80)
    raw = vision.RandomCropFlipNormalize(size=32, chw=True, normalize=False)(
        {"image": array}, rng=np.random.default_rng(1)
    )
    out = vision.RandomCropFlipNormalize(size=32, chw=True)({"image": array}, rng=np.random.default_rng(1))
    assert raw["image"].dtype == np.uint8 and raw["image"].shape == (3, 32, 32) and raw["image"].flags.c_contiguous
    np.testing.assert_array_equal(vision.normalize(raw["image"].transpose(1, 2, 0), chw=True), out["image"])


def test_arguments_of_the_new_options_are_checked():
    with pytest.raises(ArgumentError, match="decoder must be one of"):
        Decode(decoder="turbo")
    with pytest.raises(ArgumentError, match="normalize must be True or False"):
        RandomResizedCropFlipNormalize(normalize="no")
    with pytest.raises(ArgumentError, match="normalize must be True or False"):
        vision.RandomCropFlipNormalize(normalize=1)

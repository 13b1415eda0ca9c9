"""Tests for globalloader.vision: decoding, crops, flips, normalize and the record transforms."""

from __future__ import annotations

import io
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from globalloader import _scratch, vision
from globalloader.errors import ArgumentError, CorruptSampleError
from globalloader.vision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Decode,
    RandomCropFlipNormalize,
    RandomResizedCropFlipNormalize,
)


def coordinate_image(height: int = 200, width: int = 240) -> np.ndarray:
    """Pixel (y, x) holds (y, x, (y + x) % 256): a crop tells where it came from."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([y, x, (y + x) % 256], axis=2).astype(np.uint8)


def smooth_image(height: int, width: int) -> np.ndarray:
    """A smooth gradient, which JPEG keeps accurately (within a few levels)."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([255 * y / height, 255 * x / width, 128 + 60 * np.sin(x / 50.0) * np.cos(y / 70.0)], axis=2).astype(
        np.uint8
    )


def encode(array: np.ndarray, fmt: str = "JPEG", **options: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt, **options)
    return buffer.getvalue()


def reference_normalize(array: np.ndarray, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> np.ndarray:
    return (array.astype(np.float64) / 255.0 - np.asarray(mean)) / np.asarray(std)


# ------------------------------------------------------------------------------------ decoding


def test_decode_jpeg_bytes_gives_the_encoded_picture():
    original = smooth_image(120, 160)
    img = vision.decode_image(encode(original, quality=95), "a.jpg")
    assert img.size == (160, 120) and img.mode == "RGB"
    assert np.abs(vision.to_array(img).astype(int) - original).mean() < 2.0


def test_decode_converts_mode_and_keeps_png_exact():
    gray = coordinate_image()[:, :, 0]
    data = encode(gray, "PNG")
    rgb = vision.to_array(vision.decode_image(data, "g.png"))
    assert rgb.shape == (200, 240, 3)
    assert np.array_equal(rgb[:, :, 1], gray)
    kept = vision.to_array(vision.decode_image(data, "g.png", mode=None))
    assert kept.shape == (200, 240, 1) and np.array_equal(kept[:, :, 0], gray)


@pytest.mark.parametrize("data", [b"", b"not an image at all", b"\xff\xd8\xff\xe0garbage"])
def test_decode_garbage_names_the_sample(data):
    with pytest.raises(CorruptSampleError, match=r"cat/0042\.jpg"):
        vision.decode_image(data, "cat/0042.jpg")


def test_decode_truncated_jpeg_names_key_and_url():
    data = encode(smooth_image(200, 300), quality=90)
    record = {"__key__": "n0153/img_7", "__url__": "shard-000003.tar", "image": data[: len(data) // 2]}
    with pytest.raises(CorruptSampleError, match=r"n0153/img_7.*shard-000003\.tar"):
        Decode(resize=64)(record)
    with pytest.raises(CorruptSampleError, match="n0153/img_7"):
        RandomResizedCropFlipNormalize(size=32)(record, rng=np.random.default_rng(0))


@pytest.mark.parametrize("field", ["jpg", "jpeg", "png", "webp"])
def test_decode_finds_a_webdataset_image_field(field):
    data = encode(smooth_image(60, 80), "PNG")
    out = Decode(resize=30)({"__key__": "k", field: data, "cls": b"3"})
    assert out[field].shape == (30, 40, 3) and out["cls"] == b"3"
    crop = RandomCropFlipNormalize(size=24)(out, rng=np.random.default_rng(0))
    assert crop[field].shape == (24, 24, 3) and crop[field].dtype == np.float32
    augmented = RandomResizedCropFlipNormalize(size=16)({"__key__": "k", field: data}, rng=np.random.default_rng(0))
    assert augmented[field].shape == (16, 16, 3)


def test_decode_prefers_image_then_the_listed_order():
    png, jpg = encode(smooth_image(20, 20), "PNG"), encode(smooth_image(30, 30))
    out = Decode()({"__key__": "k", "png": png, "jpg": jpg})
    assert out["jpg"].shape == (30, 30, 3) and out["png"] is png
    assert Decode(field="png")({"__key__": "k", "png": png, "jpg": jpg})["png"].shape == (20, 20, 3)


@pytest.mark.parametrize("transform", [Decode(), RandomCropFlipNormalize(), RandomResizedCropFlipNormalize()])
def test_a_record_without_an_image_is_an_argument_error_listing_its_fields(transform):
    call = transform if isinstance(transform, Decode) else lambda r: transform(r, rng=np.random.default_rng(0))
    with pytest.raises(ArgumentError, match=r"'k1'.*no image field.*\['__key__', 'cls', 'txt'\]") as info:
        call({"__key__": "k1", "txt": b"a cat", "cls": b"1"})
    assert not isinstance(info.value, CorruptSampleError), "a chain mistake must not pass for a bad sample"
    with pytest.raises(ArgumentError, match=r"'k2'.*no field 'photo'.*\['__key__', 'jpg'\]"):
        Decode(field="photo")({"__key__": "k2", "jpg": b"..."})
    with pytest.raises(ArgumentError, match="field must be a str or None"):
        Decode(field=3)


def test_decode_record_shapes_and_no_mutation():
    data = encode(smooth_image(375, 500), quality=90)
    record = {"__key__": "k", "image": data, "label": 3}
    out = Decode(resize=256)(record)
    assert record["image"] is data  # the input record is left alone
    assert out["label"] == 3 and out["image"].dtype == np.uint8
    assert out["image"].shape == (256, 341, 3)
    portrait = Decode(resize=100)({"__key__": "p", "image": encode(smooth_image(300, 200))})
    assert portrait["image"].shape == (150, 100, 3)
    full = Decode()(record)["image"]
    assert full.shape == (375, 500, 3)


def test_decode_accepts_decoded_fields():
    array = coordinate_image()
    out = Decode(resize=100)({"__key__": "k", "image": array})["image"]
    assert out.shape == (100, 120, 3)
    same = Decode()({"__key__": "k", "image": Image.fromarray(array)})["image"]
    assert np.array_equal(same, array)


def test_draft_decode_matches_full_decode():
    # 1600x1200 -> shorter side 256 lets the JPEG decoder work at 1/4 scale.
    data = encode(smooth_image(1200, 1600), quality=95)
    fast = Decode(resize=256)({"__key__": "k", "image": data})["image"]
    slow = Decode(resize=256, draft=False)({"__key__": "k", "image": data})["image"]
    assert fast.shape == slow.shape == (256, 341, 3)
    assert np.abs(fast.astype(int) - slow).mean() < 2.0


# ------------------------------------------------------------------------------- geometry


def test_resize_shorter_sizes_and_types():
    img = Image.fromarray(coordinate_image(200, 240))
    assert vision.resize_shorter(img, 100).size == (120, 100)
    assert vision.resize_shorter(coordinate_image(240, 200), 50).shape == (60, 50, 3)
    assert vision.resize_shorter(img, 200) is img


def test_center_crop_position_matches_torchvision_rounding():
    array = coordinate_image(11, 12)
    crop = vision.center_crop(array, (4, 5))
    assert crop.shape == (4, 5, 3)
    # Rounded, not floored: top = round(7 / 2) = 4, left = round(7 / 2) = 4
    assert (crop[0, 0, 0], crop[0, 0, 1]) == (4, 4)
    pil_crop = vision.center_crop(Image.fromarray(array), (4, 5))
    assert np.array_equal(vision.to_array(pil_crop), crop)


@pytest.mark.parametrize("as_pil", [False, True])
def test_random_crop_lies_inside_and_is_uniformish(as_pil):
    array = coordinate_image(200, 240)
    img = Image.fromarray(array) if as_pil else array
    rng = np.random.default_rng(1)
    tops, lefts = [], []
    for _ in range(200):
        crop = vision.to_array(vision.random_crop(img, (50, 60), rng))
        assert crop.shape == (50, 60, 3) and crop.dtype == np.uint8
        top, left = int(crop[0, 0, 0]), int(crop[0, 0, 1])
        assert 0 <= top <= 150 and 0 <= left <= 180
        assert np.array_equal(crop, array[top : top + 50, left : left + 60])
        tops.append(top)
        lefts.append(left)
    # Every position is possible: the extremes' neighbourhoods are reached.
    assert min(tops) < 15 and max(tops) > 135 and min(lefts) < 18 and max(lefts) > 162


def test_crop_larger_than_image_is_an_argument_error():
    with pytest.raises(ArgumentError, match="larger than the image"):
        vision.random_crop(coordinate_image(20, 20), 21, np.random.default_rng(0))
    with pytest.raises(ArgumentError, match="size"):
        vision.center_crop(coordinate_image(20, 20), (0, 5))


def test_random_resized_crop_box_respects_scale_and_ratio():
    rng = np.random.default_rng(2)
    width, height = 500, 375
    for _ in range(500):
        left, top, w, h = vision.random_resized_crop_box(width, height, rng)
        assert left >= 0 and left + w <= width and top >= 0 and top + h <= height
        # Rounding w and h moves area and aspect a little past the sampled ranges.
        assert 0.08 * 0.95 <= w * h / (width * height) <= 1.0
        assert 3 / 4 * 0.97 <= w / h <= 4 / 3 * 1.03


@pytest.mark.parametrize(
    ("width", "height", "expected"),
    [
        (400, 100, (133, 0, 133, 100)),  # too wide: widest 4:3 box, centred
        (100, 400, (0, 133, 100, 133)),  # too tall: full width, h = w / (3/4), centred
        (300, 280, (0, 0, 300, 280)),
    ],  # within range: the whole image
)
def test_random_resized_crop_box_falls_back_to_centre(width, height, expected):
    # scale > 1 never fits, so all 10 tries fail.
    box = vision.random_resized_crop_box(width, height, np.random.default_rng(0), scale=(1.5, 2.0))
    assert box == expected


def test_random_resized_crop_resizes_exactly_the_sampled_box():
    array = coordinate_image(200, 240)
    for seed in range(20):
        left, top, w, h = vision.random_resized_crop_box(240, 200, np.random.default_rng(seed))
        out = vision.random_resized_crop(array, 32, np.random.default_rng(seed))
        assert out.shape == (32, 32, 3) and out.dtype == np.uint8
        rows, cols = out[:, :, 0].astype(int), out[:, :, 1].astype(int)
        assert top <= rows.min() and rows.max() < top + h  # only the crop is read
        assert left <= cols.min() and cols.max() < left + w
        crop = Image.fromarray(array).crop((left, top, left + w, top + h))  # as torchvision's resized_crop
        assert np.array_equal(np.asarray(crop.resize((32, 32), Image.Resampling.BILINEAR)), out)
        assert np.all(np.diff(rows[:, 0]) >= 0) and np.all(np.diff(cols[0]) >= 0)
        pil_img = Image.fromarray(array)
        pil_out = vision.random_resized_crop(pil_img, 32, np.random.default_rng(seed))
        assert np.array_equal(vision.to_array(pil_out), out)


@pytest.mark.parametrize("layout", ["rgb", "gray", "rgba", "flipped_view"])
def test_a_region_of_an_array_becomes_a_pillow_image_of_exactly_its_pixels(layout):
    # The resample's source: an RGB array's rows are unpacked in place with its row stride; the
    # other layouts take fromarray. Regions at every edge and corner, one pixel, the whole.
    pixels = np.random.default_rng(0).integers(0, 256, (37, 53, 4), dtype=np.uint8)
    array = {
        "rgb": pixels[:, :, :3].copy(),
        "gray": pixels[:, :, :1].copy(),
        "rgba": pixels,
        "flipped_view": pixels[:, ::-1, :3],
    }[layout]
    regions = [
        (0, 0, 53, 37),
        (0, 0, 1, 1),
        (52, 36, 53, 37),
        (5, 7, 50, 30),
        (1, 0, 53, 37),
        (0, 36, 53, 37),
        (52, 0, 53, 37),
    ]
    for x0, y0, x1, y1 in regions:
        image = vision._region_to_pil(array, x0, y0, x1, y1)
        assert image.size == (x1 - x0, y1 - y0)
        assert np.array_equal(vision.to_array(image), array[y0:y1, x0:x1]), (layout, x0, y0, x1, y1)


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_hflip_follows_the_rng_decision(p):
    array = coordinate_image(20, 30)
    for seed in range(30):
        decision = np.random.default_rng(seed).random() < p
        out = vision.hflip(array, np.random.default_rng(seed), p)
        assert np.array_equal(out, array[:, ::-1] if decision else array)
        pil_out = vision.hflip(Image.fromarray(array), np.random.default_rng(seed), p)
        assert np.array_equal(vision.to_array(pil_out), out)


def test_to_array_layouts():
    assert vision.to_array(Image.new("RGB", (7, 5))).shape == (5, 7, 3)
    assert vision.to_array(Image.new("L", (7, 5))).shape == (5, 7, 1)
    with pytest.raises(ArgumentError, match="8-bit"):
        vision.to_array(Image.new("F", (7, 5)))


# ----------------------------------------------------------------------------------- normalize


@pytest.mark.parametrize("layout", ["contiguous", "crop_view", "flipped"])
@pytest.mark.parametrize("chw", [False, True])
def test_normalize_matches_float64_reference(layout, chw):
    base = np.random.default_rng(3).integers(0, 256, (60, 70, 3), dtype=np.uint8)
    array = {"contiguous": base, "crop_view": base[5:50, 7:61], "flipped": base[:, ::-1]}[layout]
    out = vision.normalize(array, chw=chw)
    expected = reference_normalize(array)
    if chw:
        expected = expected.transpose(2, 0, 1)
    assert out.dtype == np.float32 and out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("chw", [False, True])
def test_a_mirrored_crop_normalizes_and_copies_to_its_exact_pixels(opencv, channels, chw):
    base = np.random.default_rng(channels).integers(0, 256, (61, 77, channels), dtype=np.uint8)
    view = base[4:50, 6:71][:, ::-1]  # what random_crop then hflip hand over
    mean, std = [0.3] * channels, [0.2] * channels
    expected = reference_normalize(np.ascontiguousarray(view), mean, std)
    out = vision.normalize(view, mean, std, chw)
    assert out.flags.c_contiguous
    np.testing.assert_allclose(out, expected.transpose(2, 0, 1) if chw else expected, rtol=0, atol=2e-6)
    into = np.full((2, *out.shape), np.nan, np.float32)  # a batch slot: written whole, nothing else
    assert np.shares_memory(vision.normalize(view, mean, std, chw, out=into[1]), into[1])
    np.testing.assert_array_equal(into[1], out)
    assert np.isnan(into[0]).all()
    crop = RandomCropFlipNormalize(size=(40, 50), flip_p=1.0, chw=chw, normalize=False)
    raw = crop({"image": base}, rng=np.random.default_rng(2))["image"]
    rng = np.random.default_rng(2)
    top, left = int(rng.integers(0, 22)), int(rng.integers(0, 28))
    mirrored = base[top : top + 40, left : left + 50][:, ::-1]
    assert raw.flags.c_contiguous
    np.testing.assert_array_equal(raw, mirrored.transpose(2, 0, 1) if chw else mirrored)


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "crop_view", "flipped", "planes", "channels_of_a_wider_array"])
def test_hwc_and_chw_outputs_hold_the_same_numbers(opencv, channels, layout):
    """Whichever way a layout is computed (OpenCV's passes or NumPy's), the CHW output is the HWC
    output transposed, bit for bit, and each is within a float32 step of the exact value."""
    base = np.random.default_rng(channels).integers(0, 256, (58, 66, channels), dtype=np.uint8)
    planes = np.ascontiguousarray(base.transpose(2, 0, 1))  # what torch's resample writes
    array = {
        "contiguous": base,
        "crop_view": base[3:50, 5:61],
        "flipped": base[:, ::-1],
        "planes": planes.transpose(1, 2, 0),
        "channels_of_a_wider_array": np.dstack([base, base[:, :, :1]])[:, :, :channels],
    }[layout]
    mean, std = [0.2, 0.45, 0.4, 0.6][:channels], [0.23, 0.22, 0.3, 0.25][:channels]
    hwc, chw = vision.normalize(array, mean, std), vision.normalize(array, mean, std, chw=True)
    assert hwc.flags.c_contiguous and chw.flags.c_contiguous
    np.testing.assert_array_equal(chw, hwc.transpose(2, 0, 1))
    np.testing.assert_allclose(hwc, reference_normalize(np.ascontiguousarray(array), mean, std), rtol=0, atol=2e-6)


@pytest.mark.parametrize("shape", [(0, 5, 3), (5, 0, 3), (0, 0, 1), (1, 1, 3), (1, 1, 1)])
def test_empty_and_one_pixel_images_normalize(opencv, shape):
    array = np.full(shape, 200, np.uint8)
    for chw in (False, True):
        out = vision.normalize(array, [0.5] * shape[2], [0.25] * shape[2], chw=chw)
        assert out.shape == ((shape[2], *shape[:2]) if chw else shape) and out.dtype == np.float32
        np.testing.assert_allclose(out, (200 / 255 - 0.5) / 0.25, rtol=0, atol=2e-6)


@pytest.mark.parametrize("chw", [False, True])
def test_opencvs_pass_rounds_the_exact_value_once(opencv, chw):
    """The OpenCV pass computes x * scale + offset exactly and rounds it once; NumPy's fallback
    rounds the product, then the sum, and some of the 256 values per channel come out a rounding
    step off. So this fails if the OpenCV pass were skipped, and checks the fallback stays close."""
    array = np.repeat(np.arange(256, dtype=np.uint8), 3).reshape(16, 16, 3)
    scale, offset = vision._affine(tuple(IMAGENET_MEAN), tuple(IMAGENET_STD))
    exact = (array * scale.astype(np.float64) + offset.astype(np.float64)).astype(np.float32)
    out = vision.normalize(array, chw=chw)
    out = out.transpose(1, 2, 0) if chw else out
    if opencv:
        np.testing.assert_array_equal(out, exact)
    else:
        assert not np.array_equal(out, exact)
        np.testing.assert_allclose(out, exact, rtol=0, atol=2e-6)


def test_normalize_writes_into_a_batch_row_and_touches_nothing_else(opencv):
    pixels = np.random.default_rng(5).integers(0, 256, (3, 40, 30, 3), dtype=np.uint8)
    for chw, shape in ((False, (40, 30, 3)), (True, (3, 40, 30))):
        batch = np.full((3, *shape), np.nan, np.float32)
        for row in (2, 0):
            assert np.shares_memory(vision.normalize(pixels[row], chw=chw, out=batch[row]), batch[row])
        assert np.isnan(batch[1]).all()
        for row in (0, 2):
            expected = reference_normalize(pixels[row])
            np.testing.assert_allclose(batch[row], expected.transpose(2, 0, 1) if chw else expected, atol=2e-6)


def test_a_result_opencv_put_elsewhere_is_copied_into_out():
    """OpenCV reallocates a `dst` it cannot use; the values must still land in `out`."""
    out = np.zeros((4, 5, 3), np.float32)
    elsewhere = np.arange(60, dtype=np.float32)  # another array, another shape
    vision._written(elsewhere, out)
    np.testing.assert_array_equal(out, elsewhere.reshape(4, 5, 3))


def test_a_large_image_does_not_grow_the_threads_float_scratch():
    small = np.full((64, 64, 3), 9, np.uint8)
    large = np.full((1500, 1500, 3), 9, np.uint8)  # 27 MB as float32: over the scratch size

    def run() -> int:  # in a new thread: its scratch starts empty
        vision.normalize(small)
        np.testing.assert_allclose(vision.normalize(large)[::500, ::500], vision.normalize(small)[:3, :3], atol=2e-6)
        return int(_scratch.array("normalize", 1, np.float32).base.nbytes)  # the buffer kept

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(run).result() == small.size * 4


def test_normalize_in_threads_keeps_each_threads_pixels_apart():
    """The float copy of the pixels is a per-thread scratch: threads never read each other's."""
    rng = np.random.default_rng(6)
    images = [rng.integers(0, 256, (64 + i, 48, 3), dtype=np.uint8) for i in range(6)]
    expected = [vision.normalize(image) for image in images]

    def run(i: int) -> bool:
        return all(np.array_equal(vision.normalize(images[(i + k) % 6]), expected[(i + k) % 6]) for k in range(300))

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(run, range(6)))


def test_normalize_custom_stats_and_out_buffer():
    array = np.random.default_rng(4).integers(0, 256, (9, 11, 1), dtype=np.uint8)
    batch = np.zeros((2, 9, 11, 1), np.float32)
    result = vision.normalize(array, mean=[0.5], std=[0.25], out=batch[1])
    assert result is batch[1] or np.shares_memory(result, batch)
    np.testing.assert_allclose(batch[1], reference_normalize(array, [0.5], [0.25]), atol=2e-6)
    assert not batch[0].any()


def test_normalize_rejects_wrong_input():
    with pytest.raises(ArgumentError, match="uint8"):
        vision.normalize(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ArgumentError, match="3 channels"):
        vision.normalize(np.zeros((4, 4, 3), np.uint8), mean=[0.5], std=[0.5])
    with pytest.raises(ArgumentError, match="out"):
        vision.normalize(np.zeros((4, 4, 3), np.uint8), out=np.zeros((4, 4, 3), np.float64))


# ----------------------------------------------------------------------- record transforms


def test_random_crop_flip_normalize_matches_its_parts():
    array = coordinate_image(256, 250)
    transform = RandomCropFlipNormalize(size=(100, 120))
    for seed in range(10):
        record = {"__key__": "k", "image": array, "label": 1}
        out = transform(record, rng=np.random.default_rng(seed))
        rng = np.random.default_rng(seed)
        top, left = rng.integers(0, 157), rng.integers(0, 131)
        crop = array[top : top + 100, left : left + 120]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        assert out["label"] == 1
        np.testing.assert_allclose(out["image"], reference_normalize(crop), atol=2e-6)


def test_random_crop_flip_normalize_refuses_bytes_and_small_images():
    with pytest.raises(ArgumentError, match="Decode"):
        RandomCropFlipNormalize()({"__key__": "k", "image": b"\xff\xd8"}, rng=np.random.default_rng(0))
    with pytest.raises(ArgumentError, match="'small'"):
        RandomCropFlipNormalize(size=224)(
            {"__key__": "small", "image": coordinate_image(100, 300)}, rng=np.random.default_rng(0)
        )


@pytest.mark.parametrize("kind", ["bytes", "pil", "array"])
def test_random_resized_crop_flip_normalize_inputs(kind):
    array = smooth_image(375, 500)
    value = {"bytes": encode(array, quality=95), "pil": Image.fromarray(array), "array": array}[kind]
    transform = RandomResizedCropFlipNormalize(size=64, chw=True)
    out = transform({"__key__": "k", "image": value}, rng=np.random.default_rng(5))["image"]
    assert out.shape == (3, 64, 64) and out.dtype == np.float32
    # Same seed, same output; pixel values within the normalized uint8 range.
    again = transform({"__key__": "k", "image": value}, rng=np.random.default_rng(5))["image"]
    assert np.array_equal(out, again)
    low, high = reference_normalize(np.array([[[0, 0, 0]], [[255, 255, 255]]], np.uint8))
    hwc = out.transpose(1, 2, 0)
    assert np.all(hwc >= low - 1e-5) and np.all(hwc <= high + 1e-5)


def test_random_resized_crop_flip_normalize_is_seed_driven():
    data = encode(smooth_image(375, 500), quality=90)
    transform = RandomResizedCropFlipNormalize(size=48)
    outputs = [transform({"__key__": "k", "image": data}, rng=np.random.default_rng(s))["image"] for s in range(6)]
    assert all(o.shape == (48, 48, 3) for o in outputs)
    assert len({o.tobytes() for o in outputs}) == 6


def test_draft_crop_matches_full_decode():
    # Large image, small output: most crops are decoded at 1/2 to 1/8 scale with draft.
    data = encode(smooth_image(1200, 1600), quality=95)
    fast = RandomResizedCropFlipNormalize(size=64)
    slow = RandomResizedCropFlipNormalize(size=64, draft=False)
    for seed in range(8):
        a = fast({"__key__": "k", "image": data}, rng=np.random.default_rng(seed))["image"]
        b = slow({"__key__": "k", "image": data}, rng=np.random.default_rng(seed))["image"]
        # 0.05 in normalized units is about 3 grey levels.
        assert np.abs(a - b).mean() < 0.05


def test_transform_arguments_are_checked():
    with pytest.raises(ArgumentError, match="resize"):
        Decode(resize=0)
    with pytest.raises(ArgumentError, match="scale"):
        RandomResizedCropFlipNormalize(scale=(0.9, 0.1))
    with pytest.raises(ArgumentError, match="std"):
        RandomCropFlipNormalize(std=(0.2, 0.0, 0.2))


# ------------------------------------------------------------------------------------ pickling

TRANSFORMS = [
    Decode(resize=64),
    RandomResizedCropFlipNormalize(size=(40, 48), scale=(0.3, 1.0), chw=True),
    RandomCropFlipNormalize(size=32, flip_p=0.7, mean=[0.5, 0.5, 0.5], std=[0.2, 0.2, 0.2]),
]


def _apply(transform, record, seed):
    if isinstance(transform, Decode):
        return transform(record)["image"]
    return transform(record, rng=np.random.default_rng(seed))["image"]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda t: type(t).__name__)
def test_transforms_pickle_and_keep_behaviour(transform):
    clone = pickle.loads(pickle.dumps(transform))
    assert clone == transform and repr(clone) == repr(transform) and hash(clone) == hash(transform)
    record = {
        "__key__": "k",
        "image": coordinate_image(100, 120)
        if isinstance(transform, RandomCropFlipNormalize)
        else encode(smooth_image(100, 120)),
    }
    assert np.array_equal(_apply(clone, record, 7), _apply(transform, record, 7))


def test_transforms_run_in_a_worker_process():
    data = encode(smooth_image(120, 150))
    record = {"__key__": "k", "image": data}
    decoded = {"__key__": "k", "image": Decode(resize=64)(record)["image"]}
    inputs = [record, record, decoded]
    expected = [_apply(t, r, 3) for t, r in zip(TRANSFORMS, inputs, strict=True)]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_apply, TRANSFORMS, inputs, [3, 3, 3]))
    for got, want in zip(results, expected, strict=True):
        assert np.array_equal(got, want)

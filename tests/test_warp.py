"""`antialias=False`: one bilinear warp (globalloader._warp), OpenCV's against Pillow's.

The Pillow path (`decoder="pillow"`: Pillow decodes and warps) is the reference: same shapes and
dtypes, values within one grey level, the same random draws. Without OpenCV (made unimportable
here, a real ImportError) Pillow warps what libjpeg-turbo decoded, with the same result.
"""

from __future__ import annotations

import dataclasses
import io

import cv2  # the `test` extra installs it: without it these tests would compare Pillow to itself
import numpy as np
import pytest
from PIL import Image
from test_jpeg import assert_close_uint8, crop_both, jpeg, photo

from globalloader import _warp
from globalloader.errors import ArgumentError
from globalloader.vision import RandomResizedCropFlipNormalize, random_resized_crop_box


@pytest.mark.parametrize(("height", "width"), [(375, 500), (1200, 1600), (777, 1001), (9, 17), (1, 1)])
@pytest.mark.parametrize("size", [224, 32, (40, 56)])
def test_the_warp_matches_the_pillow_path(height, width, size):
    data = jpeg(photo(height, width))
    transform = RandomResizedCropFlipNormalize(size=size, normalize=False, antialias=False)
    for seed in range(6):
        assert_close_uint8(*crop_both(transform, data, seed))
    normalized = RandomResizedCropFlipNormalize(size=size, chw=True, antialias=False)
    fast, slow = crop_both(normalized, data, 3)
    assert fast.dtype == np.float32 and fast.shape == slow.shape
    assert np.abs(fast - slow).max() <= 1.0 / (255 * 0.224) + 1e-5


def test_opencv_runs_on_one_thread():
    assert _warp.opencv() is cv2 and cv2.getNumThreads() == 1


def test_without_opencv_pillow_warps_the_libjpeg_turbo_pixels(without_opencv):
    data = jpeg(photo(375, 500))
    transform = RandomResizedCropFlipNormalize(size=64, normalize=False, antialias=False)
    for seed in range(8):
        assert_close_uint8(*crop_both(transform, data, seed))


@pytest.mark.parametrize("size", [48, 224], ids=["dct_scaled_warp", "whole_pixel_resize"])
def test_the_flip_is_folded_into_the_warp_and_mirrors_it(size):
    data = jpeg(photo(375, 500))
    for opencv in (True, False):
        decoder = "auto" if opencv else "pillow"
        kept = RandomResizedCropFlipNormalize(size=size, flip_p=0.0, normalize=False, antialias=False, decoder=decoder)
        mirrored = dataclasses.replace(kept, flip_p=1.0)
        a = kept({"jpg": data}, rng=np.random.default_rng(5))["jpg"]
        b = mirrored({"jpg": data}, rng=np.random.default_rng(5))["jpg"]
        assert not np.array_equal(a, b)
        assert_close_uint8(a[:, ::-1], b)


def test_it_is_not_the_antialiased_resample():
    # Fine stripes, shrunk ~1.7x: the antialiased resample averages them out, the warp aliases.
    stripes = np.zeros((375, 500, 3), np.uint8)
    stripes[:, ::2] = 255
    record = {"image": stripes}
    smooth = RandomResizedCropFlipNormalize(size=224, scale=(1, 1), ratio=(4 / 3, 4 / 3), normalize=False)
    sharp = dataclasses.replace(smooth, antialias=False)
    a = smooth(record, rng=np.random.default_rng(0))["image"].astype(int)
    b = sharp(record, rng=np.random.default_rng(0))["image"].astype(int)
    assert a.std() < b.std() / 2


@pytest.mark.parametrize("decoder", ["auto", "pillow"])
def test_decoded_fields_png_and_gray_take_the_warp_too(decoder):
    array = photo(300, 400)
    png = io.BytesIO()
    Image.fromarray(array).save(png, "PNG")
    reference = RandomResizedCropFlipNormalize(size=40, normalize=False, antialias=False, decoder="pillow")
    transform = dataclasses.replace(reference, decoder=decoder)
    for value in (array, Image.fromarray(array), png.getvalue()):
        for seed in range(4):
            out = transform({"image": value}, rng=np.random.default_rng(seed))["image"]
            assert_close_uint8(out, reference({"image": array}, rng=np.random.default_rng(seed))["image"])
    gray = RandomResizedCropFlipNormalize(size=40, mode="L", normalize=False, antialias=False, decoder=decoder)
    out = gray({"jpg": jpeg(array, mode="L")}, rng=np.random.default_rng(1))["jpg"]
    assert out.shape == (40, 40, 1) and out.dtype == np.uint8


def test_strided_arrays_are_warped_as_their_copies():
    array = photo(300, 400)
    transform = RandomResizedCropFlipNormalize(size=64, normalize=False, antialias=False)
    reference = dataclasses.replace(transform, decoder="pillow")
    for view in (array[:, ::-1], array[::2, ::3], array[:, :, ::-1], np.asfortranarray(array)):
        for seed in range(4):
            out = transform({"image": view}, rng=np.random.default_rng(seed))["image"]
            copy = {"image": np.ascontiguousarray(view)}
            assert_close_uint8(out, reference(copy, rng=np.random.default_rng(seed))["image"])


def test_images_wider_than_opencv_addresses_are_warped_by_pillow():
    # warpAffine keeps coordinates in 16 bits: a crop at x > 32767 would read the wrong pixels.
    # Columns of 1000 pixels each have their own grey, so an output tells where it was read.
    wide = np.repeat((np.arange(40) * 6).astype(np.uint8), 1000)[None, :, None].repeat(64, 0).repeat(3, 2)
    fast = RandomResizedCropFlipNormalize(size=8, scale=(4e-4, 4e-4), ratio=(1, 1), normalize=False, antialias=False)
    reference = dataclasses.replace(fast, decoder="pillow")
    lefts = []
    for seed in range(30):
        out = fast({"image": wide}, rng=np.random.default_rng(seed))["image"]
        assert_close_uint8(out, reference({"image": wide}, rng=np.random.default_rng(seed))["image"])
        lefts.append(random_resized_crop_box(40000, 64, np.random.default_rng(seed), (4e-4, 4e-4), (1, 1))[0])
    assert max(lefts) > 33000  # some crops lie beyond what OpenCV addresses


def test_antialias_must_be_a_bool():
    with pytest.raises(ArgumentError, match="antialias must be True or False"):
        RandomResizedCropFlipNormalize(antialias="no")

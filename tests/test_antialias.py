"""The antialiased resample of the crop (globalloader._antialias, torch's kernel) against Pillow's.

Pillow's `crop(box).resize(size, BILINEAR)` is the reference: the same shapes, values within one
grey level, only the crop's pixels read. The transform's two decoders agree through it, and its
crop box is the drawn one, rounded to whole decoded pixels.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch  # the `test` extra installs it: without it these tests would compare Pillow to itself
from PIL import Image
from test_jpeg import assert_close_uint8, jpeg, photo

import globalloader as gl
from globalloader import _antialias, _jpeg
from globalloader.dataset.fingerprint import fingerprint
from globalloader.synthetic import make_jpeg_folder
from globalloader.vision import RandomResizedCropFlipNormalize, random_resized_crop_box


def pillow(array: np.ndarray, size_wh: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(array).crop(box).resize(size_wh, Image.Resampling.BILINEAR))


@pytest.mark.parametrize(
    ("box", "size_wh"),
    [
        ((0, 0, 500, 375), (224, 224)),  # the whole image, shrunk
        ((37, 11, 337, 261), (224, 224)),  # a crop, shrunk more across than down
        ((120, 90, 180, 170), (224, 224)),  # a small crop, enlarged
        ((3, 5, 451, 303), (56, 40)),  # shrunk 8x, not square
        ((499, 374, 500, 375), (7, 3)),  # one pixel
    ],
)
def test_the_resample_matches_pillows_crop_then_resize(box, size_wh):
    array = photo(375, 500)
    assert _antialias.available()  # this path, not Pillow's, is under test
    out = _antialias.resize(array, size_wh, box)
    assert out is not None and out.dtype == np.uint8 and out.flags.c_contiguous
    assert_close_uint8(out, pillow(array, size_wh, box))


def test_the_flip_mirrors_the_resampled_crop(opencv):
    array = photo(200, 300)
    box = (50, 40, 250, 160)
    plain = _antialias.resize(array, (64, 48), box)
    mirrored = _antialias.resize(array, (64, 48), box, flip=True)
    planar = [_antialias.resize(array, (64, 48), box, flip, planar=True) for flip in (False, True)]
    assert plain.shape == mirrored.shape == (48, 64, 3) and plain.flags.c_contiguous and mirrored.flags.c_contiguous
    assert np.array_equal(mirrored, plain[:, ::-1])
    for hwc, expected in zip(planar, (plain, mirrored), strict=True):  # CHW planes, seen as HWC
        assert hwc.transpose(2, 0, 1).flags.c_contiguous and np.array_equal(hwc, expected)
    reference = np.asarray(Image.fromarray(array).crop(box).resize((64, 48), Image.Resampling.BILINEAR))
    assert_close_uint8(plain, reference)


def test_only_the_crop_is_read_and_the_input_is_left_alone():
    array = photo(200, 300)
    box = (50, 40, 250, 160)
    before = array.copy()
    reference = _antialias.resize(array, (64, 64), box)
    outside = array.copy()
    outside[:40] = outside[160:] = 0
    outside[:, :50] = outside[:, 250:] = 255
    assert np.array_equal(_antialias.resize(outside, (64, 64), box), reference)
    assert np.array_equal(array, before)
    read_only = np.asarray(Image.fromarray(array))  # Pillow's export: not writable
    assert not read_only.flags.writeable
    assert np.array_equal(_antialias.resize(read_only, (64, 64), box), reference)


@pytest.mark.parametrize(
    ("array", "box"),
    [
        (photo(50, 60)[:, :, :1], (0, 0, 60, 50)),  # one channel: Pillow's
        (photo(50, 60).astype(np.float32), (0, 0, 60, 50)),  # not uint8
        (photo(50, 60), (0.5, 0, 60, 50)),  # off whole pixels
        (photo(50, 60), (0, 0, 61, 50)),  # outside the image
        (photo(50, 60), (10, 0, 10, 50)),  # empty
    ],
)
def test_what_torch_does_not_resample_is_left_to_pillow(array, box):
    assert _antialias.resize(array, (8, 8), box) is None


@pytest.fixture
def without_torch(monkeypatch):
    """This process has not imported torch (None in sys.modules: not imported, and not importable)."""
    monkeypatch.setitem(sys.modules, "torch", None)
    _antialias._simd.cache_clear()
    yield
    _antialias._simd.cache_clear()


def test_a_cpu_without_torchs_simd_kernel_keeps_pillow(monkeypatch):
    # On such CPUs (ARM, x86 without AVX2) torch would take its generic path: Pillow resamples.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    _antialias._simd.cache_clear()
    try:
        assert not _antialias.available()
        assert not RandomResizedCropFlipNormalize(size=8)._torch_resample
    finally:
        _antialias._simd.cache_clear()


def test_without_torch_pillow_resamples(without_torch):
    data = jpeg(photo(375, 500))
    transform = RandomResizedCropFlipNormalize(size=64, normalize=False)
    assert not _antialias.available() and not transform._torch_resample
    for seed in range(4):
        out = transform({"jpg": data}, rng=np.random.default_rng(seed))["jpg"]
        slow = RandomResizedCropFlipNormalize(size=64, normalize=False, decoder="pillow")
        assert_close_uint8(out, slow({"jpg": data}, rng=np.random.default_rng(seed))["jpg"])


def test_a_process_that_has_not_imported_torch_does_not_import_it():
    # A job that does not use torch (installed here) must not pay its import in every worker.
    code = (
        "import sys, numpy as np; from globalloader.vision import RandomResizedCropFlipNormalize as T; "
        "from test_jpeg import jpeg, photo; "
        "out = T(size=32)({'jpg': jpeg(photo(375, 500))}, rng=np.random.default_rng(0))['jpg']; "
        "assert out.shape == (32, 32, 3) and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    tests = str(pathlib.Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("height", "width", "size"), [(375, 500, 224), (1200, 1600, 64), (777, 1001, 100)])
def test_the_transform_resizes_the_drawn_crop_on_whole_decoded_pixels(height, width, size):
    # An independent reference: Pillow decodes at the same DCT scale (draft), crops the drawn box
    # divided by the scale with its edges rounded, resizes, and flips on the same draw.
    data = jpeg(photo(height, width))
    transform = RandomResizedCropFlipNormalize(size=size, normalize=False)
    factors = set()
    for seed in range(8):
        out = transform({"jpg": data}, rng=np.random.default_rng(seed))["jpg"]
        rng = np.random.default_rng(seed)
        left, top, w, h = random_resized_crop_box(width, height, rng)
        factor = _jpeg.dct_factor(w, h, size, size)
        factors.add(factor)
        img = Image.open(io.BytesIO(data))
        if factor > 1:
            img.draft("RGB", (width // factor, height // factor))
        img = img.convert("RGB")
        box = tuple(round(v / factor) for v in (left, top, left + w, top + h))
        expected = img.crop(box).resize((size, size), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            expected = expected.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        assert_close_uint8(out, np.asarray(expected))
    assert max(factors) > 1 or height < 448


def test_forked_workers_resample_after_the_parent_used_torchs_threads(tmp_path):
    # The parent's intra-op thread pool is up (a threaded matmul) before the Loader forks its
    # workers; they resample with torch and must finish, with the batches the chain gives in-process.
    root = make_jpeg_folder(tmp_path / "images", n=12, classes=2, progress=False)
    torch.set_num_threads(2)
    a = torch.ones(600, 600)
    assert float((a @ a).sum()) == 600.0**3
    chain = gl.Dataset(gl.ImageFolder(root)).map(RandomResizedCropFlipNormalize(size=64, chw=True)).batch(4)
    expected = [batch["image"] for batch in chain]
    with gl.Loader(chain, workers=2, start_method="fork", timeout=60.0) as loader:
        got = [batch["image"] for batch in loader]
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(e))


@pytest.mark.parametrize("normalize", [False, True])
def test_chw_output_is_the_hwc_output_transposed(normalize):
    # chw takes the kernel's planes as they are (flipped per row): the same values as HWC.
    data = jpeg(photo(375, 500))
    hwc = RandomResizedCropFlipNormalize(size=(48, 64), normalize=normalize)
    chw = RandomResizedCropFlipNormalize(size=(48, 64), normalize=normalize, chw=True)
    flips = set()
    for seed in range(8):
        a = hwc({"jpg": data}, rng=np.random.default_rng(seed))["jpg"]
        b = chw({"jpg": data}, rng=np.random.default_rng(seed))["jpg"]
        assert b.shape == (3, 48, 64) and b.flags.c_contiguous and b.dtype == a.dtype
        assert np.array_equal(b, a.transpose(2, 0, 1))
        rng = np.random.default_rng(seed)
        random_resized_crop_box(500, 375, rng)
        flips.add(bool(rng.random() < 0.5))
    assert flips == {False, True}


def test_the_kernel_is_chosen_where_the_transform_is_made_and_travels_with_it(monkeypatch):
    # Every process of a job resamples alike: the choice is kept with the transform (pickled to
    # workers, in its fingerprint and equality), not made again where it runs.
    with_torch = RandomResizedCropFlipNormalize(size=64)
    monkeypatch.setitem(sys.modules, "torch", None)
    without = RandomResizedCropFlipNormalize(size=64)
    monkeypatch.undo()
    assert with_torch._torch_resample and not without._torch_resample
    assert not RandomResizedCropFlipNormalize(size=64, decoder="pillow")._torch_resample
    assert pickle.loads(pickle.dumps(without)) == without and not pickle.loads(pickle.dumps(without))._torch_resample
    assert with_torch != without and fingerprint(with_torch) != fingerprint(without)

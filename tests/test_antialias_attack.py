"""The antialiased crop resample attacked: one transform object, the same batches everywhere.

The kernel (torch's SIMD one or Pillow's) is chosen where the transform is made and travels with
it. These tests run the same transform in-process, in fork, spawn and thread workers, after a
resume, and on odd inputs, and check that every place computes the same values: bit for bit for
one transform, within one grey level between the two kernels.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch  # noqa: F401 - this process has imported torch, as a training job has
from PIL import Image
from test_jpeg import jpeg, photo

import globalloader as gl
from globalloader import _antialias
from globalloader.synthetic import make_jpeg_folder
from globalloader.vision import RandomResizedCropFlipNormalize

TESTS = pathlib.Path(__file__).parent


def made_without_torch(**kwargs) -> RandomResizedCropFlipNormalize:
    """The transform as a process that never imported torch makes it (Pillow's kernel)."""
    saved = sys.modules.get("torch")
    sys.modules["torch"] = None  # type: ignore[assignment]
    _antialias._simd.cache_clear()
    try:
        return RandomResizedCropFlipNormalize(**kwargs)
    finally:
        sys.modules["torch"] = saved  # type: ignore[assignment]
        _antialias._simd.cache_clear()


def chain(root, transform) -> gl.Dataset:
    return gl.Dataset(gl.ImageFolder(root)).shuffle(seed=3).map(transform).batch(4)


def images(batches) -> list[np.ndarray]:
    return [np.asarray(b["image"]) for b in batches]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("aa") / "images", n=16, classes=2, progress=False)


@pytest.mark.parametrize("torch_kernel", [True, False], ids=["torch", "pillow"])
@pytest.mark.parametrize(
    ("workers", "mode", "start"),
    [
        (2, "process", "fork"),
        pytest.param(2, "process", "spawn", marks=pytest.mark.slow),
        (2, "thread", None),
    ],
)
def test_one_transform_gives_the_same_batches_in_every_kind_of_worker(folder, torch_kernel, workers, mode, start):
    kw = {"size": (40, 56), "chw": True}
    transform = RandomResizedCropFlipNormalize(**kw) if torch_kernel else made_without_torch(**kw)
    assert transform._torch_resample == torch_kernel
    expected = images(chain(folder, transform))
    opts = {"start_method": start} if start else {}
    with gl.Loader(chain(folder, transform), workers=workers, mode=mode, timeout=120.0, **opts) as loader:
        got = images(loader)
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected, strict=True):
        assert np.array_equal(g, e)


def test_made_without_torch_stays_on_pillow_after_torch_is_imported(tmp_path):
    """A fresh process that never imports torch computes the reference; the transform made here
    without torch (torch imported since) must give exactly its bytes, not torch's."""
    data = jpeg(photo(375, 500))
    (tmp_path / "a.jpg").write_bytes(data)
    code = (
        "import sys, numpy as np; from globalloader.vision import RandomResizedCropFlipNormalize as T; "
        f"t = T(size=48, normalize=False); d = open({str(tmp_path / 'a.jpg')!r}, 'rb').read(); "
        "out = np.stack([t({'jpg': d}, rng=np.random.default_rng(s))['jpg'] for s in range(12)]); "
        f"np.save({str(tmp_path / 'ref.npy')!r}, out); assert 'torch' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reference = np.load(tmp_path / "ref.npy")
    late = made_without_torch(size=48, normalize=False)
    for transform in (late, pickle.loads(pickle.dumps(late))):
        out = np.stack([transform({"jpg": data}, rng=np.random.default_rng(s))["jpg"] for s in range(12)])
        assert np.array_equal(out, reference)
    fast = RandomResizedCropFlipNormalize(size=48, normalize=False)
    ours = np.stack([fast({"jpg": data}, rng=np.random.default_rng(s))["jpg"] for s in range(12)])
    assert np.abs(ours.astype(int) - reference).max() <= 1  # the kernels agree within a grey level
    assert not np.array_equal(ours, reference), "torch's kernel was not used: the test compares Pillow to itself"


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt)
    return buffer.getvalue()


def _odd_inputs() -> dict[str, object]:
    base = photo(90, 120)
    rgb = Image.fromarray(base)
    readonly = base.copy()
    readonly.flags.writeable = False
    return {
        "grey_jpeg": jpeg(base, "L"),
        "cmyk_jpeg": jpeg(base, "CMYK"),
        "palette_png": _encoded(rgb.convert("P"), "PNG"),
        "rgba_png": _encoded(rgb.convert("RGBA"), "PNG"),
        "one_pixel_jpeg": jpeg(photo(1, 1)),
        "one_pixel_array": photo(1, 1),
        "thin_row_jpeg": jpeg(photo(1, 300)),
        "thin_column_png": _encoded(Image.fromarray(photo(300, 1)), "PNG"),
        "thin_array": photo(2, 500),
        "smaller_than_output": jpeg(photo(10, 14)),
        "readonly_array": readonly,
        "non_contiguous_array": photo(180, 240)[::2, ::2],
        "pillow_image": rgb,
        "pillow_grey_image": rgb.convert("L"),
    }


ODD = _odd_inputs()


@pytest.mark.parametrize("name", sorted(ODD))
@pytest.mark.parametrize(
    "kw",
    [
        {"size": 32},
        {"size": (24, 40), "chw": True, "flip_p": 1.0},
        {"size": (40, 24), "normalize": False, "flip_p": 1.0},
        {"size": 16, "scale": (1.0, 1.0), "ratio": (1.0, 1.0)},
        {"size": 16, "scale": (1e-4, 1e-4), "ratio": (0.01, 100.0)},
        {"size": 16, "scale": (0.5, 1.0), "ratio": (50.0, 100.0)},
    ],
    ids=["square", "chw_flip", "hwc_flip_uint8", "whole_image", "tiny_crop_wild_ratio", "very_wide_ratio"],
)
def test_odd_inputs_give_the_same_values_on_both_kernels(name, kw):
    fast = RandomResizedCropFlipNormalize(**kw)
    slow = made_without_torch(**kw)
    value = ODD[name]
    before = np.array(value) if isinstance(value, np.ndarray) else None
    h, w = (kw["size"], kw["size"]) if isinstance(kw["size"], int) else kw["size"]
    shape = (3, h, w) if kw.get("chw") else (h, w, 3)
    for seed in range(4):
        a = fast({"image": value}, rng=np.random.default_rng(seed))["image"]
        b = slow({"image": value}, rng=np.random.default_rng(seed))["image"]
        again = fast({"image": value}, rng=np.random.default_rng(seed))["image"]
        assert a.shape == b.shape == shape and a.dtype == b.dtype
        assert np.array_equal(a, again)
        assert np.isfinite(a).all()
        if kw.get("normalize", True):  # one grey level through the normalize: 1 / (255 * std)
            assert np.abs(a - b).max() <= 1 / (255 * 0.224) + 1e-4
        else:
            assert np.abs(a.astype(int) - b).max() <= 1
    if before is not None:
        assert np.array_equal(value, before), "the input array was changed"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_resumed_mid_epoch_gives_the_same_batches(folder, workers):
    transform = RandomResizedCropFlipNormalize(size=32, normalize=False)
    ds = chain(folder, transform)
    with gl.Loader(ds, workers=workers, timeout=120.0) as loader:
        full = images(loader)
    with gl.Loader(ds, workers=workers, timeout=120.0) as loader:
        it = iter(loader)
        head = images([next(it), next(it)])
        state = json.loads(json.dumps(loader.state_dict()))
    with gl.Loader(ds, workers=workers, timeout=120.0) as resumed:
        resumed.load_state_dict(state)
        rest = images(resumed)
    assert len(head + rest) == len(full) == 4
    for g, e in zip(head + rest, full, strict=True):
        assert np.array_equal(g, e)


@pytest.mark.integration
def test_after_a_shared_decode_the_server_changes_no_value(tmp_path):
    """The transform takes rng, so it cannot be shared; it runs in the job's workers after the
    server's shared decode, and each sample comes out as it does without the server."""
    from helpers import Server

    records = [{"jpg": jpeg(photo(60 + i, 80, seed=i)), "index": i} for i in range(12)]
    transform = RandomResizedCropFlipNormalize(size=(24, 20), normalize=False, chw=True)
    ds = gl.Dataset(gl.from_sequence(records)).map(gl.DecodeFields(), shared=True).map(transform)
    server = Server(tmp_path / "s.sock", workers=1)
    try:
        out = {}
        for share in (False, True):
            with gl.Loader(ds, workers=2, share=share, server=str(server.socket), timeout=120.0) as loader:
                out[share] = {int(s["index"]): np.asarray(s["jpg"]) for s in loader}
    finally:
        server.stop()
    assert sorted(out[True]) == sorted(out[False]) == list(range(12))
    for i in range(12):
        assert np.array_equal(out[True][i], out[False][i])

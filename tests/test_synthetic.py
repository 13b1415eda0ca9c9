"""Tests for globalloader.synthetic: photo-like JPEGs and the cached ImageFolder tree."""

from __future__ import annotations

import io
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from globalloader.errors import ArgumentError
from globalloader.synthetic import make_image, make_jpeg_bytes, make_jpeg_folder

SMALL = {"n": 10, "size": (64, 48), "classes": 3, "quality": 85, "seed": 1, "progress": False}


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Relative path -> (mtime_ns, content) of every file under root."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()
    }


def images(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("class_*/*.jpg"))}


def test_folder_layout_and_labels(tmp_path):
    root = make_jpeg_folder(tmp_path / "data", **SMALL)
    assert root == tmp_path / "data"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert folders == ["class_00", "class_01", "class_02"]
    # Round-robin labels: image i is in class i % 3.
    assert sorted(p.name for p in (root / "class_01").iterdir()) == [
        "img_000001.jpg",
        "img_000004.jpg",
        "img_000007.jpg",
    ]
    assert len(images(root)) == 10
    with Image.open(root / "class_00" / "img_000000.jpg") as img:
        assert img.format == "JPEG" and img.size == (64, 48) and img.mode == "RGB"


def test_folder_is_deterministic_per_seed(tmp_path):
    first = images(make_jpeg_folder(tmp_path / "a", **SMALL))
    second = images(make_jpeg_folder(tmp_path / "b", **SMALL))
    other = images(make_jpeg_folder(tmp_path / "c", **{**SMALL, "seed": 2}))
    assert first == second
    assert first.keys() == other.keys()
    assert all(first[k] != other[k] for k in first)


def test_second_call_reuses_the_folder_without_rewriting(tmp_path):
    root = make_jpeg_folder(tmp_path / "data", **SMALL)
    before = snapshot(root)
    assert make_jpeg_folder(tmp_path / "data", **SMALL) == root
    assert snapshot(root) == before  # same files, same contents, same mtimes


def test_changed_parameters_rebuild(tmp_path):
    root = make_jpeg_folder(tmp_path / "data", **SMALL)
    (root / "README.txt").write_text("not ours")
    make_jpeg_folder(root, **{**SMALL, "n": 4, "classes": 2})
    assert sorted(images(root)) == [
        "class_00/img_000000.jpg",
        "class_00/img_000002.jpg",
        "class_01/img_000001.jpg",
        "class_01/img_000003.jpg",
    ]
    assert not (root / "class_02").exists()
    assert (root / "README.txt").read_text() == "not ours"
    # Back to the first parameters: the same images as a fresh build.
    make_jpeg_folder(root, **SMALL)
    assert images(root) == images(make_jpeg_folder(tmp_path / "fresh", **SMALL))


@pytest.mark.parametrize("damage", ["delete_image", "delete_marker"])
def test_partial_folder_is_rebuilt(tmp_path, damage):
    root = make_jpeg_folder(tmp_path / "data", **SMALL)
    expected = images(root)
    victim = root / "class_02" / "img_000005.jpg"
    if damage == "delete_image":
        victim.unlink()
    else:
        next(root.glob(".*.json")).unlink()
    stale = root / "class_00" / "img_000000.jpg"
    stale.write_bytes(b"half-written")  # an interrupted build can leave such files
    make_jpeg_folder(root, **SMALL)
    assert images(root) == expected


CONCURRENT = {**SMALL, "n": 200, "size": (32, 32)}


def _build(root: str, barrier) -> None:
    barrier.wait(60)  # start together, so the builds overlap
    make_jpeg_folder(root, **CONCURRENT)


def test_concurrent_builders_agree(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_build, args=(str(tmp_path / "shared"), barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert images(tmp_path / "shared") == images(make_jpeg_folder(tmp_path / "solo", **CONCURRENT))


def test_jpegs_have_photo_like_sizes_and_content():
    for seed in range(6):
        data = make_jpeg_bytes(np.random.default_rng(seed), (500, 375), quality=90)
        # Real 500x375 photos at quality 90 are roughly 50-200 KB; flat colour would be ~5 KB.
        assert 50_000 < len(data) < 200_000, len(data)
        with Image.open(io.BytesIO(data)) as img:
            array = np.asarray(img.convert("RGB"))
        assert array.shape == (375, 500, 3)
        assert array.std() > 20  # not flat
        # Not pure noise either: neighbouring pixels are strongly correlated.
        grey = array.mean(axis=2)
        assert np.corrcoef(grey[:, :-1].ravel(), grey[:, 1:].ravel())[0, 1] > 0.5


def test_make_image_is_deterministic_and_tinted_per_class():
    a = make_image(np.random.default_rng([3, 0]), (120, 90), label=0, classes=3)
    b = make_image(np.random.default_rng([3, 0]), (120, 90), label=0, classes=3)
    assert a.shape == (90, 120, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    # Average colour over many images differs by class (the labels carry signal).
    means = [
        np.mean(
            [make_image(np.random.default_rng([s, k]), (32, 32), k, 3).mean(axis=(0, 1)) for s in range(20)], axis=0
        )
        for k in range(3)
    ]
    assert all(np.abs(means[i] - means[j]).max() > 15 for i in range(3) for j in range(i + 1, 3))


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"classes": 0}, {"quality": 101}, {"size": (4, 4)}, {"seed": -1}])
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ArgumentError, match=next(iter(kwargs))):
        make_jpeg_folder(tmp_path / "x", **{**SMALL, **kwargs})
    assert not any((tmp_path / "x").glob("class_*"))

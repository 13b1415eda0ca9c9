"""Every test gets its own cache folder: nothing is written to, or reused from, the user's cache.
Tests of an OpenCV fast path run it with and without OpenCV (`opencv`, `without_opencv`)."""

from __future__ import annotations

import pathlib
import sys

import pytest

from globalloader import _warp


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def without_opencv(monkeypatch: pytest.MonkeyPatch):
    """cv2 cannot be imported (None in sys.modules makes `import cv2` raise ImportError)."""
    monkeypatch.setitem(sys.modules, "cv2", None)
    _warp.opencv.cache_clear()
    assert _warp.opencv() is None
    yield
    _warp.opencv.cache_clear()


@pytest.fixture(params=[True, False], ids=["opencv", "no_opencv"])
def opencv(request: pytest.FixtureRequest) -> bool:
    """The test runs twice: with OpenCV, and with `without_opencv` (the NumPy or Pillow fallback)."""
    if not request.param:
        request.getfixturevalue("without_opencv")
    assert (_warp.opencv() is not None) == request.param
    return bool(request.param)

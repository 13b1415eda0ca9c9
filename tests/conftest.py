"""Every test gets its own cache folder: nothing is written to, or reused from, the user's cache.
Tests of an OpenCV fast path run it with and without OpenCV (`opencv`, `without_opencv`). The run
takes Ctrl-C as from a terminal, even when started in the background (`pytest_configure`)."""

from __future__ import annotations

import pathlib
import signal
import sys

import pytest

from globalloader import _warp


def pytest_configure(config: pytest.Config) -> None:
    """A run started in the background (`nohup pytest &`) inherits SIGINT ignored, and so would
    every process it starts: the tests that stop one with Ctrl-C (SIGINT, as a user does) would
    wait for it in vain. Handled here, SIGINT is at its default again in those processes."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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

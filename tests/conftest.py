"""Every test gets its own cache folder: nothing is written to, or reused from, the user's cache."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(folder))
    return folder

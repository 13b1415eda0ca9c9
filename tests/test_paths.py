"""globalloader._paths.cache_dir: environment overrides and on-demand creation."""

from __future__ import annotations

import pathlib

import pytest

from globalloader._paths import cache_dir
from globalloader.errors import StorageError


def test_env_var_wins(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "gl"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = cache_dir("tar-index", "v1")
    assert path == tmp_path / "gl" / "tar-index" / "v1" and path.is_dir()


def test_xdg_then_home(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOBALLOADER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "globalloader"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("demo") == tmp_path / "home" / ".cache" / "globalloader" / "demo"
    assert (tmp_path / "home" / ".cache" / "globalloader" / "demo").is_dir()


def test_a_cache_folder_that_cannot_be_made_is_named(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.raises(StorageError, match=r"the cache folder .*a-file/objects \(from GLOBALLOADER_CACHE_DIR="):
        cache_dir("objects")
    monkeypatch.delenv("GLOBALLOADER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    with pytest.raises(StorageError, match=r"a-file/globalloader \(from XDG_CACHE_HOME="):
        cache_dir()

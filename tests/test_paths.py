"""globalloader._paths.cache_dir: environment overrides and on-demand creation."""

from __future__ import annotations

import os
import pathlib
import stat

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


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
def test_a_cache_folder_another_user_could_write_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tar indexes, Arrow copies and downloaded objects in it decide what a job reads."""
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(shared))
    for owner, mode in ((65534, 0o755), (os.geteuid(), 0o775), (os.geteuid(), 0o757)):
        os.chown(shared, owner, owner)
        os.chmod(shared, mode)
        for create in (True, False):
            with pytest.raises(StorageError, match=rf"refusing the cache folder {shared}: "):
                cache_dir("tar-index", create=create)
    os.chmod(shared, 0o700)
    assert cache_dir("tar-index") == shared / "tar-index"
    # A link the user made to a folder of theirs is followed; one another user made is not.
    link = tmp_path / "link"
    link.symlink_to(shared)
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(link))
    assert cache_dir("tar-index").is_dir()
    os.lchown(link, 65534, 65534)
    with pytest.raises(StorageError, match=rf"refusing the cache folder {link}: it is a symbolic link"):
        cache_dir("tar-index")


def test_cache_folders_are_made_private_whatever_the_umask(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "a" / "gl"))
    old = os.umask(0)
    try:
        cache_dir("tar-index")
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "gl", tmp_path / "a" / "gl" / "tar-index"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder

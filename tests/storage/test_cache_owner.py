"""Who may write the machine cache: a folder or file another user owns or could write is refused
(never read), links planted in it are never followed, and what the cache makes is private; a
cache shared with the group is opt-in and checks other members' entries at every open.

The tests run as root: "another user" is uid 65534 (nobody), given files with os.chown."""

from __future__ import annotations

import os
import pathlib
import stat
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from globalloader import storage
from globalloader.errors import ArgumentError, StorageError
from globalloader.storage.cache import STATS_NAME, Entry, ObjectCache

OTHER = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")


def _entry_bytes(data: bytes) -> bytes:
    """An entry as the cache writes it: the data, then its trailer (magic, CRC-32, length)."""
    return data + struct.pack("<4sIQ", b"GLC1", zlib.crc32(data), len(data))


@pytest.fixture
def remote(s3: dict[str, Any]) -> dict[str, Any]:
    """One object on the S3 server, its stat and the name of its cache entry."""
    url = f"s3://{s3['bucket']}/object.bin"
    store = storage.Store(s3["options"])
    fs, path = store.filesystem(url)
    fs.pipe_file(path, b"genuine " * 500)
    st = store.stat(url)
    return {"url": url, "options": s3["options"], "name": Entry(url, st.size, st.version).name()}


def _read(remote: dict[str, Any]) -> bytes:
    with storage.open_read(storage.Store(remote["options"]), remote["url"]) as f:
        return f.read()


def _plant(folder: pathlib.Path, name: str, data: bytes, uid: int = OTHER, gid: int = 0) -> pathlib.Path:
    """What another user leaves in the folder: an entry with a valid trailer over its own bytes."""
    path = folder / name
    path.write_bytes(_entry_bytes(data))
    os.chown(path, uid, gid)
    return path


@as_root
@pytest.mark.parametrize("how", ["objects folder of another user", "base folder of another user", "world-writable"])
def test_a_folder_another_user_could_write_is_refused_not_read(
    remote: dict[str, Any], isolated_cache: pathlib.Path, how: str
) -> None:
    objects = isolated_cache / "objects"
    objects.mkdir(parents=True)
    _plant(objects, remote["name"], b"planted " * 500)
    refused = objects
    if how == "objects folder of another user":
        os.chown(objects, OTHER, OTHER)
    elif how == "base folder of another user":  # a shared /tmp/cache another user made
        os.chown(objects / remote["name"], 0, 0)
        os.chown(isolated_cache, OTHER, OTHER)
        refused = isolated_cache
    else:
        os.chown(objects / remote["name"], 0, 0)
        os.chmod(objects, 0o777)
    with pytest.raises(
        StorageError,
        match=rf"refusing the cache folder {refused}: .*point GLOBALLOADER_CACHE_DIR at a folder of your own",
    ):
        _read(remote)


@as_root
@pytest.mark.parametrize("how", ["owner", "mode"])
def test_a_file_in_the_folder_another_user_could_write_is_refused(
    remote: dict[str, Any], isolated_cache: pathlib.Path, how: str
) -> None:
    objects = ObjectCache().root  # the folder is ours: only its file is not
    planted = _plant(objects, remote["name"], b"planted " * 500)
    if how == "mode":
        os.chown(planted, 0, 0)
        os.chmod(planted, 0o666)
    with pytest.raises(
        StorageError, match=rf"refusing the cache file {planted}: it (belongs to uid {OTHER}|is writable)"
    ):
        _read(remote)


def test_a_planted_stats_link_is_never_written_through(remote: dict[str, Any], tmp_path: pathlib.Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's own file")
    objects = ObjectCache().root
    (objects / STATS_NAME).symlink_to(victim)
    with pytest.raises(StorageError, match=rf"refusing the cache file {objects / STATS_NAME}: it is a symbolic link"):
        _read(remote)
    assert victim.read_bytes() == b"the user's own file"


@pytest.mark.parametrize("name", ["entry", "lock"])
def test_a_planted_entry_or_lock_link_is_never_followed(
    remote: dict[str, Any], tmp_path: pathlib.Path, name: str
) -> None:
    objects = ObjectCache().root
    target = tmp_path / "elsewhere"
    target.write_bytes(_entry_bytes(b"planted " * 500))
    link = objects / remote["name"] if name == "entry" else objects / "locks" / "downloads"
    if name == "lock":
        target.unlink()  # a lock opened through the link would create the file there
    link.symlink_to(target)
    with pytest.raises(StorageError, match=rf"refusing the cache file {link}: it is a symbolic link"):
        _read(remote)
    assert target.exists() == (name == "entry")


@pytest.fixture
def umask_zero() -> Iterator[None]:
    """The most permissive umask: modes must not depend on it."""
    old = os.umask(0)
    yield
    os.umask(old)


def _modes(root: pathlib.Path) -> dict[str, int]:
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.usefixtures("umask_zero")
def test_what_the_cache_makes_is_private(remote: dict[str, Any], isolated_cache: pathlib.Path) -> None:
    assert _read(remote) == b"genuine " * 500
    modes = _modes(isolated_cache / "objects")
    assert modes == {
        "objects": 0o700,
        "objects/locks": 0o700,
        "objects/locks/downloads": 0o600,
        "objects/readers": 0o700,  # this process read: its hold is registered (`storage.registry`)
        f"objects/readers/{os.getpid()}": 0o600,
        f"objects/{remote['name']}": 0o600,
        f"objects/{STATS_NAME}": 0o600,
    }
    assert stat.S_IMODE(isolated_cache.stat().st_mode) == 0o700


@as_root
@pytest.mark.usefixtures("umask_zero")
def test_a_group_shared_cache_is_opt_in_and_checks_other_members_entries(
    remote: dict[str, Any], isolated_cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_SHARED", "group")
    assert _read(remote) == b"genuine " * 500
    objects = isolated_cache / "objects"
    assert _modes(objects) == {
        "objects": 0o2770,
        "objects/locks": 0o2770,
        "objects/locks/downloads": 0o660,  # locked for writing by every member, as the counters
        "objects/readers": 0o2770,
        f"objects/readers/{os.getpid()}": 0o640,
        f"objects/{remote['name']}": 0o640,
        f"objects/{STATS_NAME}": 0o660,
    }
    # Another member of the group wrote the entry: served, and checked at every open.
    entry = objects / remote["name"]
    os.chown(entry, OTHER, 0)
    store = storage.Store(remote["options"])
    with storage.open_read(store, remote["url"]) as f:
        assert f.read() == b"genuine " * 500
    good, before = entry.read_bytes(), entry.stat()
    with open(entry, "r+b") as f:  # damaged in place, same size and times: only its CRC tells
        f.write(b"G")
    os.utime(entry, ns=(before.st_atime_ns, before.st_mtime_ns))
    with storage.open_read(store, remote["url"]) as f:  # same process, entry seen before
        assert f.read() == b"genuine " * 500
    assert entry.read_bytes() == good and entry.stat().st_uid == 0  # fetched again
    # A member's entry of a group that is not the user's, or one every user can write: refused.
    for uid, gid, mode in ((OTHER, OTHER, 0o640), (0, 0, 0o646)):
        os.chown(entry, uid, gid)
        os.chmod(entry, mode)
        with pytest.raises(StorageError, match=rf"refusing the cache file {entry}: .*one of your groups"):
            _read(remote)


def test_the_sharing_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_SHARED", "yes")
    with pytest.raises(ArgumentError, match="GLOBALLOADER_CACHE_SHARED must be 'group'"):
        ObjectCache()


@as_root
def test_a_member_of_a_shared_cache_cannot_put_other_bytes_under_an_objects_key(
    remote: dict[str, Any], isolated_cache: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another member's entry holding other bytes of the object's size, laid out as the cache lays
    out entries (its CRC-32s vouch for its own bytes): the object's MD5, its ETag, tells."""
    monkeypatch.setenv("GLOBALLOADER_CACHE_SHARED", "group")
    st = storage.Store(remote["options"]).stat(remote["url"])
    planted = ObjectCache().open(Entry(remote["url"], st.size, st.version), lambda write: write(b"planted " * 500))
    planted.close()
    entry = isolated_cache / "objects" / remote["name"]
    os.chown(entry, OTHER, 0)
    assert _read(remote) == b"genuine " * 500
    assert entry.stat().st_uid == 0 and entry.read_bytes().startswith(b"genuine ")  # fetched again, ours now

"""The member-offset index of one tar shard: built by one header scan, cached on disk.

An index holds, per sample, the range of its members and its key, and per member the data
offset, size and extension. It is saved as an `.npz` under the cache folder, named by a hash of
the shard's location, size and version (mtime or ETag), so a changed shard is rescanned and an
unchanged one is read back in milliseconds. Writes go through a temporary file and a rename, so
concurrent jobs indexing the same shard never see a half-written index.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import threading
import zipfile
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from globalloader.errors import SourceError
from globalloader.sources._tar_format import split_key, walk
from globalloader.storage import FileStat, cache_key

_VERSION = 1
_SCAN_BLOCK_LOCAL = 64 * 1024
_SCAN_BLOCK_REMOTE = 1024 * 1024


class ShardIndex(NamedTuple):
    """Index of one shard; member and key positions are local to the shard."""

    member_start: np.ndarray  # int64 (samples + 1,): sample i owns members [s[i], s[i+1])
    members: np.ndarray  # int64 (members, 3): data offset, size, extension id
    key_start: np.ndarray  # int64 (samples + 1,): sample i's key is keys[k[i]:k[i+1]]
    keys: bytes  # utf-8 keys, concatenated
    exts: list[str]  # extension names, by id

    def __len__(self) -> int:
        return len(self.member_start) - 1


def index_path(folder: pathlib.Path, url: str, st: FileStat) -> pathlib.Path:
    """Where the index of `url` at this size and version lives."""
    ident = f"{_VERSION}\0{cache_key(url)}\0{st.size}\0{st.version}".encode()
    return folder / (hashlib.sha256(ident).hexdigest()[:40] + ".npz")


def load(path: pathlib.Path) -> ShardIndex | None:
    """The index saved at `path`, or None if it is missing or unreadable (then rescan)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            exts_blob = z["exts"].tobytes()
            exts = exts_blob.decode().split("\0") if exts_blob else []
            index = ShardIndex(z["member_start"], z["members"], z["key_start"], z["keys"].tobytes(), exts)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    if index.members.ndim != 2 or len(index.key_start) != len(index.member_start):
        return None
    return index


def save(path: pathlib.Path, index: ShardIndex) -> None:
    """Write atomically; a failure to write only costs a rescan next time, so it is ignored."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                member_start=index.member_start,
                members=index.members,
                key_start=index.key_start,
                keys=np.frombuffer(index.keys, np.uint8),
                exts=np.frombuffer("\0".join(index.exts).encode(), np.uint8),
            )
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def scan(read: Callable[[int, int], bytes], url: str, size: int, remote: bool) -> ShardIndex:
    """Build the index of one shard by walking its headers (data is skipped, not read)."""
    head = read(0, 2)
    if head == b"\x1f\x8b":
        raise SourceError(
            f"{url} is gzip-compressed: random access needs an uncompressed tar "
            "(decompress it, or read it with iter_records())"
        )
    reader = BlockReader(read, size, _SCAN_BLOCK_REMOTE if remote else _SCAN_BLOCK_LOCAL)
    member_start, key_start = [0], [0]
    members: list[tuple[int, int, int]] = []  # (data offset, size, extension id)
    keys: list[bytes] = []
    ext_ids: dict[str, int] = {}
    current: str | None = None
    seen: set[int] = set()
    key_bytes = 0
    for member in walk(reader.read_at, url, size):
        split = split_key(member.name)
        if split is None:
            continue
        key, ext = split
        ext_id = ext_ids.setdefault(ext, len(ext_ids))
        if key != current:
            if current is not None:
                member_start.append(len(members))
            encoded = key.encode("utf-8", "surrogateescape")
            keys.append(encoded)
            key_bytes += len(encoded)
            key_start.append(key_bytes)
            current, seen = key, set()
        elif ext_id in seen:
            raise SourceError(
                f"duplicate member {member.name!r} in {url} at offset "
                f"{member.offset}: sample {key!r} already has a .{ext} field"
            )
        seen.add(ext_id)
        members.append((member.offset, member.size, ext_id))
    if current is not None:
        member_start.append(len(members))
    return ShardIndex(
        np.asarray(member_start, np.int64),
        np.asarray(members, np.int64).reshape(-1, 3),
        np.asarray(key_start, np.int64),
        b"".join(keys),
        list(ext_ids),
    )


class BlockReader:
    """Serve small reads from one cached block, so scanning many small members costs one read
    per block instead of one per header; reads larger than a block go straight through."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, block: int) -> None:
        self._read, self._size, self._block = read, size, block
        self._start, self._data = 0, b""

    def read_at(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self._size - offset))
        rel = offset - self._start
        if rel >= 0 and rel + length <= len(self._data):
            return self._data[rel : rel + length]
        if length >= self._block:
            return self._read(offset, length)
        self._start = offset
        self._data = self._read(offset, min(self._block, self._size - offset))
        return self._data[:length]

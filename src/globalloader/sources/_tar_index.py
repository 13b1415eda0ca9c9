"""The member-offset index of one tar shard: built by one header scan, cached on disk.

An index holds, per sample, the range of its members and its key, and per member the data
offset, size and extension. It is saved as an `.npz` under the cache folder, named by a hash of
the shard's location, size and version (mtime or ETag), so a changed shard is rescanned and an
unchanged one is read back in milliseconds. Writes go through a temporary file and a rename, so
concurrent jobs indexing the same shard never see a half-written index.

A sidecar (`<shard>.idx`, written by TarWriter beside each shard) holds the same index plus the
shard's size, MD5 and CRC-32, so a remote shard is planned from one small request instead of a
download of the whole shard; `read_sidecar` says when it is trusted, and its CRC-32 is compared
with the bytes the machine cache downloads: a shard rewritten in place is an error, never wrong
members.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pathlib
import zipfile
import zlib
from collections.abc import Callable
from typing import IO, Any, NamedTuple

import numpy as np

from globalloader.errors import SourceError
from globalloader.sources._tar_format import split_key, walk
from globalloader.storage import FileStat, cache_key, read_whole, write_atomic
from globalloader.storage.checksum import etag_md5

_VERSION = 2  # 2: built by the walker that checks each member's end and the end-of-archive marker
SIDECAR_SUFFIX = ".idx"
SIDECAR_MAX = 64 << 20  # bytes: a larger `.idx` is not an index this module wrote
_SIDECAR_FORMAT = "globalloader-tar-index"
_SIDECAR_VERSION = 1
_SCAN_BLOCK_LOCAL = 64 * 1024
_SCAN_BLOCK_REMOTE = 1024 * 1024
_NPZ_ERRORS = (OSError, KeyError, ValueError, EOFError, zlib.error, zipfile.BadZipFile)  # an unreadable .npz


class ShardIndex(NamedTuple):
    """Index of one shard; member and key positions are local to the shard."""

    member_start: np.ndarray  # int64 (samples + 1,): sample i owns members [s[i], s[i+1])
    members: np.ndarray  # int64 (members, 3): data offset, size, extension id
    key_start: np.ndarray  # int64 (samples + 1,): sample i's key is keys[k[i]:k[i+1]]
    keys: bytes  # utf-8 keys, concatenated
    exts: list[str]  # extension names, by id
    crc32: int | None = None  # the shard's CRC-32, when the index came from a sidecar (checked on read)

    def __len__(self) -> int:
        return len(self.member_start) - 1


def index_path(folder: pathlib.Path, url: str, st: FileStat) -> pathlib.Path:
    """Where the index of `url` at this size and version lives."""
    ident = f"{_VERSION}\0{cache_key(url)}\0{st.size}\0{st.version}".encode()
    return folder / (hashlib.sha256(ident).hexdigest()[:40] + ".npz")


def load(path: pathlib.Path) -> ShardIndex | None:
    """The index saved at `path`, or None if it is missing or unreadable (then rescan)."""
    try:
        with np.load(io.BytesIO(read_whole(path)), allow_pickle=False) as z:  # BytesIO shares the bytes
            index, _ = _from_npz(z)
    except _NPZ_ERRORS:
        return None
    if index.members.ndim != 2 or len(index.key_start) != len(index.member_start):
        return None
    return index


def _from_npz(z: Any) -> tuple[ShardIndex, dict[str, Any]]:
    exts_blob = z["exts"].tobytes()
    exts = exts_blob.decode().split("\0") if exts_blob else []
    meta = json.loads(z["meta"].tobytes()) if "meta" in z.files else {}
    crc = meta.get("crc32") if isinstance(meta, dict) else None
    index = ShardIndex(
        z["member_start"],
        z["members"],
        z["key_start"],
        z["keys"].tobytes(),
        exts,
        crc if isinstance(crc, int) else None,
    )
    return index, meta if isinstance(meta, dict) else {}


def _write_npz(out: IO[bytes], index: ShardIndex, meta: dict[str, Any], compressed: bool = False) -> None:
    save = np.savez_compressed if compressed else np.savez
    save(
        out,
        member_start=index.member_start,
        members=index.members,
        key_start=index.key_start,
        keys=np.frombuffer(index.keys, np.uint8),
        exts=np.frombuffer("\0".join(index.exts).encode(), np.uint8),
        meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
    )


def save(path: pathlib.Path, index: ShardIndex) -> None:
    """Write atomically; a failure to write only costs a rescan next time, so it is ignored."""
    # Not durable: an index lost to a crash is rebuilt (one that does not load is).
    with contextlib.suppress(OSError), write_atomic(path) as out:
        _write_npz(out.file, index, {} if index.crc32 is None else {"crc32": index.crc32})


def scan(read: Callable[[int, int], bytes], url: str, size: int, remote: bool) -> ShardIndex:
    """Build the index of one shard by walking its headers (data is skipped, but for the tail `walk` checks)."""
    head = read(0, 2)
    if head == b"\x1f\x8b":
        raise SourceError(
            f"{url} is gzip-compressed: random access needs an uncompressed tar "
            "(decompress it, or read it with iter_records())"
        )
    reader = BlockReader(read, size, _SCAN_BLOCK_REMOTE if remote else _SCAN_BLOCK_LOCAL)
    builder = IndexBuilder(url)
    for member in walk(reader.read_at, url, size):
        builder.add(member.name, member.offset, member.size)
    return builder.finish()


class IndexBuilder:
    """Groups members, in archive order, into samples as WebDataset does (see TarShards)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._member_start, self._key_start = [0], [0]
        self._members: list[tuple[int, int, int]] = []  # (data offset, size, extension id)
        self._keys: list[bytes] = []
        self._ext_ids: dict[str, int] = {}
        self._current: str | None = None
        self._seen: set[int] = set()
        self._key_bytes = 0

    def add(self, name: str, offset: int, size: int) -> None:
        """One regular member whose data of `size` bytes starts at `offset`."""
        split = split_key(name)
        if split is None:
            return
        key, ext = split
        ext_id = self._ext_ids.setdefault(ext, len(self._ext_ids))
        if key != self._current:
            if self._current is not None:
                self._member_start.append(len(self._members))
            encoded = key.encode("utf-8", "surrogateescape")
            self._keys.append(encoded)
            self._key_bytes += len(encoded)
            self._key_start.append(self._key_bytes)
            self._current, self._seen = key, set()
        elif ext_id in self._seen:
            raise SourceError(
                f"duplicate member {name!r} in {self._url} at offset "
                f"{offset}: sample {key!r} already has a .{ext} field"
            )
        self._seen.add(ext_id)
        self._members.append((offset, size, ext_id))

    def finish(self) -> ShardIndex:
        member_start = self._member_start + ([len(self._members)] if self._current is not None else [])
        return ShardIndex(
            np.asarray(member_start, np.int64),
            np.asarray(self._members, np.int64).reshape(-1, 3),
            np.asarray(self._key_start, np.int64),
            b"".join(self._keys),
            list(self._ext_ids),
        )


class BlockReader:
    """Serve small reads from one cached block, so scanning many small members costs one read
    per block instead of one per header; reads larger than a block go straight through. A miss
    reads a whole block past the bytes asked: the header after the tail of a member's data (which
    `walk` reads to check where the member ends) comes with that tail, not in a read of its own."""

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
        self._data = self._read(offset, min(length + self._block, self._size - offset))
        return self._data[:length]


class Sidecar(NamedTuple):
    """What a sidecar says about one shard: its index if usable (`problem` says why not), and
    whether the shard's ETag already proved it describes these very bytes (`verified`)."""

    shard_index: ShardIndex | None = None
    verified: bool = False
    problem: str = ""


def proves_content(st: FileStat) -> bool:
    """Whether the version of a shard is its MD5 (an S3 ETag of a one-part upload), so that a
    sidecar's MD5 proves the sidecar describes these bytes before any is downloaded."""
    return etag_md5(st.version) is not None


def sidecar_url(url: str) -> str:
    """Where the sidecar of shard `url` lives."""
    return url + SIDECAR_SUFFIX


def sidecar_bytes(index: ShardIndex, size: int, md5: str, crc32: int) -> bytes:
    """The sidecar of a shard of `size` bytes with this MD5 (hex) and CRC-32."""
    meta = {"format": _SIDECAR_FORMAT, "version": _SIDECAR_VERSION, "size": size, "md5": md5, "crc32": crc32}
    out = io.BytesIO()
    _write_npz(out, ShardIndex(*index[:5], crc32), meta, compressed=True)
    return out.getvalue()


def read_sidecar(data: bytes, url: str, st: FileStat) -> Sidecar:
    """The index in the sidecar `data` of shard `url` (now of size and version `st`), checked:
    a sidecar that cannot be parsed, is of another format version, was made for a shard of
    another size or MD5, or holds members outside the shard is refused with the reason."""
    name = sidecar_url(url)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            index, meta = _from_npz(z)
    except _NPZ_ERRORS as exc:
        return Sidecar(problem=f"corrupt index sidecar {name} ({type(exc).__name__}: {exc})")
    if meta.get("format") != _SIDECAR_FORMAT or meta.get("version") != _SIDECAR_VERSION:
        version = f"format {meta.get('format')!r} version {meta.get('version')!r}"
        return Sidecar(problem=f"index sidecar {name} is of an unknown {version}")
    if meta.get("size") != st.size or not isinstance(index.crc32, int):
        return Sidecar(
            problem=f"stale index sidecar {name}: made for {meta.get('size')} bytes, the shard has {st.size}"
        )
    md5 = etag_md5(st.version)
    if md5 is not None and md5 != str(meta.get("md5", "")).lower():
        return Sidecar(
            problem=f"stale index sidecar {name}: made for MD5 {meta.get('md5')}, the shard's ETag is {st.version}"
        )
    problem = _inconsistency(index, st.size)
    if problem:
        return Sidecar(problem=f"corrupt index sidecar {name}: {problem}")
    return Sidecar(index, md5 is not None)


def _inconsistency(index: ShardIndex, size: int) -> str:
    """What is impossible about this index of a shard of `size` bytes, or ""."""
    starts, members, keys = index.member_start, index.members, index.key_start
    if any(a.dtype.kind not in "iu" for a in (starts, members, keys)):
        return "arrays of the wrong type"
    if starts.ndim != 1 or keys.shape != starts.shape or members.ndim != 2 or members.shape[1] != 3 or not len(starts):
        return "arrays of the wrong shape"
    if starts[0] != 0 or starts[-1] != len(members) or np.any(np.diff(starts) < 1):
        return "sample member ranges out of order"
    if keys[0] != 0 or keys[-1] != len(index.keys) or np.any(np.diff(keys) < 1):
        return "sample key ranges out of order"
    offsets, sizes, exts = members[:, 0], members[:, 1], members[:, 2]
    if len(members) and (
        offsets[0] < 512
        or np.any(sizes < 0)
        or np.any(offsets + sizes > size)
        or np.any(offsets[1:] < offsets[:-1] + sizes[:-1] + 512)
        or np.any((exts < 0) | (exts >= len(index.exts)))
    ):
        return "member offsets, sizes or extensions outside the shard"
    return ""

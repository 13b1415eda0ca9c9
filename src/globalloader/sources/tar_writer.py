"""TarWriter: write samples as WebDataset tar shards, rolling to a new shard by count or size."""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import threading
import zlib
from typing import Any, BinaryIO

import numpy as np

from globalloader import storage
from globalloader.errors import ArgumentError
from globalloader.sources import _tar_format, _tar_index
from globalloader.sources._shard_series import ShardSeries
from globalloader.sources._tar_format import BLOCK


class TarWriter(ShardSeries):
    """Write samples into tar shards that `webdataset` and `TarShards` read back.

    `pattern` is a plain path (one shard) or contains a printf field (`out-%06d.tar`), filled
    with 0, 1, 2, ... as shards roll over at `maxcount` samples or `maxsize` bytes (a sample is
    never split; a shard holds at least one). Local paths or fsspec URLs (`storage_options=` go
    to fsspec); a remote shard is written to a local temporary file and uploaded, with retries,
    when it is finished.

    `write(sample)` takes a dict with a str `"__key__"` (no dot in its last path component,
    since the first dot starts the extension) and one entry per field; other `__x__` entries
    are ignored. Field values: bytes as-is, str as UTF-8, int/float as decimal text (bools as
    1/0), NumPy arrays as `.npy` bytes, dict/list as JSON (a dict key that is not a str, which
    JSON would turn into one, is an ArgumentError). Field names must be lower-case because
    readers lower-case them. Members get mode 0o444, owner 0 and mtime 0, so the same
    samples always give the same bytes (stable fingerprints and caches).

    Beside each shard goes its index sidecar, `<shard>.idx` (a few KB; `index=False`: none),
    written after the shard: TarShards then plans a remote shard from it with one small request
    instead of downloading the shard first (see docs/remote.md). Upload the sidecars with the
    shards when copying a folder of shards to object storage.

    Shards are created on the first sample written to them (no sample, no file), numbered from
    `first_shard`, and each appears whole when finished (written beside its place and renamed,
    or uploaded in one piece), never half-written. A file that cannot be created raises
    SourceError naming it. Not thread-safe. `paths` lists the shards written so far.
    """

    def __init__(
        self,
        pattern: str | os.PathLike[str],
        maxcount: int | None = None,
        maxsize: int | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        index: bool = True,
        first_shard: int = 0,
    ) -> None:
        super().__init__(pattern, maxcount, maxsize, storage_options, first_shard)
        self.index = bool(index)
        self._file: _Digesting | None = None
        self._members: _tar_index.IndexBuilder | None = None
        self._last_key: str | None = None

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample; rolls to the next shard first if this one is full."""
        self._check_open()
        key, members = sample_members(sample)
        nbytes = sum(BLOCK + len(data) + -len(data) % BLOCK for _, data in members)
        if self._file is None or self._full(nbytes):
            self._next_shard()
        elif key == self._last_key:
            raise ArgumentError(f"sample key {key!r} repeats the previous one; readers would merge the two samples")
        for part in _member_parts(self._file.length, key, members, self._members):  # type: ignore[union-attr, arg-type]
            self._file.write(part)  # type: ignore[union-attr]
        self._added(nbytes)
        self._last_key = key

    def _next_shard(self) -> None:
        self._finish()
        path = self._new_path()
        self._file = _Digesting(self.store.open_write(path))  # published whole, when closed (kept open until then)
        self._members = _tar_index.IndexBuilder(path)
        self._last_key = None

    def _finish(self) -> None:
        if self._file is None or self._members is None:
            return
        self._file.write(_tar_format.archive_end(self._file.length))
        self._file.close()
        if self.index:
            written = self._file
            sidecar = _tar_index.sidecar_bytes(self._members.finish(), written.length, written.md5(), written.crc)
            with self.store.open_write(_tar_index.sidecar_url(self.paths[-1])) as out:
                out.write(sidecar)
        self._file = self._members = None

    def _drop(self) -> None:
        if self._file is not None:
            self._file.discard()  # nor its sidecar
            self.paths.pop()
        self._file = self._members = None

    def __repr__(self) -> str:
        return f"TarWriter({self.pattern!r}, {len(self.paths)} shards written)"


class _Digesting:
    """A write-only file that passes bytes on and keeps their count, CRC-32 and MD5. The MD5
    is computed by a thread of its own (hashlib lets go of the GIL on large buffers), beside
    the caller's encoding of the next members: it costs as much as the rest of the writing."""

    def __init__(self, out: storage.StagedWrite) -> None:
        self._out, self.crc, self.length = out, 0, 0
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._pending: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._digester = threading.Thread(target=self._digest, name="gl-tar-md5", daemon=True)
        self._digester.start()

    def _digest(self) -> None:
        while (data := self._pending.get()) is not None:
            self._md5.update(data)

    def write(self, data: bytes) -> int:
        self._out.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.length += len(data)
        self._pending.put(bytes(data))  # a copy only if the caller's buffer could change
        return len(data)

    def tell(self) -> int:
        return self.length

    def md5(self) -> str:
        """The MD5 (hex) of everything written; call after `close()`."""
        self._digester.join()
        return self._md5.hexdigest()

    def close(self) -> None:
        self._pending.put(None)
        self._out.close()

    def discard(self) -> None:
        self._pending.put(None)
        self._out.discard()


def shard_parts(samples: list[dict[str, Any]], url: str) -> tuple[list[bytes], _tar_index.ShardIndex]:
    """One whole shard of `samples`, byte for byte what TarWriter writes for them, as the pieces
    to write in order (not joined: the data is not copied) and its index; `url` names the shard
    in errors. For a worker that writes a shard at once (see `write_parts`)."""
    members = _tar_index.IndexBuilder(url)
    parts: list[bytes] = []
    length, last = 0, None
    for sample in samples:
        key, encoded = sample_members(sample)
        if key == last:
            raise ArgumentError(f"sample key {key!r} repeats the previous one; readers would merge the two samples")
        added = _member_parts(length, key, encoded, members)
        parts += added
        length += sum(map(len, added))
        last = key
    parts.append(_tar_format.archive_end(length))
    return parts, members.finish()


def write_parts(parts: list[bytes], index: _tar_index.ShardIndex | None, out: BinaryIO) -> bytes | None:
    """Write a file's `parts` to `out`; with the `index` of a tar shard, return its `.idx`
    sidecar, the MD5 and CRC-32 computed over the bytes as they are written."""
    if index is None:
        out.writelines(parts)
        return None
    md5, crc, length = hashlib.md5(usedforsecurity=False), 0, 0
    for part in parts:
        out.write(part)
        md5.update(part)
        crc = zlib.crc32(part, crc)
        length += len(part)
    return _tar_index.sidecar_bytes(index, length, md5.hexdigest(), crc)


def sample_members(sample: Any) -> tuple[str, list[tuple[str, bytes]]]:
    """The key of a sample TarWriter takes and its fields encoded; ArgumentError naming what is wrong."""
    if not isinstance(sample, dict):
        raise ArgumentError(f"sample must be a dict, got {type(sample).__name__}")
    key = sample.get("__key__")
    if not isinstance(key, str) or not key:
        raise ArgumentError(f"sample needs a non-empty str '__key__', got {key!r}")
    if "." in key.rsplit("/", 1)[-1] or key.startswith("__"):
        raise ArgumentError(
            f"sample key {key!r}: no dot allowed in its last path part, and "
            "no leading '__' (readers would split or skip it)"
        )
    members = [(name, _encode(key, name, value)) for name, value in sample.items() if not name.startswith("__")]
    if not members:
        raise ArgumentError(f"sample {key!r} has no fields besides '__' entries")
    return key, members


def _member_parts(
    offset: int, key: str, members: list[tuple[str, bytes]], index: _tar_index.IndexBuilder
) -> list[bytes]:
    """The tar bytes of one sample's members written at `offset` (headers, data, padding: not
    joined, so that the data is copied once), each member recorded in `index`."""
    parts: list[bytes] = []
    for name, data in members:
        header = _tar_format.member_header(f"{key}.{name}", len(data))
        offset += len(header)
        index.add(f"{key}.{name}", offset, len(data))
        padding = _tar_format.data_padding(len(data))
        parts += (header, data, padding)
        offset += len(data) + len(padding)
    return parts


def _json_keys_are_text(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) for k in value) and all(_json_keys_are_text(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_json_keys_are_text(v) for v in value)
    return True


def _encode(key: str, name: str, value: Any) -> bytes:
    if not name or name != name.lower() or "/" in name:
        raise ArgumentError(f"sample {key!r}: field name {name!r} must be non-empty lower-case without '/'")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise ArgumentError(
                f"sample {key!r}: field {name!r} is an object array; .npy without pickle cannot hold it"
            )
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return buffer.getvalue()
    if isinstance(value, (bool, np.bool_)):
        return str(int(value)).encode()
    if isinstance(value, (int, float, np.integer, np.floating)):
        return repr(value.item() if isinstance(value, np.generic) else value).encode()
    if isinstance(value, (dict, list)):
        if not _json_keys_are_text(value):  # JSON would turn {1: "a"} into {"1": "a"}
            raise ArgumentError(
                f"sample {key!r}: field {name!r} has a dict key that is not a str; JSON would make it one"
            )
        try:
            return json.dumps(value).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise ArgumentError(f"sample {key!r}: field {name!r} is not JSON-serializable: {exc}") from None
    raise ArgumentError(
        f"sample {key!r}: field {name!r} has unsupported type "
        f"{type(value).__name__} (use bytes, str, int, float, ndarray, dict, list)"
    )

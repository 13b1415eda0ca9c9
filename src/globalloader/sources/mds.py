"""MDS: a Mosaic Streaming dataset (`index.json` + shards) read as it is, by global index."""

from __future__ import annotations

import bisect
import os
import pickle
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from globalloader import storage
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources import _mds_format
from globalloader.sources._files import CachedShardFiles, prefetch_files
from globalloader.sources._mds_format import ShardInfo
from globalloader.sources.base import check_index, fingerprint_of
from globalloader.storage._fork import ProcessLocal, reset_in_forked_children
from globalloader.storage.cache import CachedFile

_UNPACKED_KEPT = 16  # decompressed shards a process keeps open in the machine cache
# Shards whose sample offsets a process keeps (4 bytes a sample): a global shuffle touches every
# shard, and their tables together would grow with the dataset.
_OFFSETS_KEPT = 256


class MDS(ProcessLocal, CachedShardFiles):
    """The samples of a Mosaic Streaming (MDS) dataset, addressable by global index, without
    Mosaic Streaming installed.

    `path_or_url`: the folder holding `index.json` (a local path or any fsspec URL;
    `storage_options=` go to fsspec). Samples are numbered shard after shard, in the index's order.
    A record is `{"__key__": "<shard file>:<row>", <column>: value, ...}` with each column decoded
    as Mosaic decodes it, except images stored encoded: `jpeg` and `png` columns (and the items of
    `list[jpeg]`, `list[png]`, `jpeg_array`) are their encoded bytes, for globalloader's decode
    path (`vision`). `pil` columns are PIL images, `pkl` columns are read only with
    `allow_pickle=True` (unpickling runs code). See `_mds_format` for the layout.

    Remote shards are downloaded whole, once per machine, into the machine-wide cache
    (`cache_limit=`, see `globalloader.storage`) and read from there by every worker, job and
    epoch; `prefetch(indices)` downloads them ahead. A compressed shard (zstd, gz, bz2, br, snappy;
    zstd, br and snappy need the `formats` extra) is decompressed once per machine into the same
    cache, local or remote. Where the index records a shard file's hash (MDSWriter's `hashes=`),
    the file is checked against it before its first sample is read: once per process for a raw
    shard, once per machine for a compressed one (before it is decompressed).

    Shuffling: `shuffle(seed, window=w)` permutes the shards, then samples within windows of `w`
    shards (`block_starts`). The fingerprint (for `share=True` and caches) is made of the index's
    and the shards' sizes and versions (mtime, or ETag for object stores).

    Errors, each a SourceError naming the file: a missing or unreadable `index.json`; an index
    that is not MDS version 2, or names an encoding or compression this reader does not know; a
    shard whose size differs from the index's (at construction); a header, sample or
    decompressed shard that disagrees with the index, or a hash mismatch (when read). A missing
    compression library is a MissingExtraError naming the extra. Thread-safe for reads; safe to
    pickle to, or fork into, worker processes.
    """

    _PROCESS_ONLY = ("_lock", "_offsets", "_verified", "_unpacked")

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
        allow_pickle: bool = False,
    ) -> None:
        if not isinstance(path_or_url, (str, os.PathLike)):
            raise ArgumentError(f"path_or_url must be a str or a path, got {type(path_or_url).__name__}")
        root = os.fspath(path_or_url).rstrip("/") or "/"
        if root.rsplit("/", 1)[-1] == _mds_format.INDEX_NAME:  # the index's own path names its folder
            root = root[: -len(_mds_format.INDEX_NAME)].rstrip("/") or "."
        self.root = root
        self.store = storage.Store(storage_options, cache_limit)
        self._reader = storage.RangeReader(self.store, whole=True)
        self.index_url = _join(root, _mds_format.INDEX_NAME)
        index_stat = self.store.stat(self.index_url)
        if index_stat.size > _mds_format.INDEX_MAX:
            raise SourceError(f"{self.index_url} holds {index_stat.size} bytes: too large for an MDS index")
        self._reader.expect(self.index_url, index_stat)
        index = self._reader.read(self.index_url, 0, index_stat.size)
        self.shards: list[ShardInfo] = _mds_format.parse_index(index, self.index_url, bool(allow_pickle))
        # The file each shard is read from: the compressed one when there is one.
        self.files = [_join(root, (s.packed or s.raw).basename) for s in self.shards]
        self._stats = self.store.stats(self.files)
        for url, stat, shard in zip(self.files, self._stats, self.shards, strict=True):
            expected = (shard.packed or shard.raw).size
            if stat.size != expected:
                raise SourceError(
                    f"{url} holds {stat.size} bytes, {self.index_url} says {expected}: the shard was cut short "
                    "or rewritten after the index; write the dataset again"
                )
            self._reader.expect(url, stat)
        self._cached = [self.store.cached(url) for url in self.files]
        self._starts = np.concatenate([[0], np.cumsum([s.samples for s in self.shards], dtype=np.int64)])
        self._first = self._starts.tolist()
        self._len = int(self._starts[-1])
        versions = [f"{self.index_url}\t{index_stat.size}\t{index_stat.version}"]
        versions += [f"{u}\t{s.size}\t{s.version}" for u, s in zip(self.files, self._stats, strict=True)]
        self.fingerprint: str = fingerprint_of("MDS", versions)
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._offsets: OrderedDict[int, np.ndarray] = OrderedDict()  # recently read shards' sample offsets, LRU
        self._verified: set[int] = set()  # raw shards this process checked against their hash
        self._unpacked: OrderedDict[int, CachedFile] = OrderedDict()  # decompressed shards open, LRU
        reset_in_forked_children(self)

    def _after_fork(self) -> None:
        # The parent's open cache entries are closed by the cache's own fork hook; forget them.
        self._reset()

    @property
    def block_starts(self) -> np.ndarray:
        """Each shard's first sample: the blocks `shuffle(window=...)` permutes."""
        return self._starts[:-1].copy()

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        shard = bisect.bisect_right(self._first, index) - 1
        row = index - self._first[shard]
        with self._lock:
            offsets = self._offsets.get(shard)
            if offsets is not None:
                self._offsets.move_to_end(shard)
        if offsets is None:
            offsets = self._open_shard(shard)
        begin, end = int(offsets[row]), int(offsets[row + 1])
        data = self._read(shard, begin, end - begin)
        info = self.shards[shard]
        if len(data) != end - begin:
            raise SourceError(f"{self._where(shard)} is shorter than its header says at offset {begin}")
        try:
            columns = _mds_format.decode_sample(info, memoryview(data))
        except (ValueError, IndexError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as exc:
            raise SourceError(f"sample {row} of {self._where(shard)} cannot be decoded: {exc}") from None
        return {"__key__": f"{info.raw.basename}:{row}", **columns}

    def _where(self, shard: int) -> str:
        url = self.files[shard]
        return url if self.shards[shard].packed is None else f"{url} (decompressed)"

    def _open_shard(self, shard: int) -> np.ndarray:
        """Shard `shard`'s sample offsets from its header (checked against the index), after its
        hash when it is raw and the index records one."""
        info = self.shards[shard]
        if info.packed is None and shard not in self._verified:
            if _mds_format.hash_check(info.raw) is not None:
                _check_hash(info.raw, self._read(shard, 0, info.raw.size), self.files[shard])
            self._verified.add(shard)
        head = self._read(shard, 0, 4 * (info.samples + 2))
        offsets = _mds_format.header(head, info.samples, info.raw.size)
        if isinstance(offsets, str):
            raise SourceError(f"{self._where(shard)} does not match {self.index_url}: {offsets}")
        with self._lock:
            self._offsets[shard] = offsets
            while len(self._offsets) > _OFFSETS_KEPT:
                self._offsets.popitem(last=False)
        return offsets

    def _read(self, shard: int, start: int, length: int) -> bytes:
        if self.shards[shard].packed is None:
            return self._reader.read(self.files[shard], start, length)
        with self._lock:
            entry = self._unpacked.get(shard)
            if entry is not None:
                self._unpacked.move_to_end(shard)
        if entry is None:
            entry = self._open_unpacked(shard)
        return entry.pread(start, length)

    def _open_unpacked(self, shard: int) -> CachedFile:
        """The decompressed shard, from the machine cache (decompressed there first if missing,
        by one process of the machine while the others wait)."""
        url, stat, info = self.files[shard], self._stats[shard], self.shards[shard]
        assert info.packed is not None

        def unpack(write: Any) -> None:
            packed = self._reader.read(url, 0, stat.size)
            if len(packed) != stat.size:
                raise SourceError(f"{url} is shorter than {self.index_url} says: {len(packed)} of {stat.size} bytes")
            _check_hash(info.packed, packed, url)  # type: ignore[arg-type]  # asserted above
            write(_mds_format.unpack(info, packed, url))

        opened = self.store.open_derived(url, stat, "decompressed", info.raw.size, unpack)
        with self._lock:
            entry = self._unpacked.setdefault(shard, opened)
            dropped = [] if entry is opened else [opened]
            while len(self._unpacked) > _UNPACKED_KEPT:
                dropped.append(self._unpacked.popitem(last=False)[1])
        for handle in dropped:
            handle.close()
        return entry

    @property
    def remote(self) -> bool:
        """Whether any shard is read through the machine cache (so `prefetch` has work to do)."""
        return any(self._cached)

    def prefetch(self, indices: Any) -> None:
        """Download the shards of these sample indices into the machine cache in the background,
        in the order they are first named (cached shards cost no request)."""
        if not self.remote:
            return
        prefetch_files(self.store, self._starts, indices, self.files, self._stats, self._cached)

    def close(self) -> None:
        """Close this process's open files (later reads reopen them)."""
        self._reader.close()
        with self._lock:
            handles = list(self._unpacked.values())
            self._unpacked.clear()
        for handle in handles:
            handle.close()

    def __repr__(self) -> str:
        return f"MDS({self.root!r}, {len(self.shards)} shards, {self._len} samples)"


def _join(root: str, name: str) -> str:
    return f"{root}/{name}" if storage.scheme_of(root) else os.path.join(root, name)


def _check_hash(info: _mds_format.FileInfo, data: bytes, url: str) -> None:
    """`data` (file `url`) against one hash the index recorded for it, when it recorded one this
    process can compute."""
    check = _mds_format.hash_check(info)
    if check is None:
        return
    name, expected = check
    found = _mds_format.digest(name, data)
    if found != expected:
        raise SourceError(
            f"{url} does not match its {name} hash in the index ({found} != {expected}): the file is "
            "damaged or was rewritten; write the dataset again"
        )

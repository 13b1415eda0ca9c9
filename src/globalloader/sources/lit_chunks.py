"""LitData: datasets written by `litdata.optimize` (`index.json` + `.bin` chunks), read in place."""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from globalloader import storage
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources import _lit_format as fmt
from globalloader.sources._files import CachedShardFiles, prefetch_files
from globalloader.sources.base import check_index, fingerprint_of
from globalloader.storage._fork import ProcessLocal


class LitData(ProcessLocal, CachedShardFiles):
    """Records of a LitData optimized dataset (the folder `litdata.optimize` wrote), by index.

    `path_or_url`: the folder (or its `index.json`), local or any fsspec URL (`s3://...`;
    `storage_options=` go to fsspec). Remote chunks are downloaded whole, once per machine, into
    the machine cache (`cache_limit=`, see `globalloader.storage`) and read from there by every
    worker, job and epoch; `prefetch(indices)` downloads them ahead. `litdata` is not needed.

    A record is the item `optimize`'s function returned, rebuilt from its `data_spec`: a dict
    item is the record, plus `"__key__": "<chunk file>:<row>"`; any other item is
    `{"__key__", "item": value}`. Leaves: int, float, bool, str as Python values; bytes, files and
    images stored encoded (`jpeg`, `image`, a `jpeg_array` as a list) as their encoded bytes, so
    `globalloader.vision` decodes them; NumPy arrays, tensors (as NumPy arrays, torch is not
    needed) and `pil` images (as `numpy.asarray(image)` gives) as NumPy arrays; lists, tuples and
    dicts as they were (also the lists LitData keeps whole, as `json` leaves). zstd-compressed
    chunks (every `compression_level`) need pyarrow (`pip install 'globalloader[formats]'`), as
    do chunks of flat JSON-like rows kept as Arrow.

    Shuffling: `shuffle(seed, window=w)` permutes the chunks (`block_starts`), then the items
    within windows of `w` chunks. A compressed chunk (or frame) is inflated once and kept per
    process; `keep_blocks` sets how many.

    Errors (a SourceError naming the file, never a wrong record), at construction: a missing or
    corrupt `index.json`, encrypted chunks, an item loader other than PyTreeLoader, a serializer
    this reader does not know (`video`, ...), a chunk whose size is not what `index.json` says;
    when read: a chunk whose item count is not what `index.json` says or whose bytes do not
    decode, a `pickle` leaf other than None (LitData pickles None values; unpickling anything else
    would run code from the files).
    Thread-safe for reads; safe to pickle to, or fork into, worker processes.
    """

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
    ) -> None:
        if not isinstance(path_or_url, (str, os.PathLike)):
            raise ArgumentError(f"path_or_url must be a str or a path, got {type(path_or_url).__name__}")
        root = os.fspath(path_or_url).rstrip("/") or "/"
        if root.endswith("/" + fmt.INDEX_NAME) or root == fmt.INDEX_NAME:
            root = root[: -len(fmt.INDEX_NAME)].rstrip("/") or "."
        self.root = root
        self.store = storage.Store(storage_options, cache_limit)
        self._reader = storage.RangeReader(self.store, whole=True)
        index_url = f"{root}/{fmt.INDEX_NAME}"
        if storage.scheme_of(root):
            self.store.find(root)  # one listing answers every chunk's size and version
        try:
            index_stat = self.store.stat(index_url)
        except SourceError as exc:
            raise SourceError(
                f"{root} has no LitData index.json ({exc}): is it a folder litdata.optimize wrote?"
            ) from None
        self._reader.expect(index_url, index_stat)
        self.config = fmt.parse_index(self._reader.read(index_url, 0, index_stat.size), index_url)
        self.chunks, self._stats, self._packed = [], [], []
        for name, _, size in self.config.chunks:
            url, stat, packed = self._find_chunk(f"{root}/{name}")
            self.chunks.append(url)
            self._stats.append(stat)
            self._packed.append(packed)
            self._reader.expect(url, stat)
            if not packed and stat.size != size:
                raise SourceError(
                    f"{url} has {stat.size} bytes, {fmt.INDEX_NAME} says {size}: it was cut short or "
                    "rewritten; write the dataset again"
                )
        self._starts = np.concatenate([[0], np.cumsum([n for _, n, _ in self.config.chunks])]).astype(np.int64)
        self._len = int(self._starts[-1])
        self._start_list = self._starts.tolist()
        self._cached = [self.store.cached(url) for url in self.chunks]
        lines = [
            f"{u}\t{s.size}\t{s.version}"
            for u, s in zip([index_url, *self.chunks], [index_stat, *self._stats], strict=True)
        ]
        self.fingerprint: str = fingerprint_of("LitData", lines)
        self.kept_blocks = 2  # inflated chunks (all their frames) kept per process
        self._reset()

    _PROCESS_ONLY = ("_lock", "_tables", "_kept", "_frames", "_mapped")

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[int, Any] = {}  # chunk -> its item offsets (or framed tables)
        self._kept: OrderedDict[tuple[int, int], Any] = OrderedDict()  # (chunk, frame) -> bytes or rows, LRU
        self._frames = 1  # the most frames a chunk read here has: `kept_blocks` chunks keep them all
        self._mapped: dict[int, Any] = {}  # chunk -> Arrow rows read in place from its memory map

    def _find_chunk(self, url: str) -> tuple[str, storage.FileStat, bool]:
        """A chunk's URL, size and version, and whether it is one zstd stream: index.json names a
        whole-file compressed chunk `<name>.zstd.bin`; LitData's own copies may hold it inflated,
        as `<name>.bin`, which is read when the compressed one is absent."""
        if not (self.config.compression is not None and self.config.level == "chunk"):
            return url, self.store.stat(url), False
        suffix = f".{self.config.compression_name}.bin"
        try:
            return url, self.store.stat(url), True
        except SourceError as missing:
            if not url.endswith(suffix):
                raise
            inflated = url[: -len(suffix)] + ".bin"
            try:
                return inflated, self.store.stat(inflated), False
            except SourceError:
                raise missing from None

    @property
    def block_starts(self) -> np.ndarray:
        """Each chunk's first item: the blocks `shuffle(window=...)` permutes."""
        return self._starts[:-1].copy()

    def keep_blocks(self, count: int) -> None:
        """Keep up to `count` inflated chunks (all their frames) per process, for a windowed shuffle."""
        self.kept_blocks = max(self.kept_blocks, int(count))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        chunk = bisect.bisect_right(self._start_list, index) - 1
        row = index - self._start_list[chunk]
        value = self._item(chunk, row)
        key = f"{self.config.chunks[chunk][0]}:{row}"
        return {"__key__": key, **value} if isinstance(value, dict) else {"__key__": key, "item": value}

    def _item(self, chunk: int, row: int) -> Any:
        """Item `row` of chunk `chunk`, decoded."""
        where = f"{self.chunks[chunk]} (item {row})"
        table = self._tables.get(chunk)
        if table is None:
            table = self._table(chunk)
        if table == "rows":  # a fresh dict per read: a caller may change it
            return self._rows(chunk).slice(row, 1).to_pylist()[0]
        if isinstance(table, fmt.Framed):
            frame = row // table.rows
            first, _, offset, length, size = table.frames[frame]
            blob = self._block(chunk, frame, lambda: fmt.unzstd(self._read(chunk, offset, length), where, size))
            base = table.offsets[first]
            data = memoryview(blob)[table.offsets[row] - base : table.offsets[row + 1] - base]
        elif self._packed[chunk]:
            data = memoryview(self._block(chunk, 0, lambda: self._inflated(chunk)))[table[row] : table[row + 1]]
        else:
            data = memoryview(self._read(chunk, table[row], table[row + 1] - table[row]))
            if self.config.level == "sample" and self.config.compression:  # each item its own zstd stream
                data = memoryview(fmt.unzstd(data, where))
        return fmt.decode_item(self.config, data, where)

    def _table(self, chunk: int) -> Any:
        """Read chunk `chunk`'s item table: offsets, framed tables, or "rows" (Arrow rows)."""
        url, (_, items, _) = self.chunks[chunk], self.config.chunks[chunk]
        table: Any
        if self.config.compression and self.config.level == "batch":
            prefix = self._read(chunk, 0, 24)
            header = self._read(chunk, 0, fmt.framed_header_size(prefix, url))
            table = fmt.framed_tables(header, items, self._stats[chunk].size, url)
            self._frames = max(self._frames, len(table.frames))
        else:
            if self._packed[chunk]:
                header = self._block(chunk, 0, lambda: self._inflated(chunk))[: 4 * (items + 2)]
            else:
                header = self._read(chunk, 0, 4 * (items + 2))
            table = fmt.item_table(header, items, self.config.chunks[chunk][2], url)
            if items and table[-1] == table[0] and self.config.fields:
                table = "rows"  # no item bytes: the rows are in the Arrow footer
        with self._lock:
            self._tables[chunk] = table
        return table

    def _read(self, chunk: int, start: int, length: int) -> bytes:
        url = self.chunks[chunk]
        data = self._reader.read(url, start, length)
        if len(data) != length:
            raise SourceError(f"{url} ends before byte {start + length}: it changed after it was opened")
        return data

    def _inflated(self, chunk: int) -> bytes:
        """A whole-file zstd chunk, inflated and checked against the size index.json gives."""
        url, (_, _, size) = self.chunks[chunk], self.config.chunks[chunk]
        data = fmt.unzstd(self._read(chunk, 0, self._stats[chunk].size), url)
        if len(data) != size:
            raise SourceError(
                f"{url} inflates to {len(data)} bytes, {fmt.INDEX_NAME} says {size}: write the dataset again"
            )
        return data

    def _rows(self, chunk: int) -> Any:
        """A chunk's Arrow rows. A chunk stored plain is memory-mapped once per process (a local
        file, or its copy in the machine cache) and read in place: no copy, the pages shared, and
        a shuffle across chunks reads nothing twice. A compressed one is inflated into the kept
        blocks (LRU)."""
        items, url = self.config.chunks[chunk][1], self.chunks[chunk]
        if self._packed[chunk]:
            return self._block(chunk, 0, lambda: fmt.arrow_rows(self._arrow_ipc(chunk), items, url))
        with self._lock:
            rows = self._mapped.get(chunk)
        if rows is None:
            if self._cached[chunk]:  # the machine cache's copy, checked, then mapped
                whole = memoryview(self.store.open_cached(url, self._stats[chunk]).mapped())
            else:
                whole = memoryview(storage.memory_map(url).read_buffer()).cast("B")
            ipc = fmt.arrow_footer(whole)
            if ipc is None:
                raise SourceError(f"{url} has no item bytes and no Arrow rows: it is corrupt; write the dataset again")
            rows = fmt.arrow_rows(ipc, items, url)
            with self._lock:
                rows = self._mapped.setdefault(chunk, rows)
        return rows

    def _arrow_ipc(self, chunk: int) -> bytes | memoryview:
        url = self.chunks[chunk]
        whole = self._inflated(chunk) if self._packed[chunk] else self._read(chunk, 0, self._stats[chunk].size)
        ipc = fmt.arrow_footer(whole)
        if ipc is None:
            raise SourceError(f"{url} has no item bytes and no Arrow rows: it is corrupt; write the dataset again")
        return ipc

    def _block(self, chunk: int, frame: int, make: Any) -> Any:
        """A chunk's (or frame's) inflated bytes or rows, made once and kept per process (LRU)."""
        key = (chunk, frame)
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                return kept
        made = make()
        with self._lock:
            self._kept[key] = made
            while len(self._kept) > self.kept_blocks * self._frames:
                self._kept.popitem(last=False)
        return made

    @property
    def remote(self) -> bool:
        """Whether any chunk is read through the machine cache (so `prefetch` has work to do)."""
        return any(self._cached)

    def prefetch(self, indices: Any) -> None:
        """Download the chunks of these item indices into the machine cache in the background,
        in the order they are first named (cached chunks cost no request)."""
        if not self.remote:
            return
        prefetch_files(self.store, self._starts, indices, self.chunks, self._stats, self._cached)

    def close(self) -> None:
        """Close this process's open chunk files (later reads reopen them)."""
        self._reader.close()

    def __repr__(self) -> str:
        return f"LitData({self.root!r}, {len(self.chunks)} chunks, {self._len} items)"

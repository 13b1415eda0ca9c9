"""Parquet: rows of Parquet files as records, random access by row group plus offset."""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from globalloader import _extras, storage
from globalloader.errors import ArgumentError, SourceError, check_int
from globalloader.sources import _files
from globalloader.sources._arrow_values import exact_columns_with_nulls, is_bytes, is_exact, is_text, to_python
from globalloader.sources._columns import BlockGather, batch_values, check_columnar, gatherable
from globalloader.sources._row_layout import VALUE, Layout, Step, Unpacker
from globalloader.sources.arrow_copy import ArrowCopy
from globalloader.sources.base import check_index, check_indices, fingerprint_of
from globalloader.storage._fork import ProcessLocal

_Decoded = tuple[Unpacker | None, list[Step]]  # (row -> packed numbers, steps)
_GATHER_ROWS = 8192


def _kind(arrow_type: Any) -> str:
    """What a column's values are when read: types of one kind read as the same Python values
    (dictionary-encoded text reads as its text: pandas writes categoricals so)."""
    pa = _extras.require("pyarrow", "parquet")
    if pa.types.is_dictionary(arrow_type) and _kind(arrow_type.value_type) in ("text", "bytes"):
        return _kind(arrow_type.value_type)
    for kind, test in (
        ("integer", pa.types.is_integer),
        ("float", pa.types.is_floating),
        ("text", is_text),
        ("bytes", is_bytes),
    ):
        if test(arrow_type):
            return kind
    return str(arrow_type)


class Parquet(ProcessLocal):
    """Rows of one or more Parquet files, addressable by global row index.

    `paths`: a str with brace patterns or globs, or a list of them; local or fsspec URLs.
    `columns`: the columns to read (default all). A record is
    `{"__key__": f"{file}:{row}", <column>: value, ...}` where `row` counts within the file.
    Values are Python values (bytes, str, int, float, bool); list columns become NumPy arrays,
    structs dicts. Numeric columns never hold None, so batches of them are numeric arrays, never
    object arrays: a null in a float column is NaN; an integer or boolean column that holds a
    null anywhere in the source (by the footers' null counts, or may hold one: a nullable column
    whose footer has no null count) is read as float64 everywhere, with NaN for nulls, so its
    dtype is the same in every batch (`int_columns_as_float` names them); such a column holding an
    integer beyond 2**53, which float64 would round, is a SourceError. Nulls in other columns
    (text, bytes, nested) are None. Files whose selected columns differ in kind (ints in one, floats
    or text in another, a column missing) are refused when the source is made; text stored
    dictionary-encoded in one file (a pandas categorical) and plain in another is one kind.

    Random access: the footers give every row group's row count; a bisect over the cumulative
    counts finds the row group, which is decoded whole (Parquet's unit of compression) and kept
    in a per-process LRU of `cached_row_groups`, so sequential and nearby reads decode each
    group once. Files are opened lazily, per thread, and reopened in a forked or unpickled
    process. `block_starts` holds the first row of every row group (the source's blocks).

    Batches: a chain that only batches the rows with the default collate gets each batch
    gathered column by column (`read_columns`, when `columnar`; a worker's next batches in one
    call, up to `gather_rows` rows): about 2.5 times as fast, the same batch key for key and
    dtype for dtype (`sources._columns`).

    Shuffling: a global `shuffle(seed)` decodes a whole row group for nearly every row; use
    `shuffle(seed, window=w)` (row groups permuted, rows within `w` of them) or the exact shuffle
    on `local_copy()`. docs/columnar.md measures what each costs and how well each shuffles.

    Errors: a missing or unreadable file, or a column it lacks, raises SourceError naming it.
    Needs pyarrow (the `parquet` extra).
    """

    def __init__(
        self,
        paths: Any,
        columns: list[str] | None = None,
        *,
        cached_row_groups: int = 4,
        threads: int = 8,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
    ) -> None:
        self._reset()
        if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
            raise ArgumentError(f"columns must be a list of str or None, got {columns!r}")
        cached_row_groups = check_int(cached_row_groups, "cached_row_groups", 1)
        self.store = storage.Store(storage_options, cache_limit)
        self.files: list[str] = _files.expand_urls(paths, "paths", self.store)
        self.columns: list[str] | None = list(columns) if columns is not None else None
        self.cached_row_groups = cached_row_groups
        with ThreadPoolExecutor(min(max(1, threads), len(self.files))) as pool:
            stats = list(pool.map(self.store.stat, self.files))
            handles = list(pool.map(self._checked_file, range(len(self.files))))
        metas = [handle.metadata for handle in handles]
        self._group_start = [0]  # global row where each (file, row group) starts
        self._group_owner: list[tuple[int, int, int]] = []  # (file, row group, first row in file)
        decoded_bytes = 0
        for f, meta in enumerate(metas):
            in_file = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                decoded_bytes += meta.row_group(g).total_byte_size
                self._group_owner.append((f, g, in_file))
                self._group_start.append(self._group_start[-1] + rows)
                in_file += rows
        self._len = self._group_start[-1]
        # Rows a chain may gather in one read_columns_ahead call (dataset.gather_ahead): each call
        # costs tens of microseconds besides its rows; at most 16 MiB of rows are gathered at once.
        self.gather_rows = int(min(_GATHER_ROWS, (16 << 20) * max(1, self._len) // max(1, decoded_bytes)))
        self.block_starts: np.ndarray = np.array(self._group_start[:-1], dtype=np.int64)
        self.block_starts.setflags(write=False)
        self._origins = (  # each row group's file and first row in it, and the files' key prefixes
            np.array([f for f, _, _ in self._group_owner], dtype=np.int64),
            np.array([r for _, _, r in self._group_owner], dtype=np.int64),
            [f"{url}:" for url in self.files],
        )
        self._stats = stats
        self.int_columns_as_float: frozenset[str] = exact_columns_with_nulls(metas, self.columns)
        self._check_same_columns([handle.schema_arrow for handle in handles])
        self.columnar: bool = self._gatherable([handle.schema_arrow for handle in handles])
        versions = (f"{u}\t{s.size}\t{s.version}" for u, s in zip(self.files, stats, strict=True))
        self.fingerprint: str = fingerprint_of("Parquet", [f"columns={self.columns}", *versions])

    _PROCESS_ONLY = ("_pq", "_local", "_groups", "_gather")

    def _reset(self) -> None:
        self._pq = _extras.require("pyarrow.parquet", "parquet")
        # One ParquetFile per thread and file: a ParquetFile must not be read from two threads
        # at once, and a lock would serialize decoding, the expensive part in thread mode.
        self._local = threading.local()
        self._groups: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._gather: BlockGather | None = None
        storage.reset_in_forked_children(self)

    def _after_fork(self) -> None:
        # Decoded row groups stay valid in the child; only the open files must not be shared.
        self._local = threading.local()

    def _file(self, f: int) -> Any:
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        handle = handles.get(f)
        if handle is None:
            url = self.files[f]
            recorded = getattr(self, "_stats", None)  # None while the constructor reads the footers
            try:
                # Remote files by cached blocks: a footer and a few columns download only those.
                stat = recorded[f] if recorded else None
                handle = self._pq.ParquetFile(storage.open_arrow(self.store, url, stat))
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise SourceError(f"cannot read Parquet file {url}: {exc}") from None
            if recorded is not None and self.store.stat(url) != recorded[f]:
                raise SourceError(
                    f"Parquet file {url} changed since the source was made (size or version differs): its rows "
                    "no longer match the indices; make the source again"
                )
            handles[f] = handle
        return handle

    def _checked_file(self, f: int) -> Any:
        handle = self._file(f)
        if self.columns is not None:
            names = set(handle.schema_arrow.names)
            missing = [c for c in self.columns if c not in names]
            if missing:
                raise SourceError(f"Parquet file {self.files[f]} has no column(s) {missing}; it has {sorted(names)}")
        return handle

    def _check_same_columns(self, schemas: list[Any]) -> None:
        """Every file has the selected columns, each of one kind in every file (integers of any
        width, floats of any width, text, bytes, or else one exact type), so a batch never
        changes type mid-epoch; otherwise a SourceError names the column and two files."""
        first = schemas[0]
        names = self.columns or first.names
        for f, schema in enumerate(schemas[1:], start=1):
            extra = [n for n in schema.names if n not in names] if self.columns is None else []
            for name in [*names, *extra]:
                if name not in schema.names or name not in first.names:
                    where = self.files[f] if name not in schema.names else self.files[0]
                    raise SourceError(
                        f"Parquet column {name!r} is missing from {where} but not from the other files; "
                        "select the columns all files have with columns=[...]"
                    )
                a, b = first.field(name).type, schema.field(name).type
                if _kind(a) != _kind(b):
                    raise SourceError(
                        f"Parquet column {name!r} is {a} in {self.files[0]} but {b} in {self.files[f]}; "
                        "rewrite the files with one type for it"
                    )

    def _gatherable(self, schemas: list[Any]) -> bool:
        """Whether batches can be gathered by column (`read_columns`): every file has the same
        selected columns (in the order records have them) of types whose batch dtype the data
        cannot change."""
        selected = [[(name, schema.field(name).type) for name in self.columns or schema.names] for schema in schemas]
        if not selected or any(s != selected[0] for s in selected):
            return False
        self._column_names = [name for name, _ in selected[0]]
        return all(gatherable(kind, name in self.int_columns_as_float) for name, kind in selected[0])

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        group = bisect.bisect_right(self._group_start, index) - 1
        return self._record(self._group(group), group, index - self._group_start[group])

    def read_many(self, indices: np.ndarray) -> list[dict[str, Any]]:
        """The records at `indices`, in that order: rows are read group by group, in row order
        within each, so a task pays one cache lookup per row group, not one per row."""
        idx = check_indices(indices, self._len, self)
        order = np.argsort(idx, kind="stable")  # rows in order are row groups in order
        rows = idx[order]
        groups = np.searchsorted(self.block_starts, rows, side="right") - 1
        out: list[Any] = [None] * len(idx)
        for part in np.split(np.arange(len(idx)), np.flatnonzero(np.diff(groups)) + 1):
            if not len(part):
                continue
            group = int(groups[part[0]])
            decoded, start = self._group(group), self._group_start[group]
            for k, index in zip(order[part].tolist(), rows[part].tolist(), strict=True):
                out[k] = self._record(decoded, group, index - start)
        return out

    def read_columns(self, indices: np.ndarray) -> dict[str, Any]:
        """The batch of the records at `indices` (at least one), in that order, gathered column by
        column: what collating `read_many(indices)` gives, without a record per row. Only for a
        source whose `columnar` is True (see `sources._columns`)."""
        check_columnar(self)
        return self._gatherer()(check_indices(indices, self._len, self))

    def read_columns_ahead(self, parts: list[np.ndarray]) -> list[dict[str, Any]]:
        """`read_columns` of each part, in one gather, for the leading parts whose rows lie in the
        row groups of the first part (at least the first part): the batches of a worker's next
        tasks (`dataset.gather_ahead`), no more row groups than its current task holds."""
        check_columnar(self)
        return self._gatherer().ahead([check_indices(part, self._len, self) for part in parts])

    def _gatherer(self) -> BlockGather:
        if self._gather is None:
            self._gather = BlockGather(
                self._column_names, self.block_starts, self._len, self._origins, self._block_columns
            )
        return self._gather

    def _block_columns(self, group: int) -> list[Any]:
        return self._cached("columns", group, self._decode_columns)

    def _group(self, group: int) -> _Decoded:
        return self._cached("rows", group, self._decode_group)

    def _cached(self, form: str, group: int, decode: Callable[[int], Any]) -> Any:
        """Row group `group` decoded for reads by row or by column (`form`), from the LRU."""
        key = (form, group)
        cached = self._groups.get(key)
        if cached is None:
            cached = self._groups[key] = decode(group)
            with contextlib.suppress(KeyError):  # another thread evicted it first
                while len(self._groups) > self.cached_row_groups:
                    self._groups.popitem(last=False)
        else:
            with contextlib.suppress(KeyError):  # another thread evicted it meanwhile: the local copy is fine
                self._groups.move_to_end(key)
        return cached

    def _record(self, decoded: _Decoded, group: int, row: int) -> dict[str, Any]:
        f, _, first_row = self._group_owner[group]
        record: dict[str, Any] = {"__key__": f"{self.files[f]}:{first_row + row}"}
        unpack, steps = decoded
        packed = unpack(row) if unpack is not None else ()
        for name, kind, slot, read in steps:
            record[name] = packed[slot] if kind == VALUE else read(row)
        return record

    def read_table(self, file: int | str) -> Any:
        """The selected columns of one whole file (by index or URL) as a `pyarrow.Table`."""
        f = (self.files.index(file) if file in self.files else -1) if isinstance(file, str) else file
        if not isinstance(f, int) or isinstance(f, bool) or not 0 <= f < len(self.files):
            raise ArgumentError(
                f"file must be an index in 0..{len(self.files) - 1} or one of the source's files, got {file!r}"
            )
        try:
            return self._file(f).read(columns=self.columns)
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read Parquet file {self.files[f]}: {exc}") from None

    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Yield every record in file order, one row group at a time (no cache pollution)."""
        for group in range(len(self._group_owner)):
            decoded = self._decode_group(group)
            for row in range(self._group_start[group + 1] - self._group_start[group]):
                yield self._record(decoded, group, row)

    def _decode_group(self, group: int) -> _Decoded:
        """A row group ready for reads by row: its numbers packed row by row (one cache line per
        row when rows are read out of order, as in a windowed shuffle), the rest Python lists."""
        table = self.read_block(group)
        columns = [column.combine_chunks() for column in table.columns]
        layout = Layout.plan(table.column_names, [c.type for c in columns], self.int_columns_as_float, spans=False)
        steps: list[Step] = [
            (name, kind, slot, None if kind == VALUE else to_python(column, name).__getitem__)
            for (name, kind, slot, _), column in zip(layout.columns, columns, strict=True)
        ]
        return layout.unpacker_of(layout.records(columns)), steps

    def _decode_columns(self, group: int) -> list[Any]:
        """A row group ready for gathers by column (`sources._columns.batch_values`)."""
        table = self.read_block(group)
        return [
            batch_values(column.combine_chunks(), name, name in self.int_columns_as_float)
            for name, column in zip(table.column_names, table.columns, strict=True)
        ]

    # -- blocks: what block-aware shuffles and the Arrow copy read -----------------------------
    def read_block(self, block: int) -> Any:
        """Row group `block` (counted across files) as a `pyarrow.Table` of the selected columns.

        Raises SourceError naming the file when it cannot be read, or when an integer or boolean
        column holds nulls its footer does not count (its dtype could not be kept stable)."""
        f, g, _ = self._group_owner[block]
        try:
            table = self._file(f).read_row_group(g, columns=self.columns)
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read row group {g} of {self.files[f]}: {exc}") from None
        if table.num_rows != self._group_start[block + 1] - self._group_start[block]:
            raise SourceError(f"row group {g} of {self.files[f]} changed since the source was made; make it again")
        for name, column in zip(table.column_names, table.columns, strict=True):
            if column.null_count and is_exact(column.type) and name not in self.int_columns_as_float:
                raise SourceError(
                    f"row group {g} of {self.files[f]}: column {name!r} holds nulls its file's "
                    "footer does not count; rewrite the file with statistics"
                )
        return table

    def block_origin(self, block: int) -> tuple[str, int]:
        """(file URL, row within that file) where row group `block` starts: what its keys name."""
        f, _, first_row = self._group_owner[block]
        return self.files[f], first_row

    def keep_blocks(self, count: int) -> None:
        """Keep at least `count` decoded row groups per process (a windowed shuffle reads its whole
        window at once; a smaller cache would decode a group again for every row)."""
        self.cached_row_groups = max(self.cached_row_groups, int(count))

    @property
    def cached_blocks(self) -> int:
        """Decoded row groups kept per process (`CachesDecodedBlocks`)."""
        return self.cached_row_groups

    def file_versions(self) -> list[tuple[str, int, str]]:
        """(location, size, version) of every file, as read at construction: what a copy is keyed by."""
        return [(storage.cache_key(u), s.size, s.version) for u, s in zip(self.files, self._stats, strict=True)]

    def local_copy(self, folder: str | os.PathLike[str] | None = None, *, progress: bool | None = None) -> ArrowCopy:
        """The same records from a local memory-mapped Arrow copy, where any row is cheap (for an
        exact global shuffle). Written once, with a progress bar, into `folder` (default: the
        globalloader cache folder); later calls, runs and jobs reuse it until a file changes.
        See `ArrowCopy`."""
        return ArrowCopy(self, folder, progress=progress)

    def __repr__(self) -> str:
        return f"Parquet({len(self.files)} files, {self._len} rows)"

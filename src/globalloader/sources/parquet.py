"""Parquet: rows of Parquet files as records, random access by row group plus offset."""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from globalloader import _extras
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources import _files
from globalloader.sources.base import check_index, fingerprint_of


class Parquet:
    """Rows of one or more Parquet files, addressable by global row index.

    `paths`: a str with brace patterns or globs, or a list of them; local or fsspec URLs.
    `columns`: the columns to read (default all). A record is
    `{"__key__": f"{file}:{row}", <column>: value, ...}` where `row` counts within the file.
    Values are Python values (bytes, str, int, float, bool); list columns become NumPy arrays,
    structs dicts. Numeric columns never hold None, so batches of them are numeric arrays, never
    object arrays: a null in a float column is NaN; an integer or boolean column that holds a
    null anywhere in the source (by the footers' null counts, or may hold one: a nullable column
    whose footer has no null count) is read as float64 everywhere, with NaN for nulls, so its
    dtype is the same in every batch (`int_columns_as_float` names them). Nulls in other columns
    (text, bytes, nested) are None.

    Random access: the footers give every row group's row count; a bisect over the cumulative
    counts finds the row group, which is decoded whole (Parquet's unit of compression) and kept
    in a per-process LRU of `cached_row_groups`, so sequential and nearby reads decode each
    group once. Files are opened lazily, per thread, and reopened in a forked or unpickled
    process.

    Errors: a missing or unreadable file, or a column it lacks, raises SourceError naming it.
    Needs pyarrow (the `parquet` extra).
    """

    def __init__(
        self, paths: Any, columns: list[str] | None = None, *, cached_row_groups: int = 4, threads: int = 8
    ) -> None:
        self._pq = _extras.require("pyarrow.parquet", "parquet")
        if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
            raise ArgumentError(f"columns must be a list of str or None, got {columns!r}")
        if not isinstance(cached_row_groups, int) or cached_row_groups < 1:
            raise ArgumentError(f"cached_row_groups must be a positive int, got {cached_row_groups!r}")
        self.files: list[str] = _files.expand_urls(paths, "paths")
        self.columns: list[str] | None = list(columns) if columns is not None else None
        self.cached_row_groups = cached_row_groups
        self._reset_handles()
        with ThreadPoolExecutor(min(max(1, threads), len(self.files))) as pool:
            stats = list(pool.map(_files.stat, self.files))
            metas = list(pool.map(self._metadata, range(len(self.files))))
        self._group_start = [0]  # global row where each (file, row group) starts
        self._group_owner: list[tuple[int, int, int]] = []  # (file, row group, first row in file)
        for f, meta in enumerate(metas):
            in_file = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                self._group_owner.append((f, g, in_file))
                self._group_start.append(self._group_start[-1] + rows)
                in_file += rows
        self._len = self._group_start[-1]
        self.int_columns_as_float: frozenset[str] = _exact_columns_with_nulls(metas, self.columns)
        self.fingerprint: str = fingerprint_of(
            "Parquet",
            [
                f"columns={self.columns}",
                *(f"{u}\t{s.size}\t{s.version}" for u, s in zip(self.files, stats, strict=True)),
            ],
        )

    def _reset_handles(self) -> None:
        # One ParquetFile per thread and file: a ParquetFile must not be read from two threads
        # at once, and a lock would serialize decoding, the expensive part in thread mode.
        self._local = threading.local()
        self._groups: OrderedDict[int, tuple[list[str], list[list[Any]]]] = OrderedDict()
        _files.reset_in_forked_children(self)

    def _after_fork(self) -> None:
        # Decoded row groups stay valid in the child; only the open files must not be shared.
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_pq", "_local", "_groups"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pq = _extras.require("pyarrow.parquet", "parquet")
        self._reset_handles()

    def _file(self, f: int) -> Any:
        handles = getattr(self._local, "handles", None)
        if handles is None:
            handles = self._local.handles = {}
        handle = handles.get(f)
        if handle is None:
            url = self.files[f]
            try:
                source = _files.open_file(url, "rb") if _files.scheme_of(url) else url
                handle = self._pq.ParquetFile(source)
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise SourceError(f"cannot read Parquet file {url}: {exc}") from None
            handles[f] = handle
        return handle

    def _metadata(self, f: int) -> Any:
        handle = self._file(f)
        if self.columns is not None:
            names = set(handle.schema_arrow.names)
            missing = [c for c in self.columns if c not in names]
            if missing:
                raise SourceError(f"Parquet file {self.files[f]} has no column(s) {missing}; it has {sorted(names)}")
        return handle.metadata

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < self._len:
            index = check_index(index, self._len, self)
        group = bisect.bisect_right(self._group_start, index) - 1
        cached = self._groups.get(group)
        if cached is None:
            cached = self._decode_and_cache(group)
        else:
            # Another thread may have evicted it meanwhile (KeyError); the local copy is fine.
            with contextlib.suppress(KeyError):
                self._groups.move_to_end(group)
        names, values = cached
        row = index - self._group_start[group]
        f, _, first_row = self._group_owner[group]
        record = {"__key__": f"{self.files[f]}:{first_row + row}"}
        for name, column in zip(names, values, strict=True):
            record[name] = column[row]
        return record

    def _decode_and_cache(self, group: int) -> tuple[list[str], list[list[Any]]]:
        decoded = self._decode_group(group)
        self._groups[group] = decoded
        while len(self._groups) > self.cached_row_groups:
            try:
                self._groups.popitem(last=False)
            except KeyError:
                break
        return decoded

    def read_table(self, file: int | str) -> Any:
        """The selected columns of one whole file (by index or URL) as a `pyarrow.Table`."""
        f = self.files.index(file) if isinstance(file, str) else file
        if not isinstance(f, int) or not 0 <= f < len(self.files):
            raise ArgumentError(
                f"file must be an index in 0..{len(self.files) - 1} or one of the source's files, got {file!r}"
            )
        try:
            return self._file(f).read(columns=self.columns)
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read Parquet file {self.files[f]}: {exc}") from None

    def iter_records(self) -> Iterator[dict[str, Any]]:
        """Yield every record in file order, one row group at a time (no cache pollution)."""
        for group, (f, _, first_row) in enumerate(self._group_owner):
            names, values = self._decode_group(group)
            for row, items in enumerate(zip(*values, strict=True)):
                record = {"__key__": f"{self.files[f]}:{first_row + row}"}
                record.update(zip(names, items, strict=True))
                yield record

    def _decode_group(self, group: int) -> tuple[list[str], list[list[Any]]]:
        f, g, _ = self._group_owner[group]
        try:
            table = self._file(f).read_row_group(g, columns=self.columns)
        except (OSError, ValueError) as exc:
            raise SourceError(f"cannot read row group {g} of {self.files[f]}: {exc}") from None
        names = table.column_names
        as_float = [name in self.int_columns_as_float for name in names]
        for name, column in zip(names, table.columns, strict=True):
            if column.null_count and _is_exact(column.type) and name not in self.int_columns_as_float:
                raise SourceError(
                    f"row group {g} of {self.files[f]}: column {name!r} holds nulls its file's "
                    "footer does not count; rewrite the file with statistics"
                )
        return names, [_to_python(column, float_) for column, float_ in zip(table.columns, as_float, strict=True)]

    def __repr__(self) -> str:
        return f"Parquet({len(self.files)} files, {self._len} rows)"


def _is_exact(kind: Any) -> bool:
    """Integer and boolean types: those with no NaN of their own to stand for a null."""
    pa = _extras.require("pyarrow", "parquet")
    return bool(pa.types.is_integer(kind) or pa.types.is_boolean(kind))


def _exact_columns_with_nulls(metas: list[Any], columns: list[str] | None) -> frozenset[str]:
    """The integer and boolean columns that hold a null in some row group of some file, or may
    (a nullable column whose footer has no null count): read as float64 so that every batch of
    them has the same dtype."""
    found: set[str] = set()
    for meta in metas:
        schema = meta.schema.to_arrow_schema()
        exact = {
            field.name: field.nullable
            for field in schema
            if _is_exact(field.type) and (columns is None or field.name in columns)
        }
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for j in range(group.num_columns):
                chunk = group.column(j)
                name = chunk.path_in_schema
                if name not in exact or name in found:
                    continue
                stats = chunk.statistics
                if stats is not None and stats.has_null_count:
                    if stats.null_count > 0:
                        found.add(name)
                elif exact[name]:
                    found.add(name)
    return frozenset(found)


def _to_python(column: Any, as_float: bool = False) -> list[Any]:
    """One column of a row group as a list of Python values (lists as NumPy arrays).

    Numeric columns go through NumPy's `tolist`, several times faster than Arrow's `to_pylist`:
    float nulls become NaN, and `as_float` reads an integer or boolean column as float64 with NaN
    for nulls. List columns become one ndarray per row.
    """
    pa = _extras.require("pyarrow", "parquet")
    kind = column.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return list(column.to_numpy(zero_copy_only=False))
    if as_float:
        return np.asarray(column.cast(pa.float64()).to_numpy()).tolist()
    if pa.types.is_floating(kind) or (column.null_count == 0 and _is_exact(kind)):
        return np.asarray(column.to_numpy()).tolist()
    return column.to_pylist()

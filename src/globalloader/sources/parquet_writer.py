"""ParquetWriter: write samples as rows of Parquet files, rolling to a new file by count or size."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from globalloader import _extras
from globalloader.errors import ArgumentError, check_int
from globalloader.sources._shard_series import ShardSeries

ROW_GROUP_ROWS = 1024  # rows per row group: the unit `Parquet` reads and shuffles by


class ParquetWriter(ShardSeries):
    """Write samples as the rows of Parquet files that `Parquet` reads back.

    `pattern`, `maxcount`, `maxsize`, `storage_options` and `first_shard` are TarWriter's: a
    file rolls over at `maxcount` rows or `maxsize` bytes of values (bytes and str by length,
    arrays by `nbytes`, numbers 8; before compression). `write(sample)` takes a dict; its
    `__x__` entries are left out and every other entry is a column, typed by pyarrow from the
    file's rows (bytes, str, numbers, lists and 1-D arrays as lists, dicts as structs). A file
    is written whole when it is full or at `close()` (its rows are held until then), in row
    groups of `row_group_rows`, so the same samples always give the same bytes. Needs pyarrow
    (the `parquet` extra). Not thread-safe. `paths` lists the files written so far.
    """

    def __init__(
        self,
        pattern: str | os.PathLike[str],
        maxcount: int | None = None,
        maxsize: int | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        first_shard: int = 0,
        row_group_rows: int = ROW_GROUP_ROWS,
    ) -> None:
        super().__init__(pattern, maxcount, maxsize, storage_options, first_shard)
        _extras.require("pyarrow.parquet", "parquet")  # named at construction, not at the first full file
        self.row_group_rows = check_int(row_group_rows, "row_group_rows", 1)
        self._rows: list[dict[str, Any]] | None = None

    def write(self, sample: dict[str, Any]) -> None:
        """Append one row; writes the current file first if it is full."""
        self._check_open()
        row = sample_row(sample)
        nbytes = sum(_value_size(value) for value in row.values())
        if self._rows is None or self._full(nbytes):
            self._finish()
            self._new_path()
            self._rows = []
        assert self._rows is not None
        self._rows.append(row)
        self._added(nbytes)

    def _finish(self) -> None:
        if not self._rows:
            return
        path, rows, self._rows = self.paths[-1], self._rows, None
        data = file_bytes(rows, path, self.row_group_rows)
        with self.store.open_write(path) as out:
            out.write(data)

    def _drop(self) -> None:
        if self._rows is not None:
            self.paths.pop()
        self._rows = None

    def __repr__(self) -> str:
        return f"ParquetWriter({self.pattern!r}, {len(self.paths)} files written)"


def sample_row(sample: Any) -> dict[str, Any]:
    """The row of a sample: its entries but the `__x__` ones; ArgumentError naming what is wrong."""
    if not isinstance(sample, dict):
        raise ArgumentError(f"sample must be a dict, got {type(sample).__name__}")
    row = {name: value for name, value in sample.items() if not str(name).startswith("__")}
    if not row:
        raise ArgumentError(f"sample {sample.get('__key__')!r} has no fields besides '__' entries")
    return row


def file_bytes(rows: list[dict[str, Any]], path: str, row_group_rows: int = ROW_GROUP_ROWS) -> bytes:
    """The Parquet file of `rows` (in row groups of `row_group_rows`), as ParquetWriter writes
    it; `path` names the file in errors. Needs pyarrow."""
    pa = _extras.require("pyarrow", "parquet")
    pq = _extras.require("pyarrow.parquet", "parquet")
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ArgumentError(f"{path}: the rows cannot be one Parquet table ({exc})") from None
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=row_group_rows)
    return out.getvalue()


def _value_size(value: Any) -> int:
    """The bytes a value counts for towards `maxsize` (its size before encoding)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(_value_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_value_size(v) for v in value)
    return 8

"""Batches gathered from the Arrow copy by file offset: a row anywhere costs what a row in order does.

An exact shuffle's batch takes its rows from hundreds of row groups, and gathering row group by
row group would pay Python's overhead hundreds of times a batch. But every row group of the copy
lies in one memory-mapped file: where each row group's packed records and text data start is
noted once, and a batch is then gathered from the whole file in a few vectorized steps: the
packed record of every row (its numbers, and the spans of its text and bytes values), then the
bytes of every value, made Python values by one Arrow array. Values, keys and dtypes are the ones
collating the copy's records gives (see `sources._columns`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from globalloader import _extras
from globalloader.errors import SourceError
from globalloader.sources._arrow_values import first_offset
from globalloader.sources._columns import BlockIndex, Origins, batch_dtype, keys_of
from globalloader.sources._row_layout import BYTES, TEXT, VALUE, Layout


class MappedColumns:
    """Where every row group's columns lie in the mapped copy, and the gather that uses it.

    `mapped`: the whole file as read-only bytes; `batches`: its record batches (one per row
    group), views into it; `origins`: see `sources._columns.Origins`; `where`: the copy, as
    errors name it."""

    def __init__(
        self,
        mapped: np.ndarray,
        layout: Layout,
        batches: list[Any],
        starts: np.ndarray,
        length: int,
        origins: Origins,
        where: str,
    ) -> None:
        self._pa = _extras.require("pyarrow", "parquet")
        base = mapped.ctypes.data
        self._mapped = mapped
        self._layout = layout
        self._starts = starts
        self._locate = BlockIndex(starts, length)
        self._origins = origins
        self._width = layout.dtype.itemsize if layout.dtype.names else 0
        self._records_at = np.zeros(len(batches), dtype=np.int64)  # file offset of each group's records
        self._data_at: dict[int, np.ndarray] = {}  # text or bytes slot -> file offset of each group's data
        texts = [slot for _, kind, slot, _ in layout.columns if kind in (TEXT, BYTES)]
        for slot in texts:
            self._data_at[slot] = np.zeros(len(batches), dtype=np.int64)
        inside = True
        for b, batch in enumerate(batches):
            if self._width:
                packed = batch.column(batch.num_columns - 1)
                at = self._records_at[b] = packed.buffers()[1].address - base + packed.offset * self._width
                inside &= at >= 0 and at + batch.num_rows * self._width <= len(mapped)
            for slot, column in zip(texts, batch.columns, strict=False):  # the kept columns come first
                data = column.buffers()[2]
                at = self._data_at[slot][b] = (data.address - base + first_offset(column)) if data is not None else 0
                inside &= data is None or 0 <= at <= len(mapped)
        if not inside:
            raise SourceError(f"{where} is damaged: its columns do not lie in the file; delete it to rebuild it")

    def gather(self, indices: np.ndarray) -> dict[str, Any]:
        """The batch of the rows at `indices` (in range, at least one), in that order."""
        blocks = self._locate(indices)
        rows = indices - self._starts[blocks]
        batch: dict[str, Any] = {"__key__": keys_of(self._origins, self._starts, blocks, indices)}
        records = None
        if self._width:
            at = self._records_at[blocks] + rows * self._width
            windows = np.lib.stride_tricks.as_strided(
                self._mapped, shape=(len(self._mapped) - self._width + 1, self._width), strides=(1, 1), writeable=False
            )
            records = windows[at].view(self._layout.dtype).reshape(len(indices))
        for name, kind, slot, _ in self._layout.columns:
            assert records is not None  # every gathered column is packed, or has packed spans
            if kind == VALUE:
                field = records[f"{slot}"]
                batch[name] = field.astype(batch_dtype(field.dtype))
            else:
                batch[name] = self._values(records, slot, blocks, kind == TEXT)
        return batch

    def _values(self, records: np.ndarray, slot: int, blocks: np.ndarray, text: bool) -> list[Any]:
        """The text or bytes values of a column whose spans are at `slot` in `records`."""
        starts = records[f"{slot}"].astype(np.int64)
        nulls = starts < 0
        lengths = np.where(nulls, 0, records[f"{slot + 1}"].astype(np.int64) - starts)
        offsets = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        sources = np.repeat(self._data_at[slot][blocks] + starts - offsets[:-1], lengths)
        data = self._mapped[sources + np.arange(int(offsets[-1]), dtype=np.int64)]
        kind = self._pa.large_string() if text else self._pa.large_binary()
        array = self._pa.Array.from_buffers(
            kind, len(starts), [None, self._pa.py_buffer(offsets), self._pa.py_buffer(data)]
        )
        values = array.to_pylist()
        for k in np.flatnonzero(nulls).tolist():
            values[k] = None
        return values

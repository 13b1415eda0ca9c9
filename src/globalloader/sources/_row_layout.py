"""How a row group is laid out for reads by row: one random row should cost few cache misses.

Reading a row at random from separate columns touches one cache line (and one page) per column,
each a miss when rows are read out of order: most of a row's cost. So a row's fixed-width values
are packed one record after another and read with one `struct.unpack_from`: number columns
(already converted by the null rules: NaN for nulls, float64 for integer columns read as float)
and, in the Arrow copy, each text and bytes value's start and end in its column's data (-1 for a
null). `Parquet` packs the numbers of each decoded row group the same way (its text stays a list
of Python strings, cheaper to index); the Arrow copy writes the packed records as one fixed-size
binary column, beside the Arrow columns of everything else.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from globalloader import _extras
from globalloader.sources import _arrow_values as arrow

PACKED = "globalloader.packed_rows"  # the packed column's name (the last column of the copy)
LAYOUT_KEY = b"globalloader.layout"  # schema metadata: the Layout as JSON
# `struct` codes of packed values by NumPy (kind, size): standard sizes, whatever the platform.
_STRUCT_CODES = {("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q", ("u", 1): "B", ("u", 2): "H"}
_STRUCT_CODES |= {("u", 4): "I", ("u", 8): "Q", ("f", 2): "e", ("f", 4): "f", ("f", 8): "d", ("b", 1): "?"}

_DECODED_COLUMNS = 8  # per-process LRU of whole decoded columns (list types read by row group)

Getter = Callable[[int], Any]
Unpacker = Callable[[int], tuple[Any, ...]]  # row -> its packed values
# One step of building a record: (column name, kind, packed slot, object): kind VALUE takes the
# packed slot as is; TEXT and BYTES cut the data memoryview between slots `slot` and `slot + 1`;
# GETTER calls the object with the row.
Step = tuple[str, int, int, Any]
VALUE, TEXT, BYTES, GETTER = range(4)


@dataclass(frozen=True)
class Layout:
    """Per source column, in order: (name, kind, packed slot or -1, NumPy dtype of a packed value)."""

    columns: list[tuple[str, int, int, str]]

    @classmethod
    def plan(cls, names: list[str], types: list[Any], as_float: frozenset[str], spans: bool = True) -> Layout:
        """`spans`: pack the places of text and bytes values too (else they are GETTER columns)."""
        pa = _extras.require("pyarrow", "parquet")
        columns, slot = [], 0
        for name, kind in zip(names, types, strict=True):
            if name in as_float:  # integer and boolean columns only
                columns.append((name, VALUE, slot, "<f8"))
                slot += 1
            elif pa.types.is_floating(kind) or arrow.is_exact(kind):
                columns.append((name, VALUE, slot, np.dtype(kind.to_pandas_dtype()).newbyteorder("<").str))
                slot += 1
            elif spans and (arrow.is_text(kind) or arrow.is_bytes(kind)):  # spans as wide as the column's offsets
                columns.append((name, TEXT if arrow.is_text(kind) else BYTES, slot, arrow.offsets_dtype(kind).str))
                slot += 2
            else:
                columns.append((name, GETTER, -1, ""))
        return cls(columns)

    @classmethod
    def from_json(cls, text: bytes) -> Layout:
        return cls([(str(n), int(k), int(s), str(d)) for n, k, s, d in json.loads(text)])

    def to_json(self) -> bytes:
        return json.dumps(self.columns).encode()

    def _fields(self) -> list[tuple[str, str]]:
        fields = []
        for _, kind, slot, dtype in self.columns:
            if kind == VALUE:
                fields.append((f"{slot}", dtype))
            elif kind in (TEXT, BYTES):
                fields += [(f"{slot}", dtype), (f"{slot + 1}", dtype)]
        return fields

    @property
    def dtype(self) -> np.dtype[Any]:
        """The NumPy dtype of one packed record (fields named by slot, no padding)."""
        return np.dtype(self._fields())

    @property
    def record_format(self) -> str:
        """The `struct` format of one packed record (little-endian, no padding)."""
        dtypes = [np.dtype(dtype) for _, dtype in self._fields()]
        return "<" + "".join(_STRUCT_CODES[dtype.kind, dtype.itemsize] for dtype in dtypes)

    def records(self, columns: list[Any]) -> np.ndarray | None:
        """The packed records of one row group (its columns as single Arrow arrays), or None
        when nothing is packed."""
        fields = self._fields()
        if not fields:
            return None
        records = np.zeros(len(columns[0]), dtype=self.dtype)
        for column, (name, kind, slot, _) in zip(columns, self.columns, strict=True):
            if kind == VALUE:
                records[f"{slot}"] = _values(column, name, records.dtype[f"{slot}"])
            elif kind in (TEXT, BYTES):
                records[f"{slot}"], records[f"{slot + 1}"] = _spans(column)
        return records

    def pack(self, columns: list[Any]) -> list[Any]:
        """The Arrow columns written for one row group: the kept columns, then the packed one."""
        pa = _extras.require("pyarrow", "parquet")
        kept = [column for column, (_, kind, _, _) in zip(columns, self.columns, strict=True) if kind != VALUE]
        records = self.records(columns)
        if records is None:
            return kept
        width, n = records.dtype.itemsize, len(records)
        packed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(records.tobytes())])
        return [*kept, packed]

    def unpacker_of(self, records: np.ndarray | None) -> Unpacker | None:
        """row -> the packed values of that row, from `records` (as `records()` made them)."""
        if records is None:
            return None
        return self._unpacker(records.view(np.uint8).data, records.dtype.itemsize)

    def steps(self, batch: Any, decoded: OrderedDict[tuple[int, str], list[Any]], block: int) -> list[Step]:
        """How to read a record of this row group (`batch`, as written by `pack`)."""
        steps: list[Step] = []
        kept = iter(batch.columns)
        for name, kind, slot, _ in self.columns:
            if kind == VALUE:
                steps.append((name, kind, slot, None))
            elif kind in (TEXT, BYTES):
                steps.append((name, kind, slot, _data(next(kept))))
            else:
                steps.append((name, kind, slot, _getter(next(kept), decoded, (block, name))))
        return steps

    def unpacker(self, batch: Any) -> Unpacker | None:
        """row -> the packed values of that row, from a row group of the copy (None when nothing
        is packed)."""
        if not self._fields():
            return None
        column = batch.column(batch.num_columns - 1)
        width = column.type.byte_width
        return self._unpacker(memoryview(column.buffers()[1])[column.offset * width :], width)

    def _unpacker(self, data: memoryview, width: int) -> Unpacker:
        unpack_from = struct.Struct(self.record_format).unpack_from
        return lambda row: unpack_from(data, row * width)


def read_record(key: str, unpack: Unpacker | None, steps: list[Step], row: int) -> dict[str, Any]:
    """Record `row` of a block laid out by `Layout.steps` (`unpack`: its packed values)."""
    record: dict[str, Any] = {"__key__": key}
    packed = unpack(row) if unpack is not None else ()
    for name, kind, slot, read in steps:
        if kind == VALUE:
            record[name] = packed[slot]
        elif kind == GETTER:
            record[name] = read(row)
        elif packed[slot] < 0:
            record[name] = None
        elif kind == TEXT:
            record[name] = str(read[packed[slot] : packed[slot + 1]], "utf-8")
        else:
            record[name] = read[packed[slot] : packed[slot + 1]].tobytes()
    return record


def _values(column: Any, name: str, dtype: np.dtype[Any]) -> np.ndarray:
    """A number column as `Parquet` reads it (nulls NaN, integers with nulls as float64)."""
    pa = _extras.require("pyarrow", "parquet")
    if dtype.kind == "f" and not pa.types.is_floating(column.type):
        return arrow.as_float64(column, name)
    return np.asarray(arrow.to_numpy(column), dtype=dtype)


def _spans(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """Where each value lies in the column's data, counted from its first value; -1 for nulls."""
    n, offset = len(column), column.offset
    ends = np.frombuffer(column.buffers()[1], arrow.offsets_dtype(column.type), count=offset + n + 1)[offset:]
    ends = ends.astype(np.int64) - int(ends[0]) if n else np.zeros(1, np.int64)
    starts = ends[:-1].copy()
    if column.null_count:
        starts[np.asarray(column.is_null().to_numpy(zero_copy_only=False))] = -1
    return starts, ends[1:]


def _data(column: Any) -> memoryview:
    """A text or bytes column's data from its first value on (what `_spans` counts from)."""
    data = column.buffers()[2]
    if data is None or not len(column):
        return memoryview(b"")
    return memoryview(data)[arrow.first_offset(column) :]


def _getter(column: Any, decoded: OrderedDict[tuple[int, str], list[Any]], key: tuple[int, str]) -> Getter:
    """Columns that stay Arrow: lists of numbers as read-only views of the mapped items (as
    Parquet's are views), lists whose values depend on the whole row group decoded per group,
    everything else through Arrow's scalars (what `to_pylist` gives, one row at a time)."""
    if arrow.is_list(column.type):
        return _number_lists(column) or _by_row_group(column, decoded, key)

    def get(row: int) -> Any:
        return arrow.python_values(column[row], key[1])

    return get


def _number_lists(column: Any) -> Getter | None:
    pa = _extras.require("pyarrow", "parquet")
    kind = column.type
    item_kind = kind.value_type
    if not (pa.types.is_integer(item_kind) or pa.types.is_floating(item_kind)) or column.values.null_count:
        return None  # items turn float (or object) when any item of the row group is null
    valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False)) if column.null_count else None
    if pa.types.is_fixed_size_list(kind):
        if valid is not None:  # Parquet copies such rows (writable arrays): keep to its rule
            return None
        items = column.flatten().to_numpy()
        size = kind.list_size
        return lambda row: items[row * size : (row + 1) * size]
    items = column.values.to_numpy()
    at = column.offsets.to_numpy().item  # offsets respect the column's offset
    if valid is None:
        return lambda row: items[at(row) : at(row + 1)]
    is_valid = valid.item
    return lambda row: items[at(row) : at(row + 1)] if is_valid(row) else None


def _by_row_group(column: Any, decoded: OrderedDict[tuple[int, str], list[Any]], key: tuple[int, str]) -> Getter:
    """Decode the column as Parquet does, once per row group, and index it."""
    pa = _extras.require("pyarrow", "parquet")
    chunked = pa.chunked_array([column])

    def get(row: int) -> Any:
        values = decoded.get(key)
        if values is None:
            values = decoded[key] = arrow.to_python(chunked, key[1])
            while len(decoded) > _DECODED_COLUMNS:
                with contextlib.suppress(KeyError):  # another thread evicted it first
                    decoded.popitem(last=False)
        return values[row]

    return get

"""How Arrow columns become NumPy arrays and record values: the one rule that `Parquet`, its
Arrow copy and Ray's map tasks share (`to_numpy`).

Numeric columns never hold None, so batches of them are numeric arrays, never object arrays: a
null in a float column is NaN, and an integer or boolean column that may hold a null anywhere in
the source is read as float64 everywhere (`exact_columns_with_nulls`). List columns become one
NumPy array per row; everything else is Arrow's own Python value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from globalloader import _extras
from globalloader.errors import SourceError


def is_exact(kind: Any) -> bool:
    """Integer and boolean types: those with no NaN of their own to stand for a null."""
    pa = _extras.require("pyarrow", "parquet")
    return bool(pa.types.is_integer(kind) or pa.types.is_boolean(kind))


def is_text(kind: Any) -> bool:
    """String types, with 32- or 64-bit offsets."""
    pa = _extras.require("pyarrow", "parquet")
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


def is_bytes(kind: Any) -> bool:
    """Binary types, with 32- or 64-bit offsets."""
    pa = _extras.require("pyarrow", "parquet")
    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind))


def offsets_dtype(kind: Any) -> np.dtype[Any]:
    """The dtype of a text or bytes type's value offsets: int64 for the large types, else int32."""
    pa = _extras.require("pyarrow", "parquet")
    return np.dtype("<i8" if pa.types.is_large_string(kind) or pa.types.is_large_binary(kind) else "<i4")


def first_offset(column: Any) -> int:
    """Where a text or bytes array's first value starts in its data buffer."""
    return int(np.frombuffer(column.buffers()[1], offsets_dtype(column.type), count=column.offset + 1)[-1])


def is_list(kind: Any) -> bool:
    """The list types whose rows become NumPy arrays."""
    pa = _extras.require("pyarrow", "parquet")
    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def exact_columns_with_nulls(metas: list[Any], columns: list[str] | None) -> frozenset[str]:
    """The integer and boolean columns that hold a null in some row group of some file, or may
    (a nullable column whose footer has no null count): read as float64 so that every batch of
    them has the same dtype."""
    found: set[str] = set()
    for meta in metas:
        schema = meta.schema.to_arrow_schema()
        exact = {
            field.name: field.nullable
            for field in schema
            if is_exact(field.type) and (columns is None or field.name in columns)
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


def as_float64(column: Any, name: str) -> np.ndarray:
    """An integer or boolean column that holds nulls, as float64 with NaN for them. Arrow's safe
    cast refuses an integer beyond 2**53, which float64 would round: that is a SourceError
    naming the column, never a changed value."""
    pa = _extras.require("pyarrow", "parquet")
    try:
        return to_numpy(column.cast(pa.float64()))
    except pa.ArrowInvalid as exc:
        raise SourceError(
            f"Parquet column {name!r} holds nulls, so it is read as float64, but {exc}: float64 would round it; "
            "fill its nulls or select it out with columns=[...]"
        ) from None


def to_python(column: Any, name: str) -> list[Any]:
    """One column of a row group as a list of Python values (lists as NumPy arrays).

    Numeric columns go through NumPy's `tolist`, several times faster than Arrow's `to_pylist`:
    float nulls become NaN. List columns become one ndarray per row; integer or boolean items
    with a null among them become float64 with NaN, by the float64 rule of `as_float64`.
    """
    pa = _extras.require("pyarrow", "parquet")
    kind = column.type
    if is_list(kind):
        items = _extras.require("pyarrow.compute", "parquet").list_flatten(column)
        if items.null_count and is_exact(items.type):
            as_float64(items, name)  # Arrow's own conversion would round an integer beyond 2**53
        return list(column.to_numpy(zero_copy_only=False))
    if pa.types.is_floating(kind) or (column.null_count == 0 and is_exact(kind)):
        return to_numpy(column).tolist()
    return python_values(column, name)


def python_values(values: Any, name: str) -> list[Any]:
    """Arrow values (an array, or one scalar) as Python's, the same whether pandas is installed or
    not: pyarrow hands out pandas' Timestamp for a nanosecond time when it can import pandas, and
    refuses otherwise; here such times are cast to microseconds first, refused (named) when one
    has nanoseconds, so every record holds datetime/timedelta values in any environment."""
    pa = _extras.require("pyarrow", "parquet")
    kind = values.type
    try:
        if (
            pa.types.is_timestamp(kind) or pa.types.is_duration(kind) or pa.types.is_time64(kind)
        ) and kind.unit == "ns":
            micro = (
                pa.timestamp("us", kind.tz)
                if pa.types.is_timestamp(kind)
                else pa.duration("us")
                if pa.types.is_duration(kind)
                else pa.time64("us")
            )
            values = values.cast(micro)  # a safe cast: it refuses to drop nanoseconds
        return values.as_py() if isinstance(values, pa.Scalar) else values.to_pylist()
    except ValueError as exc:  # ArrowInvalid is one
        raise unreadable(name, exc) from None


def unreadable(name: str, exc: Exception) -> SourceError:
    """Arrow refuses a value Python's type cannot hold exactly (a timestamp or duration with
    nanoseconds): named, never rounded."""
    return SourceError(
        f"Parquet column {name!r} holds a value Python cannot hold exactly ({exc}); "
        "cast it in the files (timestamps to microseconds, for one) or select it out with columns=[...]"
    )


def to_numpy(column: Any) -> np.ndarray:
    """An Arrow (chunked) array as a NumPy array with one row per entry along axis 0: numbers,
    booleans and times as typed arrays (zero-copy where Arrow allows; float nulls NaN, integer
    nulls make float64); `fixed_size_binary(w)` as (rows, w) uint8 and a `fixed_size_list` of
    numbers as (rows, k), both without nulls; anything else an object array of Python values."""
    pa = _extras.require("pyarrow", "parquet")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind, rows = column.type, len(column)
    if column.null_count == 0:
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            # A view of Arrow's buffer: no copy, and none of pyarrow's conversion, which imports
            # pandas when it is installed (a fifth of a second in every fresh worker).
            letter = "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) else "u"
            dtype = np.dtype(f"<{letter}{kind.bit_width // 8}")
            view = (
                np.frombuffer(column.buffers()[1], dtype, rows, column.offset * dtype.itemsize)
                if rows
                else np.empty(0, dtype)
            )
            view.flags.writeable = False  # Arrow's memory (a mapped file's, maybe), as Arrow's own view is
            return view
        if pa.types.is_fixed_size_binary(kind):
            width = kind.byte_width
            data = column.buffers()[1]
            if data is None:
                return np.zeros((rows, width), np.uint8)
            return np.frombuffer(data, np.uint8, rows * width, column.offset * width).reshape(rows, width)
        if pa.types.is_fixed_size_list(kind) and (
            pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
        ):
            values = column.flatten()
            if values.null_count == 0:
                return values.to_numpy().reshape(rows, kind.list_size)
    # Arrow builds the Python values of the rest in C++, not row by row in Python.
    return np.asarray(column.to_numpy(zero_copy_only=False))

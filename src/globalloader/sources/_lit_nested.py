"""LitData's `json` leaves: lists and dicts kept whole as one leaf (a record's variable-length
lists), in LitData's compact tagged encoding, or as plain JSON text (older writers).

Each value starts with a tag byte: 0 JSON text (uint32 length, the text); 1 a list of str,
2 of int64, 3 of float64, 4 of bool (uint32 count, then the items: a str as uint32 length and its
UTF-8, a bool as one byte); 5 a dict (uint32 count, then per entry its key as a str and its value,
tagged); 6 a list of flat records (uint32 rows, uint32 keys, the keys as str, then per row and key
a tagged scalar: 0x10 None, 0x11 str, 0x12 int64, 0x13 float64, 0x14 bool); 7 str, 8 int64,
9 float64, 10 bool, 11 None. A first byte above 0x20 (`[`, `{`) marks the whole leaf as JSON text.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_ARRAYS = {2: "<i8", 3: "<f8"}


def nested_value(data: memoryview) -> Any:
    """A `json` leaf's value; damaged bytes raise ValueError or struct.error (the caller names
    the file)."""
    raw = bytes(data)
    if not raw or raw[0] > 0x20:
        return json.loads(raw)
    value, end = _value(raw, 0)
    if end != len(raw):
        raise ValueError(f"a json leaf ends at byte {end} of {len(raw)}")
    return value


def _str(raw: bytes, at: int) -> tuple[str, int]:
    (length,) = _U32.unpack_from(raw, at)
    end = at + 4 + length
    if end > len(raw):
        raise ValueError("a json leaf's string runs past its end")
    return raw[at + 4 : end].decode("utf-8"), end


def _value(raw: bytes, at: int) -> tuple[Any, int]:
    tag = raw[at]
    if tag == 0:
        (length,) = _U32.unpack_from(raw, at + 1)
        return json.loads(raw[at + 5 : at + 5 + length]), at + 5 + length
    if tag in (1, 2, 3, 4, 5, 6):
        (count,) = _U32.unpack_from(raw, at + 1)
        at += 5
        if tag in _ARRAYS:
            end = at + 8 * count
            if end > len(raw):
                raise ValueError("a json leaf's list runs past its end")
            return np.frombuffer(raw[at:end], _ARRAYS[tag]).tolist(), end
        if tag == 4:
            if at + count > len(raw):
                raise ValueError("a json leaf's list runs past its end")
            return [bool(b) for b in raw[at : at + count]], at + count
        if tag == 1:
            items = []
            for _ in range(count):
                item, at = _str(raw, at)
                items.append(item)
            return items, at
        if tag == 5:
            mapping = {}
            for _ in range(count):
                key, at = _str(raw, at)
                mapping[key], at = _value(raw, at)
            return mapping, at
        return _records(raw, at - 4, count)
    return _scalar(raw, at, tag, 7)


def _records(raw: bytes, at: int, rows: int) -> tuple[list[dict[str, Any]], int]:
    (count,) = _U32.unpack_from(raw, at + 4)
    at += 8
    keys = []
    for _ in range(count):
        key, at = _str(raw, at)
        keys.append(key)
    out = []
    for _ in range(rows):
        row = {}
        for key in keys:
            row[key], at = _scalar(raw, at + 1, raw[at], 0x11)
        out.append(row)
    return out, at


def _scalar(raw: bytes, at: int, tag: int, base: int) -> tuple[Any, int]:
    """A tagged scalar whose value starts at `at`: tags `base` (str), +1 int64, +2 float64,
    +3 bool, and None (base + 4 for values, base - 1 in records)."""
    start = at + 1 if base == 7 else at  # a value's tag precedes it; a record's was read already
    if tag == base:
        return _str(raw, start)
    if tag == base + 1:
        return _I64.unpack_from(raw, start)[0], start + 8
    if tag == base + 2:
        return _F64.unpack_from(raw, start)[0], start + 8
    if tag == base + 3:
        return raw[start] != 0, start + 1
    if tag == (base + 4 if base == 7 else base - 1):
        return None, start
    raise ValueError(f"unknown tag {tag:#x} in a json leaf")

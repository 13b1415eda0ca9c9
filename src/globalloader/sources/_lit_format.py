"""LitData's optimized format, parsed without `litdata`: `index.json`, a chunk's item table (plain,
zstd per file, per frame or per item, or an Arrow footer), and an item's fields.

The layout, as `litdata.optimize` writes it:

- `index.json`: `{"config": {...}, "chunks": [{"filename", "chunk_size", "chunk_bytes", ...}]}`;
  the config names each leaf's serializer (`data_format`), the record's structure (`data_spec`, a
  pytree spec), `compression` and `compression_level`, `encryption` and the `item_loader`.
- A plain chunk: `uint32 n`, `uint32 offsets[n + 1]` (file offsets), then the items. An item is
  `uint32 sizes[k]` (one per leaf) then the leaves' bytes, in `data_format` order.
- `compression` with level "chunk" (or none given): the whole file is one zstd stream of a plain
  chunk. Level "sample": a plain chunk whose every item is its own zstd frame. Level "batch": the
  framed layout (`LDFZ01` magic, offsets into the uncompressed items, a table of zstd frames).
- A chunk of flat JSON-like dicts may carry no item bytes at all, its rows in an Arrow IPC file
  appended after the items (`<ipc> uint32 len "LDARW01\\0"`).
"""

from __future__ import annotations

import functools
import itertools
import json
import pickle
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from globalloader import _extras
from globalloader.errors import SourceError
from globalloader.sources._lit_nested import nested_value

INDEX_NAME = "index.json"
FRAMED_MAGIC = b"LDFZ01\0\0"
_FRAMED_PREFIX = struct.Struct("<8sHHIII")  # magic, version, flags, items, rows per frame, frames
_FRAME = struct.Struct("<IIQII")  # first item, items, compressed offset, compressed and plain length
_ARROW_MAGIC = b"LDARW01\0"
_ARROW_TRAILER = 4 + len(_ARROW_MAGIC)
# LitData's dtype tables: a serializer names its dtype by position. NumPy's (`numpy`,
# `no_header_numpy:N`), with None for the kinds whose bytes do not say their items' size.
_NUMPY_DTYPES: list[np.dtype | None] = [
    *map(np.dtype, ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16", "?"]),
    None,  # object
    None,  # bytes
    None,  # str
    None,  # void
]
# torch's (`tensor`, `no_header_tensor:N`), as NumPy dtypes: tensors are read as arrays. bfloat16
# (10) has no NumPy dtype.
_TORCH_DTYPES: list[np.dtype | None] = [
    *map(np.dtype, ["f4", "f4", "f8", "f8", "c8", "c8", "c16", "c16", "f2", "f2"]),
    None,  # bfloat16
    *map(np.dtype, ["u1", "i1", "i2", "i2", "i4", "i4", "i8", "i8", "?", "u2"]),
]
# PIL modes whose raw bytes are a plain array: (dtype, channels; 0 for none).
_PIL_MODES = {
    "L": ("u1", 0),
    "I": ("<i4", 0),
    "F": ("<f4", 0),
    "I;16": ("<u2", 0),
    "LA": ("u1", 2),
    "RGB": ("u1", 3),
    "YCbCr": ("u1", 3),
    "LAB": ("u1", 3),
    "HSV": ("u1", 3),
    "RGBA": ("u1", 4),
    "CMYK": ("u1", 4),
}
_REFUSED = {
    "video": "decode the video from a format that keeps its file (file:<ext>)",
}


class LitConfig(NamedTuple):
    """What `index.json` says about every chunk: how its items decode and how it is compressed."""

    fields: list[Callable[[memoryview], Any]]  # one decoder per leaf
    spec: Any  # the parsed pytree spec of a record
    compression: str | None  # "zstd" or None
    compression_name: str  # as given ("zstd:9"): in the names of whole-file compressed chunks
    level: str  # "chunk", "batch" or "sample"
    chunks: list[tuple[str, int, int]]  # (filename, items, bytes)


def parse_index(data: bytes, url: str) -> LitConfig:
    """`index.json`'s bytes as a LitConfig; anything this reader cannot serve exactly is the
    SourceError naming `url` and the field."""
    try:
        index = json.loads(data)
        config, chunks = index["config"], index["chunks"]
        table = [(str(c["filename"]), int(c["chunk_size"]), int(c["chunk_bytes"])) for c in chunks]
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{url} is not a LitData index (corrupt or cut short: {exc!r}); write it again") from None
    if not isinstance(config, dict):
        raise SourceError(f"{url}: its config is not an object; write the dataset again")
    if config.get("encryption"):
        raise SourceError(f"{url}: the chunks are encrypted; decrypt them with LitData first (not read here)")
    loader = config.get("item_loader") or "PyTreeLoader"
    if loader != "PyTreeLoader":
        raise SourceError(f"{url}: item_loader {loader} is not read here, only PyTreeLoader's records")
    formats = config.get("data_format")
    if not isinstance(formats, list) or not all(isinstance(f, str) for f in formats):
        raise SourceError(f"{url}: data_format is missing or not a list of serializer names")
    compression = config.get("compression")
    if compression is not None and not str(compression).split(":")[0] == "zstd":
        raise SourceError(f"{url}: compression {compression!r} is not read here (only zstd)")
    level = str(config.get("compression_level") or "chunk")
    if compression and level not in ("chunk", "batch", "sample"):
        raise SourceError(f"{url}: compression_level {level!r} is not read here (chunk, batch or sample)")
    spec = parse_spec(config.get("data_spec"), url)
    if _leaves(spec) != len(formats):
        raise SourceError(
            f"{url}: data_spec has {_leaves(spec)} leaves, data_format {len(formats)}; write the dataset again"
        )
    return LitConfig(
        [field_decoder(f, url) for f in formats],
        spec,
        "zstd" if compression else None,
        str(compression),
        level,
        table,
    )


def field_decoder(name: str, url: str) -> Callable[[memoryview], Any]:
    """The decoder of one serializer name (`int`, `no_header_numpy:9`, `image:png`, ...); a
    module-level function or a partial of one, so a source pickles to worker processes."""
    base, _, arg = name.partition(":")
    simple = _SIMPLE.get(base)
    if simple is not None:
        return simple
    if base in ("numpy", "tensor", "pil"):
        return functools.partial(_ARRAYS[base], url=url)
    if base in ("no_header_numpy", "no_header_tensor"):
        table = _NUMPY_DTYPES if base == "no_header_numpy" else _TORCH_DTYPES
        return functools.partial(_flat_array, dtype=_dtype(table, arg, name, url))
    why = _REFUSED.get(base, "LitData serializer not known to globalloader")
    raise SourceError(f"{url}: data_format {name!r} is not read here ({why})")


def _int(data: memoryview) -> int:
    return struct.unpack("<q", data)[0]


def _float(data: memoryview) -> float:
    return struct.unpack("<d", data)[0]


def _bool(data: memoryview) -> bool:
    return data[0] != 0


def _str(data: memoryview) -> str:
    return str(data, "utf-8")


def _pickled_none(data: memoryview) -> None:
    """`pickle`: LitData pickles the leaves no other serializer takes, None among them. Only a
    pickled None is read: unpickling anything else would run code from the files."""
    if bytes(data) not in _PICKLED_NONE:
        raise ValueError("a pickle leaf holds something other than None: unpickling it would run code from the files")


def _flat_array(data: memoryview, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(data, dtype).copy()


def _dtype(table: list[np.dtype | None], arg: str, name: str, url: str) -> np.dtype:
    position = int(arg) if arg.isdigit() else -1
    dtype = table[position] if 0 <= position < len(table) else None
    if dtype is None:
        raise SourceError(f"{url}: data_format {name!r} names a dtype with no fixed-size NumPy equivalent")
    return dtype


def _array(data: memoryview, url: str) -> np.ndarray:
    """`numpy`: uint32 dtype, rank, shape[rank] (native order), then the items."""
    position, rank = struct.unpack_from("<II", data)
    shape = struct.unpack_from(f"<{rank}I", data, 8)
    dtype = _dtype(_NUMPY_DTYPES, str(position), "numpy", url)
    return np.frombuffer(data[8 + 4 * rank :], dtype).reshape(shape).copy()


def _tensor(data: memoryview, url: str) -> np.ndarray:
    """`tensor`: big-endian uint32 dtype, rank, shape[rank], then the items (native order)."""
    position, rank = struct.unpack_from(">II", data)
    shape = struct.unpack_from(f">{rank}I", data, 8)
    dtype = _dtype(_TORCH_DTYPES, str(position), "tensor", url)
    return np.frombuffer(data[8 + 4 * rank :], dtype).reshape(shape).copy()


def _pil(data: memoryview, url: str) -> np.ndarray:
    """`pil`: uint32 width, height, mode length, the mode, then the raw pixels: the array
    `numpy.asarray(image)` would give."""
    width, height, length = struct.unpack_from("<III", data)
    mode = str(data[12 : 12 + length], "utf-8")
    if mode not in _PIL_MODES:
        raise SourceError(f"{url}: a pil image of mode {mode!r} is not read here (its raw bytes need PIL)")
    dtype, channels = _PIL_MODES[mode]
    shape = (height, width, channels) if channels else (height, width)
    return np.frombuffer(data[12 + length :], dtype).reshape(shape).copy()


def _jpeg_array(data: memoryview) -> list[bytes]:
    """`jpeg_array`: uint32 count, uint32 sizes[count], the encoded images."""
    (count,) = struct.unpack_from("<I", data)
    sizes = struct.unpack_from(f"<{count}I", data, 4)
    out, at = [], 4 + 4 * count
    for size in sizes:
        out.append(bytes(data[at : at + size]))
        at += size
    return out


def parse_spec(text: Any, url: str) -> Any:
    """The pytree spec (`[1, node]`, each node `{"type", "context", "children_spec"}`) as nested
    tuples: None for a leaf, ("dict", keys, children), ("list", children) or ("tuple", children)."""
    try:
        _, root = json.loads(text)
        return _node(root)
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{url}: data_spec is not a pytree spec ({exc!r}); write the dataset again") from None


def _node(node: dict[str, Any]) -> Any:
    kind, children = node["type"], [_node(c) for c in node["children_spec"]]
    if kind is None:
        return None
    if kind in ("builtins.dict", "collections.OrderedDict"):
        return ("dict", json.loads(node["context"]), children)
    if kind in ("builtins.list", "builtins.tuple"):
        return (kind.split(".")[1], children)
    raise ValueError(f"container type {kind} is not read here")


def _leaves(spec: Any) -> int:
    if spec is None:
        return 1
    return sum(_leaves(child) for child in spec[-1])


def rebuild(spec: Any, leaves: Any) -> Any:
    """The record's structure from its leaves (an iterator, consumed in order)."""
    if spec is None:
        return next(leaves)
    if spec[0] == "dict":
        return {key: rebuild(child, leaves) for key, child in zip(spec[1], spec[2], strict=True)}
    values = [rebuild(child, leaves) for child in spec[1]]
    return values if spec[0] == "list" else tuple(values)


def decode_item(config: LitConfig, data: memoryview, where: str) -> Any:
    """One item's leaves decoded and put back into the record's structure."""
    count = len(config.fields)
    try:
        sizes = struct.unpack_from(f"<{count}I", data)
        at, leaves = 4 * count, []
        if at + sum(sizes) != len(data):
            raise ValueError(f"its fields take {at + sum(sizes)} bytes, the item has {len(data)}")
        for size, decode in zip(sizes, config.fields, strict=True):
            leaves.append(decode(data[at : at + size]))
            at += size
    except (struct.error, ValueError, UnicodeDecodeError, IndexError) as exc:
        raise SourceError(f"{where} cannot be read: {exc}") from None
    return rebuild(config.spec, iter(leaves))


def item_table(header: bytes, items: int, size: int, where: str) -> list[int]:
    """A plain chunk's `offsets[items + 1]`, checked against the count its index gave and the
    chunk's `size`."""
    if len(header) < 4 * (items + 2) or struct.unpack_from("<I", header)[0] != items:
        raise SourceError(f"{where} does not hold the {items} items its index.json says; write the dataset again")
    offsets = list(struct.unpack_from(f"<{items + 1}I", header, 4))
    if offsets[0] != 4 * (items + 2) or offsets[-1] > size or any(b < a for a, b in itertools.pairwise(offsets)):
        raise SourceError(f"{where}: its item offsets are corrupt; write the dataset again")
    return offsets


class Framed(NamedTuple):
    """A framed chunk's tables: offsets into its uncompressed items, and per frame its first item,
    items, compressed offset and length, and uncompressed length."""

    offsets: list[int]
    frames: list[tuple[int, int, int, int, int]]
    rows: int  # items per frame


def framed_header_size(prefix: bytes, where: str) -> int:
    """From a framed chunk's first 24 bytes, the size of its whole header."""
    if len(prefix) < _FRAMED_PREFIX.size or prefix[:8] != FRAMED_MAGIC:
        raise SourceError(f"{where} is not a framed zstd chunk as its index.json says; write the dataset again")
    _, version, _, items, _, frames = _FRAMED_PREFIX.unpack_from(prefix)
    if version != 1:
        raise SourceError(f"{where}: framed zstd version {version} is not read here")
    return _FRAMED_PREFIX.size + 4 * (items + 1) + _FRAME.size * frames


def framed_tables(header: bytes, items: int, size: int, where: str) -> Framed:
    """A framed chunk's tables from its header, checked against its index and its size."""
    _, _, _, count, rows, frames = _FRAMED_PREFIX.unpack_from(header)
    if count != items or rows < 1:
        raise SourceError(f"{where} does not hold the {items} items its index.json says; write the dataset again")
    offsets = list(struct.unpack_from(f"<{items + 1}I", header, _FRAMED_PREFIX.size))
    at = _FRAMED_PREFIX.size + 4 * (items + 1)
    table = [_FRAME.unpack_from(header, at + i * _FRAME.size) for i in range(frames)]
    if (
        frames != -(-items // rows)
        or offsets[0] != 0
        or any(b < a for a, b in itertools.pairwise(offsets))
        or any(
            first != i * rows
            or n != min(rows, items - first)
            or off + length > size
            or plain != offsets[first + n] - offsets[first]
            for i, (first, n, off, length, plain) in enumerate(table)
        )
    ):
        raise SourceError(f"{where}: its frame table is corrupt; write the dataset again")
    return Framed(offsets, table, rows)


def arrow_footer(chunk: bytes | memoryview) -> bytes | memoryview | None:
    """The Arrow IPC file appended to a chunk, if it has one."""
    if len(chunk) < _ARROW_TRAILER or chunk[-len(_ARROW_MAGIC) :] != _ARROW_MAGIC:
        return None
    (length,) = struct.unpack_from("<I", chunk, len(chunk) - _ARROW_TRAILER)
    start = len(chunk) - _ARROW_TRAILER - length
    return chunk[start : len(chunk) - _ARROW_TRAILER] if start >= 0 else None


def arrow_rows(ipc: bytes | memoryview, items: int, where: str) -> Any:
    """The rows of an Arrow footer, as a pyarrow Table of `items` rows."""
    pa = _extras.require("pyarrow", "formats")
    try:
        table = pa.ipc.open_file(pa.py_buffer(ipc)).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{where}: its Arrow rows are corrupt ({exc}); write the dataset again") from None
    if table.num_rows != items:
        raise SourceError(f"{where} holds {table.num_rows} Arrow rows, its index.json says {items}")
    return table


def unzstd(data: bytes | memoryview, where: str, size: int = -1) -> bytes:
    """One zstd stream inflated (to `size` bytes when known), by pyarrow's zstd."""
    pa = _extras.require("pyarrow", "formats")
    try:
        if size >= 0:
            out = pa.Codec("zstd").decompress(data, decompressed_size=size).to_pybytes()
        else:
            out = pa.input_stream(pa.py_buffer(data), compression="zstd").read()
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{where}: its zstd data is corrupt ({exc}); write the dataset again") from None
    if size >= 0 and len(out) != size:
        raise SourceError(f"{where}: a zstd frame inflates to {len(out)} bytes, not {size}")
    return out


# Encoded images and files stay encoded: globalloader.vision decodes them.
_SIMPLE: dict[str, Callable[[memoryview], Any]] = {
    "int": _int,
    "float": _float,
    "bool": _bool,
    "str": _str,
    "text": _str,
    "bytes": bytes,
    "file": bytes,
    "jpeg": bytes,
    "image": bytes,
    "tifffile": bytes,
    "pdf": bytes,
    "jpeg_array": _jpeg_array,
    "json": nested_value,
    "pickle": _pickled_none,
}
_PICKLED_NONE = {pickle.dumps(None, protocol) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)}
_ARRAYS: dict[str, Callable[..., np.ndarray]] = {"numpy": _array, "tensor": _tensor, "pil": _pil}

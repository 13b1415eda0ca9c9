"""Mosaic Streaming's MDS format: `index.json`, the shard layout, column encodings, compressions.

An MDS dataset is a folder with `index.json` (`{"version": 2, "shards": [...]}`) and shard files.
Each shard entry names its file (`raw_data`, or `zip_data` when `compression` is set: the raw
file compressed whole), its `samples`, `column_names`, `column_encodings` and `column_sizes`
(bytes of a fixed-size column, null for a variable one). A raw shard is

    uint32 n | uint32 offsets[n + 1] (from the file's start) | the writer's config as JSON | samples

and sample `r` is the bytes [offsets[r], offsets[r + 1]): a uint32 size for each variable-size
column, in column order, then each column's bytes, in column order. All integers little-endian.

Decoding follows the writer's encodings, except that images stored encoded (`jpeg`, `png`, and the
lists and arrays of them) stay their encoded bytes, so globalloader's decode path applies; `pil`
(raw pixels with their size and mode) becomes a PIL image, as only Pillow can rebuild it. `pkl`
runs pickle, so a source reads it only when allowed to.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import importlib.util
import json
import pickle
import zlib
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple

import numpy as np

from globalloader import _extras
from globalloader.errors import SourceError

INDEX_NAME = "index.json"
INDEX_MAX = 256 << 20  # bytes: an index.json larger than this is not an index
_UINT32 = np.dtype("<u4")

_SCALARS = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
} | {name: np.dtype(name).newbyteorder("<") for name in ("float16", "float32", "float64")}
# The array encoding's one-byte codes: the value dtype (when the column does not fix it), and in the
# low two bits of the shape byte the width of the shape's integers.
_ARRAY_DTYPES = {
    8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
    34: "float32", 64: "uint64", 65: "int64", 66: "float64",
}  # fmt: skip
_SHAPE_DTYPES = ("<u1", "<u2", "<u4", "<u8")


class FileInfo(NamedTuple):
    """One file of a shard as the index records it."""

    basename: str
    size: int
    hashes: dict[str, str]


class ShardInfo(NamedTuple):
    """One shard of an index: its file, what decompresses it, its samples and how to decode them."""

    raw: FileInfo
    packed: FileInfo | None  # the compressed file, when `compression` is set
    compression: str | None
    samples: int
    names: list[str]
    encodings: list[str]  # each checked by `decoder` when the index was parsed
    sizes: list[int | None]


def parse_index(data: bytes, where: str, allow_pickle: bool) -> list[ShardInfo]:
    """The shards of an `index.json`; a SourceError naming `where` and the field when it is not
    a version-2 MDS index, names an encoding or compression this reader does not know, or has a
    `pkl` column while `allow_pickle` is False."""
    try:
        index = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"{where} is not JSON ({exc}): is the dataset fully written?") from None
    if not isinstance(index, dict) or index.get("version") != 2 or not isinstance(index.get("shards"), list):
        raise SourceError(f"{where} is not a Mosaic Streaming index (version 2 with a list of shards)")
    return [_parse_shard(shard, f"{where} shard {i}", allow_pickle) for i, shard in enumerate(index["shards"])]


def _parse_shard(shard: Any, where: str, allow_pickle: bool) -> ShardInfo:
    try:
        if shard["format"] != "mds":
            raise SourceError(f"{where} has format {shard['format']!r}, not 'mds': only MDS shards are read")
        names, encodings, sizes = shard["column_names"], shard["column_encodings"], shard["column_sizes"]
        if not (len(names) == len(encodings) == len(sizes)) or not all(isinstance(x, str) for x in names + encodings):
            raise SourceError(
                f"{where}: column_names, column_encodings and column_sizes must be lists of one length, "
                "names and encodings strings"
            )
        compression = shard.get("compression")
        raw, packed = _file_info(shard["raw_data"]), _file_info(shard.get("zip_data"))
        samples = int(shard["samples"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SourceError(f"{where} lacks or mistypes a field ({type(exc).__name__}: {exc})") from None
    if raw is None or samples < 0 or any(s is not None and (not isinstance(s, int) or s < 0) for s in sizes):
        raise SourceError(f"{where} has no raw_data, or a negative sample count or column size")
    if compression is not None:
        decompressor(compression, where)  # unknown or not installed: said now, not at the first read
        if packed is None:
            raise SourceError(f"{where} has compression {compression!r} but no zip_data")
    else:
        packed = None
    for name, encoding, size in zip(names, encodings, sizes, strict=True):
        try:
            decoder(encoding)
        except SourceError as exc:
            raise SourceError(f"{where} column {name!r}: {exc}") from None
        if size != fixed_size(encoding):
            raise SourceError(
                f"{where}: column {name!r} ({encoding}) has column_size {size}, its encoding takes "
                f"{fixed_size(encoding)}"
            )
        if encoding == "pkl" and not allow_pickle:
            raise SourceError(
                f"{where}: column {name!r} is pickled (pkl), which runs code when read; pass allow_pickle=True "
                "only for a dataset you trust"
            )
    return ShardInfo(raw, packed, compression, samples, list(names), list(encodings), list(sizes))


def _file_info(obj: Any) -> FileInfo | None:
    if obj is None:
        return None
    basename = obj["basename"]
    if not isinstance(basename, str) or not basename or basename.startswith("/") or ".." in basename.split("/"):
        raise ValueError(f"basename {basename!r} is not a file inside the dataset's folder")
    return FileInfo(basename, int(obj["bytes"]), dict(obj.get("hashes") or {}))


def fixed_size(encoding: str) -> int | None:
    """Bytes every value of an encoding takes, or None when values vary (as `column_sizes` says)."""
    name, _, args = encoding.partition(":")
    if name in _SCALARS and not args:
        return _SCALARS[name].itemsize
    if name == "int":
        return 8
    parts = args.split(":")
    if name == "ndarray" and len(parts) == 2 and parts[0] in _ARRAY_DTYPES.values():
        try:
            return int(np.prod([int(d) for d in parts[1].split(",")])) * np.dtype(parts[0]).itemsize
        except ValueError:
            return None  # the decoder names the shape it cannot read
    return None


@functools.cache
def decoder(encoding: str) -> Callable[[memoryview], Any]:
    """The function turning a column's bytes into its value, for an encoding name as the index
    writes it (`ndarray:float32:3,4` carries its arguments after colons). Made once per process
    and encoding: a source keeps the names, which pickle, not the functions."""
    name, _, args = encoding.partition(":")
    if name in _SCALARS and not args:
        dtype = _SCALARS[name]
        return lambda data: np.frombuffer(data, dtype)[0]
    if name == "ndarray":
        return _array_decoder(args)
    plain = _PLAIN.get(name)
    if plain is None or args:
        raise SourceError(f"encoding {encoding!r} is one this MDS reader does not know")
    return plain


def _array_decoder(args: str) -> Callable[[memoryview], Any]:
    """An `ndarray` column: its dtype and shape fixed by the encoding's arguments, or each value
    carrying them (a dtype byte; a byte of ndim << 2 | shape width, then the shape)."""
    parts = args.split(":") if args else []
    try:
        fixed_dtype = np.dtype(parts[0]).newbyteorder("<") if parts else None
        fixed_shape = tuple(int(d) for d in parts[1].split(",")) if len(parts) > 1 else None
    except (TypeError, ValueError):
        raise SourceError(f"encoding 'ndarray:{args}' has a dtype or shape this reader cannot read") from None
    if len(parts) > 2 or (fixed_dtype is not None and fixed_dtype.name not in _ARRAY_DTYPES.values()):
        raise SourceError(f"encoding 'ndarray:{args}' is one this MDS reader does not know")

    def decode(data: memoryview) -> np.ndarray:
        at = 0
        dtype = fixed_dtype
        if dtype is None:
            dtype = np.dtype(_ARRAY_DTYPES[data[0]]).newbyteorder("<")
            at = 1
        shape = fixed_shape
        if shape is None:
            ndim, width = data[at] >> 2, data[at] & 3
            shape_dtype = np.dtype(_SHAPE_DTYPES[width])
            shape = tuple(np.frombuffer(data, shape_dtype, ndim, at + 1).tolist())
            at += 1 + ndim * shape_dtype.itemsize
        return np.frombuffer(data, dtype, offset=at).reshape(shape)

    return decode


def _text(data: memoryview) -> str:
    return str(data, "utf-8")


def _decimal(data: memoryview) -> Decimal:
    try:
        return Decimal(_text(data))
    except InvalidOperation:
        raise ValueError(f"not a decimal: {bytes(data)[:40]!r}") from None


def _pil(data: memoryview) -> Any:
    """Raw pixels: uint32 width, height and length of the mode name, the mode, the pixels."""
    image = _extras.require("PIL.Image", "vision")
    width, height, mode_size = np.frombuffer(data, _UINT32, 3).tolist()
    mode = str(data[12 : 12 + mode_size], "utf-8")
    return image.frombytes(mode, (width, height), bytes(data[12 + mode_size :]))


def _list_of(item: Callable[[memoryview], Any]) -> Callable[[memoryview], list[Any]]:
    """A list column: a reserved uint32, the count, a uint32 size per item, then the items."""

    def decode(data: memoryview) -> list[Any]:
        count = int(np.frombuffer(data, _UINT32, 1, 4)[0])
        return _items(data, 8, count, item)

    return decode


def _image_array(data: memoryview) -> list[bytes]:
    """`jpeg_array`: the count, a uint32 size per image, then the images."""
    count = int(np.frombuffer(data, _UINT32, 1)[0])
    return _items(data, 4, count, bytes)


def _items(data: memoryview, at: int, count: int, item: Callable[[memoryview], Any]) -> list[Any]:
    sizes = np.frombuffer(data, _UINT32, count, at).tolist()
    at += 4 * count
    out = []
    for size in sizes:
        if at + size > len(data):
            raise ValueError(f"an item of {size} bytes runs past the value's end")
        out.append(item(data[at : at + size]))
        at += size
    return out


_PLAIN: dict[str, Callable[[memoryview], Any]] = {
    "bytes": bytes,
    "str": _text,
    "int": lambda data: int(np.frombuffer(data, "<i8")[0]),
    "str_int": lambda data: int(_text(data)),
    "str_float": lambda data: float(_text(data)),
    "str_decimal": _decimal,
    "json": lambda data: json.loads(_text(data)),
    "pkl": lambda data: pickle.loads(data),  # only with allow_pickle=True (see parse_index)
    "pil": _pil,
    "jpeg": bytes,
    "png": bytes,
    "jpeg_array": _image_array,
    "jpegarray": _image_array,
    "list[pil]": _list_of(_pil),
    "list[jpeg]": _list_of(bytes),
    "list[png]": _list_of(bytes),
}


def decode_sample(shard: ShardInfo, data: memoryview) -> dict[str, Any]:
    """A sample's columns from its bytes; ValueError when they do not add up to the sample's size
    or a column's bytes are not what its encoding says."""
    sizes = shard.sizes
    variable = sum(size is None for size in sizes)
    lengths = np.frombuffer(data, _UINT32, variable).tolist() if variable else []
    at, record, k = 4 * variable, {}, 0
    for name, encoding, size in zip(shard.names, shard.encodings, sizes, strict=True):
        decode = decoder(encoding)
        if size is None:
            size, k = lengths[k], k + 1
        if at + size > len(data):
            raise ValueError(f"column {name!r} of {size} bytes runs past the sample's {len(data)} bytes")
        record[name] = decode(data[at : at + size])
        at += size
    if at != len(data):
        raise ValueError(f"the columns take {at} of the sample's {len(data)} bytes")
    return record


def header(data: bytes, samples: int, size: int) -> np.ndarray | str:
    """A raw shard's sample offsets (n + 1 of them), from its first 4 * (n + 2) bytes; or what is
    wrong with them (a count other than the index's, offsets that go back or past the file)."""
    if len(data) < 4 * (samples + 2):
        return f"it holds {len(data)} bytes, too few for the header of {samples} samples"
    count = int(np.frombuffer(data, _UINT32, 1)[0])
    if count != samples:
        return f"its header says {count} samples, the index {samples}"
    offsets = np.frombuffer(data, _UINT32, samples + 1, 4).copy()  # not a view keeping the read alive
    if int(offsets[0]) < 4 * (samples + 2) or int(offsets[-1]) != size or bool(np.any(offsets[1:] < offsets[:-1])):
        return f"its sample offsets do not lie in order between its header and its end ({size} bytes)"
    return offsets


def decompressor(compression: str, where: str) -> Callable[[bytes], bytes]:
    """The function that undoes `compression` (`zstd`, `zstd:7`, `gz`, `br`, `bz2`, `snappy`),
    raising ValueError on data it cannot undo: a SourceError for an unknown compression, a
    MissingExtraError when its library is not installed."""
    family, _, level = compression.partition(":")
    if family not in ("zstd", "gz", "bz2", "br", "snappy") or (level and (family == "snappy" or not level.isdigit())):
        raise SourceError(f"{where} has compression {compression!r}, which this MDS reader does not know")
    if family in ("gz", "bz2"):
        undo = gzip.decompress if family == "gz" else bz2.decompress
        failures: tuple[type[Exception], ...] = (OSError, EOFError, ValueError, zlib.error)
    else:
        cramjam = _extras.require("cramjam", "formats")
        codec = {"zstd": cramjam.zstd, "br": cramjam.brotli, "snappy": cramjam.snappy}[family]
        # Mosaic writes snappy's raw format, not its framed one.
        undo = codec.decompress_raw if family == "snappy" else codec.decompress
        failures = (cramjam.DecompressionError,)

    def decompress(data: bytes) -> bytes:
        try:
            return bytes(undo(data))
        except failures as exc:
            raise ValueError(str(exc) or type(exc).__name__) from None

    return decompress


def unpack(shard: ShardInfo, packed: bytes, where: str) -> bytes:
    """A compressed shard's raw bytes, checked against the size the index gives them."""
    assert shard.compression is not None
    undo = decompressor(shard.compression, where)
    try:
        raw = undo(packed)
    except ValueError as exc:
        raise SourceError(f"cannot decompress {where} ({shard.compression}): {exc}") from None
    if len(raw) != shard.raw.size:
        raise SourceError(f"{where} decompresses to {len(raw)} bytes, the index says {shard.raw.size}")
    return raw


def hash_check(info: FileInfo) -> tuple[str, str] | None:
    """One of the file's recorded hashes this process can compute (name, hex digest): the
    fastest of them, xxHash when the `xxhash` library is installed; None when it can compute none."""
    xxh = [name for name in ("xxh3_64", "xxh128", "xxh3_128", "xxh64", "xxh32") if name in info.hashes]
    if xxh and importlib.util.find_spec("xxhash") is not None:
        return xxh[0], info.hashes[xxh[0]]
    for name in ("md5", "sha1", "blake2b", "sha256", "sha512", *sorted(info.hashes)):
        if name in info.hashes and name in hashlib.algorithms_available:
            return name, info.hashes[name]
    return None


def digest(name: str, data: bytes) -> str:
    """The hex digest of `data` by the hash named as Mosaic names it (hashlib's or xxHash's)."""
    if name.startswith("xxh"):
        return str(getattr(_extras.require("xxhash", "formats"), name)(data).hexdigest())
    return hashlib.new(name, data).hexdigest()

"""A strict tar member walker and the WebDataset naming rules, shared by indexing and streaming.

Why not `tarfile`: past the first header, `tarfile` takes a bad checksum or a short header as
the end of the archive, so a corrupt shard silently loses its tail. This walker raises
SourceError naming the shard and the byte offset instead. Names are decoded the way `tarfile`
decodes them (ustar prefix, GNU long names, pax `path`/`size` records), so keys match what the
`webdataset` library yields for the same shard.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from typing import NamedTuple

from globalloader.errors import SourceError

BLOCK = 512
_ENCODING = sys.getfilesystemencoding()
_REGULAR = (b"0", b"\0", b"7")
_LONG_NAME, _LONG_LINK, _SPARSE = b"L", b"K", b"S"
_PAX, _PAX_GLOBAL = (b"x", b"X"), b"g"
# Types whose data `tarfile` does not skip: their size field is ignored (taken as 0).
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")
# WebDataset's rules: a key is the path up to the first dot of the basename, and `__x__`
# members are metadata that no sample sees.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


class Member(NamedTuple):
    """A regular file in the archive: its name, where its data starts and how long it is."""

    name: str
    offset: int
    size: int


def split_key(name: str) -> tuple[str, str] | None:
    """(key, lower-cased extension) of a member name, or None if WebDataset would skip it."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    if _META.match(name):
        return None
    match = _KEY_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def walk(read_at: Callable[[int, int], bytes], url: str, size: int | None) -> Iterator[Member]:
    """Yield the regular members of a tar read through `read_at(offset, length)`.

    `read_at` returns fewer bytes than asked only at the end of the file. With `size` known, a
    member whose data runs past the end is reported here; without it (a stream), the caller
    sees the short read. Offsets only increase, so a forward-only stream reader works too.
    """
    offset = 0
    pax_global: dict[str, str] = {}
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        if size is not None and offset > size:
            raise SourceError(
                f"truncated tar {url}: the file ends at byte {size}, before "
                f"offset {offset} where the next header belongs"
            )
        header = read_at(offset, BLOCK)
        if not header:
            if offset == 0:
                raise SourceError(f"not a tar file {url}: it is empty")
            return  # a missing end-of-archive marker is tolerated, as tarfile does
        if len(header) < BLOCK:
            raise SourceError(f"truncated tar {url}: partial header at offset {offset}")
        if header.count(0) == BLOCK:
            return
        typeflag, name, member_size = _parse_header(header, url, offset)
        data_at = offset + BLOCK
        if typeflag in _NO_DATA:
            member_size = 0
        if typeflag in (_LONG_NAME, _LONG_LINK, _PAX_GLOBAL) or typeflag in _PAX:
            data = _read_exact(read_at, data_at, member_size, url)
            if typeflag == _LONG_NAME:
                long_name = _decode(data.split(b"\0", 1)[0])
            elif typeflag == _PAX_GLOBAL:
                pax_global.update(_parse_pax(data, url, offset))
            elif typeflag != _LONG_LINK:
                pax = _parse_pax(data, url, offset)
        else:
            fields = {**pax_global, **pax}
            if long_name is not None:
                name = long_name
            if "path" in fields:
                name = fields["path"]
            if "size" in fields and typeflag not in _NO_DATA:
                try:
                    member_size = int(fields["size"])
                except ValueError:
                    raise SourceError(f"corrupt tar {url}: bad pax size at offset {offset}") from None
            long_name, pax = None, {}
            if typeflag == _SPARSE:
                raise SourceError(f"unsupported sparse member {name!r} in {url} at offset {offset}")
            if typeflag in _REGULAR and not (typeflag == b"\0" and name.endswith("/")):
                if size is not None and data_at + member_size > size:
                    raise SourceError(
                        f"truncated tar {url}: member {name!r} at offset {offset} needs "
                        f"{member_size} bytes but the file ends at byte {size}"
                    )
                yield Member(name, data_at, member_size)
        offset = data_at + -(-member_size // BLOCK) * BLOCK


def _parse_header(buf: bytes, url: str, offset: int) -> tuple[bytes, str, int]:
    stored = _number(buf[148:156], url, offset, "checksum")
    # The checksum counts its own field as 8 spaces; old writers summed signed bytes.
    unsigned = sum(buf[:148]) + 256 + sum(buf[156:])
    if stored != unsigned and stored != unsigned - 256 * sum(b >= 128 for b in buf[:148] + buf[156:]):
        raise SourceError(f"corrupt tar {url}: bad header checksum at offset {offset}")
    typeflag = buf[156:157]
    name = _decode(_cstring(buf[0:100]))
    prefix = _cstring(buf[345:500])
    if prefix and typeflag not in (_LONG_NAME, _LONG_LINK, _SPARSE):
        name = _decode(prefix) + "/" + name
    return typeflag, name, _number(buf[124:136], url, offset, "size")


def _number(field: bytes, url: str, offset: int, what: str) -> int:
    if field[0] & 0x80:  # GNU base-256 for values that do not fit in octal
        if field[0] == 0xFF:
            raise SourceError(f"corrupt tar {url}: negative {what} at offset {offset}")
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = _cstring(field).strip(b" ")
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise SourceError(f"corrupt tar {url}: bad {what} field at offset {offset}") from None


def _parse_pax(data: bytes, url: str, offset: int) -> dict[str, str]:
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise SourceError(f"corrupt tar {url}: bad pax record at offset {offset}") from None
        record = data[space + 1 : pos + length - 1]
        key, sep, value = record.partition(b"=")
        if length <= 0 or not sep:
            raise SourceError(f"corrupt tar {url}: bad pax record at offset {offset}")
        fields[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return fields


def _read_exact(read_at: Callable[[int, int], bytes], offset: int, length: int, url: str) -> bytes:
    data = read_at(offset, length)
    if len(data) != length:
        raise SourceError(f"truncated tar {url}: {length} bytes expected at offset {offset}, got {len(data)}")
    return data


def _cstring(field: bytes) -> bytes:
    return field.partition(b"\0")[0]


def _decode(raw: bytes) -> str:
    return raw.decode(_ENCODING, "surrogateescape")

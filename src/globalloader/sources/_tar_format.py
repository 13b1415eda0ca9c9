"""A strict tar member walker and the WebDataset naming rules, shared by indexing and streaming.

Why not `tarfile`: past the first header, `tarfile` takes a bad checksum, a short header, a zero
block or the end of the file as the end of the archive, so a corrupt or cut shard silently loses
its tail. This walker holds every archive to what real writers (tarfile, GNU tar, webdataset's
TarWriter) produce: each member ends where a header with a correct checksum begins, or where the
end-of-archive marker (two zero blocks) does, and nothing but zeros (the writer's record padding)
follows that marker. Anything else is a SourceError naming the shard and the byte offset. The
checks cost little: the checksum is in the header, the bytes after the marker are one record's
padding at most, and the tail of each member's data is read with the next header's block.

A header whose size grew by exactly the members after it makes a valid archive of other
content. The walker finds it when the last member taken in lies within the last `_TAIL` bytes
of the data (text, class and JSON fields do): a tar stored as a member never ends so. Past that,
or over the first block of the marker, only a checksum of the shard's bytes tells the two apart
(the CRC-32 in an index sidecar).

Names are decoded the way `tarfile` decodes them (ustar prefix, GNU long names, pax
`path`/`size` records), so keys match what the `webdataset` library yields for the same shard.
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
_OCTAL = re.compile(rb"[0-7]*")
_PAX_RECORD = re.compile(rb"([0-9]+) ([^=]*)=")
_MAGIC = b"ustar"  # at byte 257 of a POSIX or GNU header
_TAIL = 16 * 1024  # bytes at the end of a member's data searched for a member it took in
_TAIL_READ = 64 * 1024  # bytes read at a time when checking the padding after the end marker


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
    """Yield the regular members of a tar read through `read_at(offset, length)`, then check its
    end (see the module docstring): the file is read to its last byte, so a gzip stream's CRC is
    checked too.

    `read_at` returns fewer bytes than asked only at the end of the file. With `size` known, a
    member whose data runs past the end is reported here; without it (a stream), the caller
    sees the short read. Offsets only increase, except that once the caller has read a member's
    data, `walk` reads its tail again: a forward-only reader keeps its last read for that.
    """
    offset = 0
    previous: int | None = None  # the header whose member should end at `offset`
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
            raise SourceError(
                f"truncated tar {url}: the file ends at byte {offset}, where the next header or the "
                "end-of-archive marker belongs (the shard was cut short)"
            )
        if len(header) < BLOCK:
            raise SourceError(f"truncated tar {url}: partial header at offset {offset}")
        if header.count(0) == BLOCK:
            _check_end(read_at, url, offset, previous)
            return
        if not _checksum_ok(header):
            after = (
                ""
                if previous is None
                else f" (the size in the header at offset {previous} is wrong, or this header is damaged)"
            )
            raise SourceError(f"corrupt tar {url}: bad header checksum at offset {offset}{after}")
        typeflag, name, member_size = _parse_header(header, url, offset)
        data_at = offset + BLOCK
        if typeflag in _NO_DATA:
            member_size = 0
        if typeflag in (_LONG_NAME, _LONG_LINK, _PAX_GLOBAL) or typeflag in _PAX:
            data = _read_exact(read_at, data_at, member_size, url)
            if typeflag in (_LONG_NAME, _LONG_LINK):
                text, _, rest = data.partition(b"\0")
                if rest.count(0) != len(rest):  # its size took in what follows
                    raise SourceError(f"corrupt tar {url}: bad GNU long name at offset {offset}")
                long_name = _decode(text) if typeflag == _LONG_NAME else long_name
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
                member_size = _pax_size(fields["size"], url, offset)
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
            swallowed = _swallowed(read_at, data_at, data_at + _padded(member_size))
            if swallowed is not None:
                raise SourceError(
                    f"corrupt tar {url}: the size in the header at offset {offset} takes in the member "
                    f"whose header is at offset {swallowed} (the data ends exactly where that member does)"
                )
        previous, offset = offset, data_at + _padded(member_size)


def _check_end(read_at: Callable[[int, int], bytes], url: str, offset: int, previous: int | None) -> None:
    """The zero block at `offset` must begin the end-of-archive marker (two zero blocks), with only
    the writer's zero padding after it: another byte means the zero block lay inside a member
    whose header says it is shorter, or data follows the archive."""
    pos = offset + BLOCK
    while chunk := read_at(pos, _TAIL_READ):
        zeros = len(chunk) - len(chunk.lstrip(b"\0"))
        if zeros < len(chunk):
            cause = (
                "the archive starts with it"
                if previous is None
                else f"the size in the header at offset {previous} is wrong"
            )
            raise SourceError(
                f"corrupt tar {url}: a zero block at offset {offset} ends the archive but byte {pos + zeros} "
                f"after it is not zero ({cause}, or data follows the end-of-archive marker)"
            )
        pos += len(chunk)
    if pos < offset + 2 * BLOCK:
        raise SourceError(
            f"truncated tar {url}: the file ends at byte {pos}, inside the end-of-archive marker "
            f"(two zero blocks) at offset {offset}"
        )


def _swallowed(read_at: Callable[[int, int], bytes], data_at: int, end: int) -> int | None:
    """The offset of a header in the last _TAIL bytes of a member's data (from `data_at` to its
    padded `end`) whose own member ends exactly at `end`, or None. Such data is what a header
    whose size grew by the members after it covers; the archive is then a valid tar of other
    content, so nothing else shows it. A tar stored as a member never matches: its
    end-of-archive marker lies between its last member and `end`."""
    start = max(data_at, end - _TAIL)
    tail = read_at(start, end - start)
    if len(tail) != end - start:
        return None  # cut short: the next header's read reports it
    at = tail.find(_MAGIC, 257)
    while at != -1:
        header = at - 257
        if header % BLOCK == 0:
            size = _size_if_header(tail[header : header + BLOCK])
            if size is not None and header + BLOCK + _padded(size) == len(tail):
                return start + header
        at = tail.find(_MAGIC, at + 1)
    return None


def _size_if_header(block: bytes) -> int | None:
    """The size field of `block` if it is a header with a correct checksum, else None."""
    size = _octal(block[124:136])
    return size if size is not None and _checksum_ok(block) else None


def _padded(size: int) -> int:
    """Bytes a member's data takes in the archive: its size rounded up to whole blocks."""
    return -(-size // BLOCK) * BLOCK


def _checksum_ok(buf: bytes) -> bool:
    """Whether a header's checksum field matches its bytes (the field counts as 8 spaces; old
    writers summed signed bytes)."""
    stored = _octal(buf[148:156], empty=None)
    if stored is None:
        return False
    unsigned = sum(buf[:148]) + 256 + sum(buf[156:])
    return stored == unsigned or stored == unsigned - 256 * sum(b >= 128 for b in buf[:148] + buf[156:])


def _parse_header(buf: bytes, url: str, offset: int) -> tuple[bytes, str, int]:
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
    value = _octal(field)
    if value is None:
        raise SourceError(f"corrupt tar {url}: bad {what} field {_cstring(field).strip(b' ')!r} at offset {offset}")
    return value


def _octal(field: bytes, empty: int | None = 0) -> int | None:
    """An octal field's value (digits up to a NUL, spaces around them; `empty` if none), or None
    if it holds anything else."""
    text = _cstring(field).strip(b" ")
    if not text:
        return empty
    return int(text, 8) if _OCTAL.fullmatch(text) else None


def _pax_size(value: str, url: str, offset: int) -> int:
    """A pax `size` record: decimal digits only (int() would take a sign, spaces or underscores)."""
    if not (value.isascii() and value.isdigit()):
        raise SourceError(f"corrupt tar {url}: bad pax size {value!r} for the member at offset {offset}")
    return int(value)


def _parse_pax(data: bytes, url: str, offset: int) -> dict[str, str]:
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        record = _PAX_RECORD.match(data, pos)  # "<length> <key>=<value>\n", length counting it all
        end = pos + int(record[1]) if record else pos
        if record is None or not record.end() < end <= len(data) or data[end - 1] != 0x0A:
            raise SourceError(f"corrupt tar {url}: bad pax record at offset {offset}")
        key, value = record[2], data[record.end() : end - 1]
        fields[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos = end
    if data.count(0, pos) != len(data) - pos:  # its size took in what follows
        raise SourceError(f"corrupt tar {url}: bad pax record at offset {offset}")
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


# Writing: the headers `tarfile.TarInfo(name).tobuf(tarfile.PAX_FORMAT)` makes for a regular file
# of mode 0o444, owner 0, mtime 0 and empty user/group names, built directly for the common case.
_RECORD = 20 * BLOCK  # tarfile pads a closed archive to whole records of this size
_HEAD = b"0000444\x000000000\x000000000\x00"  # mode, uid, gid
_TAIL_FIELDS = b"0" + b"\0" * 100 + b"ustar\x0000" + b"\0" * (64 + 16 + 155)  # type, link, magic, names, dev, prefix
_MAX_USTAR_SIZE = 8**11 - 1


def member_header(name: str, size: int) -> bytes:
    """The header block(s) of a regular member `name` of `size` bytes, byte for byte what
    `tarfile` writes in PAX format (names that are not short ASCII get its pax records)."""
    raw = name.encode("ascii", "surrogateescape") if name.isascii() else b""
    if not raw or len(raw) > 100 or size > _MAX_USTAR_SIZE:
        import tarfile

        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime, info.uname, info.gname = size, 0o444, 0, "", ""
        return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
    block = bytearray(raw.ljust(100, b"\0") + _HEAD + b"%011o\x0000000000000\x00        " % size + _TAIL_FIELDS)
    block[148:155] = b"%06o\x00" % sum(block)
    return bytes(block) + b"\0" * (BLOCK - len(block))


def data_padding(size: int) -> bytes:
    """The zeros after a member's data of `size` bytes, up to its block boundary."""
    return b"\0" * (-size % BLOCK)


def archive_end(length: int) -> bytes:
    """What closes an archive of `length` bytes of members: the end marker (two zero blocks)
    and the zeros that pad it to whole records, as `tarfile` writes them."""
    end = length + 2 * BLOCK
    return b"\0" * (2 * BLOCK + -end % _RECORD)

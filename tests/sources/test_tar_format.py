"""The tar walker: names decoded as tarfile decodes them, and corrupt archives fail loudly."""

from __future__ import annotations

import io
import tarfile

import pytest

from globalloader.errors import SourceError
from globalloader.sources._tar_format import Member, split_key, walk
from globalloader.sources._tar_index import _SCAN_BLOCK_LOCAL, scan
from helpers import patch_header


def _tar(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _walk(blob: bytes, size_known: bool = True) -> list[Member]:
    def read_at(offset: int, length: int) -> bytes:
        return blob[offset : offset + length]

    return list(walk(read_at, "mem.tar", len(blob) if size_known else None))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_offsets_and_names_match_tarfile(fmt: int) -> None:
    names = ["a.txt", "dir/" + "p" * 90 + "/b.jpg"]
    if fmt != tarfile.USTAR_FORMAT:
        names.append("long/" + "q" * 300 + ".bin")  # needs a GNU long name or a pax path
    blob = _tar([(n, n.encode() * 3) for n in names], fmt)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        expected = [(m.name, m.offset_data, m.size) for m in tar]
    assert [tuple(m) for m in _walk(blob)] == expected


def test_non_ascii_pax_names() -> None:
    blob = _tar([("données/ключ.txt", b"x")])
    assert _walk(blob)[0].name == "données/ключ.txt"


def test_directories_and_links_are_not_members() -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        folder = tarfile.TarInfo("d")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        link = tarfile.TarInfo("l.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "a.txt"
        tar.addfile(link)
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"a"))
    assert [m.name for m in _walk(out.getvalue())] == ["a.txt"]


def test_bad_checksum_names_offset() -> None:
    blob = bytearray(_tar([("a.txt", b"x" * 600), ("b.txt", b"y")]))
    second = 512 + 1024  # header + 600 bytes of data padded to 1024
    blob[second + 10] ^= 0xFF
    with pytest.raises(SourceError, match=f"mem.tar: bad header checksum at offset {second}"):
        _walk(bytes(blob))


def test_truncated_data_names_member_and_offset() -> None:
    blob = _tar([("a.txt", b"x" * 100), ("b.txt", b"y" * 5000)])
    with pytest.raises(SourceError, match=r"truncated tar mem.tar: member 'b.txt' at offset 1024"):
        _walk(blob[:3000])


def test_partial_header_and_empty_file() -> None:
    blob = _tar([("a.txt", b"x")])
    with pytest.raises(SourceError, match="partial header at offset 1024"):
        _walk(blob[:1024] + b"\x01" * 100)
    with pytest.raises(SourceError, match="empty"):
        _walk(b"")


@pytest.mark.parametrize("size_known", [True, False])
def test_a_missing_end_marker_is_truncation(size_known: bool) -> None:
    """tarfile takes the end of the file for the end of the archive, so a shard cut at a header
    loses its tail without a word; every real writer ends an archive with two zero blocks."""
    blob = _tar([("a.txt", b"x"), ("b.txt", b"y")])
    with pytest.raises(SourceError, match=r"truncated tar mem\.tar: the file ends at byte 1024, where the next header"):
        _walk(blob[:1024], size_known)
    with pytest.raises(SourceError, match=r"truncated tar mem\.tar: the file ends at byte 2560, inside the end-of-arc"):
        _walk(blob[: 2048 + 512], size_known)
    assert [m.name for m in _walk(blob[: 2048 + 1024], size_known)] == ["a.txt", "b.txt"]


@pytest.mark.parametrize(("fmt", "what"), [(tarfile.GNU_FORMAT, "GNU long name"), (tarfile.PAX_FORMAT, "pax record")])
def test_a_name_header_whose_size_takes_in_the_next_header(fmt: int, what: str) -> None:
    blob = _tar([("d/" + "n" * 200 + ".txt", b"x"), ("b.txt", b"y")], fmt)
    grown = patch_header(blob, 0, 124, b"%011o\0" % (512 + 512))  # its data and the member's own header
    with pytest.raises(SourceError, match=f"corrupt tar mem.tar: bad {what} at offset 0"):
        _walk(grown)


@pytest.mark.parametrize("field", [b"-0000000001\0", b"+0000000001\0", b"0000000009\0\0", b"00000_00001\0"])
def test_a_size_field_that_is_not_octal_digits(field: bytes) -> None:
    blob = patch_header(_tar([("a.txt", b"x")], tarfile.USTAR_FORMAT), 0, 124, field)
    with pytest.raises(SourceError, match=r"corrupt tar mem\.tar: bad size field .* at offset 0"):
        _walk(blob)


def test_garbage_is_not_a_tar() -> None:
    with pytest.raises(SourceError, match="offset 0"):
        _walk(b"this is not a tar file" * 40)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a/b.JPG", ("a/b", "jpg")),
        ("a.b/c.seg.png", ("a.b/c", "seg.png")),
        ("noext", None),
        ("__meta__", None),
        ("__index__/x.txt", None),
        ("__k.txt", ("__k", "txt")),
    ],
)
def test_split_key_follows_webdataset(name: str, expected: tuple[str, str] | None) -> None:
    from webdataset.tariterators import base_plus_ext

    assert split_key(name) == expected
    if expected is not None:
        key, ext = base_plus_ext(name)
        assert (key, ext.lower()) == expected


def test_stream_mode_without_size() -> None:
    blob = _tar([("a.txt", b"x"), ("b.txt", b"yy")])
    assert [m.size for m in _walk(blob, size_known=False)] == [1, 2]


def test_indexing_reads_a_members_tail_with_the_next_header_in_one_block() -> None:
    """The tail check must not cost reads: a scan of members longer than the tail searched reads
    no more blocks than a scan of the headers alone would (each block starting at a header)."""
    blob = _tar([(f"s{i:03d}.{ext}", b"a" * n) for i in range(100) for ext, n in (("jpg", 30_000 + i), ("cls", 2))])
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        headers = [m.offset for m in tar] + [len(blob) - 2 * 512]  # and the end-of-archive marker
    blocks, start = 0, None
    for header in headers:
        if start is None or header + 512 > start + _SCAN_BLOCK_LOCAL:
            blocks, start = blocks + 1, header
    reads: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        reads.append((offset, length))
        return blob[offset : offset + length]

    scan(read, "mem.tar", len(blob), remote=False)
    assert len(reads) - 1 <= blocks  # the first read is the gzip check

"""End-to-end checks of downloads against a real S3 server, behind a proxy that flips a byte of
the bodies it forwards: a corrupted transfer is fetched again, and what is served and cached is
the object's bytes; when every transfer is corrupted, a named error, nothing in the cache."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest

from globalloader import storage
from globalloader.errors import RemoteReadError

_POLICY = storage.RetryPolicy(attempts=4, base=0.01, cap=0.02, deadline=30.0)


def _object(s3: dict[str, Any], name: str, size: int) -> tuple[str, bytes]:
    url, data = f"s3://{s3['bucket']}/{name}", os.urandom(size)
    with storage.Store(s3["options"]).open_write(url) as out:
        out.write(data)
    return url, data


def _cache_files(folder: pathlib.Path) -> list[str]:
    objects = folder / "objects"
    return sorted(p.name for p in objects.iterdir() if p.is_file() and p.name != "stats") if objects.exists() else []


# "store checksum": S3 sends its CRC-32 of the object, which the client checks as it reads; "etag
# only": an object stored without one (the proxy drops the header), checked against its ETag's MD5.
# "several answers": a whole object downloaded in 4 requests, checked once assembled.
@pytest.mark.parametrize("checksums", [True, False], ids=["store checksum", "etag only"])
@pytest.mark.parametrize("block_size", [1 << 20, 1000], ids=["one answer", "several answers"])
def test_a_corrupted_download_is_fetched_again_and_only_the_right_bytes_are_cached(
    s3: dict[str, Any], isolated_cache: pathlib.Path, checksums: bool, block_size: int
) -> None:
    url, data = _object(s3, "a.bin", 4000)
    proxy = s3["proxy"]
    proxy.no_checksums = not checksums
    proxy.corrupt["a.bin"] = 2
    store = storage.Store(s3["options"], retry_policy=_POLICY, block_size=block_size)
    with storage.open_read(store, url) as f:
        assert f.read() == data
    assert proxy.faults["corrupt"] == 2
    entries = store.cache.entries()
    assert len(entries) == 1 and entries[0][1] >= len(data)
    fresh = storage.Store(s3["options"], cache=True)  # another process's view: the entry as cached
    with storage.open_read(fresh, url) as f:
        assert f.read() == data


@pytest.mark.parametrize("checksums", [True, False], ids=["store checksum", "etag only"])
def test_a_whole_read_without_the_cache_is_checked_too(s3: dict[str, Any], checksums: bool) -> None:
    url, data = _object(s3, "b.bin", 3000)
    proxy = s3["proxy"]
    proxy.no_checksums = not checksums
    proxy.corrupt["b.bin"] = 1
    store = storage.Store(s3["options"], retry_policy=_POLICY, cache=False)
    reader = storage.RangeReader(store)  # how a source reads a whole shard it keeps in memory
    reader.expect(url, store.stat(url))
    assert reader.read(url, 0, len(data)) == data
    assert proxy.faults["corrupt"] == 1


@pytest.mark.parametrize("block_size", [1 << 20, 1000], ids=["one answer", "several answers"])
def test_a_transfer_corrupted_every_time_is_a_named_error_and_nothing_is_cached(
    s3: dict[str, Any], isolated_cache: pathlib.Path, block_size: int
) -> None:
    url, _ = _object(s3, "c.bin", 4000)
    proxy = s3["proxy"]
    proxy.no_checksums = True
    proxy.corrupt["c.bin"] = 10**6
    store = storage.Store(s3["options"], retry_policy=_POLICY, block_size=block_size)
    failed = r"c\.bin: 4 attempt\(s\) .*TransferCorrupted: the MD5 of the bytes"
    with storage.open_read(store, url) as f, pytest.raises(RemoteReadError, match=failed):
        f.read()
    assert _cache_files(isolated_cache) == []  # no entry, no temporary file left

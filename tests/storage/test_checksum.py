"""End-to-end checks of downloads against a real S3 server, behind a proxy that flips a byte of
the bodies it forwards: a corrupted transfer is fetched again, and what is served and cached is
the object's bytes; when every transfer is corrupted, a named error, nothing in the cache."""

from __future__ import annotations

import hashlib
import os
import pathlib
import time
from typing import Any

import pytest

from globalloader import storage
from globalloader.demo.s3 import write_shards
from globalloader.errors import RemoteReadError
from globalloader.sources import TarShards
from globalloader.storage import checksum

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


def test_a_shard_whose_etag_is_no_md5_is_checked_against_its_sidecar_crc(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=6, per_shard=3, index=True)
    expected = {r["__key__"]: r["bin"] for r in TarShards(urls, storage_options=s3["options"], cache=False)}
    # Upload the first shard again, same bytes, as a multipart upload: its ETag ("<hex>-1") is no
    # MD5, so only its sidecar's CRC-32 can tell a corrupted transfer.
    fs, path = storage.Store(s3["options"]).filesystem(urls[0])
    bucket, key = path.split("/", 1)
    body = fs.cat_file(path)
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    part = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body)
    parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
    fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=parts)
    src = TarShards(urls, storage_options=s3["options"])
    src.store.retry_policy = _POLICY
    assert src.store.stat(urls[0]).version.endswith('-1"') and len(src) == len(expected)  # sidecars read
    proxy = s3["proxy"]
    proxy.no_checksums = True
    proxy.corrupt["shard-000.tar"] = 2
    assert {r["__key__"]: r["bin"] for r in src} == expected
    assert (
        src.sidecars == 1 and proxy.faults["corrupt"] == 2
    )  # shard-000 indexed from its sidecar (shard-001 was indexed by the scan above)


def test_only_an_etag_that_is_an_md5_is_taken_for_one() -> None:
    md5 = "7b8c0097041de5d22d96344c3f3bef44"
    assert checksum.answer_md5(f'"{md5.upper()}"', "AES256", None) == md5
    assert checksum.answer_md5(f'"{md5}-3"', None, None) is None  # multipart
    assert checksum.answer_md5(f'"{md5}"', "aws:kms", None) is None  # KMS: the ETag is no MD5
    assert checksum.answer_md5(f'"{md5}"', None, "AES256") is None  # a customer's key: neither


def _kms_object(s3: dict[str, Any], name: str, size: int) -> tuple[str, bytes]:
    url, data = f"s3://{s3['bucket']}/{name}", os.urandom(size)
    fs, _ = storage.Store(s3["options"]).filesystem(url)
    fs.call_s3("put_object", Bucket=s3["bucket"], Key=name, Body=data, ServerSideEncryption="aws:kms")
    return url, data


# S3 shows the ETag of an object encrypted with KMS as a hex that is no MD5 (moto shows the MD5:
# the proxy shows another hex, as S3 does). The GET's answer does not name the encryption: the
# bytes differ from the ETag, one HEAD says why, and the object is read, not refused as corrupted.
@pytest.mark.parametrize("path", ["without the cache", "through the cache", "downloaded ahead"])
def test_an_encrypted_object_whose_etag_is_no_md5_is_read_and_a_corrupted_plain_one_is_caught(
    s3: dict[str, Any], isolated_cache: pathlib.Path, path: str
) -> None:
    secret, secret_data = _kms_object(s3, "secret.bin", 3000)
    plain, plain_data = _object(s3, "plain.bin", 3000)
    proxy = s3["proxy"]
    proxy.opaque_etags.add("secret.bin")
    proxy.no_checksums = True
    store = storage.Store(s3["options"], retry_policy=_POLICY, cache=path != "without the cache")
    secret_stat, plain_stat = store.stat(secret), store.stat(plain)
    assert checksum.etag_md5(secret_stat.version) != hashlib.md5(secret_data).hexdigest()
    proxy.corrupt["plain.bin"] = 1
    if path == "downloaded ahead":
        store.prefetch([(secret, secret_stat), (plain, plain_stat)])
        deadline = time.monotonic() + 20
        while store.fetch_counters().get("fetched", 0) + store.fetch_counters().get("failed", 0) < 2:
            assert time.monotonic() < deadline, store.fetch_counters()
            time.sleep(0.02)
        assert store.fetch_counters()["failed"] == 0
    assert store.read_object(secret, secret_stat) == secret_data
    assert store.read_object(plain, plain_stat) == plain_data
    assert proxy.faults["corrupt"] == 1  # caught, fetched again
    ahead = path == "downloaded ahead"
    # Ahead, a small object is read without a condition first: the encrypted one's bytes differ
    # from its ETag, so it is read again with If-Match, as every small object of its bucket after it.
    assert proxy.count("GET", suffix="plain.bin") == 2
    assert proxy.count("GET", suffix="secret.bin") == (2 if ahead else 1)
    if ahead:
        other, other_data = _kms_object(s3, "2-secret.bin", 3000)
        other_stat = store.stat(other)
        store.prefetch([(other, other_stat)])
        while store.fetch_counters()["fetched"] + store.fetch_counters()["failed"] < 3:
            assert time.monotonic() < deadline, store.fetch_counters()
            time.sleep(0.02)
        assert store.read_object(other, other_stat) == other_data
        assert proxy.count("GET", suffix="2-secret.bin") == 1 == proxy.count_conditional("GET", "2-secret.bin")

"""Index sidecars of remote tar shards, on a real S3 server: planning reads one small sidecar per
shard instead of downloading the shards; a missing, stale or corrupt sidecar is passed over
(the shard is scanned), and a shard rewritten behind a sidecar is an error, never wrong members."""

from __future__ import annotations

import os
import pathlib
import zlib
from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader import storage
from globalloader.demo.s3 import write_shards
from globalloader.errors import SourceError
from globalloader.sources import TarShards, TarWriter, _tar_index
from helpers import check_resume


def _expected(n: int) -> list[tuple[str, bytes]]:
    return [(f"s{i:05d}", str(i).encode()) for i in range(n)]


def _records(src: TarShards) -> list[tuple[str, bytes]]:
    return [(r["__key__"], r["cls"]) for r in (src[i] for i in range(len(src)))]


def _rewrite(url: str, opts: dict[str, Any], keys: range, size: int, index: bool = False) -> None:
    """Write shard `url` again with samples `keys` of random bytes (cls = 1000 + key)."""
    with TarWriter(url, storage_options=opts, index=index) as writer:
        for i in keys:
            writer.write({"__key__": f"s{i:05d}", "bin": os.urandom(size + i % 7), "cls": 1000 + i})


def _put_multipart(url: str, opts: dict[str, Any], data: bytes) -> None:
    """Upload `data` at `url` as a one-part multipart upload: its ETag is then not its MD5."""
    fs, path = storage.Store(opts).filesystem(url)
    bucket, key = path.split("/", 1)
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    part = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=data)
    fs.call_s3(
        "complete_multipart_upload",
        Bucket=bucket,
        Key=key,
        UploadId=upload["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )


def _read(url: str, opts: dict[str, Any]) -> bytes:
    fs, path = storage.Store(opts).filesystem(url)
    return bytes(fs.cat_file(path))


def test_planning_reads_the_sidecars_only_then_an_epoch_downloads_each_shard_once(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=60, per_shard=6, index=True)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    src = TarShards(urls, storage_options=s3["options"])
    assert len(src) == 60 and src.sidecars == len(urls) and src.scanned == 0
    sidecar_bytes = proxy.total_bytes(prefix, ".idx")
    shard_bytes = sum(st.size for st in src._stats)
    assert proxy.total_bytes(prefix, ".tar") == 0  # no shard downloaded to plan
    assert proxy.count("GET", prefix, ".idx") == len(urls) and 0 < sidecar_bytes < 0.2 * shard_bytes
    with gl.Loader(gl.Dataset(src).shuffle(seed=0, window=2).batch(8), workers=2) as loader:
        cold = [k for b in loader for k in b["__key__"]]
    assert sorted(cold) == [k for k, _ in _expected(60)]
    assert proxy.total_bytes(prefix, ".tar") == shard_bytes  # each shard once, by whichever process
    assert proxy.count("GET", prefix, ".tar") == len(urls)
    again = TarShards(urls, storage_options=s3["options"])  # a new job: index and shards cached here
    before = proxy.total_bytes(prefix)
    assert _records(again) == _expected(60) and again.sidecars == 0 and again.scanned == 0
    assert proxy.total_bytes(prefix) == before


@pytest.mark.parametrize("index", [True, False])
def test_the_index_is_the_same_with_and_without_sidecars(s3: dict[str, Any], index: bool) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=20, per_shard=6, index=index)
    src = TarShards(urls, storage_options=s3["options"], index_dir=None)
    assert _records(src) == _expected(20)
    assert (src.sidecars, src.scanned) == ((len(urls), 0) if index else (0, len(urls)))
    assert list(src.block_starts) == [0, 6, 12, 18]


def test_resume_over_shards_planned_from_sidecars_is_exact(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=30, per_shard=4, size=300, index=True)
    src = TarShards(urls, storage_options=s3["options"])
    ds = gl.Dataset(src).shuffle(seed=2, window=2).batch(3)
    full = check_resume(lambda: gl.Loader(ds, workers=2), at=4)
    assert sorted(k for batch in full for k in batch["__key__"]) == [f"s{i:05d}" for i in range(30)]
    assert src.sidecars == len(urls)


@pytest.mark.parametrize("change", ["size", "etag"])
def test_a_stale_sidecar_is_refused_and_the_shard_scanned(s3: dict[str, Any], change: str) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=12, per_shard=4, index=True)
    old = _read(urls[1], s3["options"])
    # The shard is written again without its sidecar: more samples, or the same sizes with other bytes.
    _rewrite(urls[1], s3["options"], range(4, 12) if change == "size" else range(4, 8), 2000)
    new = _read(urls[1], s3["options"])
    assert (len(new) != len(old)) if change == "size" else (len(new) == len(old) and new != old)
    src = TarShards(urls, storage_options=s3["options"])
    with pytest.warns(UserWarning, match="stale index sidecar .*shard-001.tar.idx"):
        src.build_index()
    assert src.sidecars == 2 and src.scanned == 1
    rewritten = [(f"s{i:05d}", str(1000 + i).encode()) for i in (range(4, 12) if change == "size" else range(4, 8))]
    assert _records(src) == _expected(4) + rewritten + _expected(12)[8:]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "members outside the shard"])
def test_a_corrupt_sidecar_is_refused_and_the_shard_scanned(s3: dict[str, Any], damage: str) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=12, per_shard=4, index=True)
    name = _tar_index.sidecar_url(urls[2])
    good = _read(name, s3["options"])
    fs, path = storage.Store(s3["options"]).filesystem(name)
    if damage == "garbage":
        fs.pipe_file(path, b"not an index")
    elif damage == "truncated":
        fs.pipe_file(path, good[: len(good) // 2])
    else:  # well formed, for this very shard (size and MD5), but its offsets point past the end
        st = storage.Store(s3["options"]).stat(urls[2])
        index = _tar_index.read_sidecar(good, urls[2], st).shard_index
        assert index is not None
        shifted = _tar_index.ShardIndex(index.member_start, index.members + np.array([st.size, 0, 0]), *index[2:5])
        meta_md5 = st.version.strip('"')
        fs.pipe_file(path, _tar_index.sidecar_bytes(shifted, st.size, meta_md5, index.crc32 or 0))
    src = TarShards(urls, storage_options=s3["options"])
    with pytest.warns(UserWarning, match="corrupt index sidecar .*shard-002.tar.idx"):
        src.build_index()
    assert src.sidecars == 2 and src.scanned == 1
    assert _records(src) == _expected(12)


def test_a_shard_rewritten_behind_a_sidecar_its_etag_cannot_disprove_is_an_error(s3: dict[str, Any]) -> None:
    """A multipart ETag is not an MD5: the sidecar is taken for planning, and its CRC-32 is
    compared with the bytes the cache downloads before any sample of the shard is read."""
    urls = write_shards(s3["bucket"], s3["options"], n=12, per_shard=4, index=True)
    for url in urls:  # the same bytes again, uploaded in parts: ETags no longer prove anything
        _put_multipart(url, s3["options"], _read(url, s3["options"]))
    src = TarShards(urls, storage_options=s3["options"])
    assert not _tar_index.proves_content(src._stats[0])
    assert _records(src) == _expected(12) and src.sidecars == 3  # right sidecars: checked and read
    src.store.cache.clear()
    src.close()
    # Shard 1 rewritten with the same size and other bytes, behind the sidecar of the old one.
    _rewrite(urls[1], s3["options"], range(4, 8), 2000)
    _put_multipart(urls[1], s3["options"], _read(urls[1], s3["options"]))
    stale = TarShards(urls, storage_options=s3["options"])
    assert len(stale) == 12 and stale.sidecars == 3
    assert stale[0]["cls"] == b"0" and stale[11]["cls"] == b"11"
    with pytest.raises(SourceError, match=r"shard-001.tar does not match its index sidecar .*shard-001.tar.idx"):
        stale[5]
    with gl.Loader(gl.Dataset(stale).batch(4), workers=1) as loader, pytest.raises(SourceError, match="sidecar"):
        list(loader)


def test_sidecars_beside_the_shards_in_a_pattern_are_not_shards(s3: dict[str, Any]) -> None:
    write_shards(s3["bucket"], s3["options"], n=12, per_shard=4, index=True)
    src = TarShards(f"s3://{s3['bucket']}/shard-*", storage_options=s3["options"])
    assert [u.rsplit("/", 1)[1] for u in src.shards] == ["shard-000.tar", "shard-001.tar", "shard-002.tar"]
    assert _records(src) == _expected(12)


def test_the_writer_s_sidecar_matches_a_scan(tmp_path: pathlib.Path) -> None:
    with TarWriter(str(tmp_path / "w-%02d.tar"), maxcount=5) as writer:
        for i in range(12):  # long keys need pax headers; empty and odd-sized members
            key = f"dir/{'x' * (150 if i % 3 == 0 else 3)}é{i}"
            writer.write({"__key__": key, "jpg": os.urandom(97 * i), "cls": i, "e.x": ""})
    for path in writer.paths:
        data = pathlib.Path(path).read_bytes()
        sidecar = _tar_index.read_sidecar(pathlib.Path(path + ".idx").read_bytes(), path, storage.Store().stat(path))
        scanned = _tar_index.scan(lambda a, n, data=data: data[a : a + n], path, len(data), False)
        index = sidecar.shard_index
        assert sidecar.problem == "" and index is not None
        for mine, theirs in zip(index[:4], scanned[:4], strict=True):
            assert np.array_equal(mine, theirs) if isinstance(mine, np.ndarray) else mine == theirs
        assert index.exts == scanned.exts and index.crc32 == zlib.crc32(data)


@pytest.mark.parametrize("memo", ["expired", "kept"])
def test_a_shard_changed_after_the_listing_is_refused_not_read(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch, memo: str
) -> None:
    """The listing that expanded the pattern gave each shard's ETag; once that memo has expired a
    download asks the store again, and while it is kept the download is asked for with If-Match on
    it: either way a shard rewritten since (same size, other bytes) is an error, not new bytes read
    through the old index."""
    urls = write_shards(s3["bucket"], s3["options"], n=8, per_shard=4)
    src = TarShards(f"s3://{s3['bucket']}/shard-*.tar", storage_options=s3["options"])
    assert len(src) == 8 and src.scanned == 2
    src.close()
    src.store.cache.clear()
    _rewrite(urls[0], s3["options"], range(4), 2000)  # same sizes, other bytes
    if memo == "expired":
        monkeypatch.setattr(storage.store, "INFO_TTL", 0.0)  # the memo of sizes and versions has expired
    with pytest.raises(SourceError, match=r"shard-000\.tar changed since the source was made"):
        src[0]

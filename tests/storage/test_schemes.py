"""gs:// and az:// go through the same layer as s3://: their fsspec client is made from the
source's storage_options, once per process, and their objects are read through the machine cache,
against real servers (the GCS emulator, Azurite): listings, ranges, versions in the cache key,
checksums, retries, conditional reads."""

from __future__ import annotations

import collections
import os
import pathlib
from typing import Any

import pytest

import globalloader as gl
from globalloader import storage
from globalloader.errors import RemoteAccessError, RemoteReadError, SourceError

AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.mark.parametrize(
    ("url", "options", "client", "attribute", "value"),
    [
        (
            "gs://bucket/dir/shard-0.tar",
            {"token": "anon", "project": "my-project"},
            "GCSFileSystem",
            "project",
            "my-project",
        ),
        (
            "az://container/dir/shard-0.tar",
            {"account_name": "devstoreaccount1", "account_key": AZURITE_KEY},
            "AzureBlobFileSystem",
            "account_name",
            "devstoreaccount1",
        ),
    ],
)
def test_other_object_stores_construct_from_storage_options(
    url: str, options: dict[str, str], client: str, attribute: str, value: str
) -> None:
    store = storage.Store(options)
    fs, path = store.filesystem(url)
    assert any(cls.__name__ == client for cls in type(fs).__mro__)
    assert getattr(fs, attribute) == value and path == url.split("://", 1)[1]
    again, other = store.filesystem(url.replace("shard-0", "shard-1"))
    assert again is fs and other.endswith("shard-1.tar")  # one client per process and options
    assert store.cached(url)  # read through the machine cache like s3://


# Against real servers: the GCS emulator and Azurite, each behind a fault proxy (conftest.py).


@pytest.fixture(params=["gcs", "azure"])
def cloud(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A fresh bucket or container of one store: its root URL, storage_options and proxy."""
    return dict(request.getfixturevalue(request.param))


def _random(size: int) -> bytes:
    """Random bytes that do not end in a carriage return: the GCS emulator's upload (its multipart
    parser) drops a trailing b"\\r" of an object, a fault of the emulator, not of the reads tested."""
    return os.urandom(size - 1) + b"."


def _cached(store: storage.Store, url: str, stat: storage.FileStat) -> bytes:
    """The whole object as the machine cache holds it (downloaded there first if missing)."""
    cached = store.open_cached(url, stat)
    try:
        return cached.pread(0, stat.size)
    finally:
        cached.close()


def _put(cloud: dict[str, Any], name: str, data: bytes) -> str:
    url = f"{cloud['root']}/{name}"
    with storage.Store(cloud["options"]).open_write(url) as out:
        out.write(data)
    return url


def test_listing_ranges_and_the_cache_keyed_by_the_object_s_version(cloud: dict[str, Any]) -> None:
    url = _put(cloud, "dir/a.bin", bytes(range(256)) * 40)
    store = storage.Store(cloud["options"])
    listed = store.find(f"{cloud['root']}/dir")
    assert list(listed) == [url] and listed[url].size == 10240
    field = "generation" if url.startswith("gs://") else "etag"
    info = store.filesystem(url)[0].info(url)
    assert listed[url].version == str(info[field])  # the store's own version, GCS's generation, Azure's ETag
    assert store.read_range(url, 1000, 1010, listed[url]) == (bytes(range(256)) * 40)[1000:1010]
    assert _cached(store, url, listed[url]) == bytes(range(256)) * 40
    _put(cloud, "dir/a.bin", b"new bytes")  # rewritten: a new version, a new cache entry
    again = storage.Store(cloud["options"])  # the same machine cache, a new source
    fresh = again.stat(url)
    assert fresh.version != listed[url].version
    assert _cached(again, url, fresh) == b"new bytes"


def test_tar_shards_and_an_image_folder_read_exact_records(cloud: dict[str, Any], tmp_path: pathlib.Path) -> None:
    root, opts = cloud["root"], cloud["options"]
    samples = [{"__key__": f"s{i:05d}", "bin": _random(300 + i), "cls": i} for i in range(10)]
    for pattern, options in ((f"{root}/shard-%03d.tar", opts), (str(tmp_path / "shard-%03d.tar"), None)):
        with gl.TarWriter(pattern, maxcount=4, storage_options=options) as writer:
            for sample in samples:
                writer.write(sample)
    remote = gl.TarShards(f"{root}/shard-*.tar", storage_options=opts)
    local = gl.TarShards(str(tmp_path / "shard-*.tar"))
    assert remote.shards == [f"{root}/shard-{n:03d}.tar" for n in range(3)]  # the user's scheme, listed
    assert _records(remote, "__url__") == _records(local, "__url__")
    for name in ("cat/0.jpg", "cat/1.jpg", "dog/0.png"):
        data = _random(200)
        (tmp_path / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "images" / name).write_bytes(data)
        _put(cloud, f"images/{name}", data)
    remote_images = gl.ImageFolder(f"{root}/images", storage_options=opts)
    local_images = gl.ImageFolder(tmp_path / "images")
    assert remote_images.classes == ["cat", "dog"] and len(remote_images) == 3
    for got, want in zip(_records(remote_images), _records(local_images), strict=True):
        assert got["__key__"] == want["__key__"] and got["label"] == want["label"]
        assert got["image"] == want["image"], (
            f"{got['__key__']}: {len(got['image'])} bytes, written {len(want['image'])}"
        )


def test_an_object_rewritten_after_its_listing_is_never_served_under_the_old_version(cloud: dict[str, Any]) -> None:
    url = _put(cloud, "a.bin", b"old" * 1000)
    store = storage.Store(cloud["options"])
    listed = store.find(cloud["root"])[url]
    _put(cloud, "a.bin", b"new" * 1000)  # the same size: only the version tells them apart
    for start, end in ((0, 3000), (10, 20)):  # whole, and a range
        with pytest.raises(SourceError, match=r"a\.bin changed since the source was made \(its .* is no longer"):
            store.read_range(url, start, end, listed)
    with pytest.raises(SourceError, match=r"a\.bin changed since the source was made"):
        _cached(store, url, listed)  # within INFO_TTL the listing's version is the one asked for
    sent = cloud["proxy"].total_bytes(suffix="a.bin")
    if url.startswith("az://"):
        assert sent == 0  # Azurite refused every read (412 on If-Match): no byte of the new version left it
    else:
        # The emulator ignores ifGenerationMatch and sent the new bytes: the generation asked for
        # again after the read refused them (a real GCS answers 412, or names its generation).
        assert sent > 0


def test_a_corrupted_whole_download_is_fetched_again_against_the_store_s_md5(cloud: dict[str, Any]) -> None:
    data = _random(4000)
    url = _put(cloud, "c.bin", data)
    proxy = cloud["proxy"]
    store = storage.Store(cloud["options"], retry_policy=_FAST)
    stat = store.stat(url)
    proxy.corrupt[f"{cloud['downloads']}c.bin"] = 2
    assert _cached(store, url, stat) == data
    assert proxy.faults["corrupt"] == 2  # two bodies damaged in transit, both refused
    proxy.corrupt[f"{cloud['downloads']}c.bin"] = 1
    assert storage.Store(cloud["options"], cache=False).read_range(url, 0, len(data), stat) == data
    assert proxy.faults["corrupt"] == 3


def test_throttling_5xx_and_resets_are_retried_and_the_records_stay_exact(cloud: dict[str, Any]) -> None:
    root, opts = cloud["root"], cloud["options"]
    with gl.TarWriter(f"{root}/shard-%03d.tar", maxcount=2, storage_options=opts) as writer:
        for i in range(8):
            writer.write({"__key__": f"s{i:05d}", "bin": _random(500 + i)})
    expected = _records(gl.TarShards(writer.paths, storage_options=opts, cache=False))
    sources = [gl.TarShards(writer.paths, storage_options=opts, cache=cache) for cache in (True, False)]
    for src in sources:
        src.store.retry_policy = _FAST  # constructed first: the default policy's 8 tries would fail 1 stat in 256
    proxy = cloud["proxy"]
    proxy.faults_on, proxy.slowdown, proxy.reset = True, 0.3, 0.2  # half the requests fail
    for src in sources:  # through the cache (whole downloads), then ranged reads
        assert _records(src) == expected
    for _ in range(30):  # more ranged epochs until both kinds of fault have happened, each exact
        if proxy.faults["503"] and proxy.faults["reset"]:
            break
        assert _records(sources[1]) == expected
    assert proxy.faults["503"] > 0 and proxy.faults["reset"] > 0  # the faults did happen


def test_a_stat_is_one_request_and_names_a_folder_or_a_missing_object(cloud: dict[str, Any]) -> None:
    """gcsfs's own `info` also lists the name as a folder (a pricier request), and GETs the object
    a second time when that listing answers first: a request that could reach the store after
    `stat` returned, counted against whatever came next."""
    url = _put(cloud, "dir/one.bin", b"x" * 100)
    proxy = cloud["proxy"]
    before = collections.Counter(proxy.requests)
    assert storage.Store(cloud["options"]).stat(url).size == 100
    sent = collections.Counter(proxy.requests) - before
    assert len(sent) == 1 and sum(sent.values()) == 1 and next(iter(sent)).endswith("one.bin"), sent
    with pytest.raises(SourceError, match=r"not a regular file: .*/dir$"):
        storage.Store(cloud["options"]).stat(f"{cloud['root']}/dir")
    with pytest.raises(RemoteAccessError, match=r"file not found: .*/dir/none\.bin"):
        storage.Store(cloud["options"]).stat(f"{cloud['root']}/dir/none.bin")


@pytest.mark.parametrize("status", [403, 404])
def test_access_denied_and_not_found_are_named_at_once_and_not_retried(cloud: dict[str, Any], status: int) -> None:
    url = _put(cloud, "shard-001.tar", b"x" * 100)
    proxy = cloud["proxy"]
    store = storage.Store(cloud["options"])
    stat = store.stat(url)
    before = _requests(proxy, "shard-001.tar")
    proxy.forced["shard-001"] = status
    for read in (lambda: store.read_range(url, 0, 100, stat), lambda: store.read_range(url, 0, 100)):
        with pytest.raises(RemoteAccessError, match=r"shard-001\.tar") as info:
            read()  # with its version (a conditional read), and without
        assert ("access denied" if status == 403 else "file not found") in str(info.value)
        assert "\n" not in str(info.value)  # one line, not the server's whole answer
    assert _requests(proxy, "shard-001.tar") - before == 2  # one request each, no retry (by the client or by us)


def test_a_persisting_503_is_tried_as_often_as_the_policy_says_then_named(cloud: dict[str, Any]) -> None:
    url = _put(cloud, "shard-000.tar", b"x" * 100)
    proxy = cloud["proxy"]
    proxy.forced["shard-000"] = 503
    policy = storage.RetryPolicy(attempts=3, base=0.01, cap=0.02)
    with pytest.raises(RemoteReadError, match=r"stat .*shard-000\.tar: 3 attempt\(s\) .* transient faults"):
        storage.Store(cloud["options"], retry_policy=policy).stat(url)
    assert _requests(proxy, "shard-000.tar") == 3  # the client's own retries are off: ours decide


_FAST = storage.RetryPolicy(attempts=20, base=0.01, cap=0.05)


def _records(src: Any, *but: str) -> list[dict[str, Any]]:
    """Every record of `src` in order, without the fields `but` (where it was read from)."""
    return [{k: v for k, v in src[i].items() if k not in but} for i in range(len(src))]


def _requests(proxy: Any, name: str) -> int:
    return sum(proxy.count(method, suffix=name) for method in ("GET", "HEAD"))


def test_s3_gets_reach_the_store_from_client_kwargs_and_the_environment(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GETs' client (obstore) is made from the same options as s3fs: here the endpoint in
    `client_kwargs` and the credentials and region from the environment (botocore's chain)."""
    url, data = f"s3://{s3['bucket']}/env.bin", os.urandom(2000)
    with storage.Store(s3["options"]).open_write(url) as out:
        out.write(data)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = storage.Store({"client_kwargs": {"endpoint_url": s3["proxy"].url}}, cache=False)
    stat = store.stat(url)
    assert store.read_range(url, 0, stat.size, stat) == data
    assert store.read_range(url, 100, 200, stat) == data[100:200]
    assert s3["proxy"].count("GET", f"/{s3['bucket']}/env.bin") == 2

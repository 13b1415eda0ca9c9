"""The machine-wide object cache, against a real S3 server: keyed by version, checked, shared by
processes with one download per object, evicted within its limit, safe against kill -9."""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

import globalloader as gl
from globalloader import storage
from globalloader.demo.s3 import write_shards
from globalloader.errors import ArgumentError, CacheFullError, SourceError
from globalloader.sources import TarShards
from globalloader.storage.cache import Entry, ObjectCache, parse_size, resolve_limit
from helpers import at_once


def _dataset_bytes(src: TarShards) -> int:
    return sum(st.size for st in src._stats)


def test_limits_parse_and_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_size("20GB", "x") == 20 * 10**9 and parse_size("512MiB", "x") == 512 << 20
    assert parse_size(1000, "x") == 1000 and parse_size("1000", "x") == 1000
    for bad in ("-1", "lots", "0", 0, "5 parsecs"):
        with pytest.raises(ArgumentError, match="x must be"):
            parse_size(bad, "x")
    monkeypatch.delenv("GLOBALLOADER_CACHE_LIMIT", raising=False)
    assert resolve_limit(None) == 20 * 10**9
    monkeypatch.setenv("GLOBALLOADER_CACHE_LIMIT", "3MB")
    assert resolve_limit(None) == 3 * 10**6 and resolve_limit("1GB") == 10**9


def test_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("GLOBALLOADER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ObjectCache().root == tmp_path / "xdg" / "globalloader" / "objects"
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "mine"))
    assert ObjectCache().root == tmp_path / "mine" / "objects"


def test_bytes_per_epoch_cold_once_warm_zero_with_process_workers(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=60, per_shard=6)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    src = TarShards(urls, storage_options=s3["options"])
    dataset = _dataset_bytes(src)
    chain = gl.Dataset(src).shuffle(seed=0).batch(8)
    with gl.Loader(chain, workers=2) as loader:
        cold = [k for b in loader for k in b["__key__"]]
    assert sorted(cold) == [f"s{i:05d}" for i in range(60)]
    assert proxy.total_bytes(prefix) <= 1.02 * dataset  # index scan and both workers: one download
    before = proxy.total_bytes(prefix)
    again = TarShards(urls, storage_options=s3["options"])  # a new job on the same machine
    with gl.Loader(gl.Dataset(again).shuffle(seed=0).batch(8), workers=2) as loader:
        warm = [k for b in loader for k in b["__key__"]]
    assert warm == cold and proxy.total_bytes(prefix) == before  # warm epoch: nothing downloaded
    # A plain shuffle is served from the cache: one GET per shard in all, not one per sample.
    assert proxy.count("GET", prefix, ".tar") == len(urls)


def _read_all(urls: list[str], opts: dict[str, Any], out: Any, start: Any) -> None:
    start.wait(60)  # both processes ask for the same shards at the same moment
    src = TarShards(urls, storage_options=opts)
    out.put(sorted(src[i]["__key__"] for i in range(len(src))))


@pytest.mark.slow
def test_two_processes_at_once_download_each_object_once(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=40, per_shard=4)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    proxy.latency = 0.2  # downloads overlap
    results = at_once("spawn", _read_all, urls, s3["options"])
    assert results[0] == results[1] == [f"s{i:05d}" for i in range(40)]
    sizes = TarShards(urls, storage_options=s3["options"])._stats
    assert proxy.total_bytes(prefix) == sum(st.size for st in sizes)  # each shard once
    assert proxy.count("GET", prefix, ".tar") == len(urls)


def test_the_cache_stays_within_its_limit_and_keeps_entries_in_use(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=40, per_shard=4, size=5000)
    store = storage.Store(s3["options"], cache_limit=200_000)  # six of the ten shards
    stats = [store.stat(u) for u in urls]
    assert all(st.size <= store.whole_max for st in stats)
    # Another reader (another source, or process) keeps the first one open; this store's own
    # readers would release it to stay within their share of the cache.
    held = storage.Store(s3["options"], cache_limit=200_000).open_cached(urls[0], stats[0])
    for url, st in zip(urls[1:], stats[1:], strict=True):
        store.fetch(url, st)
        entries = store.cache.entries()
        in_use = sum(size for path, size, _ in entries if path == held.path)
        assert sum(size for _, size, _ in entries) - in_use <= 200_000
    assert held.path.exists() and held.pread(0, 10) == store.read_range(urls[0], 0, 10)
    held.close()
    store.cache.evict()
    assert sum(size for _, size, _ in store.cache.entries()) <= 200_000
    # Least recently used goes first: the last shard fetched is still there.
    last = Entry(urls[-1], stats[-1].size, stats[-1].version).name()
    assert (store.cache.root / last).exists()


def test_a_changed_object_is_never_served_stale(s3: dict[str, Any]) -> None:
    opts = s3["options"]
    url = f"s3://{s3['bucket']}/one.bin"
    store = storage.Store(opts)
    fs, path = store.filesystem(url)
    fs.pipe_file(path, b"A" * 5000)
    first = storage.Store(opts)
    st1 = first.stat(url)
    first.fetch(url, st1)
    with storage.open_read(first, url, st1) as f:
        assert f.read() == b"A" * 5000
    fs.pipe_file(path, b"B" * 5000)  # same size, new ETag
    second = storage.Store(opts)
    with storage.open_read(second, url) as f:
        assert f.read() == b"B" * 5000
    # A reader still holding the old version's stat, once the old entry is gone, is refused.
    first.cache.clear()
    with pytest.raises(SourceError, match="changed since the source was made"):
        storage.open_read(storage.Store(opts), url, st1).read()


def test_a_rewrite_the_listing_has_not_seen_is_refused_not_cached(s3: dict[str, Any]) -> None:
    """The listing's ETag is trusted for INFO_TTL seconds without asking again; a rewrite in that
    time (same size, other bytes) must not land in the cache under the old version's key."""
    url = f"s3://{s3['bucket']}/one.bin"
    store = storage.Store(s3["options"])
    fs, path = store.filesystem(url)
    fs.pipe_file(path, b"A" * 5000)
    st = store.stats([url])[0]  # remembered: no request is made again within INFO_TTL
    fs.pipe_file(path, b"B" * 5000)
    with pytest.raises(SourceError, match=r"one\.bin changed since the source was made"):
        store.fetch(url, st)
    assert store.cache.entries() == []
    with storage.open_read(storage.Store(s3["options"]), url) as f:  # a source made now reads the new bytes
        assert f.read() == b"B" * 5000


def test_a_pinned_object_version_is_read_after_a_rewrite(s3: dict[str, Any]) -> None:
    """With a version_aware client, a URL naming an S3 object version reads that version, not
    the latest one (and the version check does not take the rewrite for a change)."""
    opts = {**s3["options"], "version_aware": True}
    store = storage.Store(opts)
    fs, _ = store.filesystem(f"s3://{s3['bucket']}")
    fs.call_s3("put_bucket_versioning", Bucket=s3["bucket"], VersioningConfiguration={"Status": "Enabled"})
    fs.pipe_file(f"{s3['bucket']}/kept.bin", b"A" * 3000)
    first = fs.info(f"{s3['bucket']}/kept.bin")["VersionId"]
    fs.pipe_file(f"{s3['bucket']}/kept.bin", b"B" * 3000)
    url = f"s3://{s3['bucket']}/kept.bin?versionId={first}"
    for cache in (True, False):
        with storage.open_read(storage.Store(opts, cache=cache), url) as f:
            assert f.read() == b"A" * 3000


@pytest.mark.parametrize("cache", [True, False], ids=["blocks", "uncached"])
def test_a_rewrite_between_two_reads_never_mixes_versions(s3: dict[str, Any], cache: bool) -> None:
    """A large object is read block by block (or, uncached, range by range): a rewrite after the
    first read makes the next an error, not bytes of the new version beside the old one's."""
    url = f"s3://{s3['bucket']}/large.bin"
    store = storage.Store(s3["options"], cache_limit=40_000, block_size=8192, cache=cache)
    fs, path = store.filesystem(url)
    fs.pipe_file(path, b"A" * 30_000)
    reader = storage.RangeReader(store, whole=False)
    reader.expect(url, store.stat(url))
    assert reader.read(url, 0, 100) == b"A" * 100
    fs.pipe_file(path, b"B" * 30_000)
    with pytest.raises(SourceError, match=r"large\.bin changed since the source was made"):
        reader.read(url, 20_000, 100)
    if cache:  # the first block, cached before the rewrite, stays version A's
        assert reader.read(url, 50, 50) == b"A" * 50


def test_a_damaged_entry_is_fetched_again(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=8, per_shard=8)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    store = storage.Store(s3["options"])
    st = store.stat(urls[0])
    store.fetch(urls[0], st)
    path = store.cache.root / Entry(urls[0], st.size, st.version).name()
    good, data = path.read_bytes(), store.read_range(urls[0], 0, st.size)
    for damage in (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], lambda b: b[:-5]):
        path.write_bytes(damage(good))
        time.sleep(0.01)
        assert storage.open_read(storage.Store(s3["options"]), urls[0], st).read() == data
        assert path.read_bytes() == good
    assert proxy.count("GET", prefix) == 4  # the first download, the object read above, one per damage


_KILLED_READER = """
from globalloader import storage
from globalloader.demo.s3 import options
store = storage.Store(options({endpoint!r}))
print("start", flush=True)
store.fetch({url!r})
"""


@pytest.mark.slow
def test_kill_9_mid_download_leaves_the_cache_consistent(s3: dict[str, Any], isolated_cache: pathlib.Path) -> None:
    opts, proxy = s3["options"], s3["proxy"]
    url = f"s3://{s3['bucket']}/big.bin"
    data = os.urandom(20 << 20)  # three requests of 8 MiB
    store = storage.Store(opts)
    fs, path = store.filesystem(url)
    fs.pipe_file(path, data)
    proxy.latency = 1.0
    code = _KILLED_READER.format(endpoint=proxy.url, url=url)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline().strip() == b"start"
    deadline = time.monotonic() + 30
    while not any(p.name.endswith(".tmp") for p in (isolated_cache / "objects").glob("*")):
        assert time.monotonic() < deadline, "the download never started"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    cache = ObjectCache()
    assert cache.entries() == []  # no entry: only the dead download's temporary file
    proxy.latency = 0.0
    with storage.open_read(storage.Store(opts), url) as f:
        assert f.read() == data
    assert not any(p.name.endswith(".tmp") for p in cache.root.iterdir())  # the dead one was removed
    assert len(cache.entries()) == 1


def test_a_full_disk_is_a_named_error(tmp_path: pathlib.Path) -> None:
    cache = ObjectCache(tmp_path / "c", limit="1MB")

    def no_space(write: Any) -> None:
        write(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CacheFullError, match=r"no space left in the object cache .* for s3://b/k"):
        cache.open(Entry("s3://b/k", 10, "v1"), no_space)
    assert list((tmp_path / "c").glob("*.tmp")) == [] and cache.entries() == []

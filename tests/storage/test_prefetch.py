"""Prefetch: the loader announces the samples of the next tasks, the source downloads their
shards into the machine cache ahead of the workers, several at once."""

from __future__ import annotations

import pathlib
import threading
import time
from typing import Any

import numpy as np

import globalloader as gl
from globalloader.demo.s3 import write_shards
from globalloader.sources import TarShards
from globalloader.storage.prefetch import Prefetcher


def test_prefetch_downloads_the_named_shards_in_the_background(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=40, per_shard=4)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    src = TarShards(urls, storage_options=s3["options"], cache=True)
    assert len(src) == 40
    src.close()  # the index scan filled the cache and holds its entries open
    src.store.cache.clear()  # start cold
    before = proxy.count("GET", prefix)
    src.prefetch(np.array([39, 0, 1, 17]))  # shards 9, 0 and 4
    deadline = time.monotonic() + 20
    while proxy.count("GET", prefix) - before < 3:
        assert time.monotonic() < deadline, "the prefetch never ran"
        time.sleep(0.02)
    time.sleep(0.2)
    assert proxy.count("GET", prefix) - before == 3
    fetched = [url for url in urls if proxy.count("GET", f"/{s3['bucket']}/{url.rsplit('/', 1)[1]}", ".tar") == 2]
    assert fetched == [urls[0], urls[4], urls[9]]
    assert src[39]["cls"] == b"39" and proxy.count("GET", prefix) - before == 3  # served from the cache


def test_a_loader_downloads_ahead_of_its_workers(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=48, per_shard=4)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    indexes = tmp_path / "indexes"
    first = TarShards(urls, storage_options=s3["options"], index_dir=indexes)
    assert len(first) == 48 and first.scanned == len(urls)
    first.close()
    first.store.cache.clear()
    src = TarShards(urls, storage_options=s3["options"], index_dir=indexes)  # indexes known, objects not
    assert len(src) == 48 and src.scanned == 0 and src.remote
    proxy.count_peak_afresh()
    proxy.latency = 0.05
    before = proxy.count("GET", prefix)
    with gl.Loader(gl.Dataset(src).shuffle(seed=1, window=2).batch(4), workers=1) as loader:
        keys = [k for batch in loader for k in batch["__key__"]]
    assert sorted(keys) == [f"s{i:05d}" for i in range(48)]
    assert proxy.count("GET", prefix) - before == len(urls)  # each shard once
    assert proxy.most_in_flight >= 2  # one worker alone reads one at a time: these came ahead


def test_a_loader_fetches_thousands_of_samples_ahead_however_small_its_batches(
    s3: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    # A window shuffle moves to new shards every `window` shards: a horizon of a few small batches
    # would name them only just before they are read. One batch taken, the loader goes on
    # downloading the rest of this short epoch (every shard, each once) while nobody reads.
    urls = write_shards(s3["bucket"], s3["options"], n=96, per_shard=4)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    indexes = tmp_path / "indexes"
    first = TarShards(urls, storage_options=s3["options"], index_dir=indexes)
    assert len(first) == 96
    first.close()
    first.store.cache.clear()
    src = TarShards(urls, storage_options=s3["options"], index_dir=indexes)
    assert len(src) == 96 and src.scanned == 0
    before = proxy.count("GET", prefix, ".tar")
    with gl.Loader(gl.Dataset(src).shuffle(seed=3, window=2).batch(2), workers=1, mode="thread") as loader:
        batches = iter(loader)
        next(batches)
        deadline = time.monotonic() + 30
        while proxy.count("GET", prefix, ".tar") - before < len(urls):
            assert time.monotonic() < deadline, (
                f"only {proxy.count('GET', prefix, '.tar') - before} of {len(urls)} shards were fetched ahead"
            )
            time.sleep(0.02)
        keys = [k for batch in batches for k in batch["__key__"]]
    assert len(keys) == 94
    assert proxy.count("GET", prefix, ".tar") - before == len(urls)  # each shard once


def test_the_waiting_requests_stay_within_their_count() -> None:
    started, release, fetched = threading.Event(), threading.Event(), []

    def fetch(url: str) -> None:
        fetched.append(url)
        started.set()
        assert release.wait(20)

    prefetcher = Prefetcher(fetch, threads=1, depth=3)
    prefetcher.request([("a", 1)])
    assert started.wait(20)
    prefetcher.request([("b", 1), ("c", 1), ("b", 1)])  # asked twice: queued once
    prefetcher.request([("e", 1), ("f", 1), ("g", 1)])  # 3 waiting at most: f and g dropped
    release.set()
    assert _fetched(fetched, 4) == ["a", "b", "c", "e"]
    prefetcher.request([("f", 1), ("g", 1)])  # dropped ones may be asked for again
    assert _fetched(fetched, 6) == ["a", "b", "c", "e", "f", "g"]


def test_an_object_asked_for_again_while_it_downloads_is_fetched_again_after() -> None:
    """A new epoch may ask for the last object of the one before while its download, visible
    already, is still finishing: that request is queued, not taken as served by the download
    (which the reads of the epoch before used). Requests waiting are still queued once."""
    started, release, fetched = threading.Event(), threading.Event(), []

    def fetch(url: str) -> None:
        fetched.append(url)
        if len(fetched) == 1:
            started.set()
            assert release.wait(20)

    prefetcher = Prefetcher(fetch, threads=1)
    prefetcher.request([("last", 1)])
    assert started.wait(20)
    prefetcher.request([("first", 1), ("last", 1), ("last", 1)])  # the next epoch, while "last" finishes
    release.set()
    assert _fetched(fetched, 3) == ["last", "first", "last"]


def _fetched(fetched: list[str], count: int) -> list[str]:
    """`fetched` once it holds `count` URLs (within 20 s), and a while after: none more comes."""
    deadline = time.monotonic() + 20
    while len(fetched) < count:
        assert time.monotonic() < deadline, f"only {fetched} fetched"
        time.sleep(0.01)
    time.sleep(0.1)
    return list(fetched)

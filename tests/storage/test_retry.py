"""Retries against a real S3 server behind a fault-injecting proxy: transient faults are retried
within bounds and epochs stay exact; permanent ones are named at once, never retried."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

import globalloader as gl
from globalloader import storage
from globalloader.demo.s3 import write_shards
from globalloader.errors import RemoteAccessError, RemoteReadError, SourceError
from globalloader.sources import TarShards


def _records(src: TarShards) -> dict[str, dict[str, Any]]:
    return {r["__key__"]: r for r in (src[i] for i in range(len(src)))}


@pytest.mark.slow
@pytest.mark.parametrize("cache", [True, False])
def test_epochs_are_exact_under_503s_and_connection_resets(s3: dict[str, Any], cache: bool) -> None:
    # Small shards, so that even a cached run (two requests per shard) meets many faults.
    urls = write_shards(s3["bucket"], s3["options"], n=30, per_shard=1 if cache else 5)
    expected = _records(TarShards(urls, storage_options=s3["options"], cache=False))
    proxy = s3["proxy"]
    proxy.faults_on, proxy.slowdown, proxy.reset = True, 0.10, 0.05
    src = TarShards(urls, storage_options=s3["options"], cache=cache)
    chain = gl.Dataset(src).shuffle(seed=3).batch(5)
    with gl.Loader(chain, workers=2) as loader:
        batches = list(loader)
    keys = [k for b in batches for k in b["__key__"]]
    assert sorted(keys) == sorted(expected)  # every sample exactly once
    for batch in batches:
        for key, data in zip(batch["__key__"], batch["bin"], strict=True):
            assert data == expected[key]["bin"]
    assert proxy.faults["503"] + proxy.faults["reset"] > 0  # the faults did happen
    if not cache:  # hundreds of requests: both kinds
        assert proxy.faults["503"] > 0 and proxy.faults["reset"] > 0


@pytest.mark.parametrize("status", [403, 404])
def test_permanent_errors_are_named_at_once_and_not_retried(s3: dict[str, Any], status: int) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=8, per_shard=4)
    proxy = s3["proxy"]
    proxy.forced["shard-001"] = status
    start = time.monotonic()
    with pytest.raises(RemoteAccessError, match=r"shard-001\.tar") as info:
        TarShards(urls, storage_options=s3["options"])
    assert time.monotonic() - start < 5.0
    assert ("access denied" if status == 403 else "file not found") in str(info.value)
    assert isinstance(info.value, SourceError)
    key = f"/{s3['bucket']}/shard-001.tar"
    assert proxy.count("HEAD", key) + proxy.count("GET", key) == 1  # one request, no retry


def test_a_transient_fault_that_persists_ends_in_a_named_error(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=4, per_shard=4)
    proxy = s3["proxy"]
    proxy.forced["shard-000"] = 503
    policy = storage.RetryPolicy(attempts=4, base=0.01, cap=0.05, deadline=30.0)
    store = storage.Store(s3["options"], retry_policy=policy)
    with pytest.raises(
        RemoteReadError, match=r"stat .*shard-000.tar: 4 attempt\(s\) in .* transient faults.*Service Unavailable"
    ):
        store.stat(urls[0])
    key = f"/{s3['bucket']}/shard-000.tar"
    assert proxy.count("HEAD", key) == 4


def test_a_deadline_bounds_the_retries(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=4, per_shard=4)
    proxy = s3["proxy"]
    proxy.forced["shard-000"] = 503
    store = storage.Store(
        s3["options"], retry_policy=storage.RetryPolicy(attempts=1000, base=0.2, cap=0.2, deadline=1.0)
    )
    start = time.monotonic()
    with pytest.raises(RemoteReadError, match="attempt"):
        store.stat(urls[0])
    assert time.monotonic() - start < 3.0
    assert 2 <= proxy.count("HEAD", f"/{s3['bucket']}/shard-000.tar") < 20


def test_backoff_grows_with_jitter_and_a_cap() -> None:
    policy = storage.RetryPolicy(base=0.1, cap=1.0)
    delays = [[policy.delay(n) for n in range(8)] for _ in range(50)]
    for run in delays:
        assert all(0.05 <= d <= 1.5 for d in run)
    means = [sum(run[n] for run in delays) / len(delays) for n in range(8)]
    assert means[0] < means[2] < means[3] and abs(means[7] - 1.0) < 0.2
    assert len({round(run[0], 6) for run in delays}) > 40  # jittered, not fixed


# A server that sends the next byte before each read timeout: every try must end at its own
# deadline (`grace` + its bytes at `min_rate`, set small here), then the retries decide.
@pytest.mark.parametrize("cache", [True, False])
def test_a_trickling_answer_is_cut_and_named_too_slow(s3: dict[str, Any], cache: bool) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=4, per_shard=2)
    proxy = s3["proxy"]
    proxy.trickle["shard-000.tar"] = 0.02  # about 100 s for the shard, 0.02 s between two bytes
    src = TarShards(urls, storage_options=s3["options"], cache=cache)
    src.store.retry_policy = storage.RetryPolicy(attempts=2, base=0.01, cap=0.01, grace=0.5, min_rate=1e6)
    with pytest.raises(RemoteReadError, match=r"shard-000\.tar: 2 attempt\(s\) .*too slow: no whole answer within"):
        list(gl.Loader(gl.Dataset(src).batch(4), workers=0))
    assert proxy.faults["trickle"] >= 2  # the trickle did happen


def test_a_try_s_deadline_grows_with_its_bytes() -> None:
    policy = storage.RetryPolicy(grace=2.0, min_rate=1000.0, deadline=60.0)
    assert policy.attempt_deadline(0) == 2.0
    assert policy.attempt_deadline(5000) == 7.0
    assert policy.attempt_deadline(None) == 60.0  # a listing: the policy's deadline


# The GETs of object data (obstore's) answer as s3fs's calls do: 5xx and throttling retried as the
# policy says, 403 and 404 named after one request; whole objects, ranges and the pool ahead alike.
# The object's name holds "429", as a client's message (its URL) does: it is no throttling status
# (a 500 or a 403 counted as throttling once its message held "429" by chance, a timing in it).
@pytest.mark.parametrize("status", [500, 503, 403, 404])
@pytest.mark.parametrize("read", ["whole", "range", "ahead"])
def test_a_get_answered_with_an_error_status_is_retried_or_named_by_its_status(
    s3: dict[str, Any], isolated_cache: pathlib.Path, status: int, read: str
) -> None:
    url, key = f"s3://{s3['bucket']}/obj-429.bin", f"/{s3['bucket']}/obj-429.bin"
    with storage.Store(s3["options"]).open_write(url) as out:
        out.write(b"x" * 3000)
    policy = storage.RetryPolicy(attempts=3, base=0.01, cap=0.02, deadline=30.0)
    store = storage.Store(s3["options"], retry_policy=policy, cache=read == "ahead")
    stat = store.stat(url)
    proxy = s3["proxy"]
    proxy.forced["obj-429.bin"] = status
    transient = status >= 500
    if read == "ahead":
        store.prefetch([(url, stat)])
        deadline = time.monotonic() + 20
        while store.fetch_counters().get("failed", 0) == 0:
            assert time.monotonic() < deadline, store.fetch_counters()
            time.sleep(0.01)
        assert store.fetch_counters()["throttled"] == (3 if status == 503 else 0)
    else:
        start, end = (0, stat.size) if read == "whole" else (10, 20)
        named = r"cannot read .* 3 attempt\(s\)" if transient else "access denied" if status == 403 else "not found"
        with pytest.raises(RemoteReadError if transient else RemoteAccessError, match=named) as info:
            store.read_range(url, start, end, stat)
        assert url in str(info.value)
    assert proxy.count("GET", key) == (3 if transient else 1)


def test_only_a_429_status_is_throttling_not_a_429_anywhere_in_a_message() -> None:
    """The texts the S3 clients give: botocore's code of a bodiless 429 answer and obstore's status
    line are throttling; a 500 whose message holds 429 in its timing or URL is not."""
    from globalloader.storage._fs import is_throttling

    assert is_throttling(OSError(5, "An error occurred (429) when calling the GetObject operation: Too"))
    assert is_throttling(OSError(5, "Server returned non-2xx status code: 429 Too Many Requests: "))
    assert is_throttling(OSError(5, "Server returned non-2xx status code: 429"))  # the status line alone
    timing = "Error performing GET http://127.0.0.1:4290/b/k-429 in 429.605µs - Server returned non-2xx"
    assert not is_throttling(OSError(121, f"{timing} status code: 500 Internal Server Error"))
    assert not is_throttling(PermissionError(13, f"{timing} status code: 403 Forbidden"))

"""The object cache's machine-wide counters: exact under processes updating them at once, never
corrupt after kill -9, and the same figures in the shared server's status and its /metrics."""

from __future__ import annotations

import http.client
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from globalloader import _paths, storage
from globalloader.demo.s3 import write_shards
from globalloader.service.launcher import status
from globalloader.sources import TarShards
from globalloader.storage.cache import _UNRESERVED, STATS_NAME, Entry, ObjectCache, stored_size
from helpers import Dashboard, Server

SHARED = Entry("s3://bucket/shared.bin", 100, "v1")


def _scan(cache: ObjectCache) -> tuple[int, int]:
    entries = cache.entries()
    return sum(size for _, size, _ in entries), len(entries)


def _hammer(root: str, worker: int, opens: int, downloads: int, start: Any) -> None:
    cache = ObjectCache(root)
    start.wait(60)  # every process updates the record at the same moment
    for i in range(opens):
        cache.open(SHARED, lambda write: write(b"s" * 100)).close()
        if i < downloads:
            cache.open(Entry(f"s3://bucket/{worker}-{i}.bin", 10 + i, "v1"), lambda w, n=10 + i: w(b"x" * n)).close()


def _all_at_once(procs: int, target: Any, root: str, *args: int) -> None:
    """`target(root, worker, *args, barrier)` in `procs` new processes that start together; each
    must end well."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(procs)
    workers = [ctx.Process(target=target, args=(root, w, *args, start)) for w in range(procs)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(120)
        assert p.exitcode == 0


def test_counters_are_exact_with_processes_updating_at_once(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "objects"
    ObjectCache(root).open(SHARED, lambda write: write(b"s" * 100)).close()  # one miss
    procs, opens, downloads = 4, 400, 25
    _all_at_once(procs, _hammer, str(root), opens, downloads)
    cache = ObjectCache(root)
    counts = cache.status()
    new_bytes = procs * sum(10 + i for i in range(downloads))
    assert counts["hits"] == procs * opens  # not one update lost
    assert counts["misses"] == 1 + procs * downloads
    assert counts["downloaded_bytes"] == 100 + new_bytes
    on_disk = stored_size(100) + procs * sum(stored_size(10 + i) for i in range(downloads))
    assert (counts["bytes"], counts["entries"]) == _scan(cache) == (on_disk, 101)
    assert counts["limit"] == cache.limit and counts["dir"] == str(root)


def _fill_ahead(root: str, worker: int, count: int, start: Any) -> None:
    cache = ObjectCache(root)
    start.wait(60)
    for i in range(count):  # as the pool writes: at once when it can, else waiting for room
        with cache.claim(Entry(f"s3://bucket/ahead-{worker}-{i}", 100 + i, "v1"), time.time()) as fill:
            assert fill is not None
            data = bytes([worker]) * (100 + i)
            if not fill(data, False):
                fill(data, True)
        cache.open(SHARED, lambda write: write(b"s" * 100)).close()  # readers update the record meanwhile


def test_entries_written_ahead_at_once_by_processes_keep_the_counters_exact(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "objects"
    ObjectCache(root).open(SHARED, lambda write: write(b"s" * 100)).close()
    procs, count = 4, 60
    _all_at_once(procs, _fill_ahead, str(root), count)
    cache = ObjectCache(root)
    counts = cache.status()
    written = procs * sum(100 + i for i in range(count))
    assert counts["misses"] == 1 + procs * count and counts["downloaded_bytes"] == 100 + written
    assert counts["reserved"] == 0 and counts["hits"] == procs * count
    on_disk = stored_size(100) + procs * sum(stored_size(100 + i) for i in range(count))
    assert (counts["bytes"], counts["entries"]) == _scan(cache) == (on_disk, 1 + procs * count)
    for w in range(procs):  # each whole, its own bytes, read without a download
        for i in (0, count - 1):
            entry = Entry(f"s3://bucket/ahead-{w}-{i}", 100 + i, "v1")
            handle = cache.open(entry, lambda write: pytest.fail("downloaded again"))
            assert handle.pread(0, 100 + i) == bytes([w]) * (100 + i)
            handle.close()


def _leave_temporaries(root: pathlib.Path) -> None:
    """In a child that then dies: a temporary of a download with a reservation (its size) and one
    of an entry written under the counters' lock with none, as a kill mid-write leaves them."""
    pathlib.Path(_paths._temporary_for(root / ("a" * 40))).write_bytes(b"r" * 300)
    pathlib.Path(_paths._temporary_for(root / ("b" * 40), _UNRESERVED)).write_bytes(b"u" * 500)
    os._exit(0)


def test_a_dead_writers_temporaries_give_back_only_what_they_reserved(tmp_path: pathlib.Path) -> None:
    cache = ObjectCache(tmp_path / "objects")
    with cache.stats.update() as record:
        record["reserved"] += 1000 + 300  # another download's 1000, and the dead one's 300
    child = multiprocessing.get_context("fork").Process(target=_leave_temporaries, args=(cache.root,))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and len(list(cache.root.glob(".*.tmp"))) == 2
    assert cache.evict() == 800  # both removed
    assert not list(cache.root.glob(".*.tmp")) and cache.status()["reserved"] == 1000


def test_eviction_and_clear_keep_size_and_entries_true(tmp_path: pathlib.Path) -> None:
    cache = ObjectCache(tmp_path / "objects", limit=3000)
    # Held by another reader: this cache's own readers would release it to keep within their share.
    held = ObjectCache(tmp_path / "objects", limit=3000).open(Entry("s3://b/held", 1000, "v"), lambda w: w(b"h" * 1000))
    for i in range(6):
        cache.open(Entry(f"s3://b/{i}", 1000, "v"), lambda write: write(b"x" * 1000)).close()
        counts = cache.stats.read()
        assert (counts["bytes"], counts["entries"]) == _scan(cache)
    assert counts["entries"] < 7 and counts["misses"] == 7 and counts["downloaded_bytes"] == 7000
    cache.clear()
    counts = cache.stats.read()
    assert (counts["bytes"], counts["entries"]) == _scan(cache) == (stored_size(1000), 1)  # the entry in use stays
    held.close()
    # A damaged entry (a flipped bit) found by a reader is deleted, counted out, fetched again.
    path = cache.root / Entry("s3://b/held", 1000, "v").name()
    data = path.read_bytes()
    path.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    reader = cache.open(Entry("s3://b/held", 1000, "v"), lambda write: write(b"h" * 1000))
    assert reader.pread(0, 1000) == b"h" * 1000
    reader.close()
    counts = cache.stats.read()
    assert (counts["bytes"], counts["entries"]) == _scan(cache) == (stored_size(1000), 1) and counts["misses"] == 8


_HAMMER_FOREVER = """
import sys
from globalloader.storage.cache import Entry, ObjectCache
cache = ObjectCache(sys.argv[1])
entry = Entry("s3://bucket/shared.bin", 100, "v1")
print("ready", flush=True)
while True:
    cache.open(entry, lambda write: write(b"s" * 100)).close()
"""

_HOLD_THE_LOCK = """
import sys, time
from globalloader.storage.cache import ObjectCache
with ObjectCache(sys.argv[1]).stats.update() as record:
    record["hits"] += 10**6  # never written: the process dies inside the update
    print("locked", flush=True)
    time.sleep(120)
"""


def _run(code: str, root: pathlib.Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", code, str(root)], env=env, stdout=subprocess.PIPE)
    assert child.stdout is not None
    child.stdout.readline()
    return child


@pytest.mark.slow
def test_kill_9_mid_update_never_corrupts_the_record(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "objects"
    cache = ObjectCache(root)
    cache.open(SHARED, lambda write: write(b"s" * 100)).close()
    for _ in range(3):  # processes killed at arbitrary points of their updates
        children = [_run(_HAMMER_FOREVER, root) for _ in range(3)]
        time.sleep(0.5)
        for child in children:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
    counts = cache.stats.read(timeout=5)
    assert counts["misses"] == 1 and counts["hits"] > 100, counts  # the record survived, not started again
    assert (counts["bytes"], counts["entries"]) == _scan(cache)
    # Killed while holding the lock: the lock goes with the process, the record stays as it was.
    child = _run(_HOLD_THE_LOCK, root)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert cache.stats.read(timeout=5) == counts
    cache.open(SHARED, lambda write: write(b"s" * 100)).close()
    assert cache.stats.read()["hits"] == counts["hits"] + 1


_READ_THROUGH_THE_CACHE = """
import sys
from contextlib import closing
from globalloader.storage.cache import Entry, ObjectCache
cache = ObjectCache(sys.argv[1])
for i in range(3):
    entry = Entry(f"s3://bucket/other-{i}.bin", 50, "v1")
    with closing(cache.open(entry, lambda write: write(b"o" * 50))) as f:
        assert f.pread(0, 50) == b"o" * 50
print("read", flush=True)
sys.stdin.readline()  # exits when told
"""


def test_a_stopped_process_holding_the_counters_lock_never_fails_a_read(tmp_path: pathlib.Path) -> None:
    """Counters are best-effort: a busy lock defers a process's changes (written by its next
    update that gets the lock, or when it exits), it never blocks or fails a read."""
    root = tmp_path / "objects"
    cache = ObjectCache(root)
    cache.open(SHARED, lambda write: write(b"s" * 100)).close()
    before = cache.stats.read()
    holder = _run(_HOLD_THE_LOCK, root)
    holder.send_signal(signal.SIGSTOP)
    other = None
    try:
        for i in range(5):  # hits and misses, in this process and in another one
            with closing(cache.open(SHARED, lambda write: write(b"s" * 100))) as f:
                assert f.pread(0, 100) == b"s" * 100
            with closing(cache.open(Entry(f"s3://b/{i}", 10, "v"), lambda write, i=i: write(bytes([i]) * 10))) as f:
                assert f.pread(0, 10) == bytes([i]) * 10
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        other = subprocess.Popen(
            [sys.executable, "-c", _READ_THROUGH_THE_CACHE, str(root)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert other.stdout is not None and other.stdout.readline() == b"read\n"
    finally:
        holder.send_signal(signal.SIGKILL)  # the lock is free again
        holder.wait(10)
        if other is not None:
            other.communicate(b"exit\n", timeout=60)
    assert other.returncode == 0  # it wrote its deferred changes as it ended
    cache.open(SHARED, lambda write: write(b"s" * 100)).close()  # this process writes its own now
    after = cache.stats.read()
    assert after["hits"] == before["hits"] + 6 and after["misses"] == before["misses"] + 5 + 3
    assert after["downloaded_bytes"] == before["downloaded_bytes"] + 5 * 10 + 3 * 50
    assert (after["bytes"], after["entries"]) == _scan(cache)


def test_a_child_forked_during_an_update_does_not_keep_the_lock(tmp_path: pathlib.Path) -> None:
    """A loader forks its workers while its prefetch threads update the counters: the worker's
    copy of the record's descriptor must not keep the lock for the worker's whole life."""
    cache = ObjectCache(tmp_path / "objects")
    with cache.stats.update() as record:
        record["hits"] += 1
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
    try:
        assert cache.stats.read(timeout=2)["hits"] == 1
    finally:
        child.kill()
        child.join(10)


def test_a_damaged_record_starts_again_from_the_folder(tmp_path: pathlib.Path) -> None:
    cache = ObjectCache(tmp_path / "objects")
    for i in range(3):
        cache.open(Entry(f"s3://b/{i}", 50, "v"), lambda write: write(b"x" * 50)).close()
    record = cache.root / STATS_NAME
    good = record.read_bytes()
    for damage in (good[:-1], good[:10] + bytes([good[10] ^ 1]) + good[11:], b""):
        record.write_bytes(damage)  # a torn write, a flipped bit, an empty file
        counts = cache.stats.read()
        expected = {
            "downloaded_bytes": 0,
            "hits": 0,
            "misses": 0,
            "bytes": 3 * stored_size(50),
            "entries": 3,
            "reserved": 0,
        }
        assert counts == expected, damage
        record.write_bytes(good)
    assert cache.status()["misses"] == 3
    record.unlink()  # a cache folder of an older version, or removed by hand: counted from the folder
    assert cache.status()["entries"] == 3 and cache.status()["hits"] == 0


def _read_all(urls: list[str], opts: dict[str, Any], start: Any) -> None:
    start.wait(60)
    src = TarShards(urls, storage_options=opts)
    assert sorted(src[i]["__key__"] for i in range(len(src))) == [f"s{i:05d}" for i in range(len(src))]


@pytest.mark.integration
def test_two_jobs_on_s3_show_in_the_servers_status_and_metrics(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    server = Server(tmp_path / "s.sock")  # inherits this test's cache folder
    board = Dashboard(server.socket, tmp_path / "dashboard.log")
    try:
        assert "cache" not in status(server.socket)  # no cache folder yet
        urls = write_shards(s3["bucket"], s3["options"], n=24, per_shard=4)
        proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
        ctx = multiprocessing.get_context("spawn")
        start = ctx.Barrier(2)
        jobs = [ctx.Process(target=_read_all, args=(urls, s3["options"], start)) for _ in range(2)]
        for p in jobs:
            p.start()
        for p in jobs:
            p.join(120)
            assert p.exitcode == 0
        store = storage.Store(s3["options"])
        dataset = sum(store.stat(url).size for url in urls)  # sizes only: no read through the cache
        section = status(server.socket)["cache"]
        assert section["downloaded_bytes"] == dataset == proxy.total_bytes(prefix)  # once for both jobs
        assert section["misses"] == len(urls) and section["hits"] >= len(urls)  # the other job's opens
        on_disk = sum(stored_size(store.stat(url).size) for url in urls)
        assert (section["bytes"], section["entries"]) == (on_disk, len(urls))
        assert section == ObjectCache().status()
        code, body = _scrape(board)
        assert code == 200
        samples = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
        assert samples["globalloader_cache_downloaded_bytes_total"] == dataset
        assert samples["globalloader_cache_hits_total"] == section["hits"]
        assert samples["globalloader_cache_misses_total"] == len(urls)
        assert samples["globalloader_cache_bytes"] == section["bytes"]
        assert samples["globalloader_cache_entries"] == len(urls)
        assert samples["globalloader_cache_limit"] == section["limit"]
        table = server.status_table()
        assert f"({len(urls)} downloads), {section['hits']:,} hits" in table.stdout, table.stdout + table.stderr
    finally:
        board.stop()
        server.stop()


def _scrape(board: Dashboard) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", board.port, timeout=15)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {board.token}"})
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


def test_the_threads_of_a_process_never_lose_an_update(tmp_path: pathlib.Path) -> None:
    """A process keeps one descriptor of the record for all its threads, whose flock does not
    exclude them from each other: every update still starts from the one before."""
    cache = ObjectCache(tmp_path / "objects")
    cache.open(SHARED, lambda write: write(b"s" * 100)).close()

    def hits() -> None:
        for _ in range(100):
            cache.open(SHARED, lambda write: write(b"s" * 100)).close()

    threads = [threading.Thread(target=hits) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert cache.stats.read() | {"bytes": 0} == {
        "downloaded_bytes": 100,
        "hits": 8 * 100,
        "misses": 1,
        "bytes": 0,
        "entries": 1,
        "reserved": 0,
    }

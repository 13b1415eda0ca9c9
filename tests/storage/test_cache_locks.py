"""The machine cache's download locks: one file for every entry, each object downloaded once by
the processes and threads that want it at the same moment, entries read whole."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time
from typing import Any

import numpy as np

import globalloader as gl
from globalloader import storage
from globalloader.storage.cache import Entry, ObjectCache
from helpers import at_once


def _put(s3: dict[str, Any], count: int, size: int = 3000) -> dict[str, bytes]:
    fs, _ = storage.Store(s3["options"]).filesystem(f"s3://{s3['bucket']}")
    objects = {f"s3://{s3['bucket']}/small/{i:03d}.bin": os.urandom(size) for i in range(count)}
    for url, data in objects.items():
        fs.pipe_file(url.removeprefix("s3://"), data)
    return objects


def test_a_folder_of_objects_leaves_one_lock_file(s3: dict[str, Any]) -> None:
    objects = _put(s3, 20)
    src = gl.Files(f"s3://{s3['bucket']}/small", "*.bin", storage_options=s3["options"])
    src.prefetch(np.arange(len(src)))  # the pool of downloads ahead
    store = storage.Store(s3["options"])
    read = {url: store.read_object(url, store.stat(url)) for url in objects}  # and readers
    assert read == objects
    assert sorted(p.name for p in (ObjectCache().root / "locks").iterdir()) == ["downloads"]


def _read_objects(urls: list[str], opts: dict[str, Any], out: Any, start: Any) -> None:
    store = storage.Store(opts)
    stats = store.stats(urls)
    start.wait(60)  # both processes ask for the same objects at the same moment
    got: dict[str, bytes] = {}

    def read(url: str, stat: storage.FileStat) -> None:
        got[url] = store.read_object(url, stat)

    threads = [threading.Thread(target=read, args=(u, s)) for u, s in zip(urls, stats, strict=True)]
    threads += [threading.Thread(target=read, args=(urls[0], stats[0])) for _ in range(3)]  # one object, 4 threads
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out.put(got)


def test_processes_and_threads_wanting_one_object_download_it_once(s3: dict[str, Any]) -> None:
    objects = _put(s3, 12)
    proxy = s3["proxy"]
    proxy.latency = 0.2  # the downloads overlap
    results = at_once("fork", _read_objects, list(objects), s3["options"])
    assert results[0] == results[1] == objects  # every reader got the whole object
    assert proxy.count("GET", f"/{s3['bucket']}/small/") == len(objects)  # each downloaded once


def test_a_half_written_entry_is_never_served(s3: dict[str, Any]) -> None:
    objects = _put(s3, 6, size=40_000)  # three CRC blocks each
    store = storage.Store(s3["options"])
    for url in objects:
        store.fetch(url)
    for url in objects:  # each entry's file cut to a part, as a copy or a disk fault would leave it
        st = store.stat(url)
        path = store.cache.root / Entry(url, st.size, st.version).name()
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    fresh = storage.Store(s3["options"])
    assert {url: fresh.read_object(url, fresh.stat(url)) for url in objects} == objects
    assert s3["proxy"].count("GET", f"/{s3['bucket']}/small/") == 2 * len(objects)  # each fetched again


def _claim_in_child(cache: ObjectCache, entry: Entry, out: Any) -> None:
    with cache.claim(entry, time.time()) as fill:
        out.put(fill is not None)


def test_a_download_lock_excludes_the_handle_s_threads_and_forked_children(tmp_path: Any) -> None:
    """The lock file stays open per cache handle: while one claim holds an entry, another thread
    of the handle and a child forked with the handle do not get the entry, once released they do;
    after the lock file was removed, the handle locks the new one."""
    cache = ObjectCache(tmp_path / "cache")
    entry = Entry("s3://b/one.bin", 5, "v")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()

    def in_thread() -> bool:
        got: list[bool] = []
        thread = threading.Thread(target=lambda: got.append(_claim_fill(cache, entry)))
        thread.start()
        thread.join(30)
        return got[0]

    def in_child() -> bool:
        child = ctx.Process(target=_claim_in_child, args=(cache, entry, out))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        return bool(out.get(timeout=5))

    with cache.claim(entry, time.time()) as fill:
        assert fill is not None
        assert not in_thread()
        assert not in_child()
    assert in_thread() and in_child()
    with cache.claim(entry, time.time()) as fill:
        assert fill is not None
        shutil.rmtree(tmp_path / "cache" / "locks")  # the held lock goes with its file (as ever)
        assert not in_thread()  # the handle still knows its own
        assert _claim_fill(ObjectCache(tmp_path / "cache"), entry)  # another handle: the new file
    other = ObjectCache(tmp_path / "cache")
    with cache.claim(entry, time.time()) as fill:  # the handle locks the new file now
        assert fill is not None
        assert not _claim_fill(other, entry) and not in_child()


def _claim_fill(cache: ObjectCache, entry: Entry) -> bool:
    with cache.claim(entry, time.time()) as fill:
        return fill is not None


def test_a_download_ahead_the_reads_overtook_is_not_made(tmp_path: Any) -> None:
    """A reader fetched the entry after the pool was asked for it, and it was evicted since: the
    pool's claim yields nothing (fetched again it would be downloaded twice in the epoch); asked
    for after that read, it is fetched."""
    cache = ObjectCache(tmp_path / "cache")
    entry = Entry("s3://b/one.bin", 5, "v")
    asked = time.time()
    cache.open(entry, lambda write: write(b"abcde")).close()
    assert cache.evict(target=0) > 0
    with cache.claim(entry, asked) as fill:
        assert fill is None
    with cache.claim(entry, time.time()) as fill:
        assert fill is not None


def test_a_fetch_overtakes_only_its_own_entry_not_others_of_its_slot(tmp_path: Any) -> None:
    """Two entries whose fetch times share a slot of the lock file: a reader's fetch of one makes
    the pool skip that one only. The other, asked for before that fetch and never read, is still
    downloaded ahead (with the time alone in the slot, its reader had to fetch it itself)."""
    from globalloader.storage.cache import _fetched_slot

    cache = ObjectCache(tmp_path / "cache")
    by_slot: dict[int, Entry] = {}
    for i in range(100_000):
        entry = Entry(f"s3://b/{i}.bin", 5, "v")
        slot, tag = _fetched_slot(entry.name())
        other = by_slot.setdefault(slot, entry)
        if other is not entry and _fetched_slot(other.name())[1] != tag:
            break
    asked = time.time()
    cache.open(entry, lambda write: write(b"abcde")).close()
    assert cache.evict(target=0) > 0
    with cache.claim(entry, asked) as fill:
        assert fill is None  # read since it was asked for: not downloaded twice
    with cache.claim(other, asked) as fill:
        assert fill is not None  # not read: downloaded ahead


# Holds the counters' lock for 1.5 s: a fill that waited for it would get it and write.
_HOLD_COUNTERS = """
import sys, time
from globalloader.storage.cache import ObjectCache
with ObjectCache(sys.argv[1]).stats.locked():
    print("held", flush=True)
    time.sleep(1.5)
"""


def test_a_download_ahead_told_not_to_wait_writes_only_what_fits_at_once(tmp_path: Any) -> None:
    """`fill(data, wait=False)`, what the pool's event loop calls for a small object: while
    another process holds the counters' lock, or the entry does not fit under the limit, it writes
    nothing and says so (the loop hands the object to a thread that may wait), never past the
    limit; with room, the entry is written whole, counted, and read back by another handle."""
    import subprocess
    import sys

    folder = tmp_path / "cache"
    cache = ObjectCache(folder, limit=10_000)
    first, second = Entry("s3://b/first.bin", 6000, "v"), Entry("s3://b/second.bin", 6000, "v")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_COUNTERS, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with cache.claim(first, time.time()) as fill:
            assert fill is not None and fill(b"a" * 6000, False) is False
    finally:
        holder.communicate(timeout=30)
    assert cache.entries() == []
    with cache.claim(first, time.time()) as fill:
        assert fill is not None and fill(b"a" * 6000, False) is True
    with cache.claim(second, time.time()) as fill:  # 12000 bytes > the limit: it would have to evict
        assert fill is not None and fill(b"b" * 6000, False) is False
    assert [size for _, size, _ in cache.entries()] == [cache.on_disk()]
    assert cache.status()["reserved"] == 0 and cache.status()["entries"] == 1
    other = ObjectCache(folder, limit=10_000)
    handle = other.open(first, lambda write: write(b"not this"))
    try:
        assert handle.pread(0, 6000) == b"a" * 6000
    finally:
        handle.close()

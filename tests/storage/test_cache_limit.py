"""The object cache's limit and what its readers hold, against a real S3 server with real worker
processes: within its limit once a job has ended and bounded while it runs, every shard read on a
disk smaller than the dataset, and a damaged entry never served, even to a reader that checked
it before."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pathlib
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from typing import Any, Self

import numpy as np
import pytest

import globalloader as gl
from globalloader import storage
from globalloader.demo.s3 import write_shards
from globalloader.errors import RemoteAccessError, RemoteReadError, SourceError, StorageError
from globalloader.sources import TarShards
from globalloader.storage import cache as cache_module
from globalloader.storage.cache import CHECK_BLOCK, READERS, Entry, ObjectCache, _Checksums, stored_size
from globalloader.storage.cache_stats import try_until
from globalloader.storage.prefetch import IN_FLIGHT
from globalloader.storage.registry import live
from helpers import at_once, small_filesystem

_JOB = """
import globalloader as gl
from globalloader.demo.s3 import options
from globalloader.sources import TarShards
src = TarShards({urls!r}, storage_options=options({endpoint!r}), cache_limit={limit!r})
with gl.Loader(gl.Dataset(src).shuffle(seed=0, window=2).batch(4), workers=2) as loader:
    for epoch in range(2):
        print(len({{k for b in loader for k in b["__key__"]}}), flush=True)
"""


def _run_job(code: str, log: pathlib.Path) -> subprocess.Popen[bytes]:
    """The job in a process of its own, its errors to `log` (a pipe nobody reads could fill up)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(log, "wb") as errors:
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=errors)


def _used(root: pathlib.Path) -> int:
    """Bytes of the cache's entries and downloads in flight on disk (`ObjectCache.on_disk`)."""
    return ObjectCache(root).on_disk()


@pytest.mark.slow
def test_a_cache_smaller_than_a_shard_ends_within_its_limit_and_stays_bounded_meanwhile(
    s3: dict[str, Any], isolated_cache: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A 300 KB cache for 620 KB shards: two epochs of a window shuffle by two worker processes, in
    a job of its own. Once the job has ended the cache is within its limit; while it runs, above it
    by at most what is read at that moment: an entry per worker, and the prefetch's downloads."""
    # 10 shards of ~620 KB, with their index sidecars: the job reads no shard to index it.
    urls = write_shards(s3["bucket"], s3["options"], n=40, per_shard=4, size=155_000, index=True)
    limit = 300_000
    root = ObjectCache(isolated_cache / "objects").root
    job = _run_job(_JOB.format(urls=urls, endpoint=s3["proxy"].url, limit=limit), tmp_path / "job.log")
    peak, deadline = 0, time.monotonic() + 120
    while job.poll() is None:
        assert time.monotonic() < deadline, "the job did not end"
        peak = max(peak, _used(root))
        time.sleep(0.002)
    out, _ = job.communicate()
    assert job.returncode == 0, (tmp_path / "job.log").read_text()
    assert out.split() == [b"40", b"40"]
    largest = max(st.size for st in storage.Store(s3["options"]).stats(urls))
    assert peak <= limit + (2 + IN_FLIGHT) * largest
    assert _used(root) <= limit


def _download_forever(root: str, started: Any) -> None:
    def download(write: Any) -> None:
        write(b"x" * 1000)
        started.set()
        time.sleep(600)  # killed here, mid-download

    ObjectCache(root, limit=10_000).open(Entry("s3://b/killed", 4000, "v"), download)


def test_a_download_killed_midway_gives_its_reservation_back(tmp_path: pathlib.Path) -> None:
    """A process killed with SIGKILL mid-download leaves its temporary file, as large as the bytes
    it reserved from the start: the next download removes both, so the cache's room is whole
    again (a reservation lost with its process would shrink the cache for good)."""
    root = tmp_path / "objects"
    cache = ObjectCache(root, limit=10_000)
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    child = ctx.Process(target=_download_forever, args=(str(root), started))
    child.start()
    assert started.wait(60)
    assert cache.status()["reserved"] > 0
    assert cache.on_disk() == cache.status()["reserved"]  # its temporary, at its reserved size
    os.kill(child.pid, signal.SIGKILL)
    child.join(60)
    cache.open(Entry("s3://b/next", 9000, "v"), lambda write: write(b"n" * 9000)).close()
    assert cache.status()["reserved"] == 0
    assert cache.on_disk() == cache.status()["bytes"] <= 10_000


_READER = """
import os, sys
from globalloader.storage.cache import Entry, ObjectCache
cache = ObjectCache({root!r}, limit={limit!r})
cache.hold = {hold!r}  # as a windowed shuffle sets it (`Store.keep_open`)
entry = cache.open(Entry(f"s3://b/read-{{os.getpid()}}", 100, "v"), lambda write: write(b"r" * 100))
print("ready", flush=True)
sys.stdin.read()
"""


def test_the_read_ahead_leaves_every_reading_process_the_room_it_keeps_open(tmp_path: pathlib.Path) -> None:
    """Two worker processes read through the cache, each keeping up to 4 entries' bytes open (its
    hold); the read-ahead of a third process, which reads nothing, claims ahead only what the limit
    of 10 leaves beside both holds (2), not beside its own hold alone (9): else the workers, to
    open their next entries, release and evict ones their other worker has still to read. A
    worker that dies gives its room back to the read-ahead."""
    unit = stored_size(10_000)
    root = tmp_path / "objects"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    code = _READER.format(root=str(root), limit=10 * unit, hold=4 * unit)
    readers = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        for reader in readers:
            assert reader.stdout is not None and reader.stdout.readline() == b"ready\n"
        cache = ObjectCache(root, limit=10 * unit)
        cache.hold = unit
        claimed = 0
        while cache.room_ahead(10_000) and claimed < 10:
            with cache.claim(Entry(f"s3://b/ahead-{claimed}", 10_000, "v"), time.time()) as fill:
                assert fill is not None
                fill(b"a" * 10_000)
            claimed += 1
        assert claimed == 2
        readers[0].kill()
        readers[0].wait(60)
        assert try_until(lambda: cache.room_ahead(10_000), 10.0, 0.01)  # counted again: its 4 are free
    finally:
        for reader in readers:
            reader.kill()
            reader.wait(60)


def test_the_read_ahead_has_room_again_as_soon_as_its_oldest_entry_is_read(tmp_path: pathlib.Path) -> None:
    """The read-ahead fills the room its process's hold leaves (5 entries of 10); once a reader
    opens the oldest, the next ask finds room at once: it looks at its oldest entries when the
    count does not fit, not only in its full look at every one (once a second at most, and one
    was just made)."""
    unit = stored_size(10_000)
    cache = ObjectCache(tmp_path / "objects", limit=10 * unit)
    cache.hold = 5 * unit
    entries = [Entry(f"s3://b/ahead-{i}", 10_000, "v") for i in range(10)]
    claimed = 0
    while cache.room_ahead(10_000) and claimed < 10:
        with cache.claim(entries[claimed], time.time()) as fill:
            assert fill is not None
            fill(b"a" * 10_000)
        claimed += 1
    assert claimed == 5 and not cache.room_ahead(10_000)  # that ask looked at every one
    cache.open(entries[0], lambda write: write(b"a" * 10_000)).close()
    assert cache.room_ahead(10_000)


def test_a_dropped_cache_handle_gives_its_hold_back_while_its_process_goes_on(tmp_path: pathlib.Path) -> None:
    """Each source's handle adds its hold to its process's registration once it reads; a source
    the process drops (collected) stops counting, the others of the process still count."""
    root = tmp_path / "objects"
    kept, dropped = ObjectCache(root), ObjectCache(root)
    kept.hold, dropped.hold = 3000, 5000
    kept.open(Entry("s3://b/0", 100, "v"), lambda write: write(b"x" * 100)).close()
    dropped.open(Entry("s3://b/1", 100, "v"), lambda write: write(b"x" * 100)).close()
    assert sum(live(root / READERS)) == 8000
    dropped.hold = 6000  # changed after it registered: the registration follows
    assert sum(live(root / READERS)) == 9000
    del dropped
    gc.collect()
    assert sum(live(root / READERS)) == 3000
    # A forked child dropping its copy of the handle takes nothing from the parent's registration.
    handles = [kept]
    del kept  # the child's copy of this frame must not keep the handle
    child = multiprocessing.get_context("fork").Process(target=_drop_and_collect, args=(handles, tmp_path))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and sum(live(root / READERS)) == 3000


def _drop_and_collect(handles: list[ObjectCache], scratch: pathlib.Path) -> None:
    """In a forked child: files opened first take the descriptors the fork closed (the parent's
    registration's among them); dropping the handle must write none of them."""
    files = [os.open(scratch / str(i), os.O_RDWR | os.O_CREAT, 0o600) for i in range(8)]
    handles.clear()
    gc.collect()
    if any(os.fstat(fd).st_size for fd in files):
        raise SystemExit(1)


@pytest.fixture
def small_disk(isolated_cache: pathlib.Path) -> Iterator[pathlib.Path]:
    """The cache's objects folder on a filesystem of its own of 2 MiB (a tmpfs)."""
    with small_filesystem(isolated_cache / "objects", "2m") as folder:
        yield folder


@pytest.mark.slow
def test_a_cache_on_a_disk_smaller_than_the_dataset_reads_every_shard(
    s3: dict[str, Any], small_disk: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """16 shards of ~200 KB (3.2 MB) through a cache on a 2 MiB disk with the default limit: a full
    disk evicts what no reader holds, so every shard is read, twice, and no CacheFullError."""
    urls = write_shards(s3["bucket"], s3["options"], n=64, per_shard=4, size=50_000)
    job = _run_job(_JOB.format(urls=urls, endpoint=s3["proxy"].url, limit=None), tmp_path / "job.log")
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, (tmp_path / "job.log").read_text()
    assert out.split() == [b"64", b"64"]
    assert _used(small_disk) <= 2 << 20


def _flip(path: pathlib.Path, offset: int, keep_times: bool) -> None:
    """Invert bytes of the file in place (same size), optionally putting its times back."""
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(64)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    if keep_times:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("keep_times", [False, True], ids=["written", "written-times-kept"])
def test_bytes_flipped_between_two_epochs_of_one_reader_are_never_served(s3: dict[str, Any], keep_times: bool) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=8, per_shard=8, size=3000)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    src = TarShards(urls, storage_options=s3["options"])
    first = [src[i] for i in range(len(src))]  # epoch 1: the entry is checked and kept open
    assert proxy.count("GET", prefix, ".tar") == 1
    st = src._stats[0]
    path = src.store.cache.root / Entry(urls[0], st.size, st.version).name()
    _flip(path, 5200, keep_times)  # inside the data of the second sample
    assert [src[i] for i in range(len(src))] == first  # epoch 2, same process and reader
    assert proxy.count("GET", prefix, ".tar") == 2  # the damaged entry was fetched again


def test_a_damaged_entry_that_cannot_be_fetched_again_is_an_error_not_its_bytes(s3: dict[str, Any]) -> None:
    """Damaged, and the object rewritten since the source was made: nothing right can be read."""
    urls = write_shards(s3["bucket"], s3["options"], n=8, per_shard=8, size=3000)
    src = TarShards(urls, storage_options=s3["options"])
    assert [src[i]["__key__"] for i in range(len(src))] == [f"s{i:05d}" for i in range(8)]
    st = src._stats[0]
    _flip(src.store.cache.root / Entry(urls[0], st.size, st.version).name(), 5200, keep_times=False)
    fs, key = src.store.filesystem(urls[0])
    data = fs.cat_file(key)
    fs.pipe_file(key, data[:-1] + b"\x01")  # a new version: its ETag (MD5) is another
    with pytest.raises(SourceError, match=r"shard-000\.tar changed since the source was made"):
        [src[i] for i in range(len(src))]


def test_a_reader_holds_what_it_reads_now_and_its_last_release_evicts(s3: dict[str, Any]) -> None:
    """One process reading 8 shards through a cache that holds 5: its reader keeps open at most its
    share of the cache beyond the entry it reads, so eviction deletes what it read before; closing
    it, the last release of an over-limit cache, evicts at once."""
    urls = write_shards(s3["bucket"], s3["options"], n=32, per_shard=4, size=5000)  # 8 shards of ~20 KB
    limit = 100_000
    src = TarShards(urls, storage_options=s3["options"], cache_limit=limit)
    largest = max(st.size for st in src._stats)
    with gl.Loader(gl.Dataset(src).shuffle(seed=1, window=2), workers=0) as loader:
        assert sorted(r["__key__"] for r in loader) == [f"s{i:05d}" for i in range(32)]
    root = src.store.cache.root
    assert _used(root) <= limit + largest
    src.close()
    assert _used(root) <= limit


def _read_and_release(root: str) -> None:
    reader = ObjectCache(root, limit=100).open(Entry("s3://b/a", 1000, "v"), lambda write: write(b"b" * 1000))
    assert reader.pread(0, 3) == b"aaa"
    reader.close()


def test_a_forked_child_releases_its_own_entries_never_its_parents(tmp_path: pathlib.Path) -> None:
    """A child forked while its parent holds an entry inherits the descriptor, and with it the
    parent's lock: the child drops its copy without touching the lock, so eviction still leaves
    the parent's entry, whatever the child opens, releases or leaves behind at its end."""
    root = tmp_path / "objects"
    cache = ObjectCache(root, limit=100)  # smaller than the entry: every release evicts what it can
    held = cache.open(Entry("s3://b/a", 1000, "v"), lambda write: write(b"a" * 1000))
    child = multiprocessing.get_context("fork").Process(target=_read_and_release, args=(str(root),))
    child.start()
    child.join(30)
    if child.exitcode is None:  # it waits on a lock it broke: never left running
        child.kill()
        child.join(10)
    assert child.exitcode == 0
    assert cache.evict(target=0) == 0 and held.pread(0, 1000) == b"a" * 1000
    held.close()
    assert cache.entries() == []  # the last release of an over-limit cache evicted it


def test_a_cache_that_cannot_be_written_is_named_never_taken_for_the_store(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    """A fault of the local cache (here a read-only disk under it) is a StorageError naming the
    cache folder, at once: never "access denied" by the store, nor retried as a download."""
    url = f"s3://{s3['bucket']}/object.bin"
    store = storage.Store(s3["options"])
    fs, path = store.filesystem(url)
    fs.pipe_file(path, b"x" * 1000)
    with small_filesystem(isolated_cache / "objects", "1m") as folder:
        ObjectCache()  # its folders made, then the disk turns read-only
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        with pytest.raises(StorageError, match=f"object cache {folder}") as raised, storage.open_read(store, url) as f:
            f.read()
    assert not isinstance(raised.value, RemoteAccessError | RemoteReadError), raised.value


class _Peak:
    """The most bytes the cache folder held on disk, sampled on a thread while the block runs."""

    def __init__(self, root: pathlib.Path) -> None:
        self.cache, self.most, self.samples, self._done = ObjectCache(root), 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.most = max(self.most, self.cache.on_disk())
            self.samples += 1

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)


def _read_windows(urls: list[str], options: dict[str, Any], limit: int, out: Any, start: Any) -> None:
    """One job's two epochs of a window shuffle (its own seed) through the machine cache, started
    with the other's: the keys each epoch read."""
    src = TarShards(urls, storage_options=options, cache_limit=limit)
    chain = gl.Dataset(src).shuffle(seed=os.getpid(), window=1).batch(4)
    start.wait(60)
    with gl.Loader(chain, workers=0) as loader:
        out.put([sorted(k for b in loader for k in b["__key__"]) for _ in range(2)])


@pytest.mark.slow
def test_two_jobs_reading_ahead_at_once_never_take_the_cache_over_its_limit(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    """Two jobs at once, each reading 16 shards twice in windows of one and downloading ahead of its
    reads, through a cache that holds 6: what both hold open, claim ahead and write at once fits
    the limit at every sample of the folder on disk (downloads under way included), not only once
    they end: every download reserves its bytes beside everything else on the machine before it
    writes, and the read-ahead waits for the room the reads leave."""
    proxy = s3["proxy"]
    urls = write_shards(s3["bucket"], s3["options"], n=64, per_shard=4, size=12_000, index=True)
    largest = max(st.size for st in storage.Store(s3["options"]).stats(urls))
    limit = 6 * largest
    root = ObjectCache(isolated_cache / "objects").root
    proxy.latency = 0.005  # downloads take a while: many are under way at once
    with _Peak(root) as peak:
        results = at_once("spawn", _read_windows, urls, s3["options"], limit)
    assert results == [[[f"s{i:05d}" for i in range(64)]] * 2] * 2
    assert peak.samples > 0
    assert peak.most <= limit
    assert _used(root) <= limit


@pytest.mark.parametrize("block_size", [None, 4096], ids=["shards-through-the-pool", "shards-through-the-threads"])
def test_a_dataset_four_times_the_cache_downloads_each_shard_once_an_epoch(
    s3: dict[str, Any], isolated_cache: pathlib.Path, block_size: int | None
) -> None:
    """40 shards through a cache that holds 10, a window shuffle of 2 by two worker processes that
    the loader fetches ahead of, two epochs: every shard is downloaded once an epoch (nothing
    evicted before it is read), whether the pool of one GET per object or the threads (objects
    larger than a request's `block_size`, as real shards are) fetched it ahead; the cache stays
    within its limit at every sample, the entries the readers hold included."""
    proxy = s3["proxy"]
    urls = write_shards(s3["bucket"], s3["options"], n=160, per_shard=4, size=12_000, index=True)
    largest = max(st.size for st in storage.Store(s3["options"]).stats(urls))
    limit = 10 * largest  # two windows read by each worker, two shards ahead
    src = TarShards(urls, storage_options=s3["options"], cache_limit=limit)
    if block_size is not None:
        src.store.block_size = block_size
    root = ObjectCache(isolated_cache / "objects").root
    proxy.latency = 0.005  # downloads take a while: the reads overtake the read-ahead at times
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the window fits: no warning
        chain = gl.Dataset(src).shuffle(seed=0, window=2).batch(4)
    keys = ["/" + url.split("://", 1)[1] for url in urls]  # as the proxy counts them
    sizes = {url: st.size for url, st in zip(urls, src._stats, strict=True)}
    with _Peak(root) as peak, gl.Loader(chain, workers=2) as loader:
        for epoch in range(2):
            before = {key: proxy.bytes_sent[key] for key in keys}
            assert sorted(k for b in loader for k in b["__key__"]) == [f"s{i:05d}" for i in range(160)]
            got = {url: proxy.bytes_sent[key] - before[key] for url, key in zip(urls, keys, strict=True)}
            if epoch == 0:
                assert got == sizes  # each once
            else:  # each once at most: some are still in the cache from the first epoch
                assert {url: got[url] in (0, size) for url, size in sizes.items()} == dict.fromkeys(urls, True), got
    assert peak.most <= limit
    assert _used(root) <= limit


def test_two_windows_larger_than_the_cache_are_a_warning_naming_the_window_that_fits(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    """Two windows whose shards do not fit the cache would have them evicted before they are read:
    a warning at the shuffle() call names the largest window that fits and the limit this one
    needs; the order is kept (not clamped: it must not depend on the disk)."""
    urls = write_shards(s3["bucket"], s3["options"], n=32, per_shard=4, size=12_000, index=True)
    largest = max(st.size for st in storage.Store(s3["options"]).stats(urls))
    src = TarShards(urls, storage_options=s3["options"], cache_limit=6 * largest)
    with pytest.warns(UserWarning, match=rf"shuffle\(window=4\).* use window=3 or cache_limit={16 * largest} ") as seen:
        ordered = gl.Dataset(src).shuffle(seed=0, window=4)
    assert seen[0].filename == __file__
    same = gl.Dataset(TarShards(urls, storage_options=s3["options"])).shuffle(seed=0, window=4)
    assert [r["__key__"] for r in ordered] == [r["__key__"] for r in same]


@pytest.mark.parametrize("block_size", [None, 4096], ids=["shards-through-the-pool", "shards-through-the-threads"])
def test_the_read_ahead_fetches_every_shard_of_every_epoch_as_the_reads_make_room(
    s3: dict[str, Any], isolated_cache: pathlib.Path, block_size: int | None
) -> None:
    """The whole epoch announced at once to a cache that holds 6 of its 16 shards: the read-ahead
    fetches as many as fit beside what the reads hold, and each next one as the reads open the
    ones it fetched, never dropping the rest of the epoch; the second epoch is fetched ahead
    again (its shards were evicted meanwhile). Each shard is downloaded once per epoch."""
    proxy = s3["proxy"]
    urls = write_shards(s3["bucket"], s3["options"], n=64, per_shard=4, size=12_000, index=True)
    largest = max(st.size for st in storage.Store(s3["options"]).stats(urls))
    src = TarShards(urls, storage_options=s3["options"], cache_limit=6 * largest)
    if block_size is not None:
        src.store.block_size = block_size
    src.keep_cached(2 * largest)  # as a window of one shard would: this one and the last
    keys = ["/" + url.split("://", 1)[1] for url in urls]  # as the proxy counts them
    for epoch in range(2):
        before = sum(proxy.bytes_sent[key] for key in keys)
        src.prefetch(np.arange(len(src)))
        for shard, (url, stat) in enumerate(zip(urls, src._stats, strict=True)):
            entry = Entry(url, stat.size, stat.version)  # whole: smaller than the cache's whole_max
            deadline = time.monotonic() + 10
            while not (src.store.cache.root / entry.name()).exists():  # fetched ahead, not by this read
                assert time.monotonic() < deadline, f"epoch {epoch}: shard {shard} was never fetched ahead"
                time.sleep(0.005)
            assert [src[i]["__key__"] for i in range(4 * shard, 4 * shard + 4)] == [
                f"s{i:05d}" for i in range(4 * shard, 4 * shard + 4)
            ]
        assert sum(proxy.bytes_sent[key] for key in keys) - before <= sum(st.size for st in src._stats)
    src.close()


def test_the_read_ahead_spends_half_the_room_a_record_read_left_then_reads_it_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download ahead does not read the machine's record for each small object: a read that
    left room R lends this handle R/2 for a short while. Another process taking every byte
    meanwhile costs at most that half: once it is spent, the record is read again and says no;
    room given back is seen at the next read."""
    monkeypatch.setattr(cache_module, "_ROOM_REREAD", 60.0)  # the lend outlives the test: its bytes end it
    unit = stored_size(10_000)
    root = tmp_path / "objects"
    ahead, other = ObjectCache(root, limit=100 * unit), ObjectCache(root, limit=100 * unit)
    assert ahead.room_ahead(10_000)  # read: 100 units free, this one taken, half the other 99 lent
    with other.stats.update() as record:
        record["reserved"] += 100 * unit  # another process takes the whole limit
    granted = 0
    while ahead.room_ahead(10_000) and granted < 100:
        granted += 1
    assert granted == 49
    with ahead.claim(Entry("s3://b/lent", 10_000, "v"), time.time()) as fill:
        assert fill is not None and not fill(b"a" * 10_000, False)  # the write checks under the lock
    assert not (root / Entry("s3://b/lent", 10_000, "v").name()).exists()
    assert not ahead.room_ahead(10_000)  # read again: still full
    with other.stats.update() as record:
        record["reserved"] -= 100 * unit
    assert ahead.room_ahead(10_000)


@pytest.mark.parametrize("size", [0, 1, CHECK_BLOCK - 1, CHECK_BLOCK, CHECK_BLOCK + 1, 3 * CHECK_BLOCK + 7])
def test_an_entrys_checksums_do_not_depend_on_how_its_bytes_arrive(size: int) -> None:
    """The CRC of the data and of each CHECK_BLOCK, whole or in chunks of any size (the first
    block's CRC is the data's while the data fits in it: computed once then)."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    blocks = [data[i : i + CHECK_BLOCK] for i in range(0, size, CHECK_BLOCK)]
    table = b"".join(struct.pack("<I", zlib.crc32(block)) for block in blocks)
    for chunk in (1, 1000, CHECK_BLOCK - 1, CHECK_BLOCK, size or 1):
        sums = _Checksums()
        for start in range(0, size, chunk):
            sums.add(data[start : start + chunk])
        assert (sums.crc, sums.length) == (zlib.crc32(data), size)
        assert sums.tail()[: len(table)] == table and len(sums.tail()) == len(table) + 16

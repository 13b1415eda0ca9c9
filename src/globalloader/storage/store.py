"""Store: how a source reaches its URLs (fsspec options, retries, the machine-wide cache).

Local paths (no `scheme://`) use the os module. Remote objects are fetched through fsspec with
every call retried by `storage.retry` and every whole download checked end to end
(`storage.checksum`); objects of object stores (any scheme but `file://`,
`memory://`) are read through the machine cache (`storage.cache`): whole when they are shards or
files up to `whole_max` bytes, in fixed `block_size` blocks otherwise, so reading a Parquet
footer and one column does not download the whole file. Uploads are written to a local
temporary file and put in one retried call when closed.

A Store holds only its settings, so it pickles to worker processes; clients, the cache and
`info()` answers (kept `INFO_TTL` seconds) are made per process.
"""

from __future__ import annotations

import contextlib
import functools
import glob as _glob
import io
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from globalloader.errors import ArgumentError, SourceError, StorageError
from globalloader.storage import fetch_ahead, retry
from globalloader.storage._fork import ProcessLocal, reset_in_forked_children
from globalloader.storage._fs import (
    CONDITIONAL,
    LOCAL_SCHEMES,
    S3_SCHEMES,
    Answer,
    bounded,
    can_read_if_version,
    etag_is_md5,
    file_info,
    filesystem,
    get_s3_whole_unchecked,
    list_s3_quickly,
    local_errors,
    read_if_version,
    s3_bucket_and_key,
    scheme_of,
    version_field,
)
from globalloader.storage.cache import CachedFile, Entry, ObjectCache, parse_size
from globalloader.storage.checksum import Digest, TransferCorrupted, etag_md5
from globalloader.storage.local import read_whole
from globalloader.storage.prefetch import Prefetcher

INFO_TTL = 10.0  # seconds an object's size and version are reused without asking again
BLOCK_SIZE = 8 << 20  # bytes per cached block, and per request of a whole download
# An object downloaded ahead up to this size is checked and written on the event loop itself when
# that needs no wait (`_fetch_small`): a hop to a thread and back costs a small object more CPU
# than its write; a larger one's hashing and write would hold the loop up (a millisecond a MiB).
_ON_THE_LOOP = 256 << 10
# fsspec `info()` fields that change when an object's content changes, most specific first.
_VERSION_FIELDS = ("ETag", "etag", "md5", "generation", "mtime", "LastModified", "last_modified", "updated", "created")


class FileStat(NamedTuple):
    """Size and a version string (mtime or ETag) that changes when the content changes."""

    size: int
    version: str


class Store(ProcessLocal):
    """URLs -> bytes for one source: `storage_options` go to fsspec (endpoint, key, secret,
    anon, ...); `cache_limit` (bytes or "20GB"; default $GLOBALLOADER_CACHE_LIMIT, else 20 GB)
    bounds the machine cache; `cache=False` reads remote objects without it. `block_size`: the
    bytes per cached block of a large object, and per request of a download. `fetch_concurrency`
    and `fetch_memory` bound the downloads of small objects ahead of the reads (requests in flight
    per machine, bytes of answers in memory; see `storage.fetch_ahead`)."""

    _PROCESS_ONLY = (
        "_cache",
        "_infos",
        "_lock",
        "_prefetcher",
        "_fetch_ahead",
        "_wanted",
        "_filesystems",
    )

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
        *,
        cache: bool = True,
        retry_policy: retry.RetryPolicy = retry.DEFAULT,
        block_size: int = BLOCK_SIZE,
        fetch_concurrency: int | str | None = None,
        fetch_memory: int | str | None = None,
    ) -> None:
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ArgumentError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
        if cache_limit is not None:
            parse_size(cache_limit, "cache_limit")
        self.storage_options = dict(storage_options or {})
        self.cache_limit = cache_limit
        self.use_cache = bool(cache)
        self.retry_policy = retry_policy
        self.block_size = parse_size(block_size, "block_size")
        self.fetch_concurrency = fetch_ahead.resolve(
            fetch_concurrency, fetch_ahead.CONCURRENCY_ENV, fetch_ahead.DEFAULT_CONCURRENCY, "fetch_concurrency"
        )
        self.fetch_memory = fetch_ahead.resolve(
            fetch_memory, fetch_ahead.MEMORY_ENV, fetch_ahead.DEFAULT_MEMORY, "fetch_memory"
        )
        # CRC-32 of whole objects known from where they were written (a tar shard's sidecar), by
        # URL and version, with where and what to do: a setting, so worker processes check their
        # downloads against them too.
        self.crc32s: dict[tuple[str, FileStat], tuple[int, str, str]] = {}
        self.read_hold: int | None = None  # see `keep_open`
        self._reset()

    def _after_fork(self) -> None:
        # The prefetch threads and a lock held at the fork stay in the parent; the sizes and
        # versions already asked for stay valid (a forked worker asks no HEAD again).
        self._reset(keep_infos=True)

    def _reset(self, keep_infos: bool = False) -> None:
        self._prefetcher: Prefetcher | None = None
        self._fetch_ahead: fetch_ahead.FetchAhead | None = None
        self._wanted: dict[str, tuple[FileStat, float]] = {}  # prefetched: (version, when asked)
        self._cache: ObjectCache | None = None
        # Per scheme: the shared instance, found once (not its options' key made again per object)
        self._filesystems: dict[str, Any] = {}
        self._infos: dict[str, tuple[float, FileStat]] = dict(self._infos) if keep_infos else {}
        # S3 buckets whose small objects the pool reads with If-Match alone: there the bytes of an
        # object's own version differed from its ETag (see `_answer`)
        self._etags_not_md5: set[str] = set()
        self._lock = threading.Lock()
        reset_in_forked_children(self)

    @property
    def cache(self) -> ObjectCache:
        """This process's handle on the machine cache (made on first use)."""
        if self._cache is None:
            self._cache = ObjectCache(limit=self.cache_limit)
        if self.read_hold is not None:
            self._cache.hold = min(self._cache.room, self.read_hold)
        return self._cache

    def keep_open(self, size: int) -> int:
        """Let the readers of each process keep `size` bytes of cache entries open (a windowed
        shuffle's two windows: the current one and the one a slower worker still reads), the
        read-ahead taking what that leaves of the cache; returns what the cache can hold."""
        self.read_hold = max(self.read_hold or 0, int(size))
        return self.cache.room

    @property
    def whole_max(self) -> int:
        """Objects up to this size are cached whole; larger ones in blocks."""
        return min(1 << 30, self.cache.limit // 4)

    def cached(self, url: str) -> bool:
        """Whether reads of `url` go through the machine cache."""
        scheme = scheme_of(url)
        return self.use_cache and bool(scheme) and scheme not in LOCAL_SCHEMES

    def filesystem(self, url: str) -> tuple[Any, str]:
        """(fsspec filesystem, path) for `url` with this store's options (for writes and
        listings outside the sources; reads go through the methods below)."""
        scheme = scheme_of(url)
        fs = self._filesystems.get(scheme)
        if fs is None:
            fs, path = filesystem(url, self.storage_options)
            self._filesystems[scheme] = fs
            return fs, path
        return fs, fs._strip_protocol(url)

    def stat(self, url: str) -> FileStat:
        """Size and version of one file; a SourceError naming it when it is missing."""
        if not scheme_of(url):
            return _local_stat(url)
        known = self._known(url)
        if known is not None:
            return known
        now = time.monotonic()
        fs, path = self.filesystem(url)
        # Asked of the store itself, not of the client's listing cache (one client per process holds
        # the listing that expanded a pattern): a changed object must show as changed.
        fs.invalidate_cache(path)
        info = retry.call(lambda seconds: file_info(fs, url, path, seconds), url, "stat", self.retry_policy)
        if info.get("type", "file") != "file":
            raise SourceError(f"not a regular file: {url}")
        stat = _file_stat(url, info)
        with self._lock:
            self._infos[url] = (now, stat)
        return stat

    def _known(self, url: str) -> FileStat | None:
        """What a listing or an earlier `stat` said of `url`, if not older than INFO_TTL."""
        known = self._infos.get(url)
        return known[1] if known is not None and time.monotonic() - known[0] < INFO_TTL else None

    def stats(self, urls: list[str], threads: int = 8) -> list[FileStat]:
        """`stat` of each URL, in order: the ones a listing answered (and local files) at once, the
        others asked `threads` at a time (each is a request)."""
        ask = [url for url in urls if scheme_of(url) and self._known(url) is None]
        if len(ask) > 1 and threads > 1:
            with ThreadPoolExecutor(min(threads, len(ask))) as pool:
                list(pool.map(self.stat, ask))  # remembered: the calls below find them
        return [self.stat(url) for url in urls]

    def glob(self, pattern: str) -> list[str]:
        """Sorted URLs matching a glob pattern."""
        if not scheme_of(pattern):
            return sorted(_glob.glob(pattern))
        fs, path = self.filesystem(pattern)
        found = retry.call(
            lambda seconds: fs.glob(path, detail=True, **bounded(fs, seconds)), pattern, "list", self.retry_policy, None
        )
        self._remember(_files(pattern, fs, found))
        return sorted(_as_asked(pattern, fs, name) for name in found)

    def find(self, root: str, remember: bool = True) -> dict[str, FileStat]:
        """Every file below a remote folder with its size and version, from one listing (which
        also fills the per-process memo of `stat`, unless `remember` is false: a listing of a
        million files kept elsewhere, see `storage.listing`). An S3 folder is listed through
        obstore where it names every key as it is (`_s3_listed`), else through fsspec."""
        found = self._s3_listed(root)
        if found is None:
            fs, path = self.filesystem(root)
            listing = retry.call(
                lambda seconds: fs.find(path, detail=True, **bounded(fs, seconds)),
                root,
                "list",
                self.retry_policy,
                None,
            )
            if not remember:
                fs.invalidate_cache()  # the client's own copy of the listing is not kept either
            found = _files(root, fs, listing)
        return self._remember(found) if remember else found

    def _s3_listed(self, root: str) -> dict[str, FileStat] | None:
        """The files below an S3 folder listed through obstore (`_fs.list_s3_quickly`: no s3fs
        client made for it, nor its import waited for), or None."""
        where = s3_bucket_and_key(root) if scheme_of(root) in S3_SCHEMES else None
        if where is None:
            return None
        bucket, key = where
        listed = list_s3_quickly(self.storage_options, bucket, key.rstrip("/") + "/")
        if listed is None:
            return None
        scheme = scheme_of(root)
        return {f"{scheme}://{bucket}/{name}": FileStat(size, etag) for name, size, etag in listed}

    def _remember(self, files: dict[str, FileStat]) -> dict[str, FileStat]:
        """The files of a listing, also kept in the per-process memo of `stat` (a listing answers
        what a HEAD per file would)."""
        now = time.monotonic()
        with self._lock:
            self._infos.update((url, (now, stat)) for url, stat in files.items())
        return files

    def read_range(self, url: str, start: int, end: int, stat: FileStat | None = None) -> bytes:
        """Bytes [start, end) of a remote object, straight from the store (retried).

        Given the `stat` its listing or `stat()` reported, an object of S3, GCS or Azure is asked
        for only in that version (If-Match on the ETag, `ifGenerationMatch` on the generation; see
        `_fs.read_if_version`): a version written since is a SourceError, never bytes
        mixed with the index or other blocks of the version the source was made from. A read of
        the whole object is checked against its checksums (see `storage.checksum`) and read again
        when they do not match; a read of part of it cannot be.
        """
        return self._get(url, start, end, stat).data

    def _get(self, url: str, start: int, end: int, stat: FileStat | None) -> Answer:
        """`read_range`, with the MD5 the answer vouches for when the store said one."""
        fs, path = self.filesystem(url)
        what, version = f"read [{start}, {end}) of", stat.version if stat is not None else ""
        # The whole object in one answer: checked end to end.
        digest = self._digest(url, stat) if stat is not None and start == 0 and end >= stat.size else None
        whole = digest is not None

        def get(seconds: float) -> Answer:
            if not can_read_if_version(url, version):
                answer: Answer | None = Answer(fs.cat_file(path, start=start, end=end, **bounded(fs, seconds)), None)
            else:
                answer = read_if_version(fs, url, path, start, end, version, whole=whole, timeout=seconds)
            if answer is None:
                raise _changed(url, f"its {version_field(url)} is no longer {version}")
            if digest is not None:
                digest.restart(answer.md5)
                digest.update(answer.data)
                digest.check()  # a mismatch is transient: this try is made again
            return answer

        return retry.call(get, url, what, self.retry_policy, end - start)

    def read_optional(self, url: str, limit: int) -> bytes | None:
        """A small remote object whole, straight from the store (retried), or None when it does
        not exist; one larger than `limit` bytes is a SourceError."""
        fs, path = self.filesystem(url)

        def get(seconds: float) -> bytes | None:
            try:
                return bytes(fs.cat_file(path, start=0, end=limit + 1, **bounded(fs, seconds)))
            except FileNotFoundError:
                return None

        data = retry.call(get, url, "read", self.retry_policy, limit)
        if data is not None and len(data) > limit:
            raise SourceError(f"{url} is larger than {limit} bytes")
        return data

    def expect_crc32(self, url: str, stat: FileStat, crc32: int, recorded_in: str, fix: str) -> None:
        """Check whole downloads of `url`, while it has `stat`, against this CRC-32, recorded
        where the object was written (`recorded_in`, such as "its index sidecar <url>"); `fix`
        says what to do when the object no longer matches it."""
        self.crc32s[url, stat] = (crc32, recorded_in, fix)

    def _digest(self, url: str, stat: FileStat) -> Digest:
        """The checks of whole downloads of `url` at `stat` (see `storage.checksum`); on S3, an
        ETag the bytes do not match is asked about once (`_fs.etag_is_md5`: an encrypted object's
        is no MD5)."""
        digest = Digest(url, *self.crc32s.get((url, stat), ()))
        if scheme_of(url) in S3_SCHEMES:
            digest.etag_is_md5 = functools.partial(self._etag_is_md5, url, stat.version)
        return digest

    def _etag_is_md5(self, url: str, etag: str) -> bool:
        return etag_is_md5(*self.filesystem(url), etag)

    def open_cached(self, url: str, stat: FileStat, block: int = -1, *, ahead: bool = False) -> CachedFile:
        """The whole object (block -1) or one block of it, from the machine cache (downloaded
        there first if missing; `ahead`: by a download ahead of the reads, see `storage.cache`).
        A store whose object no longer has `stat` is a SourceError.

        A whole object is checked end to end before it enters the cache: a download in one
        request by `read_range`, one in several once assembled, against the MD5 its ETag vouches
        for and the CRC-32 `expect_crc32` was given; a mismatch downloads it
        again (a transient fault of `retry`). A block of a large object is not checked (no
        checksum of a range exists): TCP's and TLS's checks are all it has.
        """
        size = self.block_size
        entry = self._entry(url, stat, block)
        # A whole object in several answers is checked once assembled; in one, by `_get`.
        several = block < 0 and stat.size > size
        digest = self._digest(url, stat) if several else None

        def download(write: Any) -> None:
            # Conditional reads need no HEAD first: the store refuses them for another version.
            fresh = stat if _pinned(url, stat) else self.stat(url)
            if fresh != stat:
                raise _changed(url, f"size {stat.size} -> {fresh.size}, version {stat.version!r} -> {fresh.version!r}")
            first, end = (0, stat.size) if block < 0 else (block * size, min(stat.size, (block + 1) * size))
            for start in range(first, end, size):
                stop = min(end, start + size)
                answer = self._get(url, start, stop, stat)
                if len(answer.data) != stop - start:
                    raise SourceError(
                        f"{url} returned {len(answer.data)} bytes for [{start}, {stop}): it changed while read"
                    )
                if digest is not None:
                    if start == first:
                        digest.restart(answer.md5)
                    digest.update(answer.data)
                write(answer.data)
            if digest is not None:
                digest.check()  # before the cache renames the entry into place

        # A corrupted transfer is retried here (the others were retried by `_get`, or are final).
        return retry.call(lambda _: self._open_entry(entry, download, url, ahead), url, "download", self.retry_policy)

    def open_derived(self, url: str, stat: FileStat, what: str, size: int, make: Any) -> CachedFile:
        """A file of `size` bytes made from the object `url` (`what`: e.g. "decompressed"), kept in
        the machine cache beside it and made once per machine: `make(write)` writes its bytes.
        Keyed by the object's location, size and version, so a rewritten object makes another."""
        return self._open_entry(Entry(f"{url}#{what}", size, f"{stat.size}:{stat.version}"), make, f"{url} ({what})")

    def _open_entry(self, entry: Entry, make: Any, what: str, ahead: bool = False) -> CachedFile:
        """`cache.open`, where an OSError other than a corrupted transfer is the local cache's,
        never the store's (not "access denied"): a StorageError naming the cache folder."""
        try:
            return self.cache.open(entry, make, ahead)
        except TransferCorrupted:
            raise
        except OSError as exc:
            raise StorageError(f"cannot keep {what} in the object cache {self.cache.root}: {exc}") from exc

    def prefetch(self, objects: list[tuple[str, FileStat]]) -> None:
        """Download these objects into the machine cache in the background: small S3 objects
        (one GET each) through the pool of many requests in flight (`storage.fetch_ahead`), the
        others (shards, blocks of large files) on a few threads (`storage.prefetch`), whose
        downloads each hold a cache entry open while written, so few run at once. Those are
        claimed until read and each waits for room under the cache's limit
        (`ObjectCache.room_ahead`): a cache smaller than the dataset evicts none of
        them before it is read."""
        # Asked for whether the cache holds them now or not (it may evict them before their turn):
        # each costs a stat of a file when its turn comes, no open if the cache holds it then.
        small: list[tuple[str, FileStat]] = []
        large: list[tuple[str, FileStat]] = []
        for url, stat in objects:  # each looked at once: an epoch asks for every object
            if self.cached(url):
                (small if self._one_get(url, stat) else large).append((url, stat))
        if not small and not large:
            return
        with self._lock:
            if large and self._prefetcher is None:
                self._prefetcher = Prefetcher(self._prefetch_one, room=self.cache.room_ahead)
            if small and self._fetch_ahead is None:
                self._fetch_ahead = fetch_ahead.FetchAhead(
                    self._fetch_small,
                    fetch_ahead.client_loop(),
                    concurrency=self.fetch_concurrency,
                    memory=self.fetch_memory,
                    policy=self.retry_policy,
                    share=self.cache.root / fetch_ahead.FETCHERS,
                    room=self.cache.room_ahead,
                    claim=self._claim_small,
                )
            now = time.time()
            self._wanted.update((url, (stat, now)) for url, stat in large)
        if small:
            assert self._fetch_ahead is not None
            self._fetch_ahead.request((url, stat.size, (stat, now)) for url, stat in small)
        if large:
            assert self._prefetcher is not None
            self._prefetcher.request((url, stat.size) for url, stat in large)

    def fetch_counters(self) -> dict[str, int]:
        """The counters of this process's pool of small downloads ahead (`FetchAhead.counters`;
        empty before its first use)."""
        return self._fetch_ahead.counters() if self._fetch_ahead is not None else {}

    def _one_get(self, url: str, stat: FileStat) -> bool:
        """Whether `url` is downloaded ahead by the pool: an S3 object with an ETag (read with
        If-Match, so never under an older version), whole in one GET."""
        small = stat.size <= min(self.block_size, self.whole_max)
        return scheme_of(url) in S3_SCHEMES and _pinned(url, stat) and small

    def _claim_small(self, url: str, asked: tuple[FileStat, float]) -> tuple[Any, Callable[[], None]] | None:
        """An object of the pool (asked for at time.time() `asked[1]`) claimed in the cache
        (`ObjectCache.claim`): its stat and `fill`, and the claim's release; None if the cache
        holds it, another process is downloading it or the reads overtook it (a reader fetched it
        since: read, and maybe evicted since)."""
        stat, since = asked
        claim = self.cache.claim(Entry(url, stat.size, stat.version, -1, 0), since)
        if claim.fill is None:
            return None
        return (stat, claim.fill), claim.release

    async def _fetch_small(self, url: str, claimed: tuple[FileStat, Callable[[bytes, bool], bool]]) -> None:
        """One object of the pool, claimed (`_claim_small`): one GET (`_answer`), checked against
        its checksums, written into the cache under the entry's download lock: on the loop when it
        is small, matches and has room at once, else off the loop, batched (`fetch_ahead.DiskWork`)."""
        stat, fill = claimed
        digest = self._digest(url, stat)
        data, fed = await self._answer(url, stat, digest)
        if fed and digest.matches() and fill(data, False):
            return

        def check_and_fill(data: bytes) -> None:
            # off the loop: the hashing, the HEAD a mismatch may ask (`_digest`), the waits
            if not fed:
                digest.update(data)
            digest.check()
            fill(data, True)

        assert self._fetch_ahead is not None  # the pool running this
        await self._fetch_ahead.disk.run(check_and_fill, data)

    async def _answer(self, url: str, stat: FileStat, digest: Digest) -> tuple[bytes, bool]:
        """The bytes of a whole object of the pool at `stat`, and whether `digest` was fed them
        (here, on the loop, when small). A small one whose ETag is an MD5 is read without a
        condition first (`_fs.get_s3_whole_unchecked`: a quarter less CPU) and kept when its bytes
        have that MD5; else (changed, corrupted, an encrypted object's ETag) it is read again with
        If-Match, which tells which. A bucket where even that version's bytes differ from its ETag
        (no MD5: encrypted with KMS) is read with If-Match alone from then on."""
        md5 = etag_md5(stat.version)
        # Split without s3fs: the pool's GETs make no s3fs client (a job's first GET waits for none).
        where = s3_bucket_and_key(url)
        missed = False
        if md5 is not None and where is not None and stat.size <= _ON_THE_LOOP and where[0] not in self._etags_not_md5:
            data = await get_s3_whole_unchecked(self.storage_options, *where, stat.size)
            if data is not None:
                digest.restart(md5)
                digest.update(data)
                if digest.matches():
                    return data, True
                missed = True
        fs, path = self.filesystem(url)
        answer = await CONDITIONAL[scheme_of(url)].get(fs, path, None, stat.version)
        if answer is None:
            raise _changed(url, f"its ETag is no longer {stat.version}")
        if len(answer.data) != stat.size:
            raise _changed(url, f"{len(answer.data)} bytes, its listing said {stat.size}")
        digest.restart(answer.md5)
        fed = len(answer.data) <= _ON_THE_LOOP
        if fed:
            digest.update(answer.data)
            if missed and where is not None and not digest.matches():
                self._etags_not_md5.add(where[0])
        return answer.data, fed

    def _prefetch_one(self, url: str) -> None:
        """Download the object (each block of it) ahead, unless the reads overtook it (fetched
        since it was asked for: read, and maybe evicted since)."""
        stat, asked = self._wanted[url]
        for block in self._blocks(stat):
            entry = self._entry(url, stat, block)
            if not self.cache.found_ahead(entry):
                if self.cache.fetched_since(entry, asked):
                    return  # the reader downloads the rest
                self.open_cached(url, stat, block, ahead=True).close()

    def _blocks(self, stat: FileStat) -> range:
        """The entries of an object in the cache: whole (-1) up to `whole_max`, else its blocks."""
        return range(-1, 0) if stat.size <= self.whole_max else range(-(-stat.size // self.block_size))

    def _entry(self, url: str, stat: FileStat, block: int) -> Entry:
        return Entry(url, stat.size, stat.version, block, self.block_size if block >= 0 else 0)

    def read_object(self, url: str, stat: FileStat) -> bytes:
        """A whole file or object of this size and version: through the machine cache when it is
        cached (one request when missing, none when held), else straight from the store; a length
        other than `stat`'s is a SourceError."""
        if not scheme_of(url):
            with local_errors(url, "read"):
                data = read_whole(url)
        elif not self.cached(url):
            data = self.read_range(url, 0, stat.size, stat)
        else:
            parts = []
            for block in self._blocks(stat):
                handle = self.open_cached(url, stat, block)
                try:
                    parts.append(handle.pread(0, stat.size if block < 0 else self.block_size))
                finally:
                    handle.close()
            data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) != stat.size:
            raise SourceError(f"{url} has {len(data)} bytes, its listing said {stat.size}: it changed since")
        return data

    def fetch(self, url: str, stat: FileStat | None = None) -> None:
        """Make sure the whole object (or all its blocks) is in the machine cache."""
        stat = stat or self.stat(url)
        if not self.cached(url):
            return
        for block in self._blocks(stat):
            self.open_cached(url, stat, block).close()

    def open_write(self, url: str) -> StagedWrite:
        """A binary file for writing `url`, which appears whole or not at all: bytes go to a
        temporary file that `close()` renames into place (local) or uploads in one retried call
        (remote); `discard()` drops them. A process killed while writing leaves no file at `url`
        (a local one may leave its `.<name>.*.tmp` beside it; `stale_temporaries` lists those)."""
        if not scheme_of(url):
            return _LocalReplace(url)
        return _Upload(self, url)

    def publish(self, temporary: str, url: str) -> None:
        """Put the finished local file `temporary` at `url` whole, as `open_write` does, and
        remove it: for a file another process (a worker) wrote. Renamed over a local `url` (so
        it must be on the same file system: beside it), uploaded in one retried call to a
        remote one."""
        try:
            if scheme_of(url):
                _upload(self, temporary, url)
            else:
                _replace(temporary, url)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


class StagedWrite(io.BufferedWriter):
    """A file written to a temporary place and published whole by `close()` (see `open_write`)."""

    def __init__(self, url: str, temporary: str) -> None:
        self.url, self._tmp = url, temporary
        super().__init__(io.FileIO(temporary, "wb"), buffer_size=1 << 20)

    def _publish(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
            self._publish()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)

    def discard(self) -> None:
        """Drop what was written: nothing appears at the URL."""
        if self.closed:
            return
        try:
            super().close()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        # An exception inside `with store.open_write(url)` leaves nothing half-written at the URL.
        if exc_type is None:
            self.close()
        else:
            self.discard()


class _LocalReplace(StagedWrite):
    """A local file written beside its place and renamed over it when closed."""

    def __init__(self, url: str) -> None:
        parent, name = os.path.split(url)
        try:
            if parent:
                os.makedirs(parent, exist_ok=True)
            temporary = os.path.join(parent, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
            super().__init__(url, temporary)
        except OSError as exc:
            raise SourceError(f"cannot open {url}: {exc.strerror}") from None

    def _publish(self) -> None:
        _replace(self._tmp, self.url)


class _Upload(StagedWrite):
    """Writes go to a local temporary file; `close()` puts it at the URL in one retried call."""

    def __init__(self, store: Store, url: str) -> None:
        self._store = store
        handle = tempfile.NamedTemporaryFile(prefix="gl-upload-", delete=False)  # noqa: SIM115
        handle.close()
        super().__init__(url, handle.name)

    def _publish(self) -> None:
        _upload(self._store, self._tmp, self.url)


def _replace(temporary: str, url: str) -> None:
    try:
        os.replace(temporary, url)
    except OSError as exc:
        raise SourceError(f"cannot write {url}: {exc.strerror}") from None


def _upload(store: Store, temporary: str, url: str) -> None:
    fs, path = store.filesystem(url)
    retry.call(
        lambda seconds: fs.put_file(temporary, path, **bounded(fs, seconds)),
        url,
        "upload to",
        store.retry_policy,
        os.path.getsize(temporary),
    )


def stale_temporaries(url: str) -> list[str]:
    """Temporary files that writers of the local file `url`, or of files named `url` plus a
    suffix (its sidecars), left beside it when killed mid-write."""
    parent, name = os.path.split(url)
    return _glob.glob(os.path.join(_glob.escape(parent), f".{_glob.escape(name)}*.tmp"))


def _files(asked: str, fs: Any, listing: dict[str, dict[str, Any]]) -> dict[str, FileStat]:
    """URL (in the scheme of the URL `asked`) -> size and version of the files of a detailed
    fsspec listing."""
    out = {}
    for name, info in listing.items():
        if info.get("type", "file") == "file" and info.get("size") is not None:
            url = _as_asked(asked, fs, name)
            out[url] = _file_stat(url, info)
    return out


def _pinned(url: str, stat: FileStat | None) -> bool:
    """Whether reads of `url` at `stat` ask for that version (`_fs.read_if_version`), so that no
    older or newer version can answer them."""
    return stat is not None and can_read_if_version(url, stat.version)


def _as_asked(asked: str, fs: Any, name: str) -> str:
    """The URL of listed `name` with the scheme of the URL `asked` (one client serves several:
    az:// and abfs://, gs:// and gcs://), so that the memo of `stat` and errors use the user's."""
    url: str = fs.unstrip_protocol(name)
    return scheme_of(asked) + url[url.index("://") :]


def _file_stat(url: str, info: dict[str, Any]) -> FileStat:
    """Size and version from an fsspec `info()` (or detailed listing) entry of `url`: the field
    its store reads conditionally on first (`_fs.version_field`), else the most specific known."""
    fields = (version_field(url), *_VERSION_FIELDS)
    return FileStat(int(info["size"]), next((str(info[f]) for f in fields if f and info.get(f) is not None), ""))


def _changed(url: str, how: str) -> SourceError:
    """The error of a read that finds the object no longer the version its source was made from."""
    return SourceError(f"{url} changed since the source was made ({how}); construct the source again")


def _local_stat(url: str) -> FileStat:
    with local_errors(url, "stat"):
        st = os.stat(url)
    if not os.path.isfile(url):
        raise SourceError(f"not a regular file: {url}")
    return FileStat(st.st_size, str(st.st_mtime_ns))


def cache_key(url: str) -> str:
    """A location string stable across working directories (absolute path for local files)."""
    return url if scheme_of(url) else os.path.abspath(url)

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
import glob as _glob
import io
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, NamedTuple

from globalloader.errors import ArgumentError, SourceError, StorageError
from globalloader.storage import retry
from globalloader.storage._fork import ProcessLocal, reset_in_forked_children
from globalloader.storage._fs import (
    LOCAL_SCHEMES,
    Answer,
    bounded,
    can_read_if_version,
    filesystem,
    local_errors,
    read_if_version,
    scheme_of,
    version_field,
)
from globalloader.storage.cache import CachedFile, Entry, ObjectCache, parse_size
from globalloader.storage.checksum import Digest, TransferCorrupted
from globalloader.storage.prefetch import Prefetcher

INFO_TTL = 10.0  # seconds an object's size and version are reused without asking again
BLOCK_SIZE = 8 << 20  # bytes per cached block, and per request of a whole download
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
    bytes per cached block of a large object, and per request of a download."""

    _PROCESS_ONLY = ("_cache", "_infos", "_lock", "_prefetcher", "_wanted", "_fetched")

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
        *,
        cache: bool = True,
        retry_policy: retry.RetryPolicy = retry.DEFAULT,
        block_size: int = BLOCK_SIZE,
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
        # CRC-32 of whole objects known from where they were written (a tar shard's sidecar), by
        # URL and version, with where and what to do: a setting, so worker processes check their
        # downloads against them too.
        self.crc32s: dict[tuple[str, FileStat], tuple[int, str, str]] = {}
        self._reset()

    def _after_fork(self) -> None:
        # The prefetch threads and a lock held at the fork stay in the parent; the sizes and
        # versions already asked for stay valid (a forked worker asks no HEAD again).
        self._reset(keep_infos=True)

    def _reset(self, keep_infos: bool = False) -> None:
        self._prefetcher: Prefetcher | None = None
        self._wanted: dict[str, FileStat] = {}
        self._fetched: set[tuple[str, FileStat]] = set()  # prefetched by this process: not asked again
        self._cache: ObjectCache | None = None
        self._infos: dict[str, tuple[float, FileStat]] = dict(self._infos) if keep_infos else {}
        self._lock = threading.Lock()
        reset_in_forked_children(self)

    @property
    def cache(self) -> ObjectCache:
        """This process's handle on the machine cache (made on first use)."""
        if self._cache is None:
            self._cache = ObjectCache(limit=self.cache_limit)
        return self._cache

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
        return filesystem(url, self.storage_options)

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
        info = retry.call(lambda seconds: fs.info(path, **bounded(fs, seconds)), url, "stat", self.retry_policy)
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
        self._remember(pattern, fs, found)
        return sorted(_as_asked(pattern, fs, name) for name in found)

    def find(self, root: str) -> dict[str, FileStat]:
        """Every file below a remote folder with its size and version, from one listing (which
        also fills the per-process memo of `stat`)."""
        fs, path = self.filesystem(root)
        found = retry.call(
            lambda seconds: fs.find(path, detail=True, **bounded(fs, seconds)), root, "list", self.retry_policy, None
        )
        return self._remember(root, fs, found)

    def _remember(self, asked: str, fs: Any, listing: dict[str, dict[str, Any]]) -> dict[str, FileStat]:
        """The files of a detailed listing with their size and version, also kept in the
        per-process memo of `stat` (a listing answers what a HEAD per file would)."""
        now, out = time.monotonic(), {}
        for name, info in listing.items():
            if info.get("type", "file") == "file" and info.get("size") is not None:
                url = _as_asked(asked, fs, name)
                out[url] = _file_stat(url, info)
        with self._lock:
            self._infos.update((url, (now, stat)) for url, stat in out.items())
        return out

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
        """The checks of whole downloads of `url` at `stat` (see `storage.checksum`)."""
        return Digest(url, *self.crc32s.get((url, stat), ()))

    def open_cached(self, url: str, stat: FileStat, block: int = -1) -> CachedFile:
        """The whole object (block -1) or one block of it, from the machine cache (downloaded
        there first if missing). A store whose object no longer has `stat` is a SourceError.

        A whole object is checked end to end before it enters the cache: a download in one
        request by `read_range`, one in several once assembled, against the MD5 its ETag vouches
        for and the CRC-32 `expect_crc32` was given; a mismatch downloads it
        again (a transient fault of `retry`). A block of a large object is not checked (no
        checksum of a range exists): TCP's and TLS's checks are all it has.
        """
        size = self.block_size
        entry = Entry(url, stat.size, stat.version, block, size if block >= 0 else 0)
        # A whole object in several answers is checked once assembled; in one, by `_get`.
        several = block < 0 and stat.size > size
        digest = self._digest(url, stat) if several else None

        def download(write: Any) -> None:
            fresh = self.stat(url)
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

        def open_entry(_: float) -> CachedFile:
            # A corrupted transfer is retried here (the others were retried by `_get`, or are
            # final); any other OSError is the local cache's, never the store's (not "access denied").
            try:
                return self.cache.open(entry, download)
            except TransferCorrupted:
                raise
            except OSError as exc:
                raise StorageError(f"cannot keep {url} in the object cache {self.cache.root}: {exc}") from exc

        return retry.call(open_entry, url, "download", self.retry_policy)

    def prefetch(self, objects: list[tuple[str, FileStat]]) -> None:
        """Download these objects into the machine cache in the background (see `prefetch`)."""
        # An object this process prefetched before is in the cache (or was evicted since: its reader
        # then fetches it): each later epoch would otherwise open every entry again for nothing.
        objects = [(url, stat) for url, stat in objects if self.cached(url) and (url, stat) not in self._fetched]
        if not objects:
            return
        with self._lock:
            if self._prefetcher is None:
                # Waiting to be downloaded: at most a quarter of what the cache can hold (a deep horizon
                # never queues more than the cache would keep).
                self._prefetcher = Prefetcher(self._prefetch_one, budget=self.cache.room // 4)
            self._wanted.update(objects)
        self._prefetcher.request((url, stat.size) for url, stat in objects)

    def _prefetch_one(self, url: str) -> None:
        stat = self._wanted[url]
        self.fetch(url, stat)
        self._fetched.add((url, stat))

    def fetch(self, url: str, stat: FileStat | None = None) -> None:
        """Make sure the whole object (or all its blocks) is in the machine cache."""
        stat = stat or self.stat(url)
        if not self.cached(url):
            return
        blocks = [-1] if stat.size <= self.whole_max else range(-(-stat.size // self.block_size))
        for block in blocks:
            self.open_cached(url, stat, block).close()

    def open_write(self, url: str) -> IO[bytes]:
        """A binary file for writing `url`: remote objects are uploaded when it is closed."""
        if not scheme_of(url):
            return _local_open(url, "wb")
        return _Upload(self, url)


class _Upload(io.BufferedWriter):
    """Writes go to a local temporary file; `close()` puts it at the URL in one retried call."""

    def __init__(self, store: Store, url: str) -> None:
        self._store, self._url = store, url
        self._tmp = tempfile.NamedTemporaryFile(prefix="gl-upload-", delete=False)  # noqa: SIM115
        super().__init__(io.FileIO(self._tmp.name, "wb"), buffer_size=1 << 20)
        self._tmp.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
            fs, path = self._store.filesystem(self._url)
            retry.call(
                lambda seconds: fs.put_file(self._tmp.name, path, **bounded(fs, seconds)),
                self._url,
                "upload to",
                self._store.retry_policy,
                os.path.getsize(self._tmp.name),
            )
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp.name)


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


def _local_open(url: str, mode: str) -> IO[bytes]:
    try:
        parent = os.path.dirname(url)
        if "w" in mode and parent:
            os.makedirs(parent, exist_ok=True)
        return open(url, mode)
    except OSError as exc:
        raise SourceError(f"cannot open {url}: {exc.strerror}") from None


def cache_key(url: str) -> str:
    """A location string stable across working directories (absolute path for local files)."""
    return url if scheme_of(url) else os.path.abspath(url)

"""Ranged reads from many files: local descriptors kept per process, remote objects through the
Store (the machine cache, or retried ranged requests), and a file object over any of them."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import IO, Any

from globalloader.errors import SourceError
from globalloader.storage import retry
from globalloader.storage._fork import ProcessLocal, reset_in_forked_children
from globalloader.storage._fs import LOCAL_SCHEMES, local_errors, scheme_of
from globalloader.storage.cache import CachedFile, pread_upto
from globalloader.storage.local import open_native
from globalloader.storage.store import FileStat, Store

# Cache entries a reader keeps at hand: whole shards are read sample by sample, blocks (Parquet
# column chunks) in large reads. Which of them stay open (pinned against eviction) the cache decides
# by bytes (see `ObjectCache.hold`); one dropped here is released.
_CACHED_KEPT = {True: 16, False: 2}


class RangeReader(ProcessLocal):
    """Ranged reads from many files, handles opened lazily and kept per process.

    Local files: one descriptor per file, read with `os.pread` (no seek, safe from many threads);
    at most `max_open` stay open, reads from further files open and close each time. Remote
    objects: through `store`'s machine cache, whole (`whole=True`, for shards read end to end) or
    by blocks; objects the cache does not hold, one retried ranged request per read. What a
    remote read is checked against (`storage.checksum`): an object cached whole, or read whole
    without the cache, end to end (its ETag's MD5, its sidecar's CRC-32, the store's checksum),
    fetched again on a mismatch; a block of a large object, or a part read without the cache,
    only by TCP (and TLS on https), as the store keeps no checksum of a range.
    `expect(url, stat)` records the size and version a source was built on, so the cache key and
    the change check use them. Handles are never pickled; a forked child drops the inherited ones
    (an at-fork hook, so reads pay no pid check) and opens its own.
    """

    _PROCESS_ONLY = ("_pid", "_fds", "_entries", "_lock")

    def __init__(self, store: Store | None = None, max_open: int = 256, *, whole: bool = True) -> None:
        self.store = store if store is not None else Store()
        self.max_open, self.whole = max_open, whole
        self._stats: dict[str, FileStat] = {}
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._fds: dict[str, int] = {}
        self._entries: OrderedDict[tuple[str, int], CachedFile] = OrderedDict()
        self._lock = threading.Lock()
        reset_in_forked_children(self)

    def expect(self, url: str, stat: FileStat) -> None:
        """Read `url` as the object of this size and version (a changed object is an error)."""
        self._stats[url] = stat

    def read(self, url: str, start: int, length: int) -> bytes:
        """Up to `length` bytes at `start` (fewer only at the end of the file)."""
        if scheme_of(url):
            return self.read_remote(url, start, length)
        return self.read_local(url, start, length)

    def read_local(self, url: str, start: int, length: int) -> bytes:
        """`read` for a path known to be local (skips the scheme check on hot paths)."""
        fd = self._fds.get(url)
        if fd is None:
            return self._read_local_cold(url, start, length)
        return _pread_full(fd, length, start, url)

    def read_remote(self, url: str, start: int, length: int) -> bytes:
        """`read` for a URL known to have a scheme."""
        if not self.store.cached(url):
            return self.store.read_range(url, start, start + length, self._stats.get(url))
        stat = self._stats.get(url) or self.store.stat(url)
        end = min(start + length, stat.size)
        if start >= end:
            return b""
        if self.whole and stat.size <= self.store.whole_max:
            return self._read_entry(url, stat, -1, start, end - start)
        parts, size = [], self.store.block_size
        for block in range(start // size, (end - 1) // size + 1):
            base = block * size
            lo, hi = max(start, base), min(end, base + size)
            parts.append(self._read_entry(url, stat, block, lo - base, hi - lo))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def crc32(self, url: str) -> int | None:
        """The CRC-32 of the whole object `url` as the machine cache holds it (downloaded first
        if missing), or None when it is not cached whole."""
        stat = self._stats.get(url) or self.store.stat(url)
        if not (self.store.cached(url) and self.whole and stat.size <= self.store.whole_max):
            return None
        return self._read_entry(url, stat, -1, 0, 0, lambda entry: entry.crc32)

    def _read_entry(
        self,
        url: str,
        stat: FileStat,
        block: int,
        start: int,
        length: int,
        take: Callable[[CachedFile], Any] | None = None,
    ) -> Any:
        # The lock guards the table only: reads (each entry serializes its own), downloads and
        # releases happen outside it.
        key = (url, block)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            opened = self.store.open_cached(url, stat, block)
            with self._lock:
                entry = self._entries.setdefault(key, opened)
                dropped = [] if entry is opened else [opened]
                while len(self._entries) > _CACHED_KEPT[self.whole]:
                    dropped.append(self._entries.popitem(last=False)[1])
            for handle in dropped:
                handle.close()
        return entry.pread(start, length) if take is None else take(entry)

    def _read_local_cold(self, url: str, start: int, length: int) -> bytes:
        # Open outside the lock; the lock only decides whether the descriptor is kept (a thread
        # that lost the race closes its own). Kept descriptors are closed only by close().
        with local_errors(url):
            fd = os.open(url, os.O_RDONLY)
        with self._lock:
            kept = self._fds.get(url)
            if kept is None and len(self._fds) < self.max_open:
                self._fds[url] = kept = fd
        if kept == fd:
            return _pread_full(fd, length, start, url)
        try:
            return _pread_full(kept if kept is not None else fd, length, start, url)
        finally:
            os.close(fd)

    def _after_fork(self) -> None:
        # The inherited descriptors are the parent's bookkeeping; close the child's copies only.
        # The cache entries' copies share their locks with the parent's: the cache closes them
        # (`ObjectCache._after_fork`), never touching the locks.
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reset()

    def close(self) -> None:
        """Close this process's descriptors and release its cache entries (reads reopen them)."""
        if self._pid == os.getpid():
            with self._lock:
                for fd in self._fds.values():
                    os.close(fd)
                entries = list(self._entries.values())
            for entry in entries:
                entry.close()
        self._reset()


def open_read(store: Store, url: str, stat: FileStat | None = None, *, whole: bool = True) -> IO[bytes]:
    """A buffered, seekable binary file for reading `url`: local files directly, objects in the
    machine cache whole (`whole=True`, unless large) or by blocks, other URLs by retried ranged
    reads."""
    if not scheme_of(url):
        with local_errors(url):
            return open(url, "rb")
    if scheme_of(url) in LOCAL_SCHEMES:
        fs, path = store.filesystem(url)
        return retry.call(lambda _: fs.open(path, "rb"), url, "open", store.retry_policy)  # local: no deadline
    stat = stat or store.stat(url)
    reader = RangeReader(store, whole=whole)
    reader.expect(url, stat)
    raw = RangeFile(lambda start, n: reader.read_remote(url, start, n), stat.size, url, reader.close)
    return io.BufferedReader(raw, buffer_size=1 << 20)


def open_arrow(store: Store, url: str, stat: FileStat | None = None) -> Any:
    """A file for pyarrow to read `url` from: a local path as pyarrow's own file (native reads),
    a URL as `open_read` by blocks (a footer and a few columns download only those)."""
    if not scheme_of(url):
        return open_native(url)
    return open_read(store, url, stat, whole=False)


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over `read(start, length)` of an object of `size` bytes."""

    def __init__(
        self, read: Callable[[int, int], bytes], size: int, name: str, on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__()
        self._read, self._size, self.name, self._pos, self._on_close = read, size, name, 0, on_close

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        data = self._read(self._pos, want)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed and self._on_close is not None:
            self._on_close()
        super().close()


def _pread_full(fd: int, length: int, start: int, url: str) -> bytes:
    try:
        return pread_upto(fd, length, start)
    except OSError as exc:
        raise SourceError(f"cannot read {url} at offset {start}: {exc.strerror}") from None

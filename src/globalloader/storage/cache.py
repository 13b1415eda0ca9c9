"""The machine-wide object cache: remote objects (or fixed blocks of them) kept on local disk.

One folder per machine (`$GLOBALLOADER_CACHE_DIR/objects`, see `_paths.cache_dir`), shared by
every process and job of the user. Properties, each relied on elsewhere:

- Keyed by everything that decides the bytes: URL, size and version (ETag, generation or
  mtime), plus the block number for a block. A changed object has another key, so it is never
  served stale.
- An entry is written to a temporary file and renamed into place: the data, a CRC-32 of each
  CHECK_BLOCK of it, and a 16-byte trailer (the data's CRC-32 and length). A process killed
  mid-download leaves a temporary file, never an entry. Every opening of an entry checks the
  blocks it reads the first time it reads them, and again once the file changed (its ctime): a
  damaged entry is deleted and fetched again, never served, however long a reader has had it open.
- Concurrent readers of a missing entry wait on the entry's exclusive download lock while one of
  them downloads, so K processes download each object once. The locks are bytes of one file
  (`locks/downloads`, a byte-range lock per entry): the folder does not grow by a file per object.
- Readers hold a shared flock on an entry while it is open; eviction (least recently used by
  access time, which opens set) takes an exclusive one without waiting and skips entries in use,
  so it never deletes what a reader has open. The readers of one cache handle (a source, in a
  process) keep open only the entries they are reading and the most recently read ones up to
  `hold` bytes (1/HOLD_SHARE of the cache's room, its limit or its disk if smaller, unless set;
  the read-ahead has the rest). The last reader to release an entry of an over-limit cache
  evicts, and a process releases what it holds when it ends.
- Within the limit at every moment: a download first reserves its bytes in the counters'
  record, where checking that they fit beside every entry and every other reservation of the
  machine and taking them is one step under the record's lock, evicting entries no reader holds
  until they do (`_reserve`). Its temporary file is as large as its reservation from the start,
  so a download killed midway gives it back when its temporary is removed. A read that finds
  the cache full of entries held, claimed or being written waits (HELD_WAIT) for readers, then
  drops claims; it goes beyond the limit, with a warning naming the limit needed, only when the
  readers of the machine hold more than the limit leaves.
- An entry downloaded ahead of its reads (`ahead`) is claimed: its access time is set AHEAD_CLAIM
  in the future, so eviction takes every entry already read before it, and the first reader's
  open makes it an ordinary entry. A download ahead starts only while the entries claimed ahead
  fit in the room the holds set (a windowed shuffle's) of every reading process of the machine
  leave (each registers its hold in `readers/`, see `storage.registry`: the workers of a job
  read the same windows at different moments, and a worker that released an entry another has
  still to read must not see it evicted for the read-ahead) and the machine's cache has room for
  it (`room_ahead`), and gives up when its reservation finds none: it never takes the reads' room.
  Only a read with no other room, or a full disk, evicts a claimed entry: nothing is evicted
  before it is read, nothing downloaded twice in an epoch, while what the readers of the machine
  use at once fits their holds (a windowed shuffle sets it to two windows per process, see
  `Store.keep_open`). A reader's fetch notes its time in the lock file's
  slot for the entry, so that a download ahead the reads overtook is not made after them
  (`fetched_since`).
- A full disk evicts every entry not in use, then waits (FULL_WAIT at most) while other
  readers or downloads hold space, then is a CacheFullError naming the folder.
- Machine-wide counters (bytes downloaded, hits, misses, size, entries) live in the folder's
  `stats` record (see `cache_stats`): best-effort, a busy lock never delays a read.
- Only this user can have written the folder and its files (`_paths.untrusted`, checked at every
  open; files are opened without following links), unless the user opted into a cache shared
  with its group: then an entry another member wrote is also checked against the object's MD5
  (its ETag's, where it is one) at every opening.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import hashlib
import mmap
import multiprocessing.util
import os
import pathlib
import re
import struct
import threading
import time
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

from globalloader import _paths
from globalloader._pids import alive
from globalloader.errors import ArgumentError, CacheFullError, GlobalLoaderError, StorageError
from globalloader.storage._fork import reset_in_forked_children
from globalloader.storage.cache_stats import CacheStats, try_until
from globalloader.storage.checksum import etag_md5
from globalloader.storage.registry import Registration, Share, live

DEFAULT_LIMIT = 20 * 10**9  # bytes, when neither cache_limit= nor GLOBALLOADER_CACHE_LIMIT says
LIMIT_ENV = "GLOBALLOADER_CACHE_LIMIT"
LOCK_TIMEOUT = 900.0  # seconds to wait for another process's download of the same entry
# Longest pause between two tries of that lock: a worker waiting for the prefetch's download of its
# shard starts reading at most this late (a try is one system call).
WAIT_POLL = 0.002
STATS_NAME = "stats"  # the counters' record in the folder (entries are named by 40 hex digits)
# Bytes of data per CRC-32 in an entry's table: a read checks the blocks it covers, so a sample
# costs the CRC of about its own bytes, never of its whole shard.
CHECK_BLOCK = 1 << 14
# The readers of one cache handle keep open, besides the entries being read, at most this share of
# the cache's room by default (the read-ahead has the rest; shards read in random order stay open,
# not reopened and checked again for each sample), and at most HOLD_FILES descriptors.
HOLD_SHARE = 2
HOLD_FILES = 64
FULL_WAIT = 30.0  # seconds a download on a full disk waits for other readers to release entries
# Seconds a read waits for readers to release entries when the cache is at its limit, before it
# goes beyond (see `ObjectCache._reserve`).
HELD_WAIT = 1.0
# An entry downloaded ahead and not read yet: its access time this far in the future (eviction takes
# it after every entry read), until a reader opens it, or for at most this long if none does.
AHEAD_CLAIM = 3600 * 10**9  # ns
READERS = "readers"  # the folder's sub-folder where reading processes register their hold (see `room_ahead`)
_READERS_RECOUNT = 0.1  # seconds between two sums of the machine's readers' holds
_ROOM_REREAD = 0.05  # seconds a record read lends its room to `_room_on_machine` (see there)
# Entries downloaded ahead that `room_ahead` counts without a look at whether they were read (their
# memory stays bounded; past it, the oldest are looked at as before).
_AHEAD_UNCHECKED = 1024
_TOUCH_EVERY = 10**9  # ns: an open sets the access time (the LRU clock) if older than this
_RECORD_WAIT = 0.1  # seconds a release waits for the counters' lock to read the cache's size
# Seconds a download waits for the counters' lock to reserve its bytes (held for a few system calls
# at a time): longer only if a process holding it is stopped, and then it evicts without reserving.
_RESERVE_WAIT = 2.0
_TRAILER = struct.Struct("<4sIQ")  # magic, CRC-32 of the data, data length
_SLOT = struct.Struct("<I")  # one block's CRC-32 in the table between the data and the trailer
_MAGIC = b"GLC2"  # GLC1 entries had no table: they read as damaged and are fetched again
_WRITE_CHUNK = 1 << 20
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}
_UNITS |= {"T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, what: str) -> int:
    """Bytes from an int or a string such as "20GB", "512MiB" or "1000000"."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise ArgumentError(f"{what} must be positive, got {text!r}")
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ArgumentError(f"{what} must be a byte count such as 20GB, 512MiB or 1000000, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def resolve_limit(limit: int | str | None) -> int:
    """The cache limit: the argument, else $GLOBALLOADER_CACHE_LIMIT, else DEFAULT_LIMIT."""
    if limit is not None:
        return parse_size(limit, "cache_limit")
    env = os.environ.get("GLOBALLOADER_CACHE_LIMIT")
    return parse_size(env, LIMIT_ENV) if env else DEFAULT_LIMIT


def default_root(create: bool = True) -> pathlib.Path:
    """Where entries live (read per call, so the environment can redirect it)."""
    return _paths.cache_dir("objects", create=create)


class Entry(NamedTuple):
    """One cached object or block: where it comes from and which version of it."""

    url: str
    size: int  # the whole object's size
    version: str
    block: int = -1  # -1: the whole object; else block number (of `block_size` bytes)
    block_size: int = 0

    def name(self) -> str:
        ident = f"{self.url}\0{self.size}\0{self.version}\0{self.block}\0{self.block_size}".encode()
        return hashlib.sha256(ident).hexdigest()[:40]

    def data_size(self) -> int:
        """Bytes of the object the entry holds."""
        if self.block < 0:
            return self.size
        return max(0, min(self.block_size, self.size - self.block * self.block_size))


Download = Callable[[Callable[[bytes], None]], None]  # calls write(chunk) with an entry's bytes in order


def stored_size(length: int) -> int:
    """Bytes on disk of an entry of `length` bytes of data: the data, its table, the trailer."""
    return length + _SLOT.size * -(-length // CHECK_BLOCK) + _TRAILER.size


def pread_upto(fd: int, length: int, start: int) -> bytes:
    """`length` bytes at `start`, fewer only at the end of the file (one `os.pread` returns at
    most about 2 GiB on Linux)."""
    data = os.pread(fd, length, start)
    if len(data) == length or not data:
        return data
    parts, got = [data], len(data)
    while got < length:
        more = os.pread(fd, length - got, start + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _is_the_object(fd: int, entry: Entry) -> bool:
    """Whether an entry another member of a cache shared with the group wrote holds the object's
    bytes, by the MD5 its version is (an S3 ETag of a one-part upload), checked at every opening:
    its CRC-32s are the writer's own and vouch only against damage. Where the version is no MD5
    (a block, a multipart upload, another store), the members are trusted (docs/remote.md)."""
    md5 = etag_md5(entry.version) if entry.block < 0 else None
    if md5 is None:
        return True
    digest = hashlib.md5(usedforsecurity=False)
    for piece in _pieces(fd, entry.size):
        digest.update(piece)
    return digest.hexdigest() == md5


def crc32_upto(fd: int, end: int) -> int:
    """CRC-32 of bytes [0, end) of an open file (fewer at its end)."""
    crc = 0
    for piece in _pieces(fd, end):
        crc = zlib.crc32(piece, crc)
    return crc


def _pieces(fd: int, end: int) -> Iterator[bytes]:
    """Bytes [0, end) of an open file (fewer at its end) in 16 MiB pieces: to digest a whole
    entry without holding it in memory."""
    offset = 0
    while offset < end and (piece := os.pread(fd, min(16 << 20, end - offset), offset)):
        yield piece
        offset += len(piece)


# The download locks of every entry: one byte each (at 60 bits of the entry's name) of this one
# file in `locks/`, locked with open file description locks (Linux's F_OFD_SETLK): like flock, two
# descriptors conflict whether they are of one process or of two, a lock goes when its process
# dies, and the folder holds one file however many entries the cache has.
_DOWNLOADS = "downloads"
# The first FETCHED_SLOTS * 8 bytes of that file: when a reader last fetched an entry of each slot
# (the entry's lock byte modulo the slots), in microseconds, above 12 more bits of the entry's name
# (its tag). With the time alone, a reader's fetch of one entry made a download ahead skip any other
# entry of its slot not read yet (with the 4096 a loader asks ahead, one fetch in 16 did), and its
# reader fetched it itself. Now two entries are mistaken only when slot and tag agree (one pair in
# 2**28), and never into a wrong read: a skipped download is its reader's fetch; a fetch
# overwritten by another entry's may let a download ahead fetch again an entry read and evicted.
FETCHED_SLOTS = 1 << 16
_FETCHED_AT = struct.Struct("<Q")
_TAG_BITS = 12


def _fetched_slot(name: str) -> tuple[int, int]:
    """The entry's slot (an offset in the lock file) and tag (bits of its name not in the slot)."""
    return (_lock_byte_of(name) % FETCHED_SLOTS) * _FETCHED_AT.size, int(name[15:18], 16)


# The mark of the temporary files of entries written under the counters' lock with no reservation
# (`_write_now`): a dead writer's is removed without taking its size from the reservations.
_UNRESERVED = "u"
_FLOCK = struct.Struct("hhqqi4x")  # Linux's struct flock: type, whence, start, length, pid (0)


def _lock_byte_of(name: str) -> int:
    """The entry's byte of the lock file: 60 bits of its name, so distinct entries, distinct bytes."""
    return int(name[:15], 16)


def _lock_byte(fd: int, byte: int, kind: int) -> bool:
    """Lock (F_WRLCK) or unlock (F_UNLCK) one byte of the file `fd` without waiting; whether it was
    granted (false: another descriptor holds it)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class _DownloadLocks:
    """The download locks of one cache handle: bytes of the folder's lock file (see `_DOWNLOADS`)
    through one descriptor kept open, not an open and a close per entry. Locks taken through one
    descriptor never conflict with each other, so the bytes this handle holds are also kept here
    and its threads exclude each other by them. The file is opened again once it was removed
    (`rm -rf` of the cache), the old descriptor closed once none of its bytes is held. A forked
    child closes its copies without unlocking them (the parent's) and opens its own."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self._fd = -1
        self._held: dict[int, int] = {}  # byte -> the descriptor it is locked through
        self._guard = threading.Lock()
        reset_in_forked_children(self)

    def _after_fork(self) -> None:
        for fd in {self._fd, *self._held.values()} - {-1}:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fd, self._held, self._guard = -1, {}, threading.Lock()

    def __del__(self) -> None:
        for fd in {self._fd, *self._held.values()} - {-1}:
            with contextlib.suppress(OSError):
                os.close(fd)

    def descriptor(self) -> int:
        """The lock file, open read-write (a write lock needs it, and its first bytes hold the fetch
        times; it is group-writable in a cache shared with the group, as the counters are). Call
        under the guard."""
        if self._fd >= 0 and os.fstat(self._fd).st_nlink:
            return self._fd
        if self._fd >= 0 and self._fd not in self._held.values():
            os.close(self._fd)
        path, mode = self.folder / _DOWNLOADS, _paths.file_mode(group_writes=True)
        try:
            self._fd = _paths.open_file(path, os.O_RDWR, mode)[0]
        except FileNotFoundError:  # the folder was removed under us (rm -rf of the cache)
            _paths.make_folder(self.folder)
            self._fd = _paths.open_file(path, os.O_RDWR, mode)[0]
        return self._fd

    def try_lock(self, byte: int) -> bool:
        """Whether the entry's byte was free and is now held by this handle (without waiting)."""
        with self._guard:
            if byte in self._held:
                return False
            fd = self.descriptor()
            if not _lock_byte(fd, byte, fcntl.F_WRLCK):
                return False
            self._held[byte] = fd
            return True

    def unlock(self, byte: int) -> None:
        with self._guard:
            fd = self._held.pop(byte)
            _lock_byte(fd, byte, fcntl.F_UNLCK)  # not only close: a child forked meanwhile holds a copy
            if fd != self._fd and fd not in self._held.values():
                os.close(fd)  # of a lock file removed since: its last byte is released

    def pread(self, length: int, offset: int, held: int | None = None) -> bytes:
        """Bytes of the lock file; through the descriptor the byte `held` is locked through, if
        given (the file of that lock, with no check that it is still the folder's)."""
        with self._guard:
            return os.pread(self._held[held] if held is not None else self.descriptor(), length, offset)

    def pwrite(self, data: bytes, offset: int) -> None:
        with self._guard:
            os.pwrite(self.descriptor(), data, offset)


class _Opened(NamedTuple):
    """An entry's descriptor under a shared lock, what its trailer says, and its stamp."""

    fd: int
    crc32: int
    stamp: tuple[int, int]  # (size, ctime): any write, truncation, rename over or touch changes it


def _stamp(st: os.stat_result) -> tuple[int, int]:
    return st.st_size, st.st_ctime_ns


def _trailer(fd: int, st: os.stat_result, length: int) -> int | None:
    """The CRC-32 in the trailer of an entry of `length` bytes of data, or None if the file is not
    laid out as one (a damaged or foreign file, or an entry of an older layout)."""
    if st.st_size != stored_size(length):
        return None
    magic, crc, found = _TRAILER.unpack(os.pread(fd, _TRAILER.size, st.st_size - _TRAILER.size))
    return crc if magic == _MAGIC and found == length else None


class CachedFile:
    """One entry of the cache for ranged reads, `pread` from any thread.

    Open (under a shared lock, so eviction leaves it) while it is read and for as long as its
    cache handle keeps it among the recently read ones (see `ObjectCache.hold`); `close()`
    releases it and a later read opens it again, downloading it again if it was evicted meanwhile.
    A read checks the CRC-32 of the blocks it covers, the first time this opening reads them and
    again once the file changed: a damaged entry is deleted and downloaded again, never served.
    """

    def __init__(self, cache: ObjectCache, entry: Entry, download: Download, ahead: bool = False) -> None:
        self.cache, self.entry, self._download, self._ahead = cache, entry, download, ahead
        self.path = cache.root / entry.name()
        self.length = entry.data_size()
        self.crc32 = 0  # of the whole data, from the trailer
        self._fd = -1
        self._stamp = (0, 0)
        self._checked = bytearray()  # per block: its CRC was compared since the file last changed
        self._lock = threading.Lock()

    def pread(self, start: int, length: int) -> bytes:
        length = max(0, min(length, self.length - start))
        with self._lock:
            data = self._read_locked(start, length)
        self.cache._touch(self)
        return data

    def _read_locked(self, start: int, length: int) -> bytes:
        """`pread` under the lock: a damaged entry is downloaded again once."""
        if self._fd < 0:
            self._open()
        data = self._checked_read(start, length)
        if data is None:
            self._drop()
            self._open()
            data = self._checked_read(start, length)
            if data is None:
                raise StorageError(
                    f"cache entry {self.path} of {self.entry.url} is damaged again right after it was "
                    f"downloaded: check the disk under the object cache {self.cache.root}"
                )
        return data

    def mapped(self) -> mmap.mmap:
        """The entry's data mapped read-only, for a format read in place (Arrow), every block's
        CRC-32 checked first (a damaged entry is downloaded again). Entries are never written in
        place, so the mapping keeps these bytes, even once the entry is closed or evicted (its
        file lives while mapped)."""
        with self._lock:  # the file checked is the file mapped
            self._read_locked(0, self.length)
            return mmap.mmap(self._fd, self.length, prot=mmap.PROT_READ) if self.length else mmap.mmap(-1, 1)

    def close(self) -> None:
        """Release the entry (a later read opens it again); the last release of an entry of an
        over-limit cache evicts."""
        with self._lock:
            last = self._release()
        if last:
            self.cache.evict_if_over_limit()

    def _open(self) -> None:
        opened = self.cache._acquire(self.entry, self._download, self._ahead)
        self._ahead = False  # a later opening (after a release) reads it
        self._fd, self.crc32, self._stamp = opened
        self._checked = bytearray(-(-self.length // CHECK_BLOCK))
        self.cache._hold(self)

    def _checked_read(self, start: int, length: int) -> bytes | None:
        """`length` bytes at `start`, each block checked once per opening and again after the file
        changed (seen once the bytes are read, so a write during the read counts); None if damaged."""
        try:
            for _ in range(2):
                data = self._read_blocks(start, length)
                st = os.fstat(self._fd)
                if data is None or _stamp(st) == self._stamp:
                    return data
                # Written, renamed over or touched since the blocks were checked: check them again.
                if _trailer(self._fd, st, self.length) != self.crc32:
                    return None
                self._stamp, self._checked = _stamp(st), bytearray(len(self._checked))
        except OSError:  # an I/O error of the disk under the cache: read as damaged
            return None
        return None  # changed while read, twice

    def _read_blocks(self, start: int, length: int) -> bytes | None:
        """`length` bytes at `start`, the blocks not checked yet compared with their CRC-32; None
        if one differs or the file is shorter than its layout."""
        if not length:
            return b""
        first, last = start // CHECK_BLOCK, (start + length - 1) // CHECK_BLOCK
        if self._checked.find(0, first, last + 1) < 0:
            data = pread_upto(self._fd, length, start)
            return data if len(data) == length else None
        lo, hi = first * CHECK_BLOCK, min(self.length, (last + 1) * CHECK_BLOCK)
        blob = pread_upto(self._fd, hi - lo, lo)
        table = os.pread(self._fd, _SLOT.size * (last + 1 - first), self.length + _SLOT.size * first)
        if len(blob) != hi - lo or len(table) != _SLOT.size * (last + 1 - first):
            return None
        view = memoryview(blob)
        for n, (crc,) in enumerate(_SLOT.iter_unpack(table)):
            if not self._checked[first + n]:
                if zlib.crc32(view[n * CHECK_BLOCK : (n + 1) * CHECK_BLOCK]) != crc:
                    return None
                self._checked[first + n] = 1
        return blob if (lo, hi - lo) == (start, length) else blob[start - lo : start - lo + length]

    def _drop(self) -> None:
        """Delete the damaged entry (unless another file took its place since) and close it."""
        fd, self._fd = self._fd, -1
        self.cache._unhold(self)
        with contextlib.suppress(OSError):
            self.cache._unlink(self.path, os.fstat(fd))
        os.close(fd)

    def _release(self) -> bool:
        """Close the entry; whether it was the last reader's (no other holds its shared lock)."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return False
        self.cache._unhold(self)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted only if nobody else holds it
            last = True
        except BlockingIOError:
            last = False
        os.close(fd)
        return last

    def _forget(self) -> None:
        """In a forked child: close the inherited descriptor without touching its lock (the
        parent's), whatever thread of the parent was reading."""
        self._lock = threading.Lock()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class ObjectCache:
    """Entries on local disk, shared by every process of the machine (see the module doc)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, limit: int | str | None = None) -> None:
        self.root = pathlib.Path(root) if root is not None else default_root()
        self._folder = os.fspath(self.root)  # a string: an entry's path is joined per object ahead
        self.limit = resolve_limit(limit)
        self._locks = self.root / "locks"
        self.stats = CacheStats(self.root / STATS_NAME, self._scan)
        try:
            _paths.make_folder(self.root)
            _paths.make_folder(self._locks)
            disk = os.statvfs(self.root)
        except OSError as exc:
            raise StorageError(f"cannot create the object cache {self.root}: {exc.strerror}") from None
        _paths.check_folder(self.root, follow=root is not None)  # a folder the caller named may be a link
        _paths.check_folder(self._locks)
        self._downloads = _DownloadLocks(self._locks)
        # What the cache can hold: its limit, or its disk if smaller.
        self.room = min(self.limit, disk.f_blocks * disk.f_frsize)
        self._keep_set = 0  # the hold set by `hold = ...` (0: none), registered once this process reads
        self._reset_held()
        reset_in_forked_children(self)
        _CACHES.add(self)

    @property
    def hold(self) -> int:
        """Bytes this handle's readers keep open besides those read now: 1/HOLD_SHARE of the
        cache's room, a bound, unless set to what they need (a windowed shuffle's two windows,
        `Store.keep_open`). A hold set is registered among the machine's readers once this
        process reads, and `room_ahead` leaves every registered hold its room, until the
        process ends or drops the handle (its source)."""
        return self._keep_set or self.room // HOLD_SHARE

    @hold.setter
    def hold(self, size: int) -> None:
        if self._registered is not None:
            self._registered.add(size - self._keep_set)
        self._keep_set = size

    def _reset_held(self) -> None:
        self._registered: Share | None = None  # its part of this process's registration, once it read
        self._readers_hold, self._readers_counted = 0, 0.0
        self._held: OrderedDict[CachedFile, int] = OrderedDict()  # open entries, least recently read first
        self._held_bytes = 0
        self._held_lock = threading.Lock()
        # Entries this handle downloaded ahead, oldest first, with their bytes (see `room_ahead`).
        self._ahead: collections.deque[tuple[str, int]] = collections.deque()
        self._ahead_bytes = 0
        self._ahead_pruned = 0  # time.time_ns() of the last look at every one (see `room_ahead`)
        self._machine_room = (0.0, 0)  # until when (monotonic) and how many bytes `_room_on_machine` may give unread

    def open(self, entry: Entry, download: Download, ahead: bool = False) -> CachedFile:
        """The entry, opened; downloaded first if missing (a damaged one is fetched again when a
        read finds it); `ahead`: by a download ahead of the reads, which claims it (see the
        module doc).

        `download(write)` must call `write(chunk)` with the entry's bytes in order; it runs in
        one process of the machine at a time per entry, the others wait for it.
        """
        handle = CachedFile(self, entry, download, ahead)
        handle._open()
        return handle

    def found_ahead(self, entry: Entry) -> bool:
        """Whether the entry is in the folder now, for a download ahead that then skips it: if it
        is, it is claimed as one downloaded ahead (counted in `room_ahead`; eviction keeping the
        limit never takes it before a reader opens it), or left as it is when already claimed."""
        return self._found_ahead(os.path.join(self._folder, entry.name()))

    def _found_ahead(self, path: str) -> bool:
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        now = time.time_ns()
        if st.st_atime_ns <= now:
            # Only an entry's owner may set its times (see `_open_existing`); gone meanwhile: fetched.
            with contextlib.suppress(PermissionError, FileNotFoundError):
                os.utime(path, ns=(now + AHEAD_CLAIM, st.st_mtime_ns), follow_symlinks=False)
                self._note_ahead(path, st.st_size)
        return True

    def _note_ahead(self, path: str, stored: int) -> None:
        """The entry at `path` (`stored` bytes on disk) is claimed ahead by this handle (`room_ahead`)."""
        with self._held_lock:
            self._ahead.append((path, stored))
            self._ahead_bytes += stored

    def fetched_since(self, entry: Entry, since: float) -> bool:
        """Whether a reader fetched the entry (or waited for its download) after `since` (a
        time.time()): a download ahead asked for before that was overtaken by the reads, and the
        entry, gone now, was read and evicted; fetched again it would be downloaded twice."""
        return self._fetched_since(entry.name(), since)

    def _fetched_since(self, name: str, since: float, held: int | None = None) -> bool:
        """`fetched_since`; `held`: the entry's lock byte, held (its lock file is read)."""
        offset, tag = _fetched_slot(name)
        raw = self._downloads.pread(_FETCHED_AT.size, offset, held)
        if len(raw) != _FETCHED_AT.size:
            return False
        (value,) = _FETCHED_AT.unpack(raw)
        return value & ((1 << _TAG_BITS) - 1) == tag and (value >> _TAG_BITS) >= since * 1e6

    def claim(self, entry: Entry, since: float) -> Claim:
        """For a download ahead of the reads (asked for at time.time() `since`), which must not
        wait on a lock: the entry claimed (`Claim.fill` set) when it is missing, no process of the
        machine is downloading it (its download lock is held until `Claim.release`, so each entry
        is still downloaded once) and no reader fetched it since (`fetched_since`); else
        unclaimed (`fill` None: the entry is there, on its way, or read already). A plain object,
        not a generator: a download ahead claims each small object it fetches."""
        name = entry.name()
        path = os.path.join(self._folder, name)
        if self._found_ahead(path):
            return Claim(None, None)
        byte = _lock_byte_of(name)
        if not self._downloads.try_lock(byte):
            return Claim(None, None)
        try:
            if os.path.lexists(path) or self._fetched_since(name, since, byte):
                self._downloads.unlock(byte)
                return Claim(None, None)
        except BaseException:
            self._downloads.unlock(byte)
            raise
        return Claim(functools.partial(self._fill, path, entry), functools.partial(self._downloads.unlock, byte))

    def _fill(self, path: str, entry: Entry, data: bytes, wait: bool = True) -> bool:
        """Write a claimed entry whole (`Claim.fill`). With `wait` it may wait for room (eviction,
        readers, a full disk): call it off an event loop's thread then. Without `wait` it never
        sleeps: it writes the entry if room is there at once and returns True, else does nothing
        and returns False (call it again with `wait`); a small object is written so on the loop,
        without a thread hop."""
        if not wait:
            try:
                self._write_now(path, entry, data)
            except _WouldWait:
                return False
            return True
        self._make_room(entry.data_size())
        with self._room_for(entry, ahead=True) as reservation:
            if reservation is not None:  # else dropped: its reader fetches it
                self._write(pathlib.Path(path), entry, lambda write: write(data), reservation, opened=False, ahead=True)
        return True

    def _acquire(self, entry: Entry, download: Download, ahead: bool = False) -> _Opened:
        self._make_room(entry.data_size())
        path = self.root / entry.name()
        found = self._open_existing(path, entry)
        if found is not None:
            return self._hit(found)
        with self._download_lock(path, entry):
            found = self._open_existing(path, entry)  # another process finished it while we waited
            if found is not None:
                return self._hit(found)
            with self._room_for(entry, ahead) as reservation:
                if reservation is None:
                    raise CacheFullError(f"no room ahead of the reads for {entry.url} in the object cache {self.root}")
                written = self._write(path, entry, download, reservation, ahead=ahead)
            assert written is not None  # opened
        self._remove_dead_temporaries()  # of downloads killed midway
        self.evict_if_over_limit()  # downloads at once may each have made room for their own only
        return written

    @contextlib.contextmanager
    def _room_for(self, entry: Entry, ahead: bool = False) -> Iterator[_Reservation | None]:
        """Around a download: its bytes reserved first (`_reserve`), returned when it ends unless
        its entry took them; None for a download `ahead` that has no room (it is dropped)."""
        reservation = self._reserve(entry, ahead)
        try:
            yield reservation
        finally:
            if reservation is not None and reservation.size:
                with self.stats.update() as record:
                    record["reserved"] -= reservation.size

    def _reserve(self, entry: Entry, ahead: bool) -> _Reservation | None:
        """Reserve the entry's bytes in the record once they fit under the limit beside every
        entry and every download under way on the machine (the reservation is atomic with the
        check: two processes never both take the last room), evicting entries no reader holds,
        least recently used first. Then a download ahead waits for the reads to leave room
        (HELD_WAIT at most: downloads ahead under way may each have found room for itself
        alone), then gives up (None): it never takes the reads' room. A read releases the entries
        its own handle keeps open but is not reading (the least recently read first, one at a
        time: another process may still read the others), then waits HELD_WAIT at most for readers
        to release entries, then evicts entries claimed ahead (the last claimed first: their
        reader fetches them again); past that, the readers of the machine hold more than the limit leaves (a
        limit smaller than what they keep open: every process keeps two windows of a windowed
        shuffle), and it reserves beyond the limit, with a warning naming the limit needed,
        rather than wait for readers that may be waiting for it. An entry larger than the limit
        fits an otherwise empty cache."""
        incoming = stored_size(entry.data_size())
        deadline, pause, over = time.monotonic() + HELD_WAIT, WAIT_POLL, False
        while True:
            try:
                with self.stats.locked(_RESERVE_WAIT) as record:
                    taken = record["bytes"] + record["reserved"]
                    if not taken or taken + incoming <= self.limit or over:
                        record["reserved"] += incoming
                        break
                    others = record["reserved"]
            except StorageError:  # a process holding the counters' lock is stopped: evict, unreserved
                self.evict(target=max(0, self.limit - incoming))
                return _Reservation(0)
            target = max(0, self.limit - others - incoming)
            if self.evict(target):
                continue
            if ahead and time.monotonic() > deadline:
                return None
            if not ahead and self._release_oldest():  # what this handle keeps open beyond its reads first
                continue
            if time.monotonic() <= deadline:
                time.sleep(pause)  # for a reader to release an entry
                pause = min(0.1, 2 * pause)
            elif not self.evict(target, claimed=True):
                over = True
        if taken and taken + incoming > self.limit:
            warnings.warn(
                f"the object cache {self.root} exceeds its limit of {self.limit} bytes to hold {entry.url}: "
                f"its readers keep {taken} bytes open (every process two windows of a windowed shuffle); "
                f"set cache_limit (or {LIMIT_ENV}) to at least {taken + incoming} bytes or use a smaller window",
                stacklevel=2,
            )
        return _Reservation(incoming)

    def _write_now(self, path: str, entry: Entry, data: bytes) -> None:
        """Write `data`, the entry claimed ahead, if it fits under the limit at once: the
        counters' lock free, nothing to evict, the disk not full; else _WouldWait. Checked,
        written whole (`_paths.write_whole`: one writev of the data and its tail, no copy of
        them, no file object) and counted under one hold of the counters' lock (one lock a small
        object, not two, and no reservation: no process counts the folder meanwhile, so the
        temporary file is never seen beyond the limit; one killed midway changed no record, and
        its temporary, marked _UNRESERVED, is removed without giving back a reservation it never
        made); never a sleep, so an event loop may call it. No entry is there to count out (as
        `_write_once` does): the claim found none under the download lock it holds, and only
        its holder writes the entry."""
        sums = _Checksums()
        sums.add(data)
        stored = stored_size(sums.length)
        with self.stats.locked_now() as record:
            if record is None:  # the lock is busy
                raise _WouldWait
            taken = record["bytes"] + record["reserved"]
            if taken and taken + stored > self.limit:
                raise _WouldWait
            now = time.time_ns()
            try:
                _paths.write_whole(
                    path, (data, sums.tail()), mode=_paths.file_mode(), times=(now + AHEAD_CLAIM, now), mark=_UNRESERVED
                )
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _WouldWait from None
                raise StorageError(f"cannot write {entry.url} into the cache {self.root}: {exc}") from None
            _count_in(record, sums.length)
        self._note_ahead(path, stored)

    def room_ahead(self, size: int, under_way: int = 0) -> bool:
        """Whether a download ahead of `size` bytes may start: the entries this handle downloaded
        ahead that no reader opened yet, the caller's downloads ahead under way (`under_way`
        bytes) and it fit in the room the holds of the machine's reading processes leave (any
        one alone may; `_readers_keep`), so that with what is being read none is evicted before
        it is read; and it fits under the limit
        beside every entry and reservation of the machine (`_room_on_machine`; those under way
        reserve their bytes when they write, evicting then what the reads have left, not sooner:
        an entry one worker has read may still be read by another): the read-ahead waits for the
        reads, it never takes their room. No system call while the entries known ahead are few
        and fit (those read since only make their count higher), else a stat or two (their
        oldest first: they are read in the order downloaded); a read of the record now and
        then, so an event loop may ask; when there is no room, every one of them is looked at
        (once a second at most: one never read, a job stopped mid-epoch, must not hold back the
        others)."""
        now = time.time_ns()
        with self._held_lock:
            fits = self._fits_ahead(size, under_way)
            if not fits or len(self._ahead) > _AHEAD_UNCHECKED:  # the oldest read since give room back
                while self._ahead and not _claimed(self._ahead[0][0], now):
                    self._ahead_bytes -= self._ahead.popleft()[1]
                fits = self._fits_ahead(size, under_way)
            if not fits and now - self._ahead_pruned > _TOUCH_EVERY:
                self._ahead_pruned = now
                self._ahead = collections.deque(item for item in self._ahead if _claimed(item[0], now))
                self._ahead_bytes = sum(stored for _, stored in self._ahead)
                fits = self._fits_ahead(size, under_way)
        return fits and self._room_on_machine(stored_size(size))

    def _room_on_machine(self, needed: int) -> bool:
        """Whether `needed` bytes fit under the limit beside the machine's entries and downloads
        under way (the record), entries no reader holds or claimed evicted first when they do not.
        A record read that left room leaves this handle half of it for _ROOM_REREAD seconds (the
        other half for the other processes meanwhile): a download ahead of many small objects
        reads it once per many, not once each. A guess only: the write checks the limit again,
        under the record's lock."""
        now = time.monotonic()
        with self._held_lock:
            until, budget = self._machine_room
            if now < until and budget >= needed:
                self._machine_room = (until, budget - needed)
                return True
        for evicted in (False, True):
            try:
                record = self.stats.read(_RECORD_WAIT)
            except StorageError:  # a process holding the counters' lock is stopped: the reservation decides
                return True
            taken = record["bytes"] + record["reserved"]
            if not taken or taken + needed <= self.limit:
                with self._held_lock:
                    self._machine_room = (now + _ROOM_REREAD, (self.limit - taken - needed) // 2)
                return True
            if evicted or not self.evict(max(0, self.limit - record["reserved"] - needed)):
                return False
        return False

    def _fits_ahead(self, size: int, under_way: int) -> bool:
        taken = self._ahead_bytes + under_way
        return not taken or taken + stored_size(size) <= self.room - self._readers_keep()

    def _readers_keep(self) -> int:
        """What the readers of the machine may keep open: the holds set of every process that
        reads through this folder (each worker keeps its own windows; counted again every
        _READERS_RECOUNT seconds), this handle's at least. Called under `_held_lock`."""
        now = time.monotonic()
        if now - self._readers_counted > _READERS_RECOUNT:
            self._readers_hold, self._readers_counted = sum(live(self.root / READERS)), now
        return max(self.hold, self._readers_hold)

    def _hit(self, found: _Opened) -> _Opened:
        try:
            with self.stats.update() as record:
                record["hits"] += 1
        except BaseException:
            os.close(found.fd)
            raise
        return found

    def status(self, timeout: float = 1.0) -> dict[str, int | str]:
        """The machine-wide counters, size and entries (from the record), limit and folder."""
        return {**self.stats.read(timeout), "limit": self.limit, "dir": str(self.root)}

    def recount(self) -> dict[str, int]:
        """The counters, with size and entries counted again from the folder (one walk; for
        the command line, which also repairs figures of entries deleted by hand)."""
        with self.stats.locked() as record:
            record["bytes"], record["entries"] = self._scan()
            return dict(record)

    def _scan(self) -> tuple[int, int]:
        entries = self.entries()
        return sum(size for _, size, _ in entries), len(entries)

    def _open_existing(self, path: pathlib.Path, entry: Entry) -> _Opened | None:
        """The entry at `path` under a shared lock, if it is there and laid out as one of
        `entry` (else it is deleted); its data is checked as it is read."""
        try:
            fd = _paths.open_file(path, os.O_RDONLY)[0]
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # eviction holds LOCK_EX only for an unlink
            st = os.fstat(fd)
            if st.st_nlink == 0:  # evicted between our open and our lock
                os.close(fd)
                return None
            crc = _trailer(fd, st, entry.data_size())
            if crc is None or (st.st_uid != os.geteuid() and not _is_the_object(fd, entry)):
                with contextlib.suppress(OSError):
                    self._unlink(path, st)
                os.close(fd)
                return None
            now = time.time_ns()
            # Least recently used = oldest access; one in the future was claimed ahead: now read.
            if abs(now - st.st_atime_ns) > _TOUCH_EVERY:
                # Only an entry's owner may set its times: another member's entry in a cache
                # shared with the group keeps its owner's last access.
                with contextlib.suppress(PermissionError):
                    os.utime(fd, ns=(now, st.st_mtime_ns))
                st = os.fstat(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return _Opened(fd, crc, _stamp(st))

    @contextlib.contextmanager
    def _download_lock(self, path: pathlib.Path, entry: Entry, wait: bool = True) -> Iterator[bool]:
        """The entry's download lock, waited for (LOCK_TIMEOUT) or not (`wait` false: yields
        whether it was free): one byte of the folder's one lock file (see `_DownloadLocks`)."""
        byte = _lock_byte_of(path.name)
        locks = self._downloads
        if wait:
            waited_for = (
                f"another process to download {entry.url} into the cache {self.root}; "
                "a stopped process holds its lock until it goes on or ends"
            )
            if not try_until(lambda: locks.try_lock(byte), LOCK_TIMEOUT, WAIT_POLL):
                raise StorageError(f"waited {LOCK_TIMEOUT:.0f} s for {waited_for}")
        elif not locks.try_lock(byte):
            yield False
            return
        try:
            if wait:
                # When a reader last fetched an entry of this slot, and which (see `fetched_since`).
                offset, tag = _fetched_slot(path.name)
                locks.pwrite(_FETCHED_AT.pack(time.time_ns() // 1000 << _TAG_BITS | tag), offset)
            yield True
        finally:
            locks.unlock(byte)

    def _write(
        self,
        path: pathlib.Path,
        entry: Entry,
        download: Download,
        reservation: _Reservation,
        *,
        opened: bool = True,
        ahead: bool = False,
    ) -> _Opened | None:
        """`_write_once`, waiting for room after a full disk (`_wait_for_room`)."""
        deadline = time.monotonic() + FULL_WAIT
        while True:
            try:
                return self._write_once(path, download, reservation, opened, ahead)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise StorageError(f"cannot write {entry.url} into the cache {self.root}: {exc}") from None
                self._wait_for_room(entry, exc, deadline)

    def _wait_for_room(self, entry: Entry, exc: OSError, deadline: float) -> None:
        """After a full disk: evict every entry not in use (this handle's readers keep only those
        they read now); return once that freed space, or once another reader released an entry
        or ended a download, to try again; a CacheFullError when nothing else holds space in the
        folder (no wait can help), or at `deadline`."""
        pause = WAIT_POLL
        busy = None
        while True:
            self._release_idle()
            if self.evict(target=0, claimed=True):
                return
            now_busy = self._busy()
            if busy is not None and not busy <= now_busy:  # something another process held is gone
                return
            if not now_busy or time.monotonic() > deadline:
                raise CacheFullError(
                    f"no space left in the object cache {self.root} for {entry.url}: {exc.strerror} "
                    f"({len(now_busy)} entries and downloads in use); free disk space, lower {LIMIT_ENV} "
                    "or point GLOBALLOADER_CACHE_DIR elsewhere"
                ) from None
            busy = now_busy
            time.sleep(pause)
            pause = min(0.1, 2 * pause)

    def _busy(self) -> set[str]:
        """Names of the entries and downloads in the folder (those in use, after `evict(target=0)`)."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            return {item.name for item in it if item.name != STATS_NAME and item.is_file(follow_symlinks=False)}
        return set()

    def _write_once(
        self,
        path: pathlib.Path,
        download: Download,
        reservation: _Reservation,
        opened: bool,
        ahead: bool,
    ) -> _Opened | None:
        """Download into a temporary file (as large as its `reservation` from the start, so that the
        temporary of a process killed midway says what it had reserved, see
        `_remove_dead_temporaries`) and rename it into place, the reservation becoming the entry's
        bytes in the record; already opened under our shared
        lock when `opened` (no eviction deletes it before we read it); else None (a download
        ahead, which reads nothing: no second open, lock and stat per small object). `ahead`: it
        appears claimed (see the module doc). Not synced to
        disk: an entry a crash of the machine left empty or cut short fails its trailer or block
        CRCs at the next read and is fetched again, so an fsync per object (milliseconds, on every
        small object) buys nothing."""
        sums = _Checksums()
        fd = -1
        try:
            with _paths.write_atomic(path, mode=_paths.file_mode(), buffering=_WRITE_CHUNK) as out:
                os.ftruncate(out.file.fileno(), reservation.size)

                def write(chunk: bytes) -> None:
                    out.write(chunk)
                    sums.add(chunk)

                download(write)
                out.write(sums.tail())
                out.file.flush()
                out.file.truncate()  # at its end: no byte of the reservation beyond it
                if ahead:
                    now = time.time_ns()
                    os.utime(out.file.fileno(), ns=(now + AHEAD_CLAIM, now))
                if opened:
                    fd = _paths.open_file(out.temporary, os.O_RDONLY)[0]
                    fcntl.flock(fd, fcntl.LOCK_SH)
                with self.stats.update() as counted:
                    _count_out_replaced(counted, path)
                    out.commit()
                    counted["reserved"] -= reservation.size
                    reservation.size = 0
                    _count_in(counted, sums.length)
            if ahead:
                self._note_ahead(os.fspath(path), stored_size(sums.length))
            return _Opened(fd, sums.crc, _stamp(os.fstat(fd))) if opened else None
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

    def entries(self) -> list[tuple[pathlib.Path, int, float]]:
        """(path, bytes, last use) of every complete entry."""
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for item in it:
                if item.name.endswith(".tmp") or item.name == STATS_NAME or not item.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = item.stat(follow_symlinks=False)
                    found.append((pathlib.Path(item.path), st.st_size, st.st_atime))
        return found

    def on_disk(self) -> int:
        """Bytes the folder's entries and downloads under way take on disk now (each file's size,
        once), counted under the counters' lock, which every change of them takes but a
        download's writes within its reservation: never two states mixed (an entry evicted and
        the download that took its room), so it measures the limit exactly."""
        seen, used = set(), 0
        with self.stats.locked(), contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for item in it:
                if item.name != STATS_NAME and item.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):  # a dead download's, removed meanwhile
                        st = item.stat(follow_symlinks=False)
                        if st.st_ino not in seen:
                            seen.add(st.st_ino)
                            used += st.st_size
        return used

    def evict(self, target: int | None = None, *, claimed: bool = False) -> int:
        """Delete least recently used entries not in use until the cache holds at most `target`
        bytes (default: its limit); remove temporary files of dead downloads (counted as freed:
        their reservations go with them). Entries claimed ahead (see the module doc) only if
        `claimed`, and last, the last claimed first (the last to be read). Returns bytes freed."""
        dead = self._remove_dead_temporaries()
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        target = self.limit if target is None else target
        freed, now = 0, time.time()
        for path, size, used in sorted(entries, key=lambda e: (e[2] > now, -e[2] if e[2] > now else e[2])):
            if total - freed <= target or (used > now and not claimed):
                break
            if self._remove_unused(path):
                freed += size
        return dead + freed

    def evict_if_over_limit(self) -> None:
        """Evict if the record says the cache is over its limit (one small read; if its lock stays
        busy, the folder is counted instead): what a release that may have left an entry of an
        over-limit cache unused calls."""
        try:
            over = self.stats.read(_RECORD_WAIT)["bytes"] > self.limit
        except StorageError:  # a process holding the counters' lock is stopped or slow
            over = True
        if over:
            self.evict()

    # -- what this handle's readers hold open ------------------------------------------------
    def _hold(self, handle: CachedFile) -> None:
        with self._held_lock:
            self._held[handle] = handle.length
            self._held_bytes += handle.length
            if self._registered is None:
                self._registered = Share(Registration.of(self.root / READERS))
                self._registered.add(self._keep_set)
                weakref.finalize(self, self._registered.withdraw)  # a handle dropped gives its hold back
        _release_when_this_process_ends()

    def _unhold(self, handle: CachedFile) -> None:
        with self._held_lock:
            self._held_bytes -= self._held.pop(handle, 0)

    def _touch(self, handle: CachedFile) -> None:
        """After a read of `handle`: the most recently read; the others, beyond what may stay
        open, released (entries opened while all were being read at once)."""
        with self._held_lock:
            if handle in self._held:
                self._held.move_to_end(handle)
            if self._held_bytes <= self.hold and len(self._held) <= HOLD_FILES:
                return
        self._make_room(0, keep=handle)

    def _make_room(self, incoming: int, keep: CachedFile | None = None) -> None:
        """Release the least recently read entries (but `keep`, and those being read now) until
        the others and `incoming` bytes more fit `hold` and HOLD_FILES: before an entry is opened."""
        with self._held_lock:
            over_bytes = self._held_bytes + incoming - self.hold
            over_files = len(self._held) + (incoming > 0) - HOLD_FILES
            idle = []
            for handle, size in self._held.items():
                if over_bytes <= 0 and over_files <= 0:
                    break
                if handle is not keep:
                    idle.append(handle)
                    over_bytes, over_files = over_bytes - size, over_files - 1
        if self._release_idle(idle):
            self.evict_if_over_limit()

    def _release_idle(self, handles: list[CachedFile] | None = None) -> bool:
        """Release these entries (default: all this handle's readers hold), except those being
        read now; whether one was an entry's last."""
        if handles is None:
            with self._held_lock:
                handles = list(self._held)
        last = False
        for handle in handles:
            if handle._lock.acquire(blocking=False):
                try:
                    last |= handle._release()
                finally:
                    handle._lock.release()
        return last

    def _release_oldest(self) -> bool:
        """Release the least recently read entry this handle keeps open and is not reading now;
        whether there was one."""
        with self._held_lock:
            handles = list(self._held)
        for handle in handles:
            if handle._lock.acquire(blocking=False):
                try:
                    if handle._fd >= 0:
                        handle._release()
                        return True
                finally:
                    handle._lock.release()
        return False

    def _after_fork(self) -> None:
        # The descriptors a forked child inherited share their locks with the parent's: closed
        # here without touching the locks; the child opens its own.
        for handle in self._held:
            handle._forget()
        self._reset_held()

    def _remove_dead_temporaries(self) -> int:
        """Remove the temporary files of dead downloads, with the bytes they had reserved (their
        size: see `_write_once`; none for one marked _UNRESERVED); returns the bytes removed."""
        freed = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for item in it:
                pid = _paths.temporary_writer(item.name)
                if pid is not None and not alive(pid):
                    with contextlib.suppress(OSError):
                        size = item.stat(follow_symlinks=False).st_size
                        os.unlink(item.path)
                        if _paths.temporary_mark(item.name) != _UNRESERVED:
                            with self.stats.update() as record:
                                record["reserved"] -= size
                        freed += size
        return freed

    def clear(self) -> int:
        """Delete every entry not in use; returns bytes freed."""
        freed = 0
        for path, size, _ in self.entries():
            if self._remove_unused(path):
                freed += size
        self._remove_dead_temporaries()
        return freed

    def _remove_unused(self, path: pathlib.Path) -> bool:
        """Unlink `path` unless a reader holds it (its shared lock makes ours fail at once)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # gone, or a link (not an entry of ours)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            return self._unlink(path, os.fstat(fd))
        finally:
            os.close(fd)

    def _unlink(self, path: pathlib.Path, st: os.stat_result) -> bool:
        """Remove the entry at `path` if it is still the file `st` describes (not a newer
        entry renamed into its place since), and count it out of the record."""
        with self.stats.update() as record:
            try:
                now = os.lstat(path)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    return False
                path.unlink()
            except FileNotFoundError:
                return False
            record["bytes"] -= st.st_size
            record["entries"] -= 1
            return True


def _count_out_replaced(record: dict[str, int], path: pathlib.Path) -> None:
    """Before an entry is renamed into place: the one there, if any (a damaged entry nobody could
    delete), counted out of the record it replaces."""
    with contextlib.suppress(FileNotFoundError):
        old = os.lstat(path)
        record["bytes"] -= old.st_size
        record["entries"] -= 1


def _count_in(record: dict[str, int], length: int) -> None:
    """An entry of `length` bytes of data downloaded and put in place, counted in the record."""
    record["bytes"] += stored_size(length)
    record["entries"] += 1
    record["misses"] += 1
    record["downloaded_bytes"] += length


def _claimed(path: str, now: int) -> bool:
    """Whether the entry at `path` is still claimed ahead (no reader opened it since; see the
    module doc): there, with its access time in the future."""
    try:
        return os.stat(path, follow_symlinks=False).st_atime_ns > now
    except FileNotFoundError:
        return False


class Claim:
    """An entry claimed for a download ahead (`ObjectCache.claim`): `fill(data, wait)` writes it
    and `release()` lets the machine download it again; unclaimed, `fill` is None. In a `with`
    block, `as` gives `fill` and the block's end releases."""

    __slots__ = ("_release", "fill")

    def __init__(self, fill: Callable[[bytes, bool], bool] | None, release: Callable[[], None] | None) -> None:
        self.fill, self._release = fill, release

    def release(self) -> None:
        """Release the entry's download lock (once; nothing when unclaimed)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Callable[[bytes, bool], bool] | None:
        return self.fill

    def __exit__(self, *exc: object) -> None:
        self.release()


class _WouldWait(Exception):
    """A download ahead told not to wait (`claim`'s `fill`) found no room at once."""


class _Reservation:
    """Bytes a download reserved in the record (see `ObjectCache._reserve`): 0 once its entry
    took them, or when the record could not be had."""

    def __init__(self, size: int) -> None:
        self.size = size


class _Checksums:
    """The CRC-32 of an entry's data and of each CHECK_BLOCK of it, as the data is written."""

    def __init__(self) -> None:
        self.crc = self.length = 0
        self._block_crc = self._block_fill = 0
        self._table = bytearray()

    def add(self, chunk: bytes) -> None:
        if self.length + len(chunk) < CHECK_BLOCK:  # all in the first block: its CRC is the data's
            self.crc = self._block_crc = zlib.crc32(chunk, self.crc)
            self.length += len(chunk)
            self._block_fill = self.length
            return
        self.crc = zlib.crc32(chunk, self.crc)
        self.length += len(chunk)
        view = memoryview(chunk)
        while view:
            piece = view[: CHECK_BLOCK - self._block_fill]
            self._block_crc = zlib.crc32(piece, self._block_crc)
            self._block_fill += len(piece)
            view = view[len(piece) :]
            if self._block_fill == CHECK_BLOCK:
                self._end_block()

    def _end_block(self) -> None:
        self._table += _SLOT.pack(self._block_crc)
        self._block_crc = self._block_fill = 0

    def tail(self) -> bytes:
        """What follows the data in the entry: its table and its trailer."""
        if self._block_fill:
            self._end_block()
        return bytes(self._table) + _TRAILER.pack(_MAGIC, self.crc, self.length)


# Every cache handle of the process, and the process that registered the release at its end.
_CACHES: weakref.WeakSet[ObjectCache] = weakref.WeakSet()
_releasing_pid = 0


def _release_when_this_process_ends() -> None:
    """Have `_release_all` run when this process ends: at interpreter exit, or when a
    multiprocessing worker returns (after the workers it started were stopped, so that what
    they held is no longer in use)."""
    global _releasing_pid
    if _releasing_pid != os.getpid():
        _releasing_pid = os.getpid()
        multiprocessing.util.Finalize(None, _release_all, exitpriority=-1)


def _release_all() -> None:
    """Release every entry this process holds, and evict what that (or the end of its workers)
    left over the limit: a job that has ended leaves its cache within its limit."""
    for cache in list(_CACHES):
        if cache.root.is_dir():  # not one removed since (a temporary folder)
            with contextlib.suppress(GlobalLoaderError, OSError):
                cache._release_idle()
                cache.evict_if_over_limit()

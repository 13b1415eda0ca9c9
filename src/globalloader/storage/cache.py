"""The machine-wide object cache: remote objects (or fixed blocks of them) kept on local disk.

One folder per machine (`$GLOBALLOADER_CACHE_DIR/objects`, see `_paths.cache_dir`), shared by
every process and job of the user. Properties, each relied on elsewhere:

- Keyed by everything that decides the bytes: URL, size and version (ETag, generation or
  mtime), plus the block number for a block. A changed object has another key, so it is never
  served stale.
- An entry is written to a temporary file and renamed into place, with a 16-byte trailer holding
  a CRC-32 and the length of the data. A process killed mid-download leaves a temporary file,
  never an entry; an entry whose length or checksum is wrong (checked once per process and
  entry) is deleted and fetched again.
- Concurrent readers of a missing entry wait on one exclusive file lock (flock) per entry while
  one of them downloads, so K processes download each object once.
- Readers hold a shared flock on the entry while they read; eviction (least recently used by
  access time, which every open sets) takes an exclusive one without waiting and skips entries in
  use, so it never deletes what a reader has open. Entries in use may take the cache past its
  limit until they are closed.
- A full disk first evicts what it can, then is a CacheFullError naming the folder.
- Machine-wide counters (bytes downloaded, hits, misses, size, entries) live in the folder's
  `stats` record (see `cache_stats`): best-effort, a busy lock never delays a read.
- Only this user can have written the folder and its files (`_paths.untrusted`, checked at every
  open; files are opened without following links), unless the user opted into a cache shared
  with its group: then an entry another user wrote has its CRC-32 checked at every open.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import pathlib
import re
import socket
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

from globalloader import _paths
from globalloader._pids import alive
from globalloader.errors import ArgumentError, CacheFullError, StorageError
from globalloader.storage.cache_stats import CacheStats, lock_exclusive

DEFAULT_LIMIT = 20 * 10**9  # bytes, when neither cache_limit= nor GLOBALLOADER_CACHE_LIMIT says
LIMIT_ENV = "GLOBALLOADER_CACHE_LIMIT"
LOCK_TIMEOUT = 900.0  # seconds to wait for another process's download of the same entry
# Longest pause between two tries of that lock: a worker waiting for the prefetch's download of its
# shard starts reading at most this late (a try is one system call).
WAIT_POLL = 0.002
STATS_NAME = "stats"  # the counters' record in the folder (entries are named by 40 hex digits)
_TRAILER = struct.Struct("<4sIQ")  # magic, CRC-32 of the data, data length
_MAGIC = b"GLC1"
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


def crc32_upto(fd: int, end: int) -> int:
    """CRC-32 of bytes [0, end) of an open file (fewer at its end), read in 16 MiB pieces."""
    crc = offset = 0
    while offset < end and (piece := os.pread(fd, min(16 << 20, end - offset), offset)):
        crc = zlib.crc32(piece, crc)
        offset += len(piece)
    return crc


class CachedFile:
    """An open cache entry: ranged reads with `pread`, under a shared lock until `close()`."""

    def __init__(self, fd: int, length: int, path: pathlib.Path, crc32: int) -> None:
        self.fd, self.length, self.path, self.crc32 = fd, length, path, crc32

    def pread(self, start: int, length: int) -> bytes:
        length = max(0, min(length, self.length - start))
        data = pread_upto(self.fd, length, start)
        if len(data) != length:
            raise StorageError(f"cache entry {self.path} ended at {start + len(data)}, expected {self.length} bytes")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the shared lock
            self.fd = -1


# (dev, inode, mtime_ns, size) of the entries checked in this process. Opens set the access time (the
# LRU clock), never the mtime, so an entry is read whole once per process, not at every open, and a
# write into it changes the mtime and has it checked again.
_verified: set[tuple[int, int, int, int]] = set()
_verified_lock = threading.Lock()


class ObjectCache:
    """Entries on local disk, shared by every process of the machine (see the module doc)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, limit: int | str | None = None) -> None:
        self.root = pathlib.Path(root) if root is not None else default_root()
        self.limit = resolve_limit(limit)
        self._locks = self.root / "locks"
        self.stats = CacheStats(self.root / STATS_NAME, self._scan)
        try:
            _paths.make_folder(self.root)
            _paths.make_folder(self._locks)
        except OSError as exc:
            raise StorageError(f"cannot create the object cache {self.root}: {exc.strerror}") from None
        _paths.check_folder(self.root, follow=root is not None)  # a folder the caller named may be a link
        _paths.check_folder(self._locks)

    def open(self, entry: Entry, download: Callable[[Callable[[bytes], None]], None]) -> CachedFile:
        """The entry, opened under a shared lock; downloaded first if missing or damaged.

        `download(write)` must call `write(chunk)` with the entry's bytes in order; it runs in
        one process of the machine at a time per entry, the others wait for it.
        """
        path = self.root / entry.name()
        found = self._open_existing(path)
        if found is not None:
            return self._hit(found)
        with self._download_lock(path, entry):
            found = self._open_existing(path)  # another process finished it while we waited
            if found is not None:
                return self._hit(found)
            self._write(path, entry, download)
            found = self._open_existing(path)  # under our shared lock before eviction runs
        if found is None:
            raise StorageError(f"cache entry {path} of {entry.url} cannot be read right after it was written")
        self.evict()
        return found

    def _hit(self, found: CachedFile) -> CachedFile:
        try:
            with self.stats.update() as record:
                record["hits"] += 1
        except BaseException:
            found.close()
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

    def _open_existing(self, path: pathlib.Path) -> CachedFile | None:
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
            checked = self._check(fd, st, path)
            if checked is None:
                with contextlib.suppress(OSError):
                    self._unlink(path, st)
                os.close(fd)
                return None
            # Least recently used = oldest access. Only an entry's owner may set its times: another
            # member's entry in a cache shared with the group keeps its owner's last access.
            with contextlib.suppress(PermissionError):
                os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return CachedFile(fd, checked[0], path, checked[1])

    @staticmethod
    def _check(fd: int, st: os.stat_result, path: pathlib.Path) -> tuple[int, int] | None:
        """The data length and CRC-32 if the trailer and (once per process) the data agree;
        else None."""
        if st.st_size < _TRAILER.size:
            return None
        magic, crc, length = _TRAILER.unpack(os.pread(fd, _TRAILER.size, st.st_size - _TRAILER.size))
        if magic != _MAGIC or length != st.st_size - _TRAILER.size:
            return None
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        # Only this user's entries are remembered: another user's (a cache shared with the group)
        # is checked at every open.
        ours = st.st_uid == os.geteuid()
        if ours and ident in _verified:
            return length, crc
        if crc32_upto(fd, length) != crc:
            return None
        if ours:
            with _verified_lock:
                _verified.add(ident)
        return length, crc

    @contextlib.contextmanager
    def _download_lock(self, path: pathlib.Path, entry: Entry) -> Iterator[None]:
        lock_path = self._locks / f"{path.name}.lock"
        try:  # read-only is enough for flock: a lock file made by another member of a shared cache
            fd = _paths.open_file(lock_path, os.O_RDONLY, _paths.file_mode())[0]
        except FileNotFoundError:  # the folder was removed under us (rm -rf of the cache)
            _paths.make_folder(self._locks)
            fd = _paths.open_file(lock_path, os.O_RDONLY, _paths.file_mode())[0]
        try:
            waited_for = (
                f"another process to download {entry.url} into the cache {self.root}; "
                f"if none is running, remove {lock_path}"
            )
            lock_exclusive(fd, LOCK_TIMEOUT, waited_for, pause_max=WAIT_POLL)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # not only close: a forked child may hold a copy (see cache_stats)
            os.close(fd)

    def _write(self, path: pathlib.Path, entry: Entry, download: Callable[[Callable[[bytes], None]], None]) -> None:
        for last_try in (False, True):
            try:
                return self._write_once(path, download)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise StorageError(f"cannot write {entry.url} into the cache {self.root}: {exc}") from None
                if last_try:
                    raise CacheFullError(
                        f"no space left in the object cache {self.root} for {entry.url}: {exc.strerror}; "
                        f"free disk space, lower {LIMIT_ENV} or point GLOBALLOADER_CACHE_DIR elsewhere"
                    ) from None
                self.evict(keep_free=entry.size)

    def _write_once(self, path: pathlib.Path, download: Callable[[Callable[[bytes], None]], None]) -> None:
        tmp = path.with_name(f"{path.name}.{_HOST}-{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        crc = length = 0
        try:
            with open(_paths.create_file(tmp, os.O_WRONLY, _paths.file_mode()), "wb", buffering=_WRITE_CHUNK) as out:

                def write(chunk: bytes) -> None:
                    nonlocal crc, length
                    out.write(chunk)
                    crc = zlib.crc32(chunk, crc)
                    length += len(chunk)

                download(write)
                out.write(_TRAILER.pack(_MAGIC, crc, length))
            with self.stats.update() as record:
                with contextlib.suppress(FileNotFoundError):
                    old = os.lstat(path)  # a damaged entry nobody could delete: replaced
                    record["bytes"] -= old.st_size
                    record["entries"] -= 1
                os.replace(tmp, path)
                st = os.lstat(path)  # its CRC was just computed from the bytes written: no read back
                record["bytes"] += st.st_size
                record["entries"] += 1
                record["misses"] += 1
                record["downloaded_bytes"] += length
            with _verified_lock:
                _verified.add((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        except BaseException:
            tmp.unlink(missing_ok=True)
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

    def evict(self, keep_free: int = 0) -> int:
        """Delete least recently used entries not in use until the cache fits its limit (and
        `keep_free` more bytes); remove temporary files of dead downloads. Returns bytes freed."""
        self._remove_dead_temporaries()
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        freed = 0
        for path, size, _ in sorted(entries, key=lambda e: e[2]):
            if total - freed + keep_free <= self.limit:
                break
            if self._remove_unused(path):
                freed += size
        return freed

    def _remove_dead_temporaries(self) -> None:
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for item in it:
                parts = item.name.split(".")
                if len(parts) != 4 or parts[3] != "tmp":
                    continue
                owner_host, _, pid = parts[1].rpartition("-")
                if owner_host == _HOST and pid.isdigit() and not alive(int(pid)):
                    with contextlib.suppress(OSError):
                        os.unlink(item.path)

    def clear(self) -> int:
        """Delete every entry not in use, and the lock files of the deleted ones (a process
        waiting on one at that moment may then download its entry a second time: wasted bytes,
        never a wrong entry); returns bytes freed."""
        freed = 0
        for path, size, _ in self.entries():
            if self._remove_unused(path):
                freed += size
                (self._locks / f"{path.name}.lock").unlink(missing_ok=True)
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


def host_tag() -> str:
    """This machine's name with letters and digits only: one field of a file name."""
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())


_HOST = host_tag()  # with the pid, names whose temporary files they are (see evict)

"""Machine-wide counters of the object cache: one fixed-size record in its folder.

Every process of the machine (jobs, their workers, the shared server's decode workers) adds to
the same record under an exclusive flock: bytes downloaded, misses (downloads), hits (opens
served without a download), the folder's size and entry count, changed by whoever adds or
removes an entry while it holds the lock, so the figures follow the folder without walking it,
and the bytes reserved by downloads under way (the cache's limit counts them).
The record is written in place by one `pwrite` and carries a CRC-32: a process killed mid-update
leaves the previous record; a torn or damaged one is detected and started again (counters from
zero, as after a restart; size and entries from one walk of the folder).
Each handle keeps its descriptor of the record open (an update is a lock, a read and a write, not
an open and a close too: one per cache entry written or read), shared by the process's threads
under a thread lock, and opens it again once the file is gone (`rm -rf` of the cache).

The counters are best-effort: an update never waits for the lock longer than BUSY_WAIT, so a
process stopped (SIGSTOP, a debugger) or hung while it holds the lock never blocks or fails a
read. Changes made while the lock is busy are deferred, kept by the process and added to the
record by its next update that gets the lock (which then does not wait: one try per update until
the lock is free again), or when it exits (within EXIT_WAIT). Only the deferred changes of a
process that ends before the lock is free, or is killed, are lost; a lost change of size or
entries is repaired by the next walk of the folder (`globalloader cache info`).
"""

from __future__ import annotations

import contextlib
import fcntl
import operator
import os
import pathlib
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from multiprocessing import util as _mp_util
from typing import Any

from globalloader import _paths
from globalloader.errors import StorageError
from globalloader.storage._fork import reset_in_forked_children

# `reserved`: bytes of the downloads under way, reserved before they are written (see
# `ObjectCache._reserve`), which become an entry's `bytes` when it is renamed into place.
FIELDS = ("downloaded_bytes", "hits", "misses", "bytes", "entries", "reserved")
LOCK_TIMEOUT = 30.0  # seconds `read` waits; the lock is held for a few system calls at a time
BUSY_WAIT = 0.05  # seconds an update waits for the lock before it defers its changes
EXIT_WAIT = 0.5  # seconds a process ending waits for the lock to write what it deferred
_VALUES = operator.itemgetter(*FIELDS)  # a record's values in FIELDS order
_RECORD = struct.Struct("<4s6Q")
_CRC = struct.Struct("<I")
_MAGIC = b"GLS2"  # GLS1 records had no `reserved`: they read as damaged and start again


class CacheStats:
    """The record at `path`; `scan()` gives (bytes, entries) of the folder when it starts again."""

    def __init__(self, path: pathlib.Path, scan: Callable[[], tuple[int, int]]) -> None:
        self.path, self._scan = path, scan
        self._fd = -1
        self._closer: weakref.finalize[[int], CacheStats] | None = None
        self._after_fork()
        reset_in_forked_children(self)

    def _after_fork(self) -> None:
        # A forked child's copy of the descriptor shares the parent's flock: closed without
        # unlocking it (only the parent may), and never by the finalizer; the child opens its own.
        if self._closer is not None:
            self._closer.detach()
            _close_quietly(self._fd)
        self._fd, self._closer = -1, None
        self._guard = threading.Lock()  # a thread of the parent may have held it at the fork

    @contextlib.contextmanager
    def update(self) -> Iterator[dict[str, int]]:
        """The record for the block: change its values to update it (written when the block ends
        without an exception). Changes of the folder's entries belong inside. When the lock is
        busy (see the module doc) the block gets zeros instead, and its changes are deferred."""
        with _Locked(self, 0.0 if _DEFERRED.has(self.path) else BUSY_WAIT, or_none=True) as record:
            if record is None:
                changes = dict.fromkeys(FIELDS, 0)
                yield changes
                _DEFERRED.add(self, changes)
                return
            yield record

    def _descriptor(self) -> int:
        """The open record (opened again when its file was removed: `rm -rf` of the cache)."""
        # Not alive: closed by its finalizer at the interpreter's exit, before the exit hook that
        # writes the deferred changes.
        if self._closer is not None and self._closer.alive and os.fstat(self._fd).st_nlink:
            return self._fd
        if self._closer is not None:
            self._closer()
        self._fd = self._open()
        self._closer = weakref.finalize(self, _close_quietly, self._fd)
        return self._fd

    def _read_locked(self, fd: int) -> tuple[dict[str, int], dict[str, int] | None, dict[str, int]]:
        """The record of `fd` (locked) with this process's deferred changes added, the record as
        read (None: new or damaged), and those changes."""
        record = _unpack(os.pread(fd, _RECORD.size + _CRC.size, 0))
        before = dict(record) if record is not None else None
        deferred = _DEFERRED.take(self.path)
        if record is None:
            size, count = self._scan()
            record = dict.fromkeys(FIELDS, 0) | {"bytes": size, "entries": count}
            deferred |= {"bytes": 0, "entries": 0}  # the walk has counted them
        for field, change in deferred.items():
            record[field] += change
        return record, before, deferred

    def write_deferred(self, timeout: float) -> None:
        """Add this process's deferred changes to the record if the lock is free within `timeout`."""
        with contextlib.suppress(StorageError), self.locked(timeout):
            pass

    def locked(self, timeout: float = LOCK_TIMEOUT) -> _Locked:
        """The record for the block, like `update` but waiting for the lock up to `timeout` seconds
        (else a StorageError): to read it, or to set values rather than add to them."""
        return _Locked(self, timeout)

    def locked_now(self) -> _Locked:
        """The record for the block if its lock is free now, else None: for a caller that must
        not wait (an event loop's)."""
        return _Locked(self, 0.0, or_none=True)

    def read(self, timeout: float = LOCK_TIMEOUT) -> dict[str, int]:
        with self.locked(timeout) as record:
            return dict(record)

    def _open(self) -> int:
        mode = _paths.file_mode(group_writes=True)  # every process of the cache writes it in place
        try:
            try:
                return _paths.open_file(self.path, os.O_RDWR, mode)[0]
            except FileNotFoundError:  # the folder was removed under us (rm -rf of the cache)
                _paths.make_folder(self.path.parent)
                return _paths.open_file(self.path, os.O_RDWR, mode)[0]
        except OSError as exc:
            raise StorageError(f"cannot open the cache's counters {self.path}: {exc.strerror}") from None


class _Locked:
    """The record under its lock for a `with` block (`CacheStats.locked`, `update`): its descriptor
    under the flock, the record read with this process's deferred changes added, written back
    when the block ends without an exception and changed it. One descriptor per handle, kept open
    (an open, a check and a close fewer per update: one per cache entry written or read); a flock
    does not exclude the threads sharing a descriptor, so a thread lock does. Not within `timeout`
    seconds: a StorageError, or the block gets None (`or_none`). A class, not a generator:
    it runs about twice per object a download ahead writes."""

    __slots__ = ("_before", "_deferred", "_fd", "_or_none", "_record", "_stats", "_timeout")

    def __init__(self, stats: CacheStats, timeout: float, or_none: bool = False) -> None:
        self._stats, self._timeout, self._or_none, self._fd = stats, timeout, or_none, -1

    def __enter__(self) -> Any:
        stats = self._stats
        deadline = time.monotonic() + self._timeout
        if not stats._guard.acquire(timeout=self._timeout):
            return self._not_got()
        locked = False
        try:
            fd = stats._descriptor()
            locked = _try_lock(fd, max(0.0, deadline - time.monotonic()))
            if locked:
                self._record, self._before, self._deferred = stats._read_locked(fd)
        except BaseException:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
            stats._guard.release()
            raise
        if not locked:
            stats._guard.release()
            return self._not_got()
        self._fd = fd
        return self._record

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self._fd < 0:  # not got: nothing held
            return
        try:
            if kind is not None:
                _DEFERRED.add(self._stats, self._deferred)  # not written: kept for the next update
            elif self._record != self._before:
                os.pwrite(self._fd, _pack(self._record), 0)
        finally:
            # Unlock explicitly: a child forked by another thread meanwhile holds a copy of the
            # descriptor, and a flock lasts until every copy is closed or one unlocks it.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._fd = -1
            self._stats._guard.release()

    def _not_got(self) -> None:
        if self._or_none:
            return
        raise StorageError(
            f"waited {self._timeout:.0f} s for the lock of the cache's counters {self._stats.path}; "
            "a process holding it is stopped or hung"
        )


class _Deferred:
    """The changes this process could not write because the lock was busy, per record; written
    by its next update, or when it exits."""

    def __init__(self) -> None:
        self._after_fork()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it at the fork
        # Per record: one of its handles (to write them at exit) and the changes; the parent
        # writes its own.
        self._pending: dict[pathlib.Path, tuple[CacheStats, dict[str, int]]] = {}
        self._at_exit = False

    def has(self, path: pathlib.Path) -> bool:
        return path in self._pending

    def add(self, stats: CacheStats, changes: dict[str, int]) -> None:
        if not any(changes.values()):
            return
        with self._lock:
            kept = self._pending.setdefault(stats.path, (stats, dict.fromkeys(FIELDS, 0)))[1]
            for field, change in changes.items():
                kept[field] += change
            if not self._at_exit:
                # multiprocessing's exit hook, which worker processes run too (they end with
                # os._exit, which skips atexit).
                _mp_util.Finalize(self, _write_all_deferred, exitpriority=0)
                self._at_exit = True

    def take(self, path: pathlib.Path) -> dict[str, int]:
        with self._lock:
            return self._pending.pop(path, (None, {}))[1]

    def records(self) -> list[CacheStats]:
        with self._lock:
            return [stats for stats, _ in self._pending.values()]


def _write_all_deferred() -> None:
    for stats in _DEFERRED.records():
        stats.write_deferred(EXIT_WAIT)


_DEFERRED = _Deferred()
reset_in_forked_children(_DEFERRED)


def lock_exclusive(fd: int, timeout: float, waited_for: str, pause_max: float = 0.01) -> None:
    """flock `fd` exclusively within `timeout` seconds, else a StorageError saying what was
    `waited_for`: a lock held by a stopped process is never a hang."""
    if not _try_lock(fd, timeout, pause_max):
        raise StorageError(f"waited {timeout:.0f} s for {waited_for}")


def _try_lock(fd: int, timeout: float, pause_max: float = 0.01) -> bool:
    """Whether `fd` was flocked exclusively within `timeout` seconds (one try when 0)."""
    return try_until(lambda: _flock_now(fd), timeout, pause_max)


def _flock_now(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def try_until(attempt: Callable[[], bool], timeout: float, pause_max: float) -> bool:
    """Whether `attempt()` (a lock taken without waiting) succeeded within `timeout` seconds (one
    try when 0), tried again after a pause growing from half a millisecond to `pause_max`."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not attempt():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause_max, pause * 2)
    return True


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _pack(record: dict[str, int]) -> bytes:
    body = _RECORD.pack(_MAGIC, *[max(0, value) for value in _VALUES(record)])
    return body + _CRC.pack(zlib.crc32(body))


def _unpack(data: bytes) -> dict[str, int] | None:
    """The record, or None when the file is new, torn or damaged."""
    if len(data) != _RECORD.size + _CRC.size:
        return None
    body, (crc,) = data[: _RECORD.size], _CRC.unpack(data[_RECORD.size :])
    magic, *values = _RECORD.unpack(body)
    if magic != _MAGIC or zlib.crc32(body) != crc:
        return None
    return dict(zip(FIELDS, values, strict=True))

"""Machine-wide counters of the object cache: one fixed-size record in its folder.

Every process of the machine (jobs, their workers, the shared server's decode workers) adds to
the same record under an exclusive flock: bytes downloaded, misses (downloads), hits (opens
served without a download), and the folder's size and entry count, changed by whoever adds or
removes an entry while it holds the lock, so the figures follow the folder without walking it.
The record is written in place by one `pwrite` and carries a CRC-32: a process killed mid-update
leaves the previous record; a torn or damaged one is detected and started again (counters from
zero, as after a restart; size and entries from one walk of the folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import struct
import time
import zlib
from collections.abc import Callable, Iterator

from globalloader.errors import StorageError

FIELDS = ("downloaded_bytes", "hits", "misses", "bytes", "entries")
LOCK_TIMEOUT = 30.0  # seconds; the lock is held for a few system calls at a time
_RECORD = struct.Struct("<4s5Q")
_CRC = struct.Struct("<I")
_MAGIC = b"GLS1"


class CacheStats:
    """The record at `path`; `scan()` gives (bytes, entries) of the folder when it starts again."""

    def __init__(self, path: pathlib.Path, scan: Callable[[], tuple[int, int]]) -> None:
        self.path, self._scan = path, scan

    @contextlib.contextmanager
    def update(self, timeout: float = LOCK_TIMEOUT) -> Iterator[dict[str, int]]:
        """The record, locked for the block: change its values to update it (written when the
        block ends without an exception). Changes of the folder's entries belong inside."""
        fd = self._open()
        try:
            lock_exclusive(
                fd, timeout, f"the lock of the cache's counters {self.path}; a process holding it is stopped or hung"
            )
            record = _unpack(os.pread(fd, _RECORD.size + _CRC.size, 0))
            before = dict(record) if record is not None else None
            if record is None:
                size, count = self._scan()
                record = dict.fromkeys(FIELDS, 0) | {"bytes": size, "entries": count}
            yield record
            if record != before:
                os.pwrite(fd, _pack(record), 0)
        finally:
            # Unlock explicitly: a child forked by another thread meanwhile holds a copy of the
            # descriptor, and a flock lasts until every copy is closed or one unlocks it.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def read(self, timeout: float = LOCK_TIMEOUT) -> dict[str, int]:
        with self.update(timeout) as record:
            return dict(record)

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            try:
                return os.open(self.path, flags, 0o600)
            except FileNotFoundError:  # the folder was removed under us (rm -rf of the cache)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                return os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise StorageError(f"cannot open the cache's counters {self.path}: {exc.strerror}") from None


def lock_exclusive(fd: int, timeout: float, waited_for: str, pause_max: float = 0.01) -> None:
    """flock `fd` exclusively within `timeout` seconds (polling with a growing pause), else a
    StorageError saying what was `waited_for`: a lock held by a stopped process is never a hang."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise StorageError(f"waited {timeout:.0f} s for {waited_for}") from None
            time.sleep(pause)
            pause = min(pause_max, pause * 2)


def _pack(record: dict[str, int]) -> bytes:
    body = _RECORD.pack(_MAGIC, *(max(0, record[f]) for f in FIELDS))
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

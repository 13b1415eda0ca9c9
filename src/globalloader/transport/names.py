"""Names of POSIX shared memory: the "gl-" prefix every segment and arena starts with, creating,
mapping and unlinking them, leftovers of crashed processes (and of process groups killed whole),
and the free space of /dev/shm.

Names are created with `_posixshmem` directly rather than `multiprocessing.shared_memory`, whose
resource tracker registers segments a process merely attaches to and unlinks them (with
warnings) when that process exits. POSIX only.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import errno
import fcntl
import mmap
import os
import sys
import time
from typing import NamedTuple

from globalloader._pids import alive
from globalloader.errors import ArgumentError

PREFIX = "gl-"  # every name this library creates starts with it
SHM_DIR = "/dev/shm"  # where Linux exposes POSIX shared-memory names
# A dead owner's segment this old is an orphan (a live job's batches are read within seconds).
ORPHAN_AGE_S = 60.0
# madvise(MADV_POPULATE_READ), Linux 5.14 and later (Python names it from 3.12 only).
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


def free_bytes() -> int | None:
    """Bytes free in /dev/shm (None where it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def list_names(prefix: str) -> list[str]:
    """Shared-memory names starting with `prefix` (Linux only; elsewhere empty)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return []


def remove_leftovers(prefix: str) -> int:
    """Unlink every shared-memory name starting with `prefix`; return how many were removed.

    For cleanup after a crash: names of batches created but never read survive their writer.
    Lists the names on Linux only; elsewhere returns 0.
    """
    check_prefix(prefix)
    return sum(1 for name in list_names(prefix) if unlink(name))


def remove_orphans() -> int:
    """Unlink the batch segments (`gl-<owner pid>-...`) of dead owners; return how many. A SIGKILL
    of a whole process group leaves no watchdog to clean them up. (Servers' arenas are held by a
    lock, not named by a live pid: `remove_unheld` sweeps those.)

    An orphan's pid runs no process, this user owns it, and it was last written more than
    ORPHAN_AGE_S ago: the age keeps safe a job whose pid this process cannot see (another pid
    namespace sharing /dev/shm), whose batches are read within seconds.
    """
    removed, now, uid = 0, time.time(), os.geteuid()
    for name in list_names(PREFIX):
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or alive(int(pid)):
            continue
        try:
            st = os.stat(os.path.join(SHM_DIR, name))
        except OSError:  # gone meanwhile
            continue
        if st.st_uid == uid and now - st.st_mtime >= ORPHAN_AGE_S:
            removed += unlink(name)
    return removed


def check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix or "/" in prefix or "\0" in prefix:
        raise ArgumentError(f"prefix: {prefix!r} must be a non-empty str without '/', e.g. 'gl-1234-0-'")


class Mapped(NamedTuple):
    """A mapping and the inode of the file it maps: what the file is, where its name only says
    where it is (a name can be unlinked and made again by another owner; the inode of a file a
    process maps stays that file's). `holder`: with `hold=True`, a descriptor whose shared flock
    says the file's creator lives (close it, after unlinking, when done); else None."""

    mapping: mmap.mmap
    inode: int
    holder: int | None = None


def create_mapping(
    name: str, capacity: int, flags: int = mmap.MAP_SHARED, hold: bool = False, written: bool = False
) -> Mapped:
    """Create `name` (FileExistsError if it exists) with `capacity` bytes reserved up front, and map it.

    Reserving (not just sizing) makes a full tmpfs fail here, with an OSError, instead of killing
    the first writer with SIGBUS later; the name is unlinked again on any failure after creation.
    `hold=True` keeps a shared flock on the file for as long as the returned `holder` (or a forked
    copy of it) is open: what tells `remove_unheld` that its creator lives. `written=True`
    reserves by writing zeros over it rather than by fallocate: pages written once can be mapped
    16 to a fault by every process (`populate`), fallocated ones only one by one (`tests/transport/test_arena.py`
    counts a worker's faults).
    """
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    if hold:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:  # a sweep took it between its creation and the lock: again
            os.close(fd)
            return create_mapping(name, capacity, flags, hold)
    try:
        if written:
            _write_zeros(fd, capacity)
        elif hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, capacity)
        else:  # not Linux: sized only
            os.ftruncate(fd, capacity)
        mapped = Mapped(mmap.mmap(fd, capacity, flags=flags), os.fstat(fd).st_ino, fd if hold else None)
    except BaseException:
        unlink(name)
        os.close(fd)
        raise
    if not hold:
        os.close(fd)
    return mapped


def _write_zeros(fd: int, capacity: int) -> None:
    os.ftruncate(fd, capacity)
    zeros = memoryview(bytes(min(capacity, 8 << 20)))
    start = 0
    while start < capacity:
        start += os.pwrite(fd, zeros[: capacity - start], start)  # ENOSPC when tmpfs is full


def remove_unheld(prefix: str) -> int:
    """Unlink this user's names starting with `prefix` that no live process holds: what servers
    that died left. A lock tells, not a pid: a server in another PID namespace sharing /dev/shm
    has a pid this process cannot see, or one that here means another process."""
    check_prefix(prefix)
    return sum(_remove_if_unheld(name) for name in list_names(prefix))


def _remove_if_unheld(name: str) -> bool:
    """Unlink `name` if it is this user's and no process holds it, while this process holds its
    lock: a creator between its creation and its lock then finds it gone and makes it again
    (`create_mapping`) rather than serving a file that has no name."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0o600)
    except OSError:  # gone, or not ours to open
        return False
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return unlink(name)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # and with it the lock


def map_existing(name: str, flags: int = mmap.MAP_SHARED, inode: int | None = None) -> mmap.mmap:
    """Map the whole of the existing `name`: FileNotFoundError if it is gone, or if `inode` is
    given and `name` now is another file (its owner unlinked it and a new one took the name)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    try:
        st = os.fstat(fd)
        if inode is not None and st.st_ino != inode:
            raise FileNotFoundError(errno.ENOENT, f"{SHM_DIR}/{name} is another file than inode {inode} now")
        return mmap.mmap(fd, st.st_size, flags=flags)
    finally:
        os.close(fd)


def populate(mapping: mmap.mmap, start: int, end: int) -> None:
    """Map the pages of bytes [start, end) of `mapping` into this process at once, before writing them.

    A write to a page of shared memory that this process has not touched yet faults once per
    page (write faults map no neighbours); populating the range for reading maps its pages 16 to
    a fault (those written once: see `create_mapping(written=True)`), writable (shared memory
    needs no notice of writes). Where the kernel cannot (before Linux 5.14: EINVAL), the writes
    fault as before."""
    if _POPULATE_READ is None or end <= start:
        return
    first = start - start % mmap.PAGESIZE
    with contextlib.suppress(OSError):
        mapping.madvise(_POPULATE_READ, first, end - first)


def unlink(name: str) -> bool:
    """Unlink a name; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True

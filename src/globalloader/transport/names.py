"""Names of POSIX shared memory: the "gl-" prefix every segment and pool starts with, unlinking,
leftovers of crashed processes, and the free space of /dev/shm.

Names are created with `_posixshmem` directly rather than `multiprocessing.shared_memory`, whose
resource tracker registers segments a process merely attaches to and unlinks them (with
warnings) when that process exits. POSIX only.
"""

from __future__ import annotations

import _posixshmem
import os

from globalloader.errors import ArgumentError

PREFIX = "gl-"  # every name this library creates starts with it
SHM_DIR = "/dev/shm"  # where Linux exposes POSIX shared-memory names


def free_bytes() -> int | None:
    """Bytes free in /dev/shm (None where it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def list_names(prefix: str = PREFIX) -> list[str]:
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


def check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix or "/" in prefix or "\0" in prefix:
        raise ArgumentError(f"prefix: {prefix!r} must be a non-empty str without '/', e.g. 'gl-1234-0-'")


def unlink(name: str) -> bool:
    """Unlink a name; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True

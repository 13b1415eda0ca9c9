"""Whether a process is alive, by pid: for the worker pools and the service (peers, owners) and
for the cache's and the Arrow copy's temporary files (whether their writer still runs)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether a process with this pid runs (ours or another user's; a zombie has ended).

    A pid of 0 (a peer in a pid namespace we cannot see) counts as running: such a peer is
    still noticed when its socket closes.
    """
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True

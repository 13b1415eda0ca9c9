"""Per-process state that a forked child must drop: threads, descriptors, locks."""

from __future__ import annotations

import os
import weakref
from typing import Any

_FORK_AWARE: weakref.WeakSet[Any] = weakref.WeakSet()


def reset_in_forked_children(obj: Any) -> None:
    """Call `obj._after_fork()` in every child forked from now on (`obj` is held weakly).

    A hook at fork time, not a pid check per read, keeps the hot path free of a system call.
    """
    _FORK_AWARE.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_FORK_AWARE):
        obj._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ProcessLocal:
    """Base of objects pickled to worker processes: `_reset()` makes the per-process state
    (handles, locks, caches) named in `_PROCESS_ONLY`, which is never pickled; an unpickled copy
    calls `_reset()` to make its own."""

    _PROCESS_ONLY: tuple[str, ...] = ()

    def _reset(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._PROCESS_ONLY}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

"""The shared-memory arena behind the server's sample store, as every process maps it.

The server creates one POSIX shared-memory segment of the arena's size (--memory); its decode workers write
samples into it and clients' workers read them in place, as NumPy views (zero copy). Offsets come
from the server's `SampleStore`; layouts are the codec's, so a sample is described like a batch.

An arena is known by its `ArenaId`, its name and its file's inode, never by the name alone: a
server in its own PID namespace (a sidecar sharing /dev/shm) is pid 1, so `gl-pool-1`, at every
start, and a mapping of the file an earlier server unlinked must never be taken for the new one.
A process maps each file once; a job holds it (`hold`) while a session uses it and `release`
unmaps it when the last one ends.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from typing import Any, NamedTuple

import numpy as np

from globalloader.errors import ServerGoneError, ServerStartError
from globalloader.transport.codec import copy_arrays, decode_tree, encode_tree
from globalloader.transport.names import (
    PREFIX,
    SHM_DIR,
    create_mapping,
    free_bytes,
    map_existing,
    populate,
    unlink,
)

ARENA_PREFIX = PREFIX + "pool-"  # + the server's pid (+ "-<random>" if a live server of another PID namespace has it)


class ArenaId(NamedTuple):
    """Which arena: the name the server gave it and the inode of its file (see the module doc)."""

    name: str
    inode: int


_attached: dict[str, Arena] = {}  # name -> this process's mapping of the file of that name it last mapped
_lock = threading.Lock()  # over `_attached` and the holds
os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))  # never inherited held


class Arena:
    def __init__(self, arena_id: ArenaId, mapping: mmap.mmap, holder: int | None = None) -> None:
        # `holder`: the server's (the owner's) descriptor whose lock says the arena lives (`names.remove_unheld`)
        self.id, self.name, self.mapping, self._holder = arena_id, arena_id.name, mapping, holder
        self._bytes = np.frombuffer(mapping, np.uint8)
        self._holders = 0  # sessions of this process using it (`hold`)

    def write(self, offset: int, placed: list[tuple[int, np.ndarray]]) -> None:
        """Copy a sample's arrays (from `encode`) to `offset`, its pages mapped first in one call
        (`names.populate`: a decode worker writes the whole pool over and over)."""
        if placed:
            last, array = placed[-1]
            populate(self.mapping, offset, offset + last + array.nbytes)
        copy_arrays(self.mapping, offset, placed)

    def read(self, offset: int, layout: tuple[int, Any]) -> Any:
        """The sample at `offset` as views into the arena (valid while its reference is held)."""
        nbytes, tree = layout
        return decode_tree(tree, self._bytes[offset : offset + nbytes])

    def holds(self, array: np.ndarray) -> bool:
        """Whether `array`'s memory lies inside this arena (a view that must not outlive its ref)."""
        start = self._bytes.ctypes.data
        address = array.__array_interface__["data"][0]
        return start <= address < start + len(self._bytes)

    def _forget(self) -> None:
        """(`_lock` held) No longer this process's mapping of its name (unless a newer file's is)."""
        if _attached.get(self.name) is self:
            del _attached[self.name]

    def release(self) -> None:
        """A session that `hold` gave this arena is done with it: the last one unmaps it."""
        with _lock:
            self._holders -= 1
            if self._holders:
                return
            self._forget()  # now, so that no `hold` finds it between here and the unmapping
        self.close()

    def close(self) -> None:
        """Unmap it now, its descriptor with it; the owner (the server) also unlinks its name.

        Memory is never unmapped under a reader: while a NumPy view of it lives, the mapping
        refuses to close (BufferError) and goes, with its descriptor, when the last view does.
        Batches a Loader hands out are copies or views of its own transport, never of the arena
        (see `execution.shared`), so a closed Loader's arena goes at once.
        """
        with _lock:
            self._forget()
        mapping, self.mapping, self._bytes = self.mapping, None, None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # then only the views refer to it
            mapping.close()
        if self._holder is not None:
            unlink(self.name)
            os.close(self._holder)
            self._holder = None


def encode(sample: Any) -> tuple[tuple[int, Any], list[tuple[int, np.ndarray]]]:
    """(layout, arrays to copy) of a sample; layout[0] is the bytes it needs."""
    tree, placed, nbytes = encode_tree(sample)
    return (nbytes, tree), placed


def create(capacity: int) -> Arena:
    """A new arena for this server process (`gl-pool-<pid>`), its memory reserved up front: a
    /dev/shm too small for the arena fails here, naming /dev/shm and --memory, not with a SIGBUS later.
    Reserved by writing it once, so that the decode workers map its pages cheaply (`Arena.write`)."""
    name = f"{ARENA_PREFIX}{os.getpid()}"
    free = free_bytes()
    if free is not None and capacity > free:
        raise ServerStartError(
            f"--memory {capacity:,} bytes does not fit in {SHM_DIR} ({free:,} bytes free): "
            f"start the server with a smaller --memory, or enlarge {SHM_DIR} (Docker: --shm-size)"
        )
    try:
        try:
            mapped = create_mapping(name, capacity, hold=True, written=True)
        except FileExistsError:  # a server of another PID namespace sharing /dev/shm has this pid (the
            # start-up sweep, `names.remove_unheld`, removed it if that server is dead)
            name += f"-{secrets.token_hex(4)}"
            mapped = create_mapping(name, capacity, hold=True, written=True)
    except OSError as exc:
        raise ServerStartError(
            f"cannot reserve a {capacity:,}-byte pool in {SHM_DIR}: {exc.strerror or exc}; "
            "start the server with a smaller --memory"
        ) from exc
    return Arena(ArenaId(name, mapped.inode), mapped.mapping, holder=mapped.holder)


def attach(arena_id: ArenaId) -> Arena:
    """This process's mapping of `arena_id`, made on first use: a worker's, kept for its life.

    A mapping made under the same name is reused only if it is the same file. ServerGoneError
    if the name is gone or is another file now (the server stopped; another took its name).
    """
    with _lock:
        arena, stale = _mapped(arena_id)
    if stale is not None:
        stale.close()
    return arena


def hold(arena_id: ArenaId) -> Arena:
    """`attach(arena_id)` for a session, which calls `release()` on the arena when it ends."""
    with _lock:
        arena, stale = _mapped(arena_id)
        arena._holders += 1
    if stale is not None:
        stale.close()
    return arena


def _mapped(arena_id: ArenaId) -> tuple[Arena, Arena | None]:
    """(`_lock` held) The arena `arena_id` names, and the mapping of an earlier file under its name
    that it replaced and nobody holds (to close), if any."""
    arena = _attached.get(arena_id.name)
    if arena is not None and arena.id == arena_id:
        return arena, None
    try:
        mapping = map_existing(arena_id.name, inode=arena_id.inode)
    except FileNotFoundError as exc:
        raise ServerGoneError(
            f"the global loader's memory pool {arena_id.name!r} (inode {arena_id.inode}) is gone: its server stopped"
        ) from exc
    _attached[arena_id.name] = fresh = Arena(arena_id, mapping)
    return fresh, arena if arena is not None and not arena._holders else None

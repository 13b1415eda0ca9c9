"""The shared-memory arena behind the server's buffer pool, as every process maps it.

The server creates one POSIX shared-memory segment of the pool's size; its decode workers write
samples into it and clients' workers read them in place, as NumPy views (zero copy). Offsets come
from the server's `BufferPool`; layouts are the codec's, so a sample is described like a batch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

import numpy as np

from globalloader.errors import ServerGoneError, ServerStartError
from globalloader.transport.codec import copy_arrays, decode_tree, encode_tree
from globalloader.transport.names import PREFIX, SHM_DIR, create_mapping, free_bytes, map_existing, unlink

POOL_PREFIX = PREFIX + "pool-"  # + the server's pid

_attached: dict[str, Arena] = {}


class Arena:
    def __init__(self, name: str, mapping: mmap.mmap, owner: bool) -> None:
        self.name, self.mapping, self._owner = name, mapping, owner
        self._bytes = np.frombuffer(mapping, np.uint8)

    def write(self, offset: int, placed: list[tuple[int, np.ndarray]]) -> None:
        """Copy a sample's arrays (from `encode`) to `offset`."""
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

    def close(self) -> None:
        _attached.pop(self.name, None)
        self._bytes = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # views alive: the mapping goes when they do
            self.mapping.close()
        if self._owner:
            unlink(self.name)


def encode(sample: Any) -> tuple[tuple[int, Any], list[tuple[int, np.ndarray]]]:
    """(layout, arrays to copy) of a sample; layout[0] is the bytes it needs."""
    tree, placed, nbytes = encode_tree(sample)
    return (nbytes, tree), placed


def create(capacity: int) -> Arena:
    """A new arena for this server process (`gl-pool-<pid>`), its memory reserved up front: a
    /dev/shm too small for the pool fails here, naming /dev/shm and --memory, not with a SIGBUS later."""
    name = f"{POOL_PREFIX}{os.getpid()}"
    free = free_bytes()
    if free is not None and capacity > free:
        raise ServerStartError(
            f"--memory {capacity:,} bytes does not fit in {SHM_DIR} ({free:,} bytes free): "
            f"start the server with a smaller --memory, or enlarge {SHM_DIR} (Docker: --shm-size)"
        )
    unlink(name)
    try:
        mapping = create_mapping(name, capacity)
    except OSError as exc:
        raise ServerStartError(
            f"cannot reserve a {capacity:,}-byte pool in {SHM_DIR}: {exc.strerror or exc}; "
            "start the server with a smaller --memory"
        ) from exc
    return Arena(name, mapping, owner=True)


def attach(name: str) -> Arena:
    """The arena `name`, mapped once per process."""
    arena = _attached.get(name)
    if arena is None:
        try:
            mapping = map_existing(name)
        except FileNotFoundError as exc:
            raise ServerGoneError(f"the global loader's memory pool {name!r} is gone (server stopped)") from exc
        arena = _attached[name] = Arena(name, mapping, owner=False)
    return arena

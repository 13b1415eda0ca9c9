"""Move whole batches from worker processes to the consumer through POSIX shared memory.

Pickling a batch through a queue copies its bytes four times (pickle, pipe write, pipe read,
unpickle). Here a worker copies each array once into a reused shared-memory segment and sends a
small message (layout plus the non-array leaves); the consumer rebuilds the batch with arrays as
zero-copy views into that segment.

Lifecycle of a segment (one segment holds all arrays of one batch):

1. `BatchWriter.write` picks a free segment big enough (or creates one), copies the arrays in and
   returns a `BatchMessage`. The segment is now in flight.
2. `BatchReader.read` maps the segment (once: mappings are cached by name) and unlinks its name
   at once, so a crash of either side afterwards leaves nothing in the shared-memory folder.
3. When every array of the batch has been garbage collected, the reader calls
   `on_release(name)`; the consumer passes the name back, and `BatchWriter.free` makes the
   segment reusable. The writer never touches a segment between 1 and 3, so the consumer's views
   are writable and stay valid even if the writer dies.

A name created but never mapped (its message unread) is unlinked by `BatchWriter.close`, or, if
the writer was killed, by `remove_leftovers(prefix)`.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from globalloader.errors import ArgumentError, SharedMemoryError
from globalloader.transport.codec import copy_arrays, decode_tree, encode_tree
from globalloader.transport.names import SHM_DIR, check_prefix, create_mapping, map_existing, unlink

_MIN_CAPACITY = 1 << 20  # small batches share one size class, so segments are rarely replaced
_GROWTH = 1.25  # head room so batches a little bigger than the last one reuse the segment
# Pre-fault pages when mapping, so steady-state reads and writes take no page faults.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

# What a worker sends for one batch, a few hundred bytes whatever the batch size: (segment name or
# None when the batch has no arrays, encoded tree, names of segments the writer destroyed, whose
# mappings the reader drops). A plain tuple: a NamedTuple costs ~3 us per message to pickle and unpickle.
BatchMessage = tuple[str | None, tuple, tuple[str, ...]]


class _Segment(NamedTuple):
    """One shared-memory segment as the writer sees it."""

    name: str
    capacity: int
    mapping: mmap.mmap


class BatchWriter:
    """Writes batches into reused shared-memory segments; lives in a worker process.

    `prefix` starts every segment name (the name is `prefix` plus a counter), so
    `remove_leftovers(prefix)` can clean up after a crash; end it with a separator, as in
    `gl-<consumer pid>-<worker id>-`. Not thread-safe: one writer per worker thread or process.
    """

    def __init__(self, prefix: str) -> None:
        check_prefix(prefix)
        self.prefix = prefix
        self._counter = 0
        self._free: list[_Segment] = []  # sorted by capacity, smallest first
        self._in_flight: dict[str, _Segment] = {}
        self._retired: list[str] = []  # destroyed since the last message
        self._closed = False

    @property
    def segment_count(self) -> int:
        """Segments this writer holds (free and in flight): flat in steady state."""
        return len(self._free) + len(self._in_flight)

    def write(self, batch: Any) -> BatchMessage:
        """Copy the batch's arrays into one segment and return the message to send.

        Arrays go to shared memory when they are plain (or memory-mapped) NumPy arrays with a
        non-object dtype and at least one byte, and CPU torch tensors with a NumPy dtype; they
        come back C-contiguous. Dicts, lists, tuples and named tuples holding such arrays are
        rebuilt with the same type; everything else (str, int, numpy scalars, object arrays,
        lists of str...) travels pickled inside the message, unchanged.
        """
        if self._closed:
            raise ArgumentError(f"BatchWriter {self.prefix!r} is closed; cannot write a batch")
        tree, placed, nbytes = encode_tree(batch)
        segment = self._take(nbytes) if placed else None
        retired = tuple(self._retired)
        self._retired.clear()
        if segment is None:
            return (None, tree, retired)
        try:
            copy_arrays(segment.mapping, 0, placed)
        except BaseException:
            self._add_free(segment)  # nothing was sent: the segment is still ours
            raise
        self._in_flight[segment.name] = segment
        return (segment.name, tree, retired)

    def take_back(self, message: BatchMessage) -> None:
        """Undo `write` for a message that was never sent: its segment is free again and the
        names it retired go with the next message."""
        name, _, retired = message
        self._retired.extend(retired)
        if name is not None:
            self._add_free(self._in_flight.pop(name))

    def free(self, segment_names: Iterable[str]) -> None:
        """Make segments the consumer has released reusable for later batches."""
        if self._closed:
            return
        for name in segment_names:
            segment = self._in_flight.pop(name, None)
            if segment is None:
                raise ArgumentError(
                    f"segment_names: {name!r} is not a segment in flight from writer "
                    f"{self.prefix!r} (released twice, or sent to the wrong worker)"
                )
            self._add_free(segment)

    def close(self) -> None:
        """Unmap every segment and unlink every name this writer still owns.

        Names of batches still in flight are unlinked too, so a dead consumer leaves nothing
        behind; call this only once the consumer will read no more of this writer's messages.
        Views the consumer already holds stay valid. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for segment in [*self._free, *self._in_flight.values()]:
            unlink(segment.name)
            segment.mapping.close()
        self._free.clear()
        self._in_flight.clear()

    def _add_free(self, segment: _Segment) -> None:
        self._free.append(segment)
        self._free.sort(key=lambda s: s.capacity)

    def _take(self, nbytes: int) -> _Segment:
        """The smallest free segment of at least `nbytes`, or a new one."""
        for i, segment in enumerate(self._free):
            if segment.capacity >= nbytes:
                return self._free.pop(i)
        # Free segments are all too small: sizes are growing, so they would only pile up.
        for segment in self._free:
            unlink(segment.name)  # normally gone already: the reader unlinks on mapping
            segment.mapping.close()
            self._retired.append(segment.name)
        self._free.clear()
        capacity = max(_MIN_CAPACITY, int(nbytes * _GROWTH))
        capacity = -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE
        return self._create(capacity)

    def _create(self, capacity: int) -> _Segment:
        while True:
            name = f"{self.prefix}{self._counter}"
            self._counter += 1
            try:
                return _Segment(name, capacity, create_mapping(name, capacity, _MAP_FLAGS).mapping)
            except FileExistsError:
                continue  # a leftover of an earlier writer with this prefix: skip its name
            except OSError as exc:
                raise SharedMemoryError(
                    f"cannot allocate {capacity} bytes of shared memory for segment {name!r}: "
                    f"{exc}; free space in {SHM_DIR}, or use fewer workers or less prefetch"
                ) from exc


class BatchReader:
    """Rebuilds batches from `BatchMessage`s as zero-copy views; lives in the consumer.

    One reader serves messages from any number of writers (their names differ by prefix).
    `read` and `close` belong to one thread; `on_release` callbacks may fire from any thread.
    """

    def __init__(self) -> None:
        self._mappings: dict[str, mmap.mmap] = {}

    @property
    def mapped_count(self) -> int:
        """Segments currently mapped: flat in steady state."""
        return len(self._mappings)

    def read(self, msg: BatchMessage, on_release: Callable[[str], None]) -> Any:
        """Rebuild the batch; call `on_release(segment)` once all its arrays are collected.

        Arrays are writable views into the segment. Anything that keeps one alive (a slice, a
        `torch.from_numpy` tensor) delays the release, and with it the segment's reuse.
        `on_release` runs when the last array dies (inside a `del` or a garbage collection),
        in whichever thread dropped it, also after `close()`: keep it short and thread-safe
        (append to a deque).
        A message without a segment (no arrays) is never released.
        """
        name, tree, retired = msg
        for old in retired:
            self._mappings.pop(old, None)  # unmapped when nothing else refers to it
        if name is None:
            return tree[1]  # a leaf: the whole batch travelled inline
        mapping = self._mappings.get(name)
        if mapping is None:
            mapping = self._map(name)
        # One base array per batch: NumPy views of it keep it (not the mapping) as their .base,
        # so its death means no array of this batch is left.
        base = np.frombuffer(mapping, np.uint8)
        finalizer = weakref.finalize(base, on_release, name)
        finalizer.atexit = False  # the consumer's pipes are gone by then
        return decode_tree(tree, base)

    def discard(self, msg: BatchMessage) -> str | None:
        """Skip a message without reading it; return its segment name for the writer to free.

        For batches thrown away unread (a reset, a resumed epoch). The segment is not mapped,
        so its name stays until the writer reuses it or closes.
        """
        name, _, retired = msg
        for old in retired:
            self._mappings.pop(old, None)
        return name

    def close(self) -> None:
        """Drop every cached mapping; arrays still alive keep theirs until they die."""
        mappings = list(self._mappings.values())
        self._mappings.clear()
        for mapping in mappings:
            with contextlib.suppress(BufferError):  # views alive: the mapping goes when they do
                mapping.close()

    def _map(self, name: str) -> mmap.mmap:
        try:
            mapping = map_existing(name, _MAP_FLAGS)
        except FileNotFoundError as exc:
            raise SharedMemoryError(
                f"shared-memory segment {name!r} is gone: its writer was closed, or "
                f"remove_leftovers ran, before this batch was read"
            ) from exc
        # Mapped: the name is no longer needed, and without it nothing can leak.
        unlink(name)
        self._mappings[name] = mapping
        return mapping

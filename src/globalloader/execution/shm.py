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

Names are created with `_posixshmem` directly rather than `multiprocessing.shared_memory`, whose
resource tracker registers segments a process merely attaches to and unlinks them (with
warnings) when that process exits. POSIX only.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import _posixshmem
import numpy as np

from globalloader.dataset.collate import Stacked
from globalloader.errors import ArgumentError, WorkerError

_ALIGN = 64  # cache-line alignment of every array in a segment
_MIN_CAPACITY = 1 << 20  # small batches share one size class, so segments are rarely replaced
_GROWTH = 1.25  # head room so batches a little bigger than the last one reuse the segment
_SHM_DIR = "/dev/shm"  # where Linux exposes POSIX shared-memory names (used to list leftovers)
# Pre-fault pages when mapping, so steady-state reads and writes take no page faults.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


# The encoded tree uses builtins only (a pickled class costs ~1 us each way, a tuple ~50 ns).
# Every node is a tuple whose first item says what it is, so user tuples cannot be mistaken
# for nodes: they only ever appear wrapped in a leaf.
_LEAF = 0  # (_LEAF, obj): kept inline, pickled with the message
_ARRAY = 1  # (_ARRAY, offset, dtype, shape): a NumPy array in the segment
_TENSOR = 2  # (_TENSOR, offset, dtype, shape): a torch tensor in the segment
_NODE = 3  # (_NODE, kind, keys, items): a container holding arrays
# kind: 0 dict (keys holds its keys), 1 list, 2 tuple, or a named tuple class (pickled by name)

# What a worker sends for one batch, a few hundred bytes whatever the batch size:
# (segment name or None when the batch has no arrays, encoded tree, retired segment names).
# `retired` names segments the writer has destroyed, so the reader can drop its mappings.
# A plain tuple, not a NamedTuple: its class would cost ~3 us per message to pickle and unpickle.
BatchMessage = tuple[str | None, tuple, tuple[str, ...]]


class _Segment:
    """One shared-memory segment as the writer sees it."""

    __slots__ = ("name", "capacity", "mapping")

    def __init__(self, name: str, capacity: int, mapping: mmap.mmap) -> None:
        self.name = name
        self.capacity = capacity
        self.mapping = mapping


class BatchWriter:
    """Writes batches into reused shared-memory segments; lives in a worker process.

    `prefix` starts every segment name (the name is `prefix` plus a counter), so
    `remove_leftovers(prefix)` can clean up after a crash; end it with a separator, as in
    `gl-<consumer pid>-<worker id>-`. Not thread-safe: one writer per worker thread or process.
    """

    def __init__(self, prefix: str) -> None:
        _check_prefix(prefix)
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
            raise WorkerError(f"BatchWriter {self.prefix!r} is closed; cannot write a batch")
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
                fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                continue  # a leftover of an earlier writer with this prefix: skip its name
            break
        try:
            try:
                if hasattr(os, "posix_fallocate"):
                    # Reserve the memory now: a full tmpfs fails here, not with SIGBUS later.
                    os.posix_fallocate(fd, 0, capacity)
                else:
                    os.ftruncate(fd, capacity)
            except OSError as exc:
                unlink(name)
                raise WorkerError(
                    f"cannot allocate {capacity} bytes of shared memory for segment {name!r}: "
                    f"{exc}; free space in {_SHM_DIR}, or use fewer workers or less prefetch"
                ) from exc
            mapping = mmap.mmap(fd, capacity, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        return _Segment(name, capacity, mapping)


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
            try:
                mapping.close()
            except BufferError:
                pass  # views alive: the mapping goes when they do

    def _map(self, name: str) -> mmap.mmap:
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
        except FileNotFoundError as exc:
            raise WorkerError(
                f"shared-memory segment {name!r} is gone: its writer was closed, or "
                f"remove_leftovers ran, before this batch was read"
            ) from exc
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        # Mapped: the name is no longer needed, and without it nothing can leak.
        unlink(name)
        self._mappings[name] = mapping
        return mapping


def encode_tree(obj: Any) -> tuple[tuple, list[tuple[int, np.ndarray]], int]:
    """(encoded tree, arrays with their offsets, bytes needed) for a batch or a sample."""
    placed: list[tuple[int, np.ndarray]] = []  # (offset, array) in walk order
    tree = _encode(obj, placed)
    return tree, placed, _end(placed)


def copy_arrays(buffer: Any, base: int, placed: list[tuple[int, np.ndarray]]) -> None:
    """Copy the arrays of `encode_tree` into `buffer` at `base` + their offsets."""
    for offset, array in placed:
        target = np.ndarray(array.shape, array.dtype, buffer=buffer, offset=base + offset)
        if type(array) is Stacked:
            array.stack_into(target)
        else:
            np.copyto(target, array)


_DTYPES: dict[Any, np.dtype] = {}


def decode_tree(node: tuple, base: np.ndarray) -> Any:
    """Rebuild what `encode_tree` encoded, arrays as views of `base` (a uint8 array)."""
    tag = node[0]
    if tag == _LEAF:
        return node[1]
    if tag == _NODE:
        _, kind, keys, items = node
        values = [decode_tree(item, base) for item in items]
        if kind == 0:
            return dict(zip(keys, values))
        if kind == 1:
            return values
        if kind == 2:
            return tuple(values)
        return kind(*values)  # a named tuple class
    _, offset, dtype, shape = node
    descr = _DTYPES.get(dtype)
    if descr is None:
        descr = _DTYPES[dtype] = np.dtype(dtype)
    view = np.ndarray(shape, descr, buffer=base, offset=offset)
    if tag == _TENSOR:
        return _torch().from_numpy(view)
    return view


def remove_leftovers(prefix: str) -> int:
    """Unlink every shared-memory name starting with `prefix`; return how many were removed.

    For cleanup after a crash: names of batches created but never read survive their writer.
    Lists the names on Linux only; elsewhere returns 0.
    """
    _check_prefix(prefix)
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if name.startswith(prefix) and unlink(name):
            removed += 1
    return removed


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix or "/" in prefix or "\0" in prefix:
        raise ArgumentError(
            f"prefix: {prefix!r} must be a non-empty str without '/', e.g. 'gl-1234-0-'"
        )


def unlink(name: str) -> bool:
    """Unlink a name; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def _torch() -> Any:
    from globalloader._extras import require

    return require("torch", "torch")


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})  # leaves, checked first


def _as_array(obj: Any) -> tuple[int, np.ndarray] | None:
    """(_ARRAY or _TENSOR, the array to copy) for `obj`, or None to keep it inline."""
    kind = type(obj)
    if kind is np.ndarray or kind is np.memmap or kind is Stacked:
        tag, array = _ARRAY, obj
    else:
        torch = sys.modules.get("torch")  # a tensor implies torch is imported already
        if torch is None or not isinstance(obj, torch.Tensor):
            return None
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.requires_grad:
            return None
        try:
            array = obj.resolve_conj().resolve_neg().numpy()
        except (TypeError, RuntimeError):
            return None  # no NumPy dtype (bfloat16...): pickled instead
        tag = _TENSOR
    if array.dtype.hasobject or array.nbytes == 0:
        return None  # objects cannot live in shared memory; empty arrays pickle in a few bytes
    return tag, array


def _end(placed: list[tuple[int, np.ndarray]]) -> int:
    """Bytes used by the arrays placed so far."""
    if not placed:
        return 0
    offset, array = placed[-1]
    return offset + array.nbytes


def _encode(obj: Any, placed: list[tuple[int, np.ndarray]]) -> tuple:
    """`obj` as an encoded tree; appends each array with its 64-byte aligned offset to `placed`."""
    kind = type(obj)
    if kind in _SCALARS:
        return (_LEAF, obj)
    shipped = _as_array(obj) if kind is not dict and kind is not list else None
    if shipped is not None:
        tag, array = shipped
        offset = -(-_end(placed) // _ALIGN) * _ALIGN
        placed.append((offset, array))
        dtype = array.dtype
        # A dtype string is short and fast to pickle; records and the like need the full dtype.
        descr = dtype.str if dtype.names is None else dtype
        return (tag, offset, descr, array.shape)
    if kind is dict:
        code: Any = 0
        items = obj.values()
    elif kind is list:
        code, items = 1, obj
    elif kind is tuple:
        code, items = 2, obj
    elif isinstance(obj, tuple) and hasattr(kind, "_fields"):
        code, items = kind, obj  # a named tuple: rebuilt by calling its class
    else:
        return (_LEAF, obj)
    for item in items:
        if type(item) not in _SCALARS:
            break
    else:
        return (_LEAF, obj)  # keys, labels...: no need to walk item by item
    count = len(placed)
    nodes = [_encode(item, placed) for item in items]
    if len(placed) == count:
        return (_LEAF, obj)  # no arrays inside: one pickled leaf, not rebuilt by the reader
    return (_NODE, code, tuple(obj) if kind is dict else None, nodes)

"""Batch slots: a transform writes a sample's array straight into its row of the batch.

Where a batch is built in memory the loop reads directly (workers=0, thread workers, the jobs
of the shared server), the default collate would copy every sample's array into a fresh batch,
for 224x224x3 float32 images a large part of that thread's work. Inside `batch_slots(n)`,
`empty(shape, dtype)` (used by normalize and the crops' uint8 copies) hands sample p its row p
of one (n, *shape) buffer per output, and `taken(items)` gives the collate that buffer when
the items are exactly its rows 0..n-1 in order. Anything else (another shape, a skipped or
reordered sample, a row shared by two fields) is left to the collate's copy, so the batch is
always the one a copy would make, and no two fields of a batch share memory. What a map makes
before a `cache()` point gets no row: the cache must not keep a view of a batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

_CURRENT: ContextVar[_Slots | None] = ContextVar("globalloader_batch_slots", default=None)


class _Slots:
    __slots__ = ("buffers", "open", "position", "requests", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.position = 0  # the row of the sample being built
        self.requests = 0  # arrays that sample asked for so far
        self.open = True  # False while the sample's maps make what a cache keeps
        # One per output of a sample, in the order asked; None: not a batch's (any more).
        self.buffers: list[np.ndarray | None] = []

    def start(self, position: int, open: bool = True) -> None:
        """The next sample built goes to row `position` (the batch's count of samples kept so far:
        a skipped sample's row is written again by the next one); `open=False` hands it no rows
        until `open_rows()`, so that nothing a cache keeps is a view of a batch."""
        self.position, self.requests, self.open = position, 0, open

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        if not self.open:
            return np.empty(shape, dtype)
        k, self.requests = self.requests, self.requests + 1
        if k == len(self.buffers):  # a buffer only from the first row, so its rows can all be filled
            self.buffers.append(np.empty((self.size, *shape), dtype) if self.position == 0 else None)
        buffer = self.buffers[k]
        if buffer is None or buffer.shape[1:] != tuple(shape) or buffer.dtype != np.dtype(dtype):
            return np.empty(shape, dtype)
        return buffer[self.position]


def empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array for a sample: its batch row inside `batch_slots`, else a new one."""
    slots = _CURRENT.get()
    return np.empty(shape, dtype) if slots is None else slots.empty(shape, dtype)


@contextmanager
def batch_slots(size: int) -> Iterator[_Slots]:
    """Slots for a batch of up to `size` samples; call `start(position)` before each."""
    slots = _Slots(size)
    token = _CURRENT.set(slots)
    try:
        yield slots
    finally:
        _CURRENT.reset(token)


def open_rows() -> None:
    """From here on, the sample being built may be written in its batch row."""
    slots = _CURRENT.get()
    if slots is not None:
        slots.open = True


def taken(items: list[np.ndarray]) -> np.ndarray | None:
    """The slot buffer whose rows 0..len(items)-1 are `items` in order, handed out once (so two
    fields never share it); else None."""
    slots = _CURRENT.get()
    if slots is None or not items:
        return None
    buffer = items[0].base
    if not isinstance(buffer, np.ndarray) or len(items) > len(buffer):
        return None
    k = next((k for k, b in enumerate(slots.buffers) if b is buffer), None)
    if k is None:
        return None
    start, step, row_shape, row_strides = buffer.ctypes.data, buffer.strides[0], buffer.shape[1:], buffer.strides[1:]
    for p, item in enumerate(items):
        if item.base is not buffer or item.ctypes.data != start + p * step:
            return None
        if item.shape != row_shape or item.strides != row_strides or item.dtype != buffer.dtype:
            return None
    slots.buffers[k] = None
    return buffer[: len(items)]

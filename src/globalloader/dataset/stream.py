"""Streaming sources (no random access) and the reader of an epoch through a stream chain's
operators (the buffer shuffle in `dataset.shuffle`, the strided shard in `dataset.shard`).

A stream is re-iterated from its start every epoch. Resuming is exact by replay: the state is
the number of records already taken, and a restored reader re-reads and re-shuffles that many
records (without running any map) before it continues. The buffer shuffle is seeded from
(seed, epoch), so the replay reproduces the same order.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from globalloader.dataset.fingerprint import digest, fingerprint
from globalloader.dataset.operator import StreamOp
from globalloader.errors import ArgumentError
from globalloader.sources.base import RecordStream, declared_fingerprint


class StreamSource:
    """A re-iterable record stream: an iterable, a callable returning an iterator, or a source
    with `iter_records()` (TarShards, Parquet read sequentially)."""

    def __init__(self, iterable: Any) -> None:
        if not callable(iterable) and not isinstance(iterable, RecordStream):
            if not hasattr(iterable, "__iter__"):
                raise ArgumentError(f"stream: expected an iterable, got {type(iterable).__name__}")
            if iter(iterable) is iterable:
                raise ArgumentError(
                    "stream: got a one-shot iterator; pass something that can be iterated again "
                    "every epoch (a list, a source, or a function returning an iterator)"
                )
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        it = self.iterable
        if isinstance(it, RecordStream):
            return iter(it.iter_records())
        if callable(it) and not hasattr(it, "__iter__"):
            return iter(it())
        return iter(it)

    def length(self) -> int | None:
        try:
            return len(self.iterable)
        except TypeError:
            return None

    @property
    def fingerprint(self) -> str:
        fp = declared_fingerprint(self.iterable)
        if fp is not None:
            return fp
        if inspect.isfunction(self.iterable):
            return fingerprint(self.iterable, f"function {self.iterable.__qualname__!r}")
        return digest(type(self.iterable).__qualname__, self.length())


class StreamReader:
    """The tasks of one epoch of records after the stream operators, of `task_size` records
    each (none short with `drop_last`), counting the records taken (the state)."""

    def __init__(
        self,
        source: StreamSource,
        ops: Sequence[StreamOp],
        epoch: int,
        task_size: int,
        drop_last: bool = False,
        skip_tasks: int = 0,
    ) -> None:
        length = source.length()
        records: Iterator[Any] = iter(source)
        for op in ops:
            records = op.apply(records, epoch, length)
            length = op.length(length)
        self._records = records
        self.task_size, self.drop_last = task_size, drop_last
        self.taken = sum(1 for _ in itertools.islice(records, skip_tasks * task_size))  # replayed, never mapped

    def _take(self, count: int) -> list[Any]:
        """Up to `count` next records; fewer (maybe none) at the end of the epoch."""
        out = []
        for record in self._records:
            out.append(record)
            if len(out) == count:
                break
        self.taken += len(out)
        return out

    def task(self, task: int) -> list[tuple[int, Any]] | None:
        """The next task's records, numbered by their position in the epoch (the rng index);
        None at the end of the epoch (or before a partial batch with drop_last)."""
        records = self._take(self.task_size)
        if not records or (self.drop_last and len(records) < self.task_size):
            return None
        first = task * self.task_size
        return [(first + k, record) for k, record in enumerate(records)]

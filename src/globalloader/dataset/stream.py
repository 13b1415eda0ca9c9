"""Streaming sources (no random access): buffer shuffle and strided sharding over an iterator.

A stream is re-iterated from its start every epoch. Resuming is exact by replay: the state is
the number of records already taken, and a restored reader re-reads and re-shuffles that many
records (without running any map) before it continues. The buffer shuffle is seeded from
(seed, epoch), so the replay reproduces the same order.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from globalloader._seeding import BUFFER_SHUFFLE, generator
from globalloader.dataset.fingerprint import digest, fingerprint
from globalloader.errors import ArgumentError, check_int
from globalloader.sampling.sharding import ShardArgs, shard_length
from globalloader.sources.base import RecordStream, declared_fingerprint

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


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


@dataclass(frozen=True)
class BufferShuffle:
    """Shuffle within a sliding buffer of `buffer_size` records (the best a stream can do)."""

    buffer_size: int
    seed: int | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffer_size", check_int(self.buffer_size, "shuffle: buffer_size", 1))
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int(self.seed, "shuffle: seed"))

    def attach(self, plan: Builder) -> None:
        plan.add_stream_op(self if self.seed is not None else replace(self, seed=plan.stream_seed("shuffle")))

    def apply(self, records: Iterator[Any], epoch: int, length: int | None) -> Iterator[Any]:
        assert self.seed is not None, "the plan gives every shuffle its seed"
        rng = generator(self.seed, epoch, BUFFER_SHUFFLE)
        buffer: list[Any] = []
        for record in records:
            if len(buffer) < self.buffer_size:
                buffer.append(record)
                continue
            j = int(rng.integers(self.buffer_size))
            yield buffer[j]
            buffer[j] = record
        for j in rng.permutation(len(buffer)):
            yield buffer[j]

    def length(self, n: int | None) -> int | None:
        return n

    def describe(self) -> tuple[object, ...]:
        return ("buffer_shuffle", self.buffer_size, self.seed)


@dataclass(frozen=True)
class StreamShard(ShardArgs):
    """Every `world_size`-th record from `rank`; "pad"/"drop" need the stream's length."""

    def attach(self, plan: Builder) -> None:
        plan.add_stream_op(self)

    def length(self, n: int | None) -> int | None:
        if n is None:
            if self.uneven != "none":
                raise ArgumentError(
                    f"shard(uneven={self.uneven!r}) on a stream needs the stream's length; the "
                    "source has no len(): pass uneven='none' or a source with a length"
                )
            return None
        return shard_length(n, self.rank, self.world_size, self.uneven)

    def apply(self, records: Iterator[Any], epoch: int, length: int | None) -> Iterator[Any]:
        target = self.length(length)
        head: list[Any] = []  # the first world_size records: what a "pad" tail wraps onto
        taken = 0
        for ordinal, record in enumerate(records):
            if ordinal < self.world_size:
                head.append(record)
            if ordinal % self.world_size == self.rank:
                if target is not None and taken >= target:
                    return
                taken += 1
                yield record
        if target is not None and taken < target and head:
            yield head[(self.rank + taken * self.world_size) % len(head)]

    def describe(self) -> tuple[object, ...]:
        return ("stream_shard", self.rank, self.world_size, self.uneven)


class StreamReader:
    """Records of one epoch after the stream operators, counting what was taken (the state)."""

    def __init__(self, source: StreamSource, ops: tuple[Any, ...], epoch: int, skip: int = 0) -> None:
        length = source.length()
        records: Iterator[Any] = iter(source)
        for op in ops:
            records = op.apply(records, epoch, length)
            length = op.length(length)
        self._records = records
        self.taken = sum(1 for _ in itertools.islice(records, skip))  # replayed, never mapped

    def take(self, count: int) -> list[Any]:
        """Up to `count` next records; fewer (maybe none) at the end of the epoch."""
        out = []
        for record in self._records:
            out.append(record)
            if len(out) == count:
                break
        self.taken += len(out)
        return out

"""`Dataset`: a lazy, immutable chain of operators over a source (the DataPipes idea).

Each method returns a new Dataset with one more operator; nothing is read until iteration.
Index operators (select, shuffle, shard) work on integer indices, so a global shuffle needs no
buffer and sharding reads only this rank's samples. Iterating a Dataset runs it in the calling
thread; `globalloader.Loader` runs the same chain in parallel with identical output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any

from globalloader.dataset.batch import BatchOp
from globalloader.dataset.cache import CacheOp
from globalloader.dataset.collate import collate as default_collate
from globalloader.dataset.index_ops import Select, Shard, Shuffle
from globalloader.dataset.iterator import DatasetIterator
from globalloader.dataset.map import MapOp
from globalloader.dataset.plan import Plan
from globalloader.dataset.stream import BufferShuffle, StreamShard, StreamSource
from globalloader.dataset.window_shuffle import WindowShuffle
from globalloader.errors import ArgumentError


class Dataset:
    """A chain over `source` (anything with `len()` and `[i]`, e.g. `gl.ImageFolder(...)`).

    >>> ds = Dataset(from_sequence(range(10))).shuffle(seed=0).map(f).batch(4)
    """

    def __init__(self, source: Any, _ops: tuple[Any, ...] = ()) -> None:
        if not isinstance(source, StreamSource) and not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise ArgumentError(
                f"Dataset needs a source with len() and [i], got {type(source).__name__}; "
                "use Dataset.stream(...) for iterables without random access"
            )
        self.source = source
        self._ops = _ops

    @classmethod
    def stream(cls, iterable: Any) -> Dataset:
        """A chain over records with no random access: a list, a function returning an iterator,
        or a source with `iter_records()`. Shuffle with a buffer; shards are strided records."""
        return cls(StreamSource(iterable))

    def _then(self, op: Any) -> Dataset:
        ds = Dataset(self.source, (*self._ops, op))
        ds.plan  # noqa: B018 - building the plan validates operator order now, where the user wrote the mistake
        return ds

    # -- index operators ---------------------------------------------------------------------
    def select(self, indices: Iterable[int]) -> Dataset:
        """Keep only `indices` (positions of the current chain), in this order."""
        if self.plan.is_stream:
            raise ArgumentError("select() needs random access; a stream has none")
        return self._then(Select.of(indices))

    def shuffle(self, seed: int = 0, buffer_size: int | None = None, window: int | None = None) -> Dataset:
        """A fresh global permutation every epoch (random access), or for a stream a shuffle
        within a buffer of `buffer_size` records. The seed also seeds random maps. `window`: for
        a source made of blocks (Parquet row groups), permute the blocks, then rows within each
        `window` consecutive blocks, decoding each block once per epoch (see WindowShuffle)."""
        if not isinstance(seed, int):
            raise ArgumentError(f"shuffle: seed must be an int, got {seed!r}")
        if window is not None:
            if self.plan.is_stream or buffer_size is not None:
                raise ArgumentError(
                    "shuffle(window=...) is for random-access sources; a stream shuffles with buffer_size="
                )
            return self._then(WindowShuffle.over(self.source, seed, window, self.plan.index_ops))
        if self.plan.is_stream:
            if buffer_size is None:
                raise ArgumentError("shuffle() on a stream needs buffer_size= (it has no random access)")
            return self._then(BufferShuffle(buffer_size, seed))
        if buffer_size is not None:
            raise ArgumentError("shuffle(buffer_size=...) is for streams; random-access sources shuffle globally")
        return self._then(Shuffle(seed))

    def shard(self, rank: int, world_size: int, uneven: str = "pad") -> Dataset:
        """This rank's share; `uneven` is "pad", "drop" or "none" (see globalloader.sampling.sharding)."""
        op = StreamShard if self.plan.is_stream else Shard
        return self._then(op(rank, world_size, uneven))

    # -- record operators --------------------------------------------------------------------
    def map(
        self, fn: Callable[..., Any], shared: bool = False, name: str | None = None, key: str | None = None
    ) -> Dataset:
        """Apply `fn` to every sample (or every batch, after `batch()`).

        `fn(x, rng=...)` receives a per-sample Generator; without `rng` it must be deterministic.
        `shared=True` marks a deterministic prefix (decode, resize) that jobs may share: jobs
        share it when its identity is equal, which covers `fn`'s code, closure, defaults, the
        globals it reads (recursively), partial arguments and callable objects' state. Where
        that cannot be established (a captured lock or file), starting a shared Loader (or a
        disk `cache`) raises FingerprintError; `key="decode-v2"` then names the map instead: a
        promise that maps with equal keys produce equal outputs (change it when `fn` changes).
        """
        if not callable(fn):
            raise ArgumentError(f"map: fn must be callable, got {type(fn).__name__}")
        _check_key("map", key)
        fn_name: str = getattr(fn, "__name__", type(fn).__name__)
        op = MapOp(fn, bool(shared), name or fn_name, key)
        if op.shared and op.random:
            raise ArgumentError(f"map {op.name!r}: shared=True needs a deterministic fn (it takes rng)")
        return self._then(op)

    def cache(self, path: str | os.PathLike[str] | None = None, key: str | None = None) -> Dataset:
        """Keep samples as computed so far (deterministic maps only): in memory, or on disk at
        `path` shared by every worker and run, in a folder named by the identity of the source and
        the maps before it (as for `map(shared=True)`). `key` names those maps instead: equal
        keys on the same source promise equal samples."""
        _check_key("cache", key)
        if key is not None and path is None:
            raise ArgumentError("cache(key=...) names a disk cache's folder; give path= too")
        return self._then(CacheOp(path, key))

    def batch(self, n: int, drop_last: bool = False, collate: Callable[[list[Any]], Any] | None = None) -> Dataset:
        """Group `n` consecutive samples; `collate` defaults to stacking NumPy arrays per key."""
        return self._then(BatchOp(n, bool(drop_last), collate or default_collate))

    # -- running -----------------------------------------------------------------------------
    @cached_property
    def plan(self) -> Plan:
        return Plan(self.source, self._ops)

    @property
    def fingerprint(self) -> str:
        return self.plan.fingerprint

    def __len__(self) -> int:
        """Items per epoch: batches if batched, else samples."""
        n = self.plan.items_per_epoch()
        if n is None:
            raise TypeError("this stream has no known length")
        return n

    def iterator(self, epoch: int = 0) -> DatasetIterator:
        """A resumable iterator over one epoch in the calling thread."""
        return DatasetIterator(self.plan, epoch)

    def __iter__(self) -> DatasetIterator:
        return self.iterator(0)

    def __repr__(self) -> str:
        ops = " -> ".join(type(op).__name__ for op in self._ops)
        return f"Dataset({type(self.source).__name__}{' -> ' + ops if ops else ''})"


def _check_key(method: str, key: object) -> None:
    if key is not None and not (isinstance(key, str) and key):
        raise ArgumentError(f"{method}: key must be a non-empty string, got {key!r}")

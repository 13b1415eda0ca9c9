"""`Dataset`: a lazy, immutable chain of operators over a source (the DataPipes idea).

Each method returns a new Dataset with one more operator; nothing is read until iteration.
Index operators (select, shuffle, shard) work on integer indices, so a global shuffle needs no
buffer and sharding reads only this rank's samples. Iterating a Dataset runs it in the calling
thread; `globalloader.Loader` runs the same chain in parallel with identical output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from globalloader.dataset.batch import BatchOp, check_flag
from globalloader.dataset.bucket import BucketBatchOp
from globalloader.dataset.cache import CacheOp
from globalloader.dataset.combine import Combined
from globalloader.dataset.filter import FilterOp
from globalloader.dataset.flat_map import FlatMapOp
from globalloader.dataset.index_plan import IndexPlan
from globalloader.dataset.iterator import DatasetIterator
from globalloader.dataset.map import MapOp
from globalloader.dataset.pack import PackOp
from globalloader.dataset.plan import Plan
from globalloader.dataset.seeds import SeedOp
from globalloader.dataset.stream import StreamSource
from globalloader.dataset.stream_plan import StreamPlan
from globalloader.errors import ArgumentError


class Dataset:
    """A chain over `source` (anything with `len()` and `[i]`, e.g. `gl.ImageFolder(...)`).

    >>> ds = Dataset(from_sequence(range(10))).shuffle(seed=0).map(f).batch(4)
    """

    def __init__(self, source: Any, _ops: tuple[Any, ...] = ()) -> None:
        lacks = [m for m in ("__len__", "__getitem__") if not hasattr(source, m)]
        if not isinstance(source, (StreamSource, Combined)) and lacks:
            raise ArgumentError(
                f"Dataset needs a source with len() and [i], but {type(source).__name__} has no "
                f"{' or '.join(lacks)}; use Dataset.stream(...) for iterables without random access "
                "(see docs/custom-sources.md)"
            )
        self.source = source
        self._ops = _ops

    @classmethod
    def stream(cls, iterable: Any) -> Dataset:
        """A chain over records with no random access: a list, a function returning an iterator,
        or a source with `iter_records()`. Shuffle with a buffer; shards are strided records."""
        return cls(StreamSource(iterable))

    # -- combining datasets --------------------------------------------------------------------
    @classmethod
    def concat(cls, datasets: Sequence[Dataset]) -> Dataset:
        """The datasets one after the other (each a chain of index operators and maps)."""
        return cls(Combined("concat", _parts("concat", datasets)))

    @classmethod
    def mix(cls, datasets: Sequence[Dataset], weights: Sequence[float], on_exhausted: str = "stop") -> Dataset:
        """Interleave `datasets` in the exact proportions of `weights`, smoothly (shuffle after
        mixing for a random interleave). When one runs out, "stop" ends the epoch (no repeats,
        exact proportions); "cycle" restarts it with a fresh order until all were read once."""
        return cls(Combined("mix", _parts("mix", datasets), weights, on_exhausted))

    @classmethod
    def zip(cls, datasets: Sequence[Dataset]) -> Dataset:
        """Tuples of the datasets' records at the same position; as long as the shortest."""
        return cls(Combined("zip", _parts("zip", datasets)))

    def _then(self, op: Any) -> Dataset:
        ds = Dataset(self.source, (*self._ops, op))
        ds.plan  # noqa: B018 - building the plan validates operator order now, where the user wrote the mistake
        return ds

    # -- index operators ---------------------------------------------------------------------
    def select(self, indices: Iterable[int]) -> Dataset:
        """Keep only `indices` (positions of the current chain), in this order."""
        return self._then(self.plan.select_op(indices))

    def seed(self, seed: int) -> Dataset:
        """The root of every random operator in the chain (default 0), wherever it is written:
        each shuffle without its own seed and each random map derive a stream of their own."""
        return self._then(SeedOp(seed))

    def shuffle(self, seed: int | None = None, buffer_size: int | None = None, window: int | None = None) -> Dataset:
        """A fresh global permutation every epoch (random access), or for a stream a shuffle
        within a buffer of `buffer_size` records. `seed` defaults to a stream of the chain's
        root seed (`seed()`); it never seeds other operators. `window`: for a source made of
        blocks (Parquet row groups), permute the blocks, then rows within each `window`
        consecutive blocks, decoding each block once per epoch (see WindowShuffle)."""
        if seed is not None and (isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer))):
            raise ArgumentError(f"shuffle: seed must be an int, got {seed!r}")
        return self._then(self.plan.shuffle_op(seed, buffer_size, window))

    def shard(self, rank: int, world_size: int, uneven: str = "pad") -> Dataset:
        """This rank's share; `uneven` is "pad", "drop" or "none" (see globalloader.sampling.sharding)."""
        return self._then(self.plan.shard_op(rank, world_size, uneven))

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
        _check_fn("map", "fn", fn, key)
        op = MapOp(fn, name or _name(fn), key, bool(shared))
        if op.shared and op.random:
            raise ArgumentError(f"map {op.name!r}: shared=True needs a deterministic fn (it takes rng)")
        return self._then(op)

    def filter(self, predicate: Callable[..., Any], name: str | None = None, key: str | None = None) -> Dataset:
        """Keep the samples for which `predicate(x)` (or `predicate(x, rng=...)`) is true."""
        _check_fn("filter", "predicate", predicate, key)
        return self._then(FilterOp(predicate, name or _name(predicate), key))

    def flat_map(self, fn: Callable[..., Any], name: str | None = None, key: str | None = None) -> Dataset:
        """Replace each sample by the records `fn(x)` returns (any number, in order)."""
        _check_fn("flat_map", "fn", fn, key)
        return self._then(FlatMapOp(fn, name or _name(fn), key))

    def cache(self, path: str | os.PathLike[str] | None = None, key: str | None = None) -> Dataset:
        """Keep samples as computed so far (deterministic maps only): in memory, or on disk at
        `path` shared by every worker and run, in a folder named by the identity of the source and
        the maps before it (as for `map(shared=True)`). `key` names those maps instead: equal
        keys on the same source promise equal samples."""
        _check_key("cache", key)
        if key is not None and path is None:
            raise ArgumentError("cache(key=...) names a disk cache's folder; give path= too")
        return self._then(CacheOp(path, key))

    def batch(
        self, n: int, drop_last: bool = False, collate: Callable[[list[Any]], Any] | None = None, pad: Any = None
    ) -> Dataset:
        """Group `n` consecutive samples; `collate` defaults to stacking NumPy arrays per key.
        `pad`: a value (or {key: value}) to pad arrays of different shapes to the batch's largest."""
        return self._then(BatchOp.of(n, drop_last, collate, pad))

    def bucket_batch(
        self,
        length_fn: Callable[[Any], int],
        boundaries: Sequence[int],
        batch_size: int | Sequence[int],
        pad: Any = None,
        drop_last: bool = False,
    ) -> Dataset:
        """Batch samples of similar `length_fn(x)` together: bucket b holds lengths below
        `boundaries[b]` (and at least the one before); `batch_size` is one or one per bucket."""
        return self._then(BucketBatchOp.of(length_fn, boundaries, batch_size, pad, drop_last))

    def pack(
        self, seq_len: int, key: str | None = "tokens", pad: int = 0, drop_last: bool = False, dtype: Any = None
    ) -> Dataset:
        """Concatenate 1-D token arrays (`x[key]`, or bare arrays with key=None) into rows of
        `seq_len` with `segment_ids` and `positions`; `dtype`: the rows' token dtype (default:
        the common type of each row's documents); see `globalloader.dataset.pack`."""
        try:
            fixed = None if dtype is None else np.dtype(dtype)
        except TypeError as exc:
            raise ArgumentError(f"pack: dtype must be an integer NumPy dtype, got {dtype!r}") from exc
        return self._then(PackOp(seq_len, key, pad, check_flag(drop_last, "pack: drop_last"), fixed))

    # -- running -----------------------------------------------------------------------------
    @cached_property
    def plan(self) -> Plan:
        """The compiled chain, of its kind: the one place that tells a stream chain (no random
        access) from a random-access one; each kind's plan holds its own operators."""
        kind = StreamPlan if isinstance(self.source, StreamSource) else IndexPlan
        return kind(self.source, self._ops)

    @property
    def fingerprint(self) -> str:
        return self.plan.fingerprint

    def __len__(self) -> int:
        """Items per epoch: batches if batched, else samples."""
        n = self.plan.items_per_epoch()
        if n is None:
            raise TypeError(f"{self.plan.unsized} has no length known before it runs")
        return n

    def iterator(self, epoch: int = 0) -> DatasetIterator:
        """A resumable iterator over one epoch in the calling thread."""
        return DatasetIterator(self.plan, epoch)

    def __iter__(self) -> DatasetIterator:
        return self.iterator(0)

    def __repr__(self) -> str:
        ops = " -> ".join(type(op).__name__ for op in self._ops)
        source = self.source.describe() if isinstance(self.source, Combined) else type(self.source).__name__
        return f"Dataset({source}{' -> ' + ops if ops else ''})"


def _check_fn(method: str, arg: str, fn: object, key: object) -> None:
    if not callable(fn):
        raise ArgumentError(f"{method}: {arg} must be callable, got {type(fn).__name__}")
    _check_key(method, key)


def _check_key(method: str, key: object) -> None:
    if key is not None and not (isinstance(key, str) and key):
        raise ArgumentError(f"{method}: key must be a non-empty string, got {key!r}")


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _parts(method: str, datasets: Any) -> list[Dataset]:
    parts = list(datasets) if isinstance(datasets, (list, tuple)) else None
    if not parts or not all(isinstance(p, Dataset) for p in parts):
        raise ArgumentError(f"{method}: expected a non-empty list of gl.Dataset, got {datasets!r:.200}")
    return parts

"""What every source is (a random-access sequence of dict records with a content fingerprint),
and the abilities a source may add, each for something the loader then does faster or at all:
the plan asks once, when a chain is built (`capable`); docs/custom-sources.md shows how."""

from __future__ import annotations

import hashlib
import inspect
import operator
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from globalloader.errors import ArgumentError, SampleIndexError


@runtime_checkable
class Source(Protocol):
    """A random-access sequence of records.

    `len(src)` is the number of records and `src[i]` returns record `i` as a dict (with a
    `"__key__"` entry) for `0 <= i < len(src)`; negative indices are refused, because in a loader
    they are always a bug. `fingerprint` is a stable string identifying the content (paths,
    sizes, mtimes or ETags), used as the key for caches and for sharing across jobs.

    Sources are pickled to worker processes: they open file handles lazily, never pickle them,
    and reopen them in a process other than the one that opened them.
    """

    @property
    def fingerprint(self) -> str: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


def declared_fingerprint(obj: object) -> str | None:
    """`obj`'s own `fingerprint` string, or None when it declares none. Every `Source` does, but a
    chain also reads plain sequences and iterables, Ray reads any object with len() and [i], and
    the fingerprint walk meets user callables: those may or may not carry one."""
    fp = getattr(obj, "fingerprint", None)
    return fp if isinstance(fp, str) else None


@runtime_checkable
class BatchReads(Protocol):
    """Reads a task's records in one call, cheaper than one `[i]` each (Parquet: block by block)."""

    def read_many(self, indices: np.ndarray) -> list[dict[str, Any]]: ...


@runtime_checkable
class ColumnarReads(Protocol):
    """Builds a batch column by column, exactly what collating `read_many(indices)` gives, for a
    chain that only batches the rows with the default collate; `columnar`: the columns allow it."""

    columnar: bool

    def read_columns(self, indices: np.ndarray) -> dict[str, Any]: ...


@runtime_checkable
class GathersAhead(Protocol):
    """Gathers several tasks' batches in one call (`dataset.gather_ahead`), up to `gather_rows`
    rows; returns the batches of the leading parts it could serve."""

    gather_rows: int

    def read_columns_ahead(self, parts: list[np.ndarray]) -> list[dict[str, Any]]: ...


@runtime_checkable
class Blocks(Protocol):
    """Made of blocks read best whole (row groups, shards) starting at `block_starts`: what
    `shuffle(window=...)` permutes."""

    block_starts: np.ndarray


@runtime_checkable
class ArrowBlocks(Protocol):
    """`Blocks` that are Arrow tables of files (Parquet's row groups), read whole by the Arrow copy
    and Ray's map tasks: `block_origin(b)` is (file, row in it); `file_versions()` keys a copy."""

    def read_block(self, block: int) -> Any: ...

    def block_origin(self, block: int) -> tuple[str, int]: ...

    def file_versions(self) -> list[tuple[str, int, str]]: ...


@runtime_checkable
class KeepsBlocks(Protocol):
    """Keeps read blocks per process; a windowed shuffle asks it to keep two windows' worth."""

    def keep_blocks(self, count: int) -> None: ...


@runtime_checkable
class CachedBlocks(Protocol):
    """Blocks (files) read whole through the machine cache: `cached_block_bytes()` each one's
    bytes there (0: read without it); `keep_cached(size)` lets the readers keep that many bytes
    open (a windowed shuffle's two windows, which must fit: a warning says so) and returns what
    the cache can hold (`Store.keep_open`)."""

    def cached_block_bytes(self) -> np.ndarray: ...

    def keep_cached(self, size: int) -> int: ...


@runtime_checkable
class CachesDecodedBlocks(Protocol):
    """Decodes a whole block to read a row, keeping `cached_blocks` per process: a global shuffle
    over more blocks than that decodes a block for nearly every row (a warning says so)."""

    cached_blocks: int


@runtime_checkable
class RecordStream(Protocol):
    """Yields every record in storage order without an index (`Dataset.stream`; gzip tars)."""

    def iter_records(self) -> Iterable[Any]: ...


@runtime_checkable
class StreamedShards(Protocol):
    """When `streamed`, its shards have no index (gzip tar shards): they are read only in order,
    shard by shard (`iter_records([s])` for shard s of `shards`), and counted by reading them."""

    streamed: bool


@runtime_checkable
class Prefetching(Protocol):
    """Fetches the remote objects of `prefetch(indices)` ahead of the reads, when `remote`: the
    loader names the source indices of the next tasks, in order."""

    remote: bool

    def prefetch(self, indices: np.ndarray) -> None: ...


def capable(source: object, protocol: type) -> bool:
    """Whether `source` offers every member of `protocol` (one of the abilities above), looked up
    statically so that asking runs no property (an index build). Some but not all is the
    ArgumentError naming the class and what it lacks: a half-written ability is a bug."""
    named = {*vars(protocol).get("__annotations__", {}), *(n for n, v in vars(protocol).items() if callable(v))}
    members = sorted(n for n in named if not n.startswith("_"))
    missing = [m for m in members if inspect.getattr_static(source, m, capable) is capable]  # capable: absent
    if missing and len(missing) < len(members):
        raise ArgumentError(
            f"{type(source).__name__} has {', '.join(m for m in members if m not in missing)} but not "
            f"{', '.join(missing)}: a {protocol.__name__} source needs all of {', '.join(members)} "
            "(see docs/custom-sources.md)"
        )
    return not missing


def check_index(index: Any, length: int, source: object) -> int:
    """Return `index` as an int in [0, length), or raise the error that names it.

    Call it only off the fast path (`type(i) is not int or not 0 <= i < n`): it is the slow,
    explanatory half of the bounds check.
    """
    if isinstance(index, bool):
        raise ArgumentError(f"index must be an int, got bool ({index}) for {source!r}")
    try:
        value = operator.index(index)
    except TypeError:
        raise ArgumentError(f"index must be an int, got {type(index).__name__} for {source!r}") from None
    if value < 0:
        raise SampleIndexError(f"index {value} is negative; {source!r} has length {length} and takes 0..{length - 1}")
    if value >= length:
        raise SampleIndexError(f"index {value} is out of range for {source!r} of length {length}")
    return value


def check_indices(indices: Any, length: int, source: object) -> np.ndarray:
    """`indices` as an int64 array, all in [0, length), or the error naming the first bad one
    (a float, bool or text index is an ArgumentError: 1.7 -> 1 would read a row nobody asked for)."""
    given = np.asarray(indices)
    if given.ndim != 1 or (given.size and given.dtype.kind not in "iu"):
        raise ArgumentError(
            f"indices must be a flat list of ints, got {given.dtype} of shape {given.shape} for {source!r}"
        )
    if given.dtype.kind == "u" and given.size and int(given.max()) >= length:
        check_index(int(given.max()), length, source)  # before int64 could wrap it
    idx = given.astype(np.int64, copy=False)
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= length):
        check_index(int(idx[(idx < 0) | (idx >= length)][0]), length, source)
    return idx


def fingerprint_of(kind: str, parts: Iterable[str]) -> str:
    """A short stable fingerprint: the source kind plus a hash of its identifying lines."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8", "surrogateescape"))
        digest.update(b"\n")
    return f"{kind}:{digest.hexdigest()[:32]}"

"""`shuffle()`, every form: a global permutation of a random-access chain's positions
(`Shuffle`), a windowed one for sources made of blocks (`WindowShuffle`), or for a stream a
shuffle within a buffer of records (`BufferShuffle`).

The index forms map output positions to source indices with a few vectorized NumPy calls, so
they are exact (a bijection: every sample once per epoch), reproducible from (seed, epoch) alone
and resumable from any position.

For sources stored in blocks that are decoded whole (Parquet row groups), a global shuffle reads
a random block for every row. The windowed one reads `window` blocks at a time: each epoch it
permutes the blocks, cuts the permuted sequence into windows of `window` blocks and permutes the
rows of each window. A worker reading consecutive positions then needs only the current window's
blocks, each decoded once per epoch. The cost in randomness: a stretch of the epoch draws from
`window` blocks only (docs/columnar.md measures it).

A stream is re-iterated from its start every epoch and its buffer shuffle is seeded from (seed,
epoch), so a resume that replays the records taken reproduces the same order (`dataset.stream`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from globalloader._seeding import BUFFER_SHUFFLE, WINDOW_BLOCKS, WINDOW_ROWS, check_seed, generator, sequence
from globalloader.dataset.operator import IndexOp, StreamOp
from globalloader.errors import ArgumentError, check_int
from globalloader.sampling.permutation import Permutation
from globalloader.sources.base import Blocks, CachedBlocks, CachesDecodedBlocks, KeepsBlocks, capable

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


def index_shuffle(
    source: Any, seed: int | None, buffer_size: int | None, window: int | None, preceding: Sequence[IndexOp]
) -> IndexOp:
    """`shuffle()` of a random-access chain over `source` (`preceding`: its index operators)."""
    if window is not None:
        if buffer_size is not None:
            raise ArgumentError(_WINDOW_ON_STREAM)
        return WindowShuffle.over(source, seed, window, preceding)
    if buffer_size is not None:
        raise ArgumentError("shuffle(buffer_size=...) is for streams; random-access sources shuffle globally")
    _warn_if_rows_scatter(source)
    return Shuffle(seed)


def stream_shuffle(seed: int | None, buffer_size: int | None, window: int | None) -> BufferShuffle:
    """`shuffle()` of a stream chain."""
    if window is not None:
        raise ArgumentError(_WINDOW_ON_STREAM)
    if buffer_size is None:
        raise ArgumentError("shuffle() on a stream needs buffer_size= (it has no random access)")
    return BufferShuffle(buffer_size, seed)


_WINDOW_ON_STREAM = "shuffle(window=...) is for random-access sources; a stream shuffles with buffer_size="


def _warn_if_rows_scatter(source: Any) -> None:
    """A global shuffle over a source whose blocks are decoded whole (Parquet row groups) and do
    not all fit its cache decodes a block for nearly every row: say so once, with the remedies."""
    if (
        capable(source, Blocks)
        and capable(source, CachesDecodedBlocks)
        and len(source.block_starts) > source.cached_blocks
    ):
        blocks = len(source.block_starts)
        warnings.warn(
            f"shuffle() over {source!r} reads its {blocks} row groups in random order, decoding a whole "
            f"row group for nearly every row (hundreds of times slower than in order); use shuffle(window=w), "
            f"or shuffle() on its local_copy(), or keep every group decoded (cached_row_groups={blocks}); "
            "see docs/columnar.md",
            stacklevel=5,  # the user's shuffle() call: Dataset.shuffle -> the plan's form -> here
        )


def _keep_windows_cached(source: Any, window: int) -> None:
    """Let the readers keep two windows of blocks open in the machine cache (the one read and the
    one a slower worker still finishes), the read-ahead taking the rest. Two windows larger than
    the cache have blocks evicted before they are read and downloaded again, several times an
    epoch: a warning names the largest window that fits and the limit this one needs. Not
    clamped: an epoch's order must not depend on the machine's disk."""
    largest = np.sort(source.cached_block_bytes())[::-1]
    needed = int(largest[: 2 * window].sum())
    if not needed:
        return
    room = source.keep_cached(needed)
    if needed > room:
        fits = int(np.searchsorted(np.cumsum(largest), room, side="right")) // 2
        warnings.warn(
            f"shuffle(window={window}) over {source!r} keeps two windows of blocks in the machine cache "
            f"({needed} bytes), more than it holds ({room} bytes): blocks would be evicted before they are "
            f"read and downloaded again; use window={max(1, fits)} or cache_limit={2 * needed} (more with several "
            "workers: each keeps its own two windows open; see docs/remote.md)",
            stacklevel=6,  # the user's shuffle() call: Dataset.shuffle -> the plan's form -> over -> here
        )


@lru_cache(maxsize=8)
def _permutation(n: int, seed: int, epoch: int) -> Permutation:
    return Permutation(n, seed, epoch)


@dataclass(frozen=True)
class Shuffle(IndexOp):
    """A global permutation of the input, new for every epoch, reproducible from the seed
    (None: the chain's stream "shuffle" k, see `dataset.seeds`)."""

    seed: int | None
    per_epoch = True  # a position's source index changes with the epoch

    def __post_init__(self) -> None:
        if self.seed is not None:
            object.__setattr__(self, "seed", check_seed(self.seed, "shuffle: seed"))

    def attach(self, plan: Builder) -> None:
        plan.add_index(self if self.seed is not None else replace(self, seed=plan.stream_seed("shuffle")))

    def length(self, n: int) -> int:
        return n

    def parents(self, positions: npt.NDArray[np.int64], n: int, epoch: int) -> npt.NDArray[np.int64]:
        assert self.seed is not None, "the plan gives every shuffle its seed"
        return _permutation(n, self.seed, epoch)[positions]

    def parents_run(self, start: int, stop: int, n: int, epoch: int) -> npt.NDArray[np.int64]:
        """`parents` of the positions [start, stop), a task's (see `Permutation.run`)."""
        assert self.seed is not None, "the plan gives every shuffle its seed"
        return _permutation(n, self.seed, epoch).run(start, stop)

    def shard_args(self) -> None:
        return None

    def describe(self) -> tuple[object, ...]:
        return ("shuffle", self.seed)


_EXPLICIT_ROWS = 1 << 22


class _Layout(NamedTuple):
    """One epoch's order of blocks, in output positions."""

    order: npt.NDArray[np.int64]  # source block at each permuted place
    starts: npt.NDArray[np.int64]  # output position where each permuted block starts (+ the end)
    window_starts: npt.NDArray[np.int64]  # output position where each window starts (+ the end)


@dataclass(frozen=True, eq=False)
class WindowShuffle(IndexOp):
    """Permute blocks, then rows within each window of `window` consecutive permuted blocks.

    `bounds`: the blocks' boundaries in source indices, `[0, ..., n]` (empty blocks dropped).
    Build it with `WindowShuffle.over(source, seed, window)` from a source's `block_starts`;
    seed None takes the chain's stream "shuffle" k, as `shuffle()` does.
    """

    seed: int | None
    window: int
    bounds: npt.NDArray[np.int64]
    _key: tuple[int, int, bytes] = field(init=False, repr=False)
    per_epoch = True  # a position's source index changes with the epoch

    def __post_init__(self) -> None:
        if self.seed is not None:
            object.__setattr__(self, "seed", check_seed(self.seed, "shuffle: seed"))
        if isinstance(self.window, bool) or not isinstance(self.window, (int, np.integer)) or self.window < 1:
            raise ArgumentError(f"shuffle: window must be an int >= 1 (blocks per window), got {self.window!r}")
        object.__setattr__(self, "window", int(self.window))
        bounds = np.unique(np.asarray(self.bounds, dtype=np.int64))
        if len(bounds) == 0 or bounds[0] != 0:
            raise ArgumentError(f"shuffle: block bounds must start at 0, got {self.bounds[:3]!r}")
        bounds.setflags(write=False)
        object.__setattr__(self, "bounds", bounds)
        object.__setattr__(
            self, "_key", (-1 if self.seed is None else int(self.seed), int(self.window), bounds.tobytes())
        )

    def attach(self, plan: Builder) -> None:
        plan.add_index(self if self.seed is not None else replace(self, seed=plan.stream_seed("shuffle")))

    @classmethod
    def over(cls, source: Any, seed: int | None, window: int, preceding: Sequence[IndexOp] = ()) -> WindowShuffle:
        """The windowed shuffle of `source`'s blocks (its `block_starts`), which must come first
        among the index operators (`preceding`: those before it). Asks a source that caches
        decoded blocks (`keep_blocks`) to keep two windows, so that each block is decoded once per
        epoch per worker even when a batch straddles two windows."""
        if preceding:
            raise ArgumentError(
                f"shuffle(window=...) must apply directly to the source, but it follows {preceding[-1].describe()[0]}; "
                "put it first (select and shard may follow it)"
            )
        if not capable(source, Blocks):
            raise ArgumentError(
                f"shuffle(window=...) needs a source made of blocks (with `block_starts`, such as gl.Parquet, "
                f"its local_copy() or gl.TarShards); {type(source).__name__} has none: use shuffle(seed) instead"
            )
        op = cls(seed, window, np.append(np.asarray(source.block_starts, dtype=np.int64), len(source)))
        if capable(source, CachedBlocks):
            _keep_windows_cached(source, op.window)
        if capable(source, KeepsBlocks):
            source.keep_blocks(2 * op.window)
        return op

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WindowShuffle) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def length(self, n: int) -> int:
        if n != int(self.bounds[-1]):
            raise ArgumentError(
                f"shuffle(window=...): the blocks cover {int(self.bounds[-1])} rows but the source has {n}; "
                "it must apply directly to the source (before select, shard or another shuffle)"
            )
        return n

    def parents(self, positions: npt.NDArray[np.int64], n: int, epoch: int) -> npt.NDArray[np.int64]:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size == 0:
            return pos.copy()
        layout = _layout(self, epoch)
        window = np.searchsorted(layout.window_starts, pos, side="right") - 1
        result = np.empty_like(pos)
        lowest, highest = int(window.min()), int(window.max())
        for k in [lowest] if lowest == highest else np.unique(window).tolist():  # a task spans one or two
            here = slice(None) if lowest == highest else window == k
            first = int(layout.window_starts[k])
            order = _window(self, epoch, k)
            if isinstance(order, Permutation):
                result[here] = self._sources(layout, first + order[pos[here] - first])
            else:  # a task's positions are consecutive: read in order, not gathered
                result[here] = order[pos[here] - first]
        return result

    def parents_run(self, start: int, stop: int, n: int, epoch: int) -> npt.NDArray[np.int64]:
        """`parents` of the positions [start, stop), a task's: a slice of its window's order."""
        layout = _layout(self, epoch)
        k = int(np.searchsorted(layout.window_starts, start, side="right")) - 1
        first, end = int(layout.window_starts[k]), int(layout.window_starts[min(k + 1, len(layout.window_starts) - 1)])
        order = _window(self, epoch, k) if start < stop <= end else None
        if order is None or isinstance(order, Permutation):
            return self.parents(np.arange(start, stop, dtype=np.int64), n, epoch)
        return order[start - first : stop - first].copy()

    def _sources(self, layout: _Layout, shuffled: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Source indices of output positions once rows are shuffled within their window."""
        place = np.searchsorted(layout.starts, shuffled, side="right") - 1
        result: npt.NDArray[np.int64] = self.bounds[layout.order[place]] + (shuffled - layout.starts[place])
        return result

    def shard_args(self) -> None:
        return None

    def describe(self) -> tuple[object, ...]:
        return ("window_shuffle", self.seed, self.window, self.bounds)


@lru_cache(maxsize=4)
def _layout(op: WindowShuffle, epoch: int) -> _Layout:
    sizes = np.diff(op.bounds)
    order = generator(op._key[0], epoch, WINDOW_BLOCKS).permutation(len(sizes)).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes[order])]).astype(np.int64)
    window_starts = starts[:: op.window]
    if window_starts[-1] != starts[-1]:
        window_starts = np.append(window_starts, starts[-1])
    return _Layout(order, starts, window_starts)


@lru_cache(maxsize=3)  # a task spans at most two windows
def _window(op: WindowShuffle, epoch: int, window: int) -> Permutation | npt.NDArray[np.int64]:
    """Window `window` of `epoch`, its rows shuffled by its own random stream: up to
    `_EXPLICIT_ROWS` rows, the source index at each of its positions (at most 32 MiB); above,
    the permutation of its rows (no memory, a few microseconds per thousand rows)."""
    layout = _layout(op, epoch)
    first, end = int(layout.window_starts[window]), int(layout.window_starts[window + 1])
    if end - first > _EXPLICIT_ROWS:
        return Permutation(
            end - first, int(sequence(op._key[0], epoch, window, WINDOW_ROWS).generate_state(1, np.uint64)[0])
        )
    blocks = layout.order[window * op.window : (window + 1) * op.window]
    rows = np.concatenate([np.arange(op.bounds[b], op.bounds[b + 1], dtype=np.int64) for b in blocks.tolist()])
    # Shuffling the rows themselves swaps as shuffling arange(len(rows)) would: rows[permutation],
    # without the gather (a random read per row).
    sources: npt.NDArray[np.int64] = generator(op._key[0], epoch, window, WINDOW_ROWS).permutation(rows)
    return sources


@dataclass(frozen=True)
class BufferShuffle(StreamOp):
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

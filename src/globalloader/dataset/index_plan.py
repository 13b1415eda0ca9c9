"""The plan of a random-access chain: its index operators map a task's positions to source
indices, and the task reads them from the source, by column, in blocks or one `[i]` each.

Index operators are asked only what `IndexOp` declares (`dataset.operator`): their length, how
they map positions (a task's run at once where they can), whether the map changes per epoch,
and whether they split the order among ranks (a shard).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from globalloader.dataset.collate import collate as default_collate
from globalloader.dataset.combine import Combined
from globalloader.dataset.fingerprint import digest
from globalloader.dataset.gather_ahead import GatherAhead
from globalloader.dataset.operator import IndexOp, StreamOp
from globalloader.dataset.plan import Plan, TaskResult, Timer, tick
from globalloader.dataset.select import Select
from globalloader.dataset.shard import Shard
from globalloader.dataset.shuffle import index_shuffle
from globalloader.errors import ArgumentError, FingerprintError
from globalloader.sampling.sharding import ShardArgs
from globalloader.sources.base import BatchReads, ColumnarReads, GathersAhead, capable, declared_fingerprint


class IndexPlan(Plan):
    """The plan of a random-access chain: index operators (`IndexOp`) map a task's positions
    to source indices, which the task reads (by column, in blocks, or one `[i]` each)."""

    is_stream = False
    unsized = "this chain (a filter, flat_map, pack or bucket_batch)"

    def __init__(self, source: Any, ops: Sequence[Any], inherited_seed: int | None = None) -> None:
        self.index_ops: list[IndexOp] = []
        super().__init__(source, ops, inherited_seed)
        self._combined = source.bind(self.seed, IndexPlan) if isinstance(source, Combined) else None
        if self._combined is not None:
            self.source = self._combined
        self.lengths = self._lengths()
        # A batch of the source's rows with nothing in between: the source gathers it by column.
        self.columnar = bool(
            capable(self.source, ColumnarReads)
            and self.source.columnar
            and self.batch is not None
            and self.batch.collate is default_collate
            and not (self.maps or self.tail or self.cache is not None)
        )
        # A source whose gathers cost much per call says how many rows it would rather gather at once.
        gathers = self.columnar and capable(self.source, GathersAhead)
        ahead = self.source.gather_rows // self.task_size if gathers else 0
        self.gather_ahead = GatherAhead(ahead) if ahead > 1 else None
        # How a task reads the source, chosen once: by column, all records in one call, or one [i] each.
        many = self.cache is None and capable(self.source, BatchReads)
        self._read_task = self._by_columns if self.columnar else self._by_read_many if many else self._by_index
        self._take_identity()
        if self.cache is not None and self.cache.path is not None:
            if declared_fingerprint(self.source) is None:
                raise ArgumentError(
                    f"cache(path) needs a source with a .fingerprint to key its files; "
                    f"{type(source).__name__} has none (wrap it: gl.from_sequence(...))"
                )
            self.cache.bind(self._cache_key())

    def select_op(self, indices: Any) -> IndexOp:
        return Select.of(indices)

    def shuffle_op(self, seed: int | None, buffer_size: int | None, window: int | None) -> IndexOp:
        return index_shuffle(self.source, seed, buffer_size, window, self.index_ops)

    def shard_op(self, rank: int, world_size: int, uneven: str) -> IndexOp:
        return Shard(rank, world_size, uneven)

    def add_index(self, op: IndexOp) -> None:
        self._order_op_fits(op)
        self.index_ops.append(op)

    def add_stream_op(self, op: StreamOp) -> None:
        raise ArgumentError(f"{self._order_op_fits(op)} does not apply to a random-access source")

    @property
    def combinable(self) -> bool:
        return not (self.batch is not None or self.tail or self.expands)

    @property
    def epoch_dependent(self) -> bool:
        """Source index at a position changes with the epoch (a shuffle)."""
        return any(op.per_epoch for op in self.index_ops)

    @property
    def source_length(self) -> int:
        return self.source.index_space if isinstance(self.source, Combined) else len(self.source)

    def check_shareable(self) -> None:
        if isinstance(self.source, Combined) and not self.source.deterministic:
            raise ArgumentError(
                f"share=True needs the parts of {self.source.kind}() to be deterministic (no random map, no zip of "
                "shuffled parts): apply random maps after combining"
            )

    def order_identity(self, placed: bool) -> list[tuple[object, ...]]:
        return [op.describe() for op in self.index_ops if placed or op.shard_args() is None]

    def shard(self) -> tuple[int, ShardArgs | None]:
        for k, op in enumerate(self.index_ops):
            args = op.shard_args()
            if args is not None:
                return k, args
        return len(self.index_ops), None

    def _identify_source(self, strict: bool) -> str:
        if isinstance(self.source, Combined):
            return self.source.identity(strict)
        return self._walk_source(self.source, strict)

    def _cache_key(self) -> str:
        """The disk cache's folder: the source and the maps before the cache point (or its key)."""
        assert self.cache is not None
        if self.cache.key is not None:
            return digest(self._source_identity(True), "explicit key", self.cache.key)
        try:
            maps = [m.identity() for m in self.maps[: self.cache_at]]
        except FingerprintError as exc:
            raise FingerprintError(
                f"cache({str(self.cache.path)!r}) cannot key its files: {exc}; "
                f'or key the cache itself: .cache(path, key="my-cache-v1")'
            ) from None
        return digest(self._source_identity(True), maps)

    def _lengths(self) -> list[int]:
        """Length after each index operator; lengths[0] is the source's."""
        lengths = [len(self.source)]
        for op in self.index_ops:
            lengths.append(op.length(lengths[-1]))
        return lengths

    @property
    def samples(self) -> int:
        return self.lengths[-1]

    def stream_reader(self, epoch: int, skip_tasks: int = 0) -> None:
        return None

    # -- what a task covers -------------------------------------------------------------------
    def task_indices(self, epoch: int, task: int) -> np.ndarray:
        """Source indices of task `task`."""
        start = task * self.task_size
        return self.indices(epoch, start, min(start + self.task_size, self.samples))

    def indices(self, epoch: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Source indices at epoch positions [start, stop). The last index operator maps the run
        itself (`IndexOp.parents_run`), cheaper than any positions."""
        stop = self.samples if stop is None else stop
        if not self.index_ops:
            return self.map_positions(np.arange(start, stop, dtype=np.int64), epoch)
        last = len(self.index_ops) - 1
        run = self.index_ops[last].parents_run(start, stop, self.lengths[last], epoch)
        return self.map_positions(run, epoch, last)

    def map_positions(self, positions: np.ndarray, epoch: int, ops: int | None = None) -> np.ndarray:
        """Source indices of epoch positions, or of the positions after the first `ops` index
        operators."""
        ops = len(self.index_ops) if ops is None else ops
        for op, parent_len in zip(reversed(self.index_ops[:ops]), reversed(self.lengths[:ops]), strict=True):
            positions = op.parents(positions, parent_len, epoch)
        if isinstance(self.source, Combined):
            positions = self.source.resolve(epoch, positions)
        return positions

    # -- how a task reads the source ------------------------------------------------------------
    def _by_columns(
        self, epoch: int, task: int, items: Any, skip: bool, timer: Timer, deferred: bool, sendable: bool
    ) -> TaskResult:
        """The task's batch gathered by the source, column by column (`ColumnarReads`); no
        per-sample maps run, so there is no sample to check for `sendable`."""
        t0 = time.perf_counter()
        if items is None and self.gather_ahead is not None:
            batch = self.gather_ahead.read(self, epoch, task)
        else:
            indices = self.task_indices(epoch, task) if items is None else np.asarray(items, dtype=np.int64)
            if not len(indices):
                return TaskResult(None)
            batch = self.source.read_columns(indices)
        tick(timer, "read", t0, len(batch["__key__"]))
        return TaskResult(self._batch_maps(batch, epoch, task, timer))

    def _by_read_many(
        self, epoch: int, task: int, items: Any, skip: bool, timer: Timer, deferred: bool, sendable: bool
    ) -> TaskResult:
        """A source made of blocks reads a task's records block by block (`BatchReads`)."""
        t0 = time.perf_counter()
        indices = self.task_indices(epoch, task) if items is None else np.asarray(items, dtype=np.int64)
        pairs = list(zip(indices.tolist(), self.source.read_many(indices), strict=True))
        tick(timer, "read", t0, len(pairs))
        return self._build(epoch, task, pairs, True, 0, skip, timer, deferred, sendable)

    def _by_index(
        self, epoch: int, task: int, items: Any, skip: bool, timer: Timer, deferred: bool, sendable: bool
    ) -> TaskResult:
        """Each sample read when it is built (`source[i]`, or the cache first)."""
        indices = self.task_indices(epoch, task) if items is None else items
        return self._build(epoch, task, indices, False, 0, skip, timer, deferred, sendable)

"""The plan of a stream chain (no random access): its stream operators turn the source's
records into an epoch's, which a reader cuts into tasks in turn; a task comes with its records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from globalloader.dataset.cache import CacheOp
from globalloader.dataset.operator import IndexOp, StreamOp
from globalloader.dataset.plan import CACHE_PLACE, Plan, TaskResult, Timer
from globalloader.dataset.shard import StreamShard
from globalloader.dataset.shuffle import stream_shuffle
from globalloader.dataset.stream import StreamReader, StreamSource
from globalloader.errors import ArgumentError


class StreamPlan(Plan):
    """The plan of a stream chain: stream operators (`StreamOp`) turn the source's records into
    an epoch's, read in turn (`StreamReader`); its tasks come with their records."""

    is_stream = True
    unsized = "this stream"
    source: StreamSource

    def __init__(self, source: StreamSource, ops: Sequence[Any], inherited_seed: int | None = None) -> None:
        self.stream_ops: list[StreamOp] = []
        super().__init__(source, ops, inherited_seed)
        lengths = [source.length()]
        for op in self.stream_ops:
            lengths.append(op.length(lengths[-1]))
        self.lengths = lengths
        self._read_task = self._by_records
        self._take_identity()

    def select_op(self, indices: Any) -> IndexOp:
        raise ArgumentError("select() needs random access; a stream has none")

    def shuffle_op(self, seed: int | None, buffer_size: int | None, window: int | None) -> StreamOp:
        return stream_shuffle(seed, buffer_size, window)

    def shard_op(self, rank: int, world_size: int, uneven: str) -> StreamOp:
        return StreamShard(rank, world_size, uneven)

    def add_index(self, op: IndexOp) -> None:
        raise ArgumentError(f"{self._order_op_fits(op)} does not apply to a stream")

    def add_stream_op(self, op: StreamOp) -> None:
        self._order_op_fits(op)
        self.stream_ops.append(op)

    def set_cache(self, op: CacheOp) -> None:
        raise ArgumentError(CACHE_PLACE)

    @property
    def combinable(self) -> bool:
        return False

    @property
    def source_length(self) -> None:
        return None

    def check_shareable(self) -> None:
        raise ArgumentError("share=True needs a random-access source; a stream cannot be shared")

    def order_identity(self, placed: bool) -> list[tuple[object, ...]]:
        # Its shard stays in either: a stream's state loads only into the same rank and world size.
        return [op.describe() for op in self.stream_ops]

    def _identify_source(self, strict: bool) -> str:
        return self._walk_source(self.source.iterable, strict)

    def shard(self) -> tuple[int, None]:
        return len(self.stream_ops), None

    @property
    def samples(self) -> int | None:
        return self.lengths[-1]

    def stream_reader(self, epoch: int, skip_tasks: int = 0) -> StreamReader:
        drop_last = self.batch is not None and self.batch.drop_last
        return StreamReader(self.source, self.stream_ops, epoch, self.task_size, drop_last, skip_tasks)

    def _by_records(
        self, epoch: int, task: int, items: Any, skip: bool, timer: Timer, deferred: bool, sendable: bool
    ) -> TaskResult:
        """The task's (index, record) pairs, as the stream's reader took them."""
        return self._build(epoch, task, items, True, 0, skip, timer, deferred, sendable)

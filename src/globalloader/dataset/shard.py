"""`shard(rank, world_size, uneven)`, both forms: this rank's strided share of a random-access
chain's positions (`Shard`, an index operator) or of a stream's records (`StreamShard`).

The arithmetic (which positions a rank takes, what `uneven` does) is `sampling.sharding`'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from globalloader.dataset.operator import IndexOp, StreamOp
from globalloader.errors import ArgumentError
from globalloader.sampling.sharding import ShardArgs, shard_length, shard_positions

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True)
class Shard(ShardArgs, IndexOp):
    """This rank's strided share of the input; see `globalloader.sampling.sharding`."""

    per_epoch = False

    def attach(self, plan: Builder) -> None:
        plan.add_index(self)

    def length(self, n: int) -> int:
        return shard_length(n, self.rank, self.world_size, self.uneven)

    def parents(self, positions: npt.NDArray[np.int64], n: int, epoch: int) -> npt.NDArray[np.int64]:
        return shard_positions(positions, n, self.rank, self.world_size)

    def shard_args(self) -> ShardArgs:
        return self

    def describe(self) -> tuple[object, ...]:
        return ("shard", self.rank, self.world_size, self.uneven)


@dataclass(frozen=True)
class StreamShard(ShardArgs, StreamOp):
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

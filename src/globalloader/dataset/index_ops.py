"""Index-space operators: select, shuffle and shard map output positions to source indices.

Each operator knows its output length from its input length and maps an array of its output
positions to input positions for an epoch, so a whole chain turns a block of positions into
source indices with a few vectorized NumPy calls and no per-epoch buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from globalloader._seeding import check_seed
from globalloader.errors import ArgumentError, SampleIndexError
from globalloader.sampling.permutation import Permutation
from globalloader.sampling.sharding import ShardArgs, shard_length, shard_positions

if TYPE_CHECKING:
    from globalloader.dataset.operator import Builder


@dataclass(frozen=True, eq=False)
class Select:
    """Keep `indices` (positions of the input, in this order): a job's own index set."""

    indices: npt.NDArray[np.int64]

    @classmethod
    def of(cls, indices: object) -> Select:
        try:
            given = np.asarray(indices if not isinstance(indices, (str, bytes)) else [indices])
        except (TypeError, ValueError) as exc:
            raise ArgumentError(f"select: indices must be integers, got {type(indices).__name__}") from exc
        if given.size and (given.dtype.kind not in "iu" or (given.dtype.kind == "u" and given.max() >= 2**63)):
            raise ArgumentError(  # 1.5 -> 1, True -> 1 or "3" -> 3 would select what nobody asked for
                f"select: indices must be integers, got {given.dtype} values such as {given.reshape(-1)[0]!r}"
            )
        if given.ndim > 1:  # [[1, 2], [3, 4]] is not a list of positions: flattening would guess
            raise ArgumentError(f"select: indices must be a flat list of integers, got an array of shape {given.shape}")
        arr = given.astype(np.int64).reshape(-1)
        arr.setflags(write=False)
        return cls(arr)

    def attach(self, plan: Builder) -> None:
        plan.add_index(self)

    def length(self, n: int) -> int:
        bad = (self.indices < 0) | (self.indices >= n)
        if bad.any():
            raise SampleIndexError(
                f"select: index {int(self.indices[bad][0])} is out of range for a dataset of {n} samples"
            )
        return len(self.indices)

    def parents(self, positions: npt.NDArray[np.int64], n: int, epoch: int) -> np.ndarray:
        return self.indices[positions]

    def describe(self) -> tuple[object, ...]:
        return ("select", self.indices)


@lru_cache(maxsize=8)
def _permutation(n: int, seed: int, epoch: int) -> Permutation:
    return Permutation(n, seed, epoch)


@dataclass(frozen=True)
class Shuffle:
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

    def parents(self, positions: np.ndarray, n: int, epoch: int) -> np.ndarray:
        assert self.seed is not None, "the plan gives every shuffle its seed"
        return _permutation(n, self.seed, epoch)[positions]

    def parents_run(self, start: int, stop: int, n: int, epoch: int) -> np.ndarray:
        """`parents` of the positions [start, stop), a task's (see `Permutation.run`)."""
        assert self.seed is not None, "the plan gives every shuffle its seed"
        return _permutation(n, self.seed, epoch).run(start, stop)

    def describe(self) -> tuple[object, ...]:
        return ("shuffle", self.seed)


@dataclass(frozen=True)
class Shard(ShardArgs):
    """This rank's strided share of the input; see `globalloader.sampling.sharding`."""

    def attach(self, plan: Builder) -> None:
        plan.add_index(self)

    def length(self, n: int) -> int:
        return shard_length(n, self.rank, self.world_size, self.uneven)

    def parents(self, positions: np.ndarray, n: int, epoch: int) -> np.ndarray:
        return shard_positions(positions, n, self.rank, self.world_size)

    def describe(self) -> tuple[object, ...]:
        return ("shard", self.rank, self.world_size, self.uneven)

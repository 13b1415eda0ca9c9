"""Two-level sharding in index space: ranks first (here), then the Loader's workers.

A rank takes every `world_size`-th position starting at its rank (strided, so every rank's share
is spread over the whole shuffled order). `uneven` says what happens when `n` does not divide:

- "pad": every rank gets ceil(n / world) positions, the tail wrapping around to the start
  (a few samples are seen twice per epoch; no rank waits for another);
- "drop": every rank gets floor(n / world) positions (the last n % world positions are unused);
- "none": ranks get n // world or n // world + 1 positions (DDP may then hang: opt in knowingly).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import numpy as np

from globalloader.errors import ArgumentError, check_int

UNEVEN_POLICIES = ("pad", "drop", "none")
# The largest world a shard (and a state dict's layers) may name: an elastic resume keeps a count
# per rank of each world, so a world is bounded before a state's counts are allocated.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class ShardArgs:
    """A `shard(rank, world_size, uneven)`'s arguments, checked: rank and world_size become
    Python ints (NumPy integers are taken; a bool is not: shard(True, 2) is no rank anyone
    meant), else ArgumentError naming the argument that is wrong."""

    rank: int
    world_size: int
    uneven: str

    def __post_init__(self) -> None:
        world_size = check_int(self.world_size, "shard: world_size", 1)
        if world_size > MAX_WORLD_SIZE:
            raise ArgumentError(f"shard: world_size must be at most {MAX_WORLD_SIZE}, got {world_size}")
        rank = self.rank
        if isinstance(rank, bool) or not isinstance(rank, Integral) or not 0 <= rank < world_size:
            raise ArgumentError(f"shard: rank must be an int in [0, {world_size}), got {rank!r}")
        if self.uneven not in UNEVEN_POLICIES:
            raise ArgumentError(f"shard: uneven must be one of {UNEVEN_POLICIES}, got {self.uneven!r}")
        object.__setattr__(self, "rank", int(rank))
        object.__setattr__(self, "world_size", world_size)


def shard_length(n: int, rank: int, world_size: int, uneven: str) -> int:
    """How many positions `rank` gets out of `n`."""
    if uneven == "pad":
        return -(-n // world_size) if n else 0
    if uneven == "drop":
        return n // world_size
    return len(range(rank, n, world_size))


def shard_positions(positions: np.ndarray, n: int, rank: int, world_size: int) -> np.ndarray:
    """Parent positions of a rank's shard positions (the "pad" tail wraps modulo n)."""
    return (rank + np.asarray(positions, dtype=np.int64) * world_size) % max(n, 1)

"""Two-level sharding in index space: ranks first (here), then the Loader's workers.

A rank takes every `world_size`-th position starting at its rank (strided, so every rank's share
is spread over the whole shuffled order). `uneven` says what happens when `n` does not divide:

- "pad": every rank gets ceil(n / world) positions, the tail wrapping around to the start
  (a few samples are seen twice per epoch; no rank waits for another);
- "drop": every rank gets floor(n / world) positions (the last n % world positions are unused);
- "none": ranks get n // world or n // world + 1 positions (DDP may then hang: opt in knowingly).
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

from globalloader.errors import ArgumentError, check_int

UNEVEN_POLICIES = ("pad", "drop", "none")


def check_shard_args(rank: int, world_size: int, uneven: str) -> tuple[int, int]:
    """(rank, world_size) as Python ints (NumPy integers are taken; a bool is not: shard(True, 2)
    is no rank anyone meant), or ArgumentError naming the argument that is wrong."""
    world_size = check_int(world_size, "shard: world_size", 1)
    if isinstance(rank, bool) or not isinstance(rank, Integral) or not 0 <= rank < world_size:
        raise ArgumentError(f"shard: rank must be an int in [0, {world_size}), got {rank!r}")
    if uneven not in UNEVEN_POLICIES:
        raise ArgumentError(f"shard: uneven must be one of {UNEVEN_POLICIES}, got {uneven!r}")
    return int(rank), world_size


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

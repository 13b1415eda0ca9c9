"""What remains of an epoch after ranks of other world sizes consumed part of it (elastic resume).

The epoch's global order is the sequence of positions before `shard` (the shuffle's permutation);
rank r of world W takes the strided positions r, r + W, r + 2W, ... (`sampling.sharding`). A rank
that consumed c of its positions therefore consumed a known set of global positions, and one
`Layer` (world, consumed count per rank) describes what a whole world consumed. Layers apply in
order, each over what the earlier ones left (a job may change size several times in an epoch).

Ranks in lockstep (equal counts) consumed a prefix, so what remains is a suffix: a number, O(1)
whatever the epoch's size. Ranks out of step leave holes: what remains is then materialised once,
an int64 array of the remaining positions (O(n) time and memory when the state is loaded).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
import numpy.typing as npt

from globalloader.errors import StateError
from globalloader.sampling.sharding import MAX_WORLD_SIZE, UNEVEN_POLICIES, shard_length

_INT64_MAX = (1 << 63) - 1  # positions and counts are NumPy int64


@dataclass(frozen=True)
class Layer:
    """What ranks 0..world-1 of one world consumed: `counts[r]` positions of rank r's share,
    shared out by the `uneven` policy of that world's `shard`."""

    world: int
    counts: tuple[int, ...]
    uneven: str = "none"

    def to_json(self) -> dict[str, Any]:
        """Counts run-length encoded ([[count, ranks], ...]): ranks in lockstep cost one pair."""
        runs = [[c, len(list(same))] for c, same in itertools.groupby(self.counts)]
        return {"world": self.world, "counts": runs, "uneven": self.uneven}

    @classmethod
    def from_json(cls, value: Any) -> Layer:
        """A layer of a state dict's `base`, its world bounded and its runs checked before the
        counts are expanded (a world of 10**12 ranks is refused, not allocated)."""
        if not isinstance(value, dict) or value.get("uneven") not in UNEVEN_POLICIES:
            raise StateError(f"state dict field 'base' holds a malformed layer {value!r:.200}")
        world = state_int(value.get("world"), "base", 1, MAX_WORLD_SIZE, "a layer's world")
        runs = value.get("counts")
        if not isinstance(runs, list) or not all(isinstance(r, (list, tuple)) and len(r) == 2 for r in runs):
            raise StateError(
                f"state dict field 'base' holds a layer whose counts are not [count, ranks]: {runs!r:.200}"
            )
        pairs = [
            (state_int(c, "base", what="a count"), state_int(n, "base", 1, world, "a run of ranks")) for c, n in runs
        ]
        if sum(times for _, times in pairs) != world:
            raise StateError(f"state dict field 'base' holds a layer whose counts do not cover its {world} ranks")
        return cls(world, tuple(c for c, times in pairs for _ in range(times)), value["uneven"])


def state_int(value: Any, field: str, low: int = 0, high: int = _INT64_MAX, what: str = "") -> int:
    """An int in a state dict (a NumPy integer is one; a bool, float or str is not) in [low, high],
    else a StateError naming the field (and `what` in it)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not low <= int(value) <= high:
        part = f"{field!r}: {what}" if what else repr(field)
        bound = f">= {low}" if high == _INT64_MAX else f"in [{low}, {high}]"
        raise StateError(f"state dict field {part} must be an int {bound}, got {value!r:.100}")
    return int(value)


class Remaining:
    """The global positions of an epoch of `n` not consumed by `layers`, in epoch order."""

    def __init__(self, n: int, layers: tuple[Layer, ...] = ()) -> None:
        self.start, self.stop = 0, n  # a suffix [start, stop) while every layer was in lockstep
        self.array: npt.NDArray[np.int64] | None = None
        for layer in layers:
            self.consume(layer)

    def __len__(self) -> int:
        return self.stop - self.start if self.array is None else len(self.array)

    def copy(self) -> Remaining:
        other = Remaining(0)
        other.start, other.stop = self.start, self.stop
        other.array = self.array  # never written in place: consume and drop replace it
        return other

    def positions(self, index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Global positions at `index` (indices into what remains)."""
        if self.array is None:
            return np.asarray(index, dtype=np.int64) + self.start
        return self.array[index]

    def share(self, rank: int, world: int, uneven: str) -> int:
        """How many positions rank `rank` of `world` takes of what remains."""
        return shard_length(len(self), rank, world, uneven)

    def consume(self, layer: Layer) -> None:
        """Remove what the ranks of `layer` consumed (each rank's share is strided over what remains)."""
        m, world, uneven = len(self), layer.world, layer.uneven
        for rank, count in enumerate(layer.counts):
            if count > self.share(rank, world, uneven):
                raise StateError(
                    f"state of rank {rank} of {world}: position {count} is beyond its share of the epoch "
                    f"({self.share(rank, world, uneven)} samples)"
                )
        if m == 0:
            return
        first = layer.counts[0]
        if all(c == first for c in layer.counts) and first * world <= m:  # lockstep: a prefix
            if self.array is None:
                self.start += first * world
            else:
                self.array = self.array[first * world :]
            return
        keep = np.ones(m, dtype=bool)
        for rank, count in enumerate(layer.counts):  # the "pad" tail wraps around modulo m
            keep[(rank + np.arange(count, dtype=np.int64) * world) % m] = False
        self.array = self.positions(np.flatnonzero(keep))

    def drop(self, keep: npt.NDArray[np.bool_]) -> None:
        """Keep only the remaining positions where `keep` (one flag per remaining position)."""
        self.array = self.positions(np.flatnonzero(keep))

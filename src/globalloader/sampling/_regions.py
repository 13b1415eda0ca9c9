"""Regions: the partition of the index universe by which jobs want each index.

Region r holds the indices whose set of interested jobs is exactly `jobs[r]`. The joint sampler
uses it to tell, when a sample is loaded, which jobs may follow it, and to give a job its cells
when an epoch starts. Ids are renumbered on every change, so callers keep no region id across
`add` or `remove`.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from typing import Generic, TypeVar

import numpy as np

Member = TypeVar("Member", bound=Hashable)


class RegionMap(Generic[Member]):
    """One region id per index of the universe [0, size), plus each region's member tuple.

    `ids` is an `array('i')` so single lookups on the hot path return plain ints; bulk work goes
    through short-lived NumPy views (never kept, so the arrays can be replaced on growth).
    Members are opaque hashable objects; a region's tuple lists them in joining order, so two
    regions with the same members always have equal tuples.
    """

    __slots__ = ("ids", "jobs")

    def __init__(self) -> None:
        self.ids = array("i")
        self.jobs: list[tuple[Member, ...]] = [()]

    @property
    def size(self) -> int:
        """Length of the universe: every index below it has a region (0 or more members)."""
        return len(self.ids)

    def view(self) -> np.ndarray:
        """A NumPy view of the ids, for bulk reads and writes; drop it before the next `grow`."""
        return np.frombuffer(self.ids, dtype=np.int32) if len(self.ids) else np.zeros(0, np.int32)

    def grow(self, size: int) -> None:
        """Extend the universe to `size` indices; new indices belong to the region nobody wants."""
        if size <= len(self.ids):
            return
        empty = self._empty_region()
        grown = np.full(size, empty, dtype=np.int32)
        grown[: len(self.ids)] = self.view()
        self.ids = array("i", grown.tobytes())

    def add(self, member: Member, indices: np.ndarray) -> None:
        """Add `member` as interested in `indices` (sorted, unique, inside the universe)."""
        ids = self.view()
        count = len(self.jobs)
        # Each old region splits into (old, not wanted) and (old, wanted): key = 2 * old + bit.
        present = np.zeros(2 * count, dtype=bool)
        wanted = np.zeros(len(ids), dtype=bool)
        wanted[indices] = True
        keys = ids.astype(np.int64) * 2 + wanted
        present[keys] = True
        kept = np.flatnonzero(present)
        table = np.cumsum(present, dtype=np.int64) - 1
        ids[:] = table[keys]
        self.jobs = [self.jobs[key >> 1] + ((member,) if key & 1 else ()) for key in kept.tolist()]
        if not self.jobs:
            self.jobs = [()]

    def remove(self, member: Member) -> None:
        """Drop `member` everywhere and merge the regions that became equal."""
        renumber: dict[tuple[Member, ...], int] = {}
        table = np.empty(len(self.jobs), dtype=np.int32)
        for old, members in enumerate(self.jobs):
            left = tuple(m for m in members if m is not member)
            table[old] = renumber.setdefault(left, len(renumber))
        ids = self.view()
        ids[:] = table[ids]
        self.jobs = list(renumber)

    def _empty_region(self) -> int:
        """The id of the region no job wants, creating it when every index is wanted."""
        for rid, members in enumerate(self.jobs):
            if not members:
                return rid
        self.jobs.append(())
        return len(self.jobs) - 1

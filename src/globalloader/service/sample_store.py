"""The sample store: decoded samples in the server's arena, reference counted, with an LRU tier.

A sample is written into the arena once (by a server worker) and read in place by every job that
takes it, each holding a reference. When the last one is released the sample stays readable (a
later request is a hit) in an LRU tier until its space is needed. That tier is two LRU lists:
samples no job still wants this epoch, evicted first, and samples some job still wants (the joint
sampler's advice: followable samples stay longer than under plain LRU). A sample is filed when it
becomes unreferenced; whether a job wants it changes otherwise only when jobs come, go or start an
epoch, and the server then calls `refile`. A referenced or loading sample is never evicted, and the
arena never grows past its capacity: a reservation that cannot fit yet returns None until releases
make room.

Bookkeeping only, in the server's main thread; the bytes are written and read by other processes
through `transport.arena`.
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from globalloader.errors import ArgumentError, ProtocolError, SampleTooLargeError, ServerError
from globalloader.transport.codec import ALIGN, aligned

K = TypeVar("K", bound=Hashable)  # a sample's key (the server's: (prefix fingerprint, index))


@dataclass
class Entry:
    offset: int
    nbytes: int
    layout: Any = None  # set when the bytes are written (ready)
    holders: Counter[Hashable] = field(default_factory=Counter)  # job -> references
    served: int = 0  # acquisitions so far: all but the first are hits (no load needed)

    @property
    def ready(self) -> bool:
        return self.layout is not None

    @property
    def refs(self) -> int:
        return sum(self.holders.values())


class SampleStore(Generic[K]):
    """Allocation, references and eviction for an arena of `capacity` bytes."""

    def __init__(
        self,
        capacity: int,
        on_evict: Callable[[K], None] | None = None,
        wanted: Callable[[K], bool] | None = None,
    ) -> None:
        if not isinstance(capacity, int) or capacity < ALIGN:
            raise ArgumentError(f"sample store: capacity must be an int >= {ALIGN} bytes, got {capacity!r}")
        self.capacity = capacity
        self._on_evict = on_evict or (lambda key: None)
        self._wanted = wanted or (lambda key: False)
        self._entries: dict[K, Entry] = {}
        # Ready and unreferenced, oldest first, each with the tick it was filed at: samples no
        # job wants (evicted first), and the others.
        self._unwanted: OrderedDict[K, int] = OrderedDict()
        self._kept: OrderedDict[K, int] = OrderedDict()
        self._ticks = 0
        self._starts = [0]  # free blocks, sorted by offset
        self._sizes = {0: capacity}
        self.used = 0
        self.counters: Counter[str] = Counter()  # hits, evictions, loads

    # -- lookups -----------------------------------------------------------------------------
    def get(self, key: K) -> Entry | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # -- loading -----------------------------------------------------------------------------
    def reserve(self, key: K, nbytes: int) -> int | None:
        """Space for `key`'s bytes: the offset, or None if it cannot fit until something is
        released. Evicts least-recently-used unreferenced samples as needed."""
        if key in self._entries:
            raise ServerError(f"sample store: {key!r} is already in the store")
        size = max(ALIGN, aligned(nbytes))
        if size > self.capacity:
            raise SampleTooLargeError(
                f"sample {key!r} needs {nbytes} bytes but the pool holds only {self.capacity}: "
                "start the server with a larger --memory"
            )
        offset = self._fit(size)
        while offset is None and (self._unwanted or self._kept):
            self._evict(self._victim())
            offset = self._fit(size)
        if offset is None:
            return None
        self._entries[key] = Entry(offset, size)
        self.used += size
        self.counters["loads"] += 1
        return offset

    def shrink(self, key: K, nbytes: int) -> None:
        """A reservation made on a size guess: give back the tail the sample did not use."""
        entry = self._entries[key]
        size = max(ALIGN, aligned(nbytes))
        if size < entry.nbytes:
            self._insert(entry.offset + size, entry.nbytes - size)
            self.used -= entry.nbytes - size
            entry.nbytes = size

    def commit(self, key: K, layout: Any) -> Entry:
        """The bytes of `key` are written: it becomes readable (unreferenced, so in the LRU tier)."""
        entry = self._entries[key]
        entry.layout = layout
        self._file(key)
        return entry

    def abort(self, key: K) -> None:
        """Loading `key` failed: give its space back."""
        entry = self._entries.pop(key)
        self._free(entry)

    # -- references --------------------------------------------------------------------------
    def acquire(self, key: K, holder: Hashable) -> Entry:
        """`holder` takes a reference to a ready sample (a hit unless it was loaded for this one)."""
        entry = self._entries[key]
        if not entry.ready:
            raise ServerError(f"sample store: {key!r} is still loading")
        if not entry.holders:
            self._unfile(key)
        if entry.served:
            self.counters["hits"] += 1
        entry.served += 1
        entry.holders[holder] += 1
        return entry

    def release(self, key: K, holder: Hashable) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.holders[holder] <= 0:
            raise ProtocolError(f"sample store: {holder!r} holds no reference to {key!r}")
        entry.holders[holder] -= 1
        if entry.holders[holder] == 0:
            del entry.holders[holder]
        if not entry.holders:
            self._file(key)

    def release_holder(self, holder: Hashable) -> int:
        """Drop every reference `holder` has (a job that left or died); returns how many."""
        dropped = 0
        for key, entry in self._entries.items():
            count = entry.holders.pop(holder, 0)
            if count:
                dropped += count
                if not entry.holders and entry.ready:
                    self._file(key)
        return dropped

    def refile(self) -> None:
        """Sort the unreferenced samples again by whether a job wants them (call it when jobs
        came, went or started an epoch); ages are kept."""
        idle = sorted([*self._unwanted.items(), *self._kept.items()], key=lambda item: item[1])
        self._unwanted.clear()
        self._kept.clear()
        for key, tick in idle:
            (self._kept if self._wanted(key) else self._unwanted)[key] = tick

    # -- reporting ---------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        referenced = sum(1 for e in self._entries.values() if e.holders)
        return {
            "capacity": self.capacity,
            "used": self.used,
            "samples": len(self._entries),
            "referenced": referenced,
            "cached": len(self._unwanted) + len(self._kept),
            "loading": sum(1 for e in self._entries.values() if not e.ready),
            **self.counters,
        }

    # -- free-list allocator -----------------------------------------------------------------
    def _fit(self, size: int) -> int | None:
        """First fit: the lowest free block that holds `size` bytes."""
        for i, start in enumerate(self._starts):
            block = self._sizes[start]
            if block >= size:
                del self._starts[i]
                del self._sizes[start]
                if block > size:
                    self._insert(start + size, block - size)
                return start
        return None

    def _file(self, key: K) -> None:
        """`key` became unreferenced: into the LRU list that says whether a job still wants it."""
        self._ticks += 1
        (self._kept if self._wanted(key) else self._unwanted)[key] = self._ticks

    def _unfile(self, key: K) -> None:
        if self._unwanted.pop(key, None) is None:
            del self._kept[key]

    def _victim(self) -> K:
        """The oldest unreferenced sample nobody wants any more, else the oldest one."""
        return next(iter(self._unwanted or self._kept))

    def _evict(self, key: K) -> None:
        self._unfile(key)
        entry = self._entries.pop(key)
        self._free(entry)
        self.counters["evictions"] += 1
        self._on_evict(key)

    def _free(self, entry: Entry) -> None:
        self.used -= entry.nbytes
        self._insert(entry.offset, entry.nbytes)

    def _insert(self, start: int, size: int) -> None:
        """Add a free block, merging it with free neighbours."""
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + size == self._starts[i]:
            size += self._sizes.pop(self._starts.pop(i))
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:
                self._sizes[prev] += size
                return
        self._starts.insert(i, start)
        self._sizes[start] = size

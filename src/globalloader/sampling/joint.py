"""The joint sampler: one uniformly random order per job, drawn so that jobs share loads.

Several training jobs on one machine read overlapping index sets of one dataset. Each job must
see its own set once per epoch in a uniformly random order, whatever the others do, yet a sample
loaded for one job should serve the others while it is still in memory. The production rule is
the region-wise "follow" specified in docs/shared.md ("The joint sampler"):

- Cells. When a job's order is drawn (its epoch start, a join that cuts one of its cells), the
  indices it has not taken yet are split into cells of indices that nothing can tell apart at
  that moment: same region; for every other job that wants them, both seen this epoch or both
  unseen in the same cell of that job; neither warm (drawn and not evicted since: perhaps in the
  sample store, in flight or in a follow log), each warm index being a cell of its own.
  It draws a uniform arrangement of its cell labels; request i is served from cell label i.
- Follow. Within the cell it takes the oldest sample that another job drew fresh since this
  job's epoch began, that has not been evicted since, and that it has not seen; else a fresh
  element (uniform among its unseen ones), which the others may then follow.

Why that is uniform (docs/shared.md, "Why each order is uniform"): every later decision treats
indices only through their history, which the indices of a cell share, so the order inside each
cell is exchangeable and, with uniform labels, the job's order is uniform given its previous
epochs too. Cells that were only regions were not enough (a faster follower avoids this job's
last items). The price: a warm index is rarely followed, so each epoch loses about as many
follows as the store holds samples of the job's set. Consequences that shape the code:

- A job joining mid-epoch makes the others re-draw where its set cuts their cells; a job
  leaving never merges them (the follow rule would prefer the part the leaver had loaded).
- Only draws made since the job's own epoch began may be followed, so epochs stay independent.
- A fresh draw makes a sample followable, loaded or not; `evicted` ends its followability and
  its warmth (see `JointSampler` for why an order drawn while sharing is not its seed's).

Cost per request is O(1) amortised (a few list, dict and bytearray lookups): each follow-log
entry and each fresh-list element is passed at most once per epoch. Drawing an order (epoch
start, cut) costs O(universe + |set| * jobs sharing it) in NumPy. Memory per job is
about 5 bytes per index of the universe (the largest index of any job) plus about 30 bytes per
element of its set. Not thread-safe: one thread (the server's scheduler) drives it, or callers
hold a lock.
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import InitVar, dataclass, field

import numpy as np

from globalloader._seeding import entropy_seed, generator, spawned_generator
from globalloader.errors import ArgumentError, SampleIndexError, check_int
from globalloader.sampling._regions import RegionMap

# A cell's follow log is compacted (stale entries dropped) once it is longer than twice the
# number of followable samples plus this slack, which keeps compaction amortised O(1) per entry.
_LOG_SLACK = 4096
# Indices index per-job bitmaps over the universe, so they are bounded to keep memory sane.
_MAX_INDEX = 2**31 - 2


@dataclass(slots=True, eq=False)
class _Cell:
    """One cell of a job's current epoch: its elements in uniform order and its follow log."""

    fresh: array[int]  # the cell's elements, uniformly shuffled; seen ones are skipped
    next_fresh: int = 0
    log: list[tuple[int, int]] = field(default_factory=list)  # (load sequence number, index), oldest first
    next_log: int = 0  # entries before it are followed or stale for this epoch


@dataclass(slots=True, eq=False)  # by identity: regions hold jobs in tuples
class _Job:
    """Everything the sampler keeps for one job."""

    name: Hashable
    indices: np.ndarray  # sorted unique int64
    seed: int
    universe: InitVar[int]
    seen: bytearray = field(init=False)  # 1 for every index seen this epoch
    cell: array[int] = field(init=False)  # cell id of each unseen index of the set
    epoch: int = 0
    cells: list[_Cell] = field(default_factory=list)
    labels: array[int] | None = None  # cell label of each request; None with one cell
    pos: int = 0  # requests served from the current arrangement
    length: int = 0  # requests the current arrangement holds
    base: int = 0  # requests served before the current arrangement
    followed: int = 0
    seeded: bool = False  # whether the current arrangement is the plain shuffle of its seed
    # (regions version, whether no other job wants any of its indices), cached per version
    layout: tuple[int, bool] = (-1, True)

    def __post_init__(self, universe: int) -> None:
        self.seen = bytearray(universe)
        self.cell = array("i", bytes(4 * universe))


class JointSampler:
    """Chooses each job's next index: every job's epoch order is uniform, and loads are shared.

    Pure index-space logic, no I/O: the server asks `next(job)` and reports through `evicted(i)`
    every sample that leaves its sample store (or that it did not keep). A fresh draw is
    followable at once, so a follower may be served from a load still in flight. Jobs join and
    leave at any time, mid-epoch included; none ever waits for another. A job resumes mid-epoch by
    being added again over the indices it has not consumed (the server does so for a pass over
    the rest of an epoch): the rest of the epoch is a uniform order of what remains.

    Randomness: a job that starts an epoch alone (no other job wants any of its indices) gets
    the plain shuffle of that epoch, a function of its seed, epoch number and set only. A job
    that starts an epoch while sharing draws its order from the sampler's own stream instead:
    were it replayed from its seed (a job re-run with the same seed, or resumed again from one
    checkpoint), the jobs following it would see the same order twice and their epochs would
    stop being independent. `seed` seeds that stream (None: fresh OS entropy) and the default
    job seeds.
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:
            seed = entropy_seed()
        self._seed = check_int(seed, "seed")
        # Fresh randomness for orders drawn while jobs share: never replayed within one sampler.
        self._rng = generator(self._seed)
        self._jobs: dict[Hashable, _Job] = {}
        self._regions: RegionMap[_Job] = RegionMap()
        self._version = 0  # bumped whenever the regions change
        self._registrations = 0  # makes default job seeds differ between registrations
        # index -> sequence number of the fresh draw that made it followable; dropped on eviction
        self._live: dict[int, int] = {}
        self._seq = 0

    # -- jobs -------------------------------------------------------------------------------

    def add_job(
        self,
        job: Hashable,
        indices: Sequence[int] | np.ndarray,
        *,
        seed: int | None = None,
        epoch: int = 0,
    ) -> None:
        """Register `job` over `indices` (unique non-negative ints) and start its epoch `epoch`.

        `seed` fixes the job's epoch orders when it runs alone. The default is derived from the
        sampler's seed, the job name and a count of registrations, so it is reproducible for a
        given sequence of calls, yet a job removed and added again (say, once per epoch) does
        not replay its first epoch. Other jobs' remaining labels are re-drawn where the new set
        cuts their cells; their orders stay uniform.
        """
        if job in self._jobs:
            raise ArgumentError(f"job {job!r} is already registered; remove_job({job!r}) first")
        indices = _index_set(indices, "indices")
        seed = self._default_seed(job) if seed is None else check_int(seed, "seed")
        epoch = check_int(epoch, "epoch")
        self._start_epoch(self._register(job, indices, seed), epoch)

    def remove_job(self, job: Hashable) -> None:
        """Forget `job`, mid-epoch included. Other jobs keep their cells until their next epoch."""
        j = self._job(job)
        del self._jobs[job]
        self._regions.remove(j)
        self._version += 1

    def new_epoch(self, job: Hashable, epoch: int | None = None) -> None:
        """Start `job`'s next epoch (or epoch `epoch`), independent of the previous ones.

        Whatever remained of the current epoch is dropped.
        """
        j = self._job(job)
        self._start_epoch(j, j.epoch + 1 if epoch is None else check_int(epoch, "epoch"))

    # -- the hot path -----------------------------------------------------------------------

    def next(self, job: Hashable) -> int:
        """The next index of `job`'s current epoch; StopIteration once the epoch is done."""
        try:
            j = self._jobs[job]
        except KeyError:
            raise self._unknown(job) from None
        pos = j.pos
        if pos >= j.length:
            raise StopIteration
        j.pos = pos + 1
        labels = j.labels
        cell = j.cells[0] if labels is None else j.cells[labels[pos]]
        seen = j.seen
        log = cell.log
        at = cell.next_log
        end = len(log)
        if at < end:
            live = self._live
            while at < end:
                seq, index = log[at]
                at += 1
                if not seen[index] and live.get(index) == seq:
                    cell.next_log = at
                    seen[index] = 1
                    j.followed += 1
                    return index
            cell.next_log = at
        # Nothing to follow: the next unseen element of the cell's uniform order (a fresh draw).
        fresh = cell.fresh
        at = cell.next_fresh
        index = fresh[at]
        while seen[index]:
            at += 1
            index = fresh[at]
        cell.next_fresh = at + 1
        seen[index] = 1
        self._publish(index)
        return index

    def loaded(self, index: int) -> None:
        """Report that sample `index` is in memory. Accepted for the store's symmetry only.

        Decisions do not depend on it: a sample is followable from the moment a job draws it
        fresh (see the module docstring for why "loaded since the epoch began" is not used).
        """
        operator.index(index)

    def evicted(self, index: int) -> None:
        """Report that sample `index` left memory: nobody follows it until it is drawn again."""
        self._live.pop(operator.index(index), None)

    def wanted(self, index: int) -> bool:
        """Whether some job that wants `index` has not taken it yet in its current epoch.

        A hint for the sample store: evicting unwanted samples first (instead of refreshing them
        on every hit, as plain LRU does) keeps the window of followable samples full. It is a
        function of the jobs' seen sets, so a store that uses it keeps every order uniform.
        """
        index = operator.index(index)
        regions = self._regions
        ids = regions.ids
        if not 0 <= index < len(ids):
            return False
        return any(not j.seen[index] for j in regions.jobs[ids[index]])

    # -- state and introspection ------------------------------------------------------------

    def remaining(self, job: Hashable) -> int:
        """How many requests `job`'s current epoch has left."""
        j = self._job(job)
        return j.length - j.pos

    def stats(self) -> dict[Hashable, dict[str, int]]:
        """Per job: epoch, requests, followed (took another job's draw), fresh (drew anew).

        Counts start when the job is added.
        """
        out = {}
        for name, j in self._jobs.items():
            requests = j.base + j.pos
            out[name] = {
                "epoch": j.epoch,
                "requests": requests,
                "followed": j.followed,
                "fresh": requests - j.followed,
            }
        return out

    # -- internals --------------------------------------------------------------------------

    def _publish(self, index: int) -> None:
        """Make a fresh draw followable by every job that wants `index` and has not seen it."""
        live = self._live
        regions = self._regions
        self._seq = seq = self._seq + 1
        live[index] = seq
        entry = (seq, index)
        limit = 2 * len(live) + _LOG_SLACK
        for j in regions.jobs[regions.ids[index]]:
            if not j.seen[index]:
                cell = j.cells[j.cell[index]]
                log = cell.log
                log.append(entry)
                if len(log) > limit:
                    _compact(cell, j.seen, live)

    def _job(self, job: Hashable) -> _Job:
        try:
            return self._jobs[job]
        except KeyError:
            raise self._unknown(job) from None

    def _unknown(self, job: Hashable) -> ArgumentError:
        known = ", ".join(repr(name) for name in self._jobs) or "none"
        return ArgumentError(f"no job named {job!r} (registered: {known}); call add_job first")

    def _default_seed(self, job: Hashable) -> int:
        self._registrations += 1
        key = f"{self._seed}\0{self._registrations}\0{job!r}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")

    def _register(self, name: Hashable, indices: np.ndarray, seed: int) -> _Job:
        """Create the job, grow the universe, split regions and other jobs' cells."""
        if len(indices) and indices[-1] >= self._regions.size:
            self._grow(int(indices[-1]) + 1)
        j = _Job(name, indices, seed, self._regions.size)
        self._regions.add(j, indices)
        self._version += 1
        for other in self._jobs.values():
            self._refine(other)
        self._jobs[name] = j
        return j

    def _grow(self, size: int) -> None:
        """Extend the universe; copies rather than resizes, so no buffer export can block it."""
        self._regions.grow(size)
        for j in self._jobs.values():
            seen = bytearray(size)
            seen[: len(j.seen)] = j.seen
            j.seen = seen
            cell = array("i", bytes(4 * size))
            cell[: len(j.cell)] = j.cell
            j.cell = cell

    def _start_epoch(self, j: _Job, epoch: int) -> None:
        j.epoch = epoch
        j.seen = bytearray(self._regions.size)
        if self._alone(j):
            order = j.indices[_plain_order(j.seed, epoch, len(j.indices))]
            self._arrange(j, order, np.zeros(len(order), dtype=np.int64), 1)  # one cell
            j.seeded = True
        else:
            self._redraw(j, j.indices)

    def _alone(self, j: _Job) -> bool:
        """Whether no other job wants any of j's indices (cached until the regions change)."""
        if j.layout[0] != self._version:
            regions = self._regions
            present = np.flatnonzero(np.bincount(regions.view()[j.indices])).tolist() if len(j.indices) else []
            j.layout = (self._version, all(len(regions.jobs[r]) == 1 for r in present))
        return j.layout[1]

    def _cells_of(self, j: _Job, rest: np.ndarray) -> tuple[np.ndarray, int]:
        """Cells (as the module docstring defines them) for drawing j's order of `rest`, its
        unseen indices, now: (cell id of each, count)."""
        if not len(rest):
            return rest, 0
        regions = self._regions
        region = regions.view()[rest].astype(np.int64)
        key, _ = _dense(region)
        members = regions.jobs
        for g in self._jobs.values():
            if g is j:
                continue
            wants = np.fromiter((g in m for m in members), dtype=bool, count=len(members))[region]
            if not wants.any():
                continue
            status = np.frombuffer(g.cell, dtype=np.int32)[rest].astype(np.int64) + 1
            status[~wants | (np.frombuffer(g.seen, dtype=np.uint8)[rest] != 0)] = 0
            key = _combine(key, status)
        if self._live:
            warm = np.zeros(regions.size, dtype=bool)
            warm[np.fromiter(self._live, dtype=np.int64, count=len(self._live))] = True
            warm = warm[rest]
            if warm.any():
                key = _combine(key, np.where(warm, np.cumsum(warm), 0))
        return _dense(key)

    def _redraw(self, j: _Job, rest: np.ndarray) -> None:
        """Serve j's unseen indices `rest` in a fresh uniform order over the cells of now."""
        cell_of, count = self._cells_of(j, rest)
        perm = self._rng.permutation(len(rest))
        self._arrange(j, rest[perm], cell_of[perm], count)

    def _arrange(self, j: _Job, order: np.ndarray, cell_of: np.ndarray, count: int) -> None:
        """Serve `order`, a uniform order of j's unseen indices, from cells 0..count-1.

        `cell_of[i]` is the cell of order[i]. The label of request i is that cell, and each
        cell's fresh list is `order` restricted to it: for a uniform `order` that is a uniform
        label arrangement and independent uniform orders inside cells, from one permutation. A
        lone job with one cell therefore gets `order` itself.
        """
        j.base += j.pos
        j.pos = 0
        j.length = len(order)
        j.labels = None
        j.seeded = False
        if not len(order):
            j.cells = []
            return
        np.frombuffer(j.cell, dtype=np.int32)[order] = cell_of
        if count == 1:
            j.cells = [_Cell(_int_array(order))]
            return
        j.labels = _label_array(cell_of, count)
        grouped = order[np.argsort(cell_of, kind="stable")]
        cells, start = [], 0
        for stop in np.cumsum(np.bincount(cell_of, minlength=count)).tolist():
            cells.append(_Cell(_int_array(grouped[start:stop])))
            start = stop
        j.cells = cells

    def _refine(self, j: _Job) -> None:
        """Re-draw the rest of j's epoch, as an epoch start would, when a joining job's set cuts
        one of its cells or when j was alone on its seeded shuffle and is no longer alone (a
        seeded order is never followed). The follow logs are history and are kept: their live
        entries are warm, so each has a cell of its own."""
        if j.pos >= j.length:
            return  # epoch done; its next epoch starts from the current regions
        seen = np.frombuffer(j.seen, dtype=np.uint8)
        rest = j.indices[seen[j.indices] == 0]
        del seen
        old = np.frombuffer(j.cell, dtype=np.int32)[rest].astype(np.int64)
        region = self._regions.view()[rest].astype(np.int64)
        cut = int(_combine(old, region).max()) + 1 > np.count_nonzero(np.bincount(old))
        if not cut and not (j.seeded and not self._alone(j)):
            return
        entries = sorted(entry for cell in j.cells for entry in _followable(cell, j.seen, self._live))
        self._redraw(j, rest)
        cells, cell_ids = j.cells, j.cell
        for entry in entries:
            cells[cell_ids[entry[1]]].log.append(entry)


def _followable(cell: _Cell, seen: bytearray, live: dict[int, int]) -> list[tuple[int, int]]:
    """The cell's log entries a request can still follow (not passed, not seen, not evicted)."""
    return [(seq, index) for seq, index in cell.log[cell.next_log :] if not seen[index] and live.get(index) == seq]


def _compact(cell: _Cell, seen: bytearray, live: dict[int, int]) -> None:
    """Drop the log entries no request can follow any more."""
    cell.log = _followable(cell, seen, live)
    cell.next_log = 0


def _plain_order(seed: int, epoch: int, size: int) -> np.ndarray:
    """The plain shuffle of a job's epoch (positions into its sorted indices): its order alone."""
    return spawned_generator(seed, epoch).permutation(size)


def _dense(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Renumber non-negative int keys as 0..count-1 in increasing order: (new ids, count)."""
    top = int(keys.max()) + 1
    if top <= 4 * len(keys) + 1024:
        present = np.bincount(keys, minlength=top) > 0
        table = np.cumsum(present) - 1
        return table[keys], int(table[-1]) + 1
    uniq, inv = np.unique(keys, return_inverse=True)
    return inv, len(uniq)


def _combine(keys: np.ndarray, more: np.ndarray) -> np.ndarray:
    """Dense ids of the pairs (keys[i], more[i]) of non-negative ints: equal pairs, equal ids."""
    return _dense(keys * (int(more.max()) + 1) + more)[0]


def _label_array(labels: np.ndarray, count: int) -> array[int]:
    """Cell labels as the narrowest `array` whose items index fast as plain ints."""
    if count <= 1 << 8:
        return array("B", labels.astype(np.uint8).tobytes())
    if count <= 1 << 16:
        return array("H", labels.astype(np.uint16).tobytes())
    return array("i", labels.astype(np.int32).tobytes())


def _int_array(values: np.ndarray) -> array[int]:
    return array("q", values.astype(np.int64, copy=False).tobytes())


def _index_set(indices: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """A job's index set as a sorted unique int64 array, or a clear error naming the culprit."""
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise ArgumentError(f"{name} must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ArgumentError(f"{name} must hold ints, got dtype {arr.dtype}")
    ordered = np.sort(arr.astype(np.int64))
    if ordered[0] < 0:
        raise SampleIndexError(f"{name} holds the negative index {int(ordered[0])}")
    if ordered[-1] > _MAX_INDEX:
        raise SampleIndexError(f"{name} holds the index {int(ordered[-1])}, above {_MAX_INDEX}")
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        raise ArgumentError(f"{name} must be unique, but {int(repeated[0])} appears twice")
    return ordered

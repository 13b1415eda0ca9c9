"""Tests for globalloader.sampling.joint.JointSampler.

Contract (docs/shared.md): per epoch every index of a job exactly once; each job's order uniform and
its epochs independent whatever the other jobs do; exact resume. The statistical tests run fixed
seeds at alpha = 0.001 and each kind of test is shown to reject a biased control sampler (some
controls subclass JointSampler and reach into its internals to change exactly one decision).
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Hashable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scipy import stats

from globalloader.errors import ArgumentError, SampleIndexError
from globalloader.sampling import JointSampler
from globalloader.sampling.joint import _dense

ALPHA = 0.001


# -- a buffer pool and the statistics -------------------------------------------------------


class _Pool:
    """A buffer pool of `capacity` samples in front of a sampler.

    "lru": a hit refreshes the sample. "wanted": LRU, but samples no job still wants go first.
    """

    def __init__(self, sampler: object, capacity: int, policy: str = "lru") -> None:
        self.sampler = sampler
        self.capacity = capacity
        self.policy = policy
        self.order: OrderedDict[int, None] = OrderedDict()

    def serve(self, index: int) -> None:
        if index in self.order:
            self.order.move_to_end(index)
        else:
            if len(self.order) >= self.capacity:
                old, _ = self.order.popitem(last=False)
                self.sampler.evicted(old)
            self.order[index] = None
            self.sampler.loaded(index)
        if self.policy == "wanted" and not self.sampler.wanted(index):
            self.order.move_to_end(index, last=False)


def _take(sampler: object, pool: _Pool, job: str) -> int:
    """One request of `job`, starting its next epoch when the current one is over."""
    try:
        index = sampler.next(job)
    except StopIteration:
        sampler.new_epoch(job)
        index = sampler.next(job)
    pool.serve(index)
    return index


def _start_pass(sampler: JointSampler, job: str, indices: object, epoch: int) -> None:
    """What the server does when a job starts a pass over another set than its current one
    (`service.scheduler`, "run"): register it again over `indices` at `epoch`. A resumed epoch is
    a pass over the indices the job has not consumed; its next epoch, one over the whole set."""
    if job in sampler.stats():
        sampler.remove_job(job)
    sampler.add_job(job, indices, epoch=epoch)


def _orders_pvalue(orders: np.ndarray) -> float:
    """Chi-square p-value of the counts of all n! orders (n = 4: 24 cells, 23 df)."""
    size = orders.shape[1]
    code = {perm: k for k, perm in enumerate(itertools.permutations(range(size)))}
    counts = np.bincount([code[tuple(row)] for row in orders.tolist()], minlength=len(code))
    return float(stats.chisquare(counts).pvalue)


def _positions_pvalue(orders: np.ndarray) -> float:
    """Item x position test: Pearson statistic times (n-1)/n, chi-square with (n-1)^2 df.

    The table is a sum of permutation matrices (fixed margins), which inflates the raw
    statistic by n/(n-1); without the correction a uniform sampler fails far too often.
    """
    epochs, size = orders.shape
    table = np.zeros((size, size))
    for position in range(size):
        table[:, position] = np.bincount(orders[:, position], minlength=size)
    expected = epochs / size
    statistic = ((table - expected) ** 2 / expected).sum() * (size - 1) / size
    return float(stats.chi2.sf(statistic, (size - 1) ** 2))


def _cross_epoch_pvalue(orders: np.ndarray, back: int = 1) -> float:
    """(back-th last of epoch 2m, first of epoch 2m+1) must be uniform over all n*n pairs.

    Only disjoint pairs of epochs are used, so the pairs are independent under the null.
    """
    size = orders.shape[1]
    last, first = orders[0::2, -back], orders[1::2, 0]
    count = min(len(last), len(first))
    counts = np.bincount(last[:count] * size + first[:count], minlength=size * size)
    return float(stats.chisquare(counts).pvalue)


# -- scenarios: job "k" owns range(size); the others vary ---------------------------------

Factory = Callable[[int], object]


def _alone(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    sampler = make(seed)
    sampler.add_job("k", range(size))
    pool = _Pool(sampler, size)
    return np.array([[_take(sampler, pool, "k") for _ in range(size)] for _ in range(epochs)])


def _run(
    make: Factory,
    size: int,
    epochs: int,
    seed: int,
    others: dict[str, range | list[int]],
    speeds: dict[str, int],
    capacity: int,
    policy: str = "lru",
) -> np.ndarray:
    """Job k and faster/slower others sharing one pool; the others make speeds[name] requests
    before each of k's requests and roll over their epochs independently."""
    sampler = make(seed)
    for name, indices in others.items():
        sampler.add_job(name, indices)
    sampler.add_job("k", range(size))
    pool = _Pool(sampler, capacity, policy)
    orders = np.empty((epochs, size), dtype=np.int64)
    for epoch in range(epochs):
        for position in range(size):
            for name, speed in speeds.items():
                for _ in range(speed):
                    _take(sampler, pool, name)
            orders[epoch, position] = _take(sampler, pool, "k")
    return orders


def _follow_identical(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    return _run(make, size, epochs, seed, {"f": range(size)}, {"f": 2}, max(2, size // 2))


def _follow_overlap(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    # k's cells: {0, 1} shared with the slow g, {2, ...} shared with the fast f.
    others = {"f": range(2, size + 3), "g": [0, 1, size + 5]}
    return _run(make, size, epochs, seed, others, {"f": 3, "g": 1}, 3)


def _small_window(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    # k's cells: {0} shared with g, {1, ...} shared with f and g; one resident sample.
    others = {"f": range(1, size + 2), "g": range(size)}
    return _run(make, size, epochs, seed, others, {"f": 2, "g": 1}, 1)


def _wanted_pool(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    # k's cells: {0, 1} shared with g, {2, ...} with f and g; the pool evicts unwanted first.
    others = {"f": range(2, size + 3), "g": range(size)}
    return _run(make, size, epochs, seed, others, {"f": 2, "g": 1}, 2, policy="wanted")


def _join_leave(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    """Per epoch of k: j (the lower half of k's set) joins, loads it, leaves; then h (the odd
    indices and more) joins mid-epoch, loads one, leaves. Both are re-runs with a fixed seed.
    Their loads stay resident, so a sampler that merged k's cells when they leave would serve
    those first."""
    sampler = make(seed)
    sampler.add_job("k", range(size))
    pool = _Pool(sampler, size)
    half = list(range(size // 2))
    odd = [*range(1, size, 2), size, size + 1]
    orders = np.empty((epochs, size), dtype=np.int64)
    for epoch in range(epochs):
        if epoch:
            sampler.new_epoch("k")
        sampler.add_job("j", half, seed=11)
        for _ in half:
            _take(sampler, pool, "j")
        sampler.remove_job("j")
        orders[epoch, 0] = _take(sampler, pool, "k")
        sampler.add_job("h", odd, seed=12)
        _take(sampler, pool, "h")
        orders[epoch, 1] = _take(sampler, pool, "k")
        sampler.remove_job("h")
        for position in range(2, size):
            orders[epoch, position] = _take(sampler, pool, "k")
    return orders


def _rerun_leader(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    """Per epoch of k (which starts it alone, so on its seeded shuffle): j, a re-run of one job
    (k's set, the same seed and epoch number every time), joins, leads k through the epoch and
    leaves. A sampler that replayed j's seeded order would have k follow the same order again."""
    sampler = make(seed)
    sampler.add_job("k", range(size))
    pool = _Pool(sampler, 1)
    orders = np.empty((epochs, size), dtype=np.int64)
    for epoch in range(epochs):
        if epoch:
            sampler.new_epoch("k")
        sampler.add_job("j", range(size), seed=11)
        for position in range(size):
            _take(sampler, pool, "j")
            orders[epoch, position] = _take(sampler, pool, "k")
        sampler.remove_job("j")
    return orders


def _restore_mid_epoch(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    """k follows a faster job and is resumed mid-epoch, every epoch, as the server resumes it."""
    sampler = make(seed)
    sampler.add_job("f", range(size))
    sampler.add_job("k", range(size))
    pool = _Pool(sampler, 2)
    orders = np.empty((epochs, size), dtype=np.int64)
    for epoch in range(epochs):
        if epoch:
            _start_pass(sampler, "k", range(size), epoch)
        for position in range(size):
            if position == size // 2:
                _start_pass(sampler, "k", sorted(set(range(size)) - set(orders[epoch, :position].tolist())), epoch)
            _take(sampler, pool, "f")
            _take(sampler, pool, "f")
            orders[epoch, position] = _take(sampler, pool, "k")
    return orders


def _drawn_as_decoders_free(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    """The server's timing: jobs ask ahead (up to 3 requests each), but requests are drawn only
    while fewer than 2 loads are in flight (a load takes 2 steps), in turns: the job that waited
    longest first, and a job that drew goes to the back. f (faster, a superset of k's set) and
    k share a pool of 2 samples."""
    sampler = make(seed)
    sampler.add_job("f", range(1, size + 2))
    sampler.add_job("k", range(size))
    pool = _Pool(sampler, 2)
    speeds, asked = {"f": 2, "k": 1}, {"f": 0, "k": 0}
    turns = ["f", "k"]  # who waited longest first
    loads: list[int] = []  # the step each load in flight ends at
    orders: list[int] = []
    step = 0
    while len(orders) < epochs * size:
        step += 1
        loads = [end for end in loads if end > step]
        for name in asked:
            asked[name] = min(3, asked[name] + speeds[name])
        for name in list(turns):
            drew = False
            while asked[name] and len(loads) < 2:
                resident = set(pool.order)
                index = _take(sampler, pool, name)
                if index not in resident:
                    loads.append(step + 2)
                asked[name] -= 1
                drew = True
                if name == "k":
                    orders.append(index)
            if drew:
                turns.remove(name)
                turns.append(name)
    return np.array(orders[: epochs * size]).reshape(epochs, size)  # the last round may overshoot


def _eager(
    make: Factory,
    seed: int,
    sets: dict[str, range | list[int]],
    speeds: dict[str, int],
    capacity: int,
    observe: str,
    epochs: int,
    ahead: int = 0,
) -> np.ndarray:
    """Jobs take turns (speeds[name] requests each, in the order given) through one pool, and
    each starts its next epoch as soon as its current one ends, as the server does when a
    client asks for its next pass ahead: the first request of an epoch may follow what the
    others drew while the previous epoch was ending. The first job starts `ahead` requests
    early. Returns `observe`'s orders."""
    sampler = make(seed)
    for name, indices in sets.items():
        sampler.add_job(name, indices)
    pool = _Pool(sampler, capacity)
    for _ in range(ahead):
        pool.serve(sampler.next(next(iter(sets))))
    orders: list[list[int]] = []
    current: list[int] = []
    while len(orders) < epochs:
        for name, speed in speeds.items():
            for _ in range(speed):
                index = sampler.next(name)
                pool.serve(index)
                if name == observe:
                    current.append(index)
                if not sampler.remaining(name):
                    sampler.new_epoch(name)
                    if name == observe:
                        orders.append(current)
                        current = []
    return np.array(orders[:epochs])


def _superset_follower(make: Factory, size: int, epochs: int, seed: int, capacity: int = 2) -> np.ndarray:
    """k's order while f (k's set but 0, plus two more) makes 2 requests per request of k.

    f follows k's fresh draws, so when k's next epoch starts f has already seen k's last
    items: cells blind to that let f's fresh draws steer k's first follows away from them."""
    sets = {"f": range(1, size + 2), "k": range(size)}
    return _eager(make, seed, sets, {"f": 2, "k": 1}, capacity, "k", epochs)


def _offset_same_speed(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    """f and k over the same set at the same speed, f one request ahead: k's epoch starts when f
    has seen one item, the one k followed last, and k would follow f's draws of the others."""
    sets = {"f": range(size), "k": range(size)}
    return _eager(make, seed, sets, {"f": 1, "k": 1}, 2, "k", epochs, ahead=1)


def _superset_small_pool(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    """The same with a pool of 1: what f has seen is mostly evicted (cold) when k's epoch starts."""
    return _superset_follower(make, size, epochs, seed, capacity=1)


def _superset_leader(make: Factory, size: int, epochs: int, seed: int) -> np.ndarray:
    """The same with the roles seen from the faster job: f's order, f over range(size), k over
    f's set but its last two items, plus one more."""
    sets = {"f": range(size), "k": [*range(size - 2), size]}
    return _eager(make, seed, sets, {"f": 2, "k": 1}, 2, "f", epochs)


SCENARIOS = {
    "alone": _alone,
    "follow_identical": _follow_identical,
    "follow_overlap": _follow_overlap,
    "small_window": _small_window,
    "wanted_pool": _wanted_pool,
    "join_leave": _join_leave,
    "restore_mid_epoch": _restore_mid_epoch,
    "drawn_as_decoders_free": _drawn_as_decoders_free,
    "superset_follower": _superset_follower,
    "superset_small_pool": _superset_small_pool,
    "superset_leader": _superset_leader,
    "rerun_leader": _rerun_leader,
    "offset_same_speed": _offset_same_speed,
}
# 100k epochs where an epoch is cheap; the scenarios that add and remove jobs every epoch are
# slower, and 30k epochs (1,250 per order) still detect a few percent of bias.
EPOCHS = {"join_leave": 30_000, "rerun_leader": 30_000, "restore_mid_epoch": 30_000}
SEEDS = {name: 1000 + k for k, name in enumerate(SCENARIOS)}


@functools.cache
def _orders_of_four(scenario: str) -> np.ndarray:
    return SCENARIOS[scenario](JointSampler, 4, EPOCHS.get(scenario, 100_000), SEEDS[scenario])


def _every_epoch_a_permutation(orders: np.ndarray) -> None:
    size = orders.shape[1]
    assert (np.sort(orders, axis=1) == np.arange(size)).all()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_all_24_orders_are_uniform(scenario: str) -> None:
    orders = _orders_of_four(scenario)
    _every_epoch_a_permutation(orders)
    assert _orders_pvalue(orders) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_consecutive_epochs_are_independent(scenario: str) -> None:
    """The first item of an epoch is independent of the last and of the second-to-last item of
    the previous one (what other jobs did with those is what could carry over)."""
    orders = _orders_of_four(scenario)
    assert _cross_epoch_pvalue(orders) > ALPHA
    assert _cross_epoch_pvalue(orders, back=2) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_positions_are_uniform(scenario: str) -> None:
    orders = SCENARIOS[scenario](JointSampler, 7, 10_000, SEEDS[scenario] + 1)
    _every_epoch_a_permutation(orders)
    assert _positions_pvalue(orders) > ALPHA


@pytest.mark.parametrize("scenario", [name for name in SCENARIOS if name != "alone"])
def test_scenarios_do_share(scenario: str) -> None:
    """The scenarios are not vacuous: k often takes a draw of another job. (Not as often as in
    large sets: in these 4-index sets a pool of 1 to 4 samples makes up to all of them warm, and
    a warm index has a cell of its own.)"""
    made: list[_CountsAcrossPasses] = []

    def make(seed: int) -> JointSampler:
        made.append(_CountsAcrossPasses(seed))
        return made[-1]

    epochs = 3_000
    SCENARIOS[scenario](make, 4, epochs, SEEDS[scenario])
    stats_k = made[0].counts("k")
    assert stats_k["followed"] > 0.1 * stats_k["requests"]


class _CountsAcrossPasses(JointSampler):
    """Keeps a job's request counts across its registrations (a resumed job is registered again)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self._earlier: dict[object, Counter[str]] = defaultdict(Counter)

    def remove_job(self, job: Hashable) -> None:
        stats = self.stats()[job]
        self._earlier[job].update({"requests": stats["requests"], "followed": stats["followed"]})
        super().remove_job(job)

    def counts(self, job: Hashable) -> Counter[str]:
        stats = self.stats()[job]
        return self._earlier[job] + Counter({"requests": stats["requests"], "followed": stats["followed"]})


# -- controls: biased samplers the same tests must reject ----------------------------------


class _NaiveFollow:
    """Follows the oldest resident sample it has not seen, ignoring regions. With
    `since_epoch=False` it also follows samples loaded before its epoch began."""

    def __init__(self, seed: int, since_epoch: bool = True) -> None:
        self._rng = random.Random(seed)
        self._since_epoch = since_epoch
        self._sets: dict[str, set[int]] = {}
        self._seen: dict[str, set[int]] = {}
        self._start: dict[str, int] = {}
        self._resident: OrderedDict[int, int] = OrderedDict()
        self._seq = 0

    def add_job(self, job: str, indices: range | list[int]) -> None:
        self._sets[job] = set(indices)
        self.new_epoch(job)

    def remove_job(self, job: str) -> None:
        del self._sets[job]

    def new_epoch(self, job: str) -> None:
        self._seen[job] = set()
        self._start[job] = self._seq

    def loaded(self, index: int) -> None:
        if index not in self._resident:
            self._seq += 1
            self._resident[index] = self._seq

    def evicted(self, index: int) -> None:
        self._resident.pop(index, None)

    def next(self, job: str) -> int:
        wanted, seen = self._sets[job], self._seen[job]
        if len(seen) == len(wanted):
            raise StopIteration
        for index, seq in self._resident.items():
            recent = seq > self._start[job] or not self._since_epoch
            if index in wanted and index not in seen and recent:
                break
        else:
            index = self._rng.choice(sorted(wanted - seen))
        seen.add(index)
        return index


def test_control_without_regions_is_rejected() -> None:
    """Following across regions serves the shared part first: the orders test must see it."""
    orders = _follow_overlap(_NaiveFollow, 4, 20_000, 7)
    _every_epoch_a_permutation(orders)
    assert _orders_pvalue(orders) < ALPHA
    assert _positions_pvalue(_follow_overlap(_NaiveFollow, 7, 10_000, 8)) < ALPHA


class _SeededWhenShared(JointSampler):
    """Draws every epoch from the job's seed, even while sharing: re-registered jobs replay."""

    def _alone(self, j: object) -> bool:
        return True


class _CellsBlindToTheOthers(JointSampler):
    """The previous rule: a job's cells are its regions, blind to what the other jobs have
    seen, hold in their cells or drew recently (warm)."""

    def _cells_of(self, j: object, rest: np.ndarray) -> tuple[np.ndarray, int]:
        if not len(rest):
            return rest, 0
        return _dense(self._regions.view()[rest].astype(np.int64))


def _blind_to(state: str, what: str) -> type[JointSampler]:
    """A control whose cells ignore `what`: it draws them with its `state` attribute emptied."""

    class Blind(JointSampler):
        def _cells_of(self, j: object, rest: np.ndarray) -> tuple[np.ndarray, int]:
            kept = getattr(self, state)
            setattr(self, state, {})
            try:
                return super()._cells_of(j, rest)
            finally:
                setattr(self, state, kept)

    Blind.__doc__ = f"Cells that ignore {what}."
    return Blind


# samples still in the pool or in follow logs share cells with cold ones
_BlindToWarm = _blind_to("_live", "warmth")
_BlindToTheOthersSeen = _blind_to("_jobs", "what the other jobs have seen and how they hold the rest")


class _MergeOnLeave(JointSampler):
    """Merges the others' cells when a job leaves (re-drawing their remaining labels over the
    coarser regions): the follow rule then prefers what the leaver drew."""

    def remove_job(self, job: str) -> None:
        super().remove_job(job)
        for j in self._jobs.values():
            if j.pos >= j.length:
                continue
            rest = j.indices[np.frombuffer(j.seen, dtype=np.uint8)[j.indices] == 0]
            entries = sorted(
                (seq, index)
                for cell in j.cells
                for seq, index in cell.log[cell.next_log :]
                if not j.seen[index] and self._live.get(index) == seq
            )
            cell_of, count = _dense(self._regions.view()[rest].astype(np.int64))
            perm = self._rng.permutation(len(rest))
            self._arrange(j, rest[perm], cell_of[perm], count)
            for entry in entries:
                j.cells[j.cell[entry[1]]].log.append(entry)


@pytest.mark.slow
def test_control_merging_cells_when_a_job_leaves_is_rejected() -> None:
    orders = _join_leave(_MergeOnLeave, 4, 15_000, SEEDS["join_leave"])
    _every_epoch_a_permutation(orders)
    assert _orders_pvalue(orders) < ALPHA


@pytest.mark.slow
def test_control_replaying_a_seeded_order_while_sharing_is_rejected() -> None:
    """A job re-run with the same seed lays down the same draws again: a follower would see
    one order every epoch."""
    orders = _rerun_leader(_SeededWhenShared, 4, 3_000, SEEDS["rerun_leader"])
    _every_epoch_a_permutation(orders)
    assert _cross_epoch_pvalue(orders) < ALPHA


def test_control_with_cells_blind_to_the_others_is_rejected() -> None:
    """A faster job has already seen the follower's last items when its next epoch starts, so
    cells that ignore it make the follower's first follows avoid them (about 0.74 times the
    uniform chance that the first item of an epoch is the last of the previous one)."""
    orders = _superset_follower(_CellsBlindToTheOthers, 4, 20_000, SEEDS["superset_follower"])
    _every_epoch_a_permutation(orders)
    assert _cross_epoch_pvalue(orders) < ALPHA
    # Same speed, one request apart: k would follow f's draws, all but the one k took last.
    orders = _offset_same_speed(_CellsBlindToTheOthers, 4, 20_000, SEEDS["offset_same_speed"])
    assert _cross_epoch_pvalue(orders) < ALPHA


def test_control_blind_to_warm_samples_is_rejected() -> None:
    """When h's join re-draws k's rest, j's draws still wait in k's follow log: in a cell with
    cold samples they are followed first."""
    orders = _join_leave(_BlindToWarm, 4, 3_000, SEEDS["join_leave"])
    _every_epoch_a_permutation(orders)
    assert _orders_pvalue(orders) < ALPHA


@pytest.mark.slow
def test_control_blind_to_what_the_others_have_seen_is_rejected() -> None:
    """With a pool of 1 the follower's second-to-last item is seen by f but cold when k's next
    epoch starts; f will not draw it fresh again soon, so k's first item avoids it (about 0.96
    times the uniform chance)."""
    orders = _superset_small_pool(_BlindToTheOthersSeen, 4, 100_000, SEEDS["superset_small_pool"])
    _every_epoch_a_permutation(orders)
    assert _cross_epoch_pvalue(orders, back=2) < ALPHA


def test_control_following_old_loads_is_rejected() -> None:
    """Following samples loaded before the epoch began ties consecutive epochs together."""
    make = functools.partial(_NaiveFollow, since_epoch=False)
    orders = _follow_identical(make, 4, 20_000, 9)
    _every_epoch_a_permutation(orders)
    assert _cross_epoch_pvalue(orders) < ALPHA


# -- exact-once under random schedules (hypothesis) ---------------------------------------


class _Schedules(RuleBasedStateMachine):
    """Random joins, leaves, requests, delayed load reports, evictions, epochs and resumes;
    every epoch of every job must be its set, each index exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.sampler = JointSampler(seed=3)
        self.sets: dict[str, set[int]] = {}
        self.passes: dict[str, set[int]] = {}  # what the current pass of each job is over
        self.taken: dict[str, list[int]] = {}
        self.resident: OrderedDict[int, None] = OrderedDict()
        self.pending: list[int] = []

    @rule(
        job=st.sampled_from("abcd"),
        indices=st.sets(st.integers(0, 24), max_size=12),
        epoch=st.integers(0, 3),
    )
    def add(self, job: str, indices: set[int], epoch: int) -> None:
        if job in self.sets:
            with pytest.raises(ArgumentError):
                self.sampler.add_job(job, sorted(indices))
            return
        self.sampler.add_job(job, np.array(sorted(indices), dtype=np.int64), epoch=epoch)
        self.sets[job] = self.passes[job] = indices
        self.taken[job] = []

    @precondition(lambda self: self.sets)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(sorted(self.sets)))
        self.sampler.remove_job(job)
        del self.sets[job], self.passes[job], self.taken[job]

    @precondition(lambda self: self.sets)
    @rule(data=st.data(), report=st.sampled_from(["now", "later", "never"]), count=st.integers(1, 6))
    def request(self, data: st.DataObject, report: str, count: int) -> None:
        job = data.draw(st.sampled_from(sorted(self.sets)))
        for _ in range(count):
            try:
                index = self.sampler.next(job)
            except StopIteration:
                assert sorted(self.taken[job]) == sorted(self.sets[job])
                with pytest.raises(StopIteration):
                    self.sampler.next(job)
                return
            assert index in self.sets[job]
            assert index not in self.taken[job]
            self.taken[job].append(index)
            if report == "now":
                self._load(index)
            elif report == "later":
                self.pending.append(index)

    @precondition(lambda self: self.pending)
    @rule()
    def finish_loads(self) -> None:
        for index in self.pending:
            self._load(index)
        self.pending.clear()

    @precondition(lambda self: self.resident)
    @rule()
    def evict_oldest(self) -> None:
        old, _ = self.resident.popitem(last=False)
        self.sampler.evicted(old)

    @precondition(lambda self: self.sets)
    @rule(data=st.data())
    def new_epoch(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(sorted(self.sets)))
        if self.passes[job] == self.sets[job]:
            self.sampler.new_epoch(job)
        else:  # a resumed epoch: the next pass is over the whole set again
            _start_pass(self.sampler, job, sorted(self.sets[job]), self.sampler.stats()[job]["epoch"] + 1)
            self.passes[job] = self.sets[job]
        self.taken[job] = []

    @precondition(lambda self: self.sets)
    @rule(data=st.data(), fresh_sampler=st.booleans())
    def resume(self, data: st.DataObject, fresh_sampler: bool) -> None:
        job = data.draw(st.sampled_from(sorted(self.sets)))
        epochs = {name: stats["epoch"] for name, stats in self.sampler.stats().items()}
        resumed = [job]
        if fresh_sampler:
            # Resume in a new sampler, as after a restart: the others re-register as they are.
            resumed = [name for name in self.sets if name != job] + resumed
            self.sampler = JointSampler(seed=4)
            self.resident.clear()
            self.pending.clear()
        for name in resumed:
            self.passes[name] = self.sets[name] - set(self.taken[name])
            _start_pass(self.sampler, name, sorted(self.passes[name]), epochs[name])

    @invariant()
    def remaining_matches(self) -> None:
        for job, indices in self.sets.items():
            assert self.sampler.remaining(job) == len(indices) - len(self.taken[job])

    def _load(self, index: int) -> None:
        if index not in self.resident:
            self.resident[index] = None
            self.sampler.loaded(index)
            if len(self.resident) > 5:
                old, _ = self.resident.popitem(last=False)
                self.sampler.evicted(old)


TestSchedules = _Schedules.TestCase
TestSchedules.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- resume --------------------------------------------------------------------------------


def _drain(sampler: JointSampler, job: str, pool: _Pool | None = None) -> list[int]:
    out = []
    while True:
        try:
            index = sampler.next(job)
        except StopIteration:
            return out
        if pool is not None:
            pool.serve(index)
        out.append(index)


def test_restored_job_finishes_exactly_what_it_had_not_seen() -> None:
    sampler = JointSampler(seed=5)
    sampler.add_job("f", range(300))
    sampler.add_job("k", range(100, 400))
    pool = _Pool(sampler, 30)
    seen = []
    for _ in range(120):
        _take(sampler, pool, "f")
        seen.append(_take(sampler, pool, "k"))
    assert sampler.stats()["k"]["followed"] > 0
    unseen = sorted(set(range(100, 400)) - set(seen))
    for target in (sampler, JointSampler(seed=6)):
        _start_pass(target, "k", unseen, epoch=0)
        rest = _drain(target, "k")
        assert len(rest) == 300 - 120
        assert sorted(seen + rest) == list(range(100, 400))


def test_lone_job_resumes_what_it_had_not_seen_and_keeps_its_later_epochs() -> None:
    """A lone job's resumed rest is the plain shuffle of the rest under its seed and epoch (the
    same in any sampler), and its next pass over the whole set is the epoch it would have had."""
    sampler = JointSampler(seed=8)
    sampler.add_job("k", range(50), seed=123, epoch=2)
    first = [sampler.next("k") for _ in range(20)]
    _drain(sampler, "k")
    sampler.new_epoch("k")
    following = _drain(sampler, "k")

    unseen = sorted(set(range(50)) - set(first))
    rests = []
    for other in (JointSampler(seed=99), JointSampler(seed=100)):
        other.add_job("k", list(reversed(unseen)), seed=123, epoch=2)
        rests.append(_drain(other, "k"))
        other.remove_job("k")
        other.add_job("k", range(50), seed=123, epoch=3)
        assert _drain(other, "k") == following
    assert rests[0] == rests[1]
    assert sorted(first + rests[0]) == list(range(50))


def test_lone_job_gets_a_plain_shuffle_fixed_by_its_seed() -> None:
    a, b = JointSampler(seed=1), JointSampler(seed=2)
    a.add_job("x", range(200), seed=7)
    b.add_job("y", range(200), seed=7)
    pool = _Pool(a, 50)
    order_a = _drain(a, "x", pool)  # residency reports change nothing for a lone job
    assert order_a == _drain(b, "y")
    assert sorted(order_a) != order_a
    assert a.stats()["x"] == {"epoch": 0, "requests": 200, "followed": 0, "fresh": 200}
    a.new_epoch("x")
    assert _drain(a, "x") != order_a
    c = JointSampler(seed=1)
    c.add_job("x", range(200))
    d = JointSampler(seed=1)
    d.add_job("z", range(200))
    first = _drain(c, "x")
    assert first != _drain(d, "z")  # default seeds differ per job name
    c.remove_job("x")
    c.add_job("x", range(200))  # ... and per registration: re-adding does not replay
    assert _drain(c, "x") != first
    e = JointSampler(seed=1)
    e.add_job("x", range(200))
    assert _drain(e, "x") == first  # but the same calls on the same sampler seed reproduce


def test_a_lone_job_that_gets_company_leaves_its_seeded_order() -> None:
    """A re-run with the same seed would replay the seeded shuffle, so once another job can
    follow it the rest of the epoch is drawn anew (from the sampler's stream)."""
    reference = JointSampler(seed=2)
    reference.add_job("k", range(200), seed=7)
    plain = _drain(reference, "k")
    sampler = JointSampler(seed=1)
    sampler.add_job("k", range(200), seed=7)
    first = [sampler.next("k") for _ in range(100)]
    assert first == plain[:100]
    sampler.add_job("j", range(200))
    rest = _drain(sampler, "k")
    assert sorted(first + rest) == list(range(200))
    assert rest != plain[100:]


# -- the rest of the API -------------------------------------------------------------------


def test_lock_step_identical_jobs_load_each_sample_once() -> None:
    sampler = JointSampler(seed=2)
    for name in "abcd":
        sampler.add_job(name, range(500))
    pool = _Pool(sampler, 8)
    loads = 0
    for _ in range(500):
        for name in "abcd":
            index = sampler.next(name)
            loads += index not in pool.order
            pool.serve(index)
    assert loads == 500
    assert sum(s["followed"] for s in sampler.stats().values()) == 3 * 500


def test_only_draws_made_in_this_epoch_are_followed() -> None:
    sampler = JointSampler(seed=3)
    sampler.add_job("a", range(10))
    sampler.add_job("b", range(10))
    for _ in range(10):
        sampler.loaded(sampler.next("a"))
    sampler.new_epoch("b")  # every sample is in memory, but a drew it before b's new epoch
    _drain(sampler, "b")
    assert sampler.stats()["b"]["followed"] == 0


def test_fresh_draws_are_followable_whether_they_hit_or_load() -> None:
    """Followability must not depend on what happened to be resident: no loaded() calls at
    all, and every draw of the leader is still followed."""
    sampler = JointSampler(seed=3)
    sampler.add_job("a", range(50))
    sampler.add_job("b", range(50))
    for _ in range(50):
        drawn = sampler.next("a")
        assert sampler.next("b") == drawn
    assert sampler.stats()["b"]["followed"] == 50


def test_orders_drawn_while_sharing_are_never_replayed() -> None:
    """A job re-registered with the same seed and epoch replays its plain shuffle when alone,
    but not when another job could follow it (that job would see one order twice)."""
    sampler = JointSampler(seed=4)
    orders = []
    for _ in range(2):
        sampler.add_job("j", range(30), seed=5)
        orders.append(_drain(sampler, "j"))
        sampler.remove_job("j")
    assert orders[0] == orders[1]
    sampler.add_job("k", range(30))
    shared = []
    for _ in range(2):
        sampler.add_job("j", range(30), seed=5)
        shared.append(_drain(sampler, "j"))
        sampler.remove_job("j")
    assert shared[0] != shared[1]


def test_evicted_samples_are_not_followed() -> None:
    sampler = JointSampler(seed=4)
    sampler.add_job("a", range(10))
    sampler.add_job("b", range(10))
    index = sampler.next("a")
    sampler.loaded(index)
    sampler.evicted(index)
    taken_by_b = sampler.next("b")
    assert sampler.stats()["b"]["followed"] == 0
    index = sampler.next("a")
    while index == taken_by_b:
        index = sampler.next("a")
    sampler.loaded(index)
    assert sampler.next("b") == index
    assert sampler.stats()["b"]["followed"] == 1


def test_wanted_tells_whether_a_job_may_still_take_a_sample() -> None:
    sampler = JointSampler()
    sampler.add_job("a", range(5))
    sampler.add_job("b", range(3, 8))
    assert sampler.wanted(4) and sampler.wanted(7) and not sampler.wanted(8)
    assert not sampler.wanted(10**6)
    taken = _drain(sampler, "a")
    assert not sampler.wanted(0)
    assert sampler.wanted(4)  # b has not taken it
    sampler.remove_job("b")
    assert not any(sampler.wanted(i) for i in taken)


def test_stalled_job_keeps_its_follow_log_bounded() -> None:
    """A job that stops asking while others load a lot must not accumulate their loads."""
    sampler = JointSampler()
    sampler.add_job("fast", range(20_000))
    sampler.add_job("stalled", range(20_000))
    pool = _Pool(sampler, 100)
    for _ in range(60_000):
        _take(sampler, pool, "fast")
    cells = sampler._jobs["stalled"].cells
    assert sum(len(cell.log) for cell in cells) <= 2 * 100 + 4096 + 1
    assert len(_drain(sampler, "stalled", pool)) == 20_000


def test_empty_set_and_unknown_jobs() -> None:
    sampler = JointSampler()
    sampler.add_job("empty", [])
    with pytest.raises(StopIteration):
        sampler.next("empty")
    with pytest.raises(ArgumentError, match=r"'nope'.*add_job"):
        sampler.next("nope")
    with pytest.raises(ArgumentError, match="'nope'"):
        sampler.remove_job("nope")
    sampler.loaded(5)  # no job wants it: ignored
    sampler.evicted(5)


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        ([1, 2, 2], ArgumentError, "2 appears twice"),
        ([0, -3], SampleIndexError, "-3"),
        ([0.5, 1.0], ArgumentError, "float"),
        ([[0, 1]], ArgumentError, "1-D"),
        ([True, False], ArgumentError, "bool"),
    ],
)
def test_bad_index_sets_are_refused(indices: list, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        JointSampler().add_job("k", indices)


def test_bad_seeds_and_epochs_are_refused() -> None:
    with pytest.raises(ArgumentError, match="seed"):
        JointSampler(seed=-1)
    sampler = JointSampler()
    with pytest.raises(ArgumentError, match="epoch"):
        sampler.add_job("k", range(3), epoch=-1)
    sampler.add_job("k", range(3))
    with pytest.raises(ArgumentError, match="epoch"):
        sampler.new_epoch("k", epoch=1.5)

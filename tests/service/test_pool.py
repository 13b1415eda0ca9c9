"""The buffer pool's bookkeeping: budget, references, the LRU tier, eviction order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalloader.errors import ProtocolError, SampleTooLargeError
from globalloader.service.pool import BufferPool


def loaded(pool: BufferPool, key: str, nbytes: int = 64) -> int:
    offset = pool.reserve(key, nbytes)
    assert offset is not None
    pool.commit(key, ("layout", key))
    return offset


def test_a_released_sample_stays_readable_until_space_is_needed():
    evicted = []
    pool = BufferPool(256, on_evict=evicted.append)
    for key in "abcd":
        loaded(pool, key)
        pool.acquire(key, "job")
    assert pool.reserve("e", 64) is None, "all four are referenced: nothing may be evicted"
    pool.release("b", "job")
    pool.release("a", "job")
    assert pool.get("b").ready and evicted == []  # the LRU tier keeps it
    assert pool.acquire("b", "other").ready and pool.counters["hits"] == 1
    pool.release("b", "other")
    assert pool.reserve("e", 64) is not None
    assert evicted == ["a"], "the least recently released goes first"


def test_references_are_counted_per_holder_and_dropped_when_a_holder_dies():
    pool = BufferPool(1024)
    loaded(pool, "x")
    pool.acquire("x", "job1")
    pool.acquire("x", "job1")
    pool.acquire("x", "job2")
    assert pool.get("x").refs == 3
    assert pool.release_holder("job1") == 2
    assert pool.stats()["referenced"] == 1
    pool.release("x", "job2")
    assert pool.stats()["cached"] == 1
    with pytest.raises(ProtocolError, match="holds no reference"):
        pool.release("x", "job2")


def test_loading_samples_are_never_evicted_and_aborts_free_space():
    pool = BufferPool(128)
    assert pool.reserve("loading", 128) == 0
    assert pool.reserve("next", 64) is None
    pool.abort("loading")
    assert pool.reserve("next", 64) == 0


def test_a_sample_larger_than_the_pool_is_an_error_naming_it():
    with pytest.raises(SampleTooLargeError, match=r"'huge' needs 4096 bytes.*--memory"):
        BufferPool(1024).reserve("huge", 4096)


@given(st.lists(st.tuples(st.integers(1, 300), st.booleans()), min_size=1, max_size=200))
@settings(max_examples=100, deadline=None)
def test_budget_holds_and_blocks_never_overlap(ops):
    pool = BufferPool(1024)
    held: list[str] = []
    for n, (size, keep) in enumerate(ops):
        key = f"s{n}"
        offset = pool.reserve(key, size)
        if offset is None:
            assert held, "refused while nothing was referenced"
            pool.release(held.pop(0), "job")
            continue
        pool.commit(key, key)
        pool.acquire(key, "job")
        if keep:
            held.append(key)
        else:
            pool.release(key, "job")
        spans = sorted((e.offset, e.offset + e.nbytes) for e in pool._entries.values())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
        assert pool.used == sum(e.nbytes for e in pool._entries.values()) <= pool.capacity


def test_samples_no_job_wants_are_evicted_before_older_wanted_ones():
    evicted = []
    wanted = {"a", "c"}
    pool = BufferPool(192, on_evict=evicted.append, wanted=wanted.__contains__)
    for key in "abc":
        loaded(pool, key)
    pool.reserve("d", 64)
    assert evicted == ["b"], "the oldest unwanted sample goes first"
    wanted.clear()
    pool.reserve("e", 64)
    assert evicted == ["b", "a"], "with nothing wanted, plain LRU order"


def test_an_unwanted_sample_goes_first_however_many_wanted_ones_are_older():
    """A lagging job leaves many older samples it still wants; the newest sample, which every
    job has taken, is the one to evict."""
    evicted = []
    wanted = {f"w{n}" for n in range(500)}
    pool = BufferPool(501 * 64, on_evict=evicted.append, wanted=wanted.__contains__)
    for n in range(500):
        loaded(pool, f"w{n}")
    loaded(pool, "done")
    pool.reserve("next", 64)
    assert evicted == ["done"]


def test_refile_sorts_again_after_the_jobs_changed():
    evicted = []
    wanted = {"a", "b"}
    pool = BufferPool(192, on_evict=evicted.append, wanted=wanted.__contains__)
    for key in "abc":
        loaded(pool, key)
    wanted.symmetric_difference_update("bc")  # a job that wanted b left; one that wants c came
    pool.refile()
    pool.reserve("d", 64)
    pool.reserve("e", 64)
    assert evicted == ["b", "a"], "b is no longer wanted; then the oldest wanted one"

"""The sample store's bookkeeping: budget, references, the LRU tier, eviction order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalloader.errors import ProtocolError, SampleTooLargeError
from globalloader.service.sample_store import SampleStore


def loaded(store: SampleStore, key: str, nbytes: int = 64) -> int:
    offset = store.reserve(key, nbytes)
    assert offset is not None
    store.commit(key, ("layout", key))
    return offset


def test_a_released_sample_stays_readable_until_space_is_needed():
    evicted = []
    store = SampleStore(256, on_evict=evicted.append)
    for key in "abcd":
        loaded(store, key)
        store.acquire(key, "job")
    assert store.reserve("e", 64) is None, "all four are referenced: nothing may be evicted"
    store.release("b", "job")
    store.release("a", "job")
    assert store.get("b").ready and evicted == []  # the LRU tier keeps it
    assert store.acquire("b", "other").ready and store.counters["hits"] == 1
    store.release("b", "other")
    assert store.reserve("e", 64) is not None
    assert evicted == ["a"], "the least recently released goes first"


def test_references_are_counted_per_holder_and_dropped_when_a_holder_dies():
    store = SampleStore(1024)
    loaded(store, "x")
    store.acquire("x", "job1")
    store.acquire("x", "job1")
    store.acquire("x", "job2")
    assert store.get("x").refs == 3
    assert store.release_holder("job1") == 2
    assert store.stats()["referenced"] == 1
    store.release("x", "job2")
    assert store.stats()["cached"] == 1
    with pytest.raises(ProtocolError, match="holds no reference"):
        store.release("x", "job2")


def test_loading_samples_are_never_evicted_and_aborts_free_space():
    store = SampleStore(128)
    assert store.reserve("loading", 128) == 0
    assert store.reserve("next", 64) is None
    store.abort("loading")
    assert store.reserve("next", 64) == 0


def test_a_sample_larger_than_the_pool_is_an_error_naming_it():
    with pytest.raises(SampleTooLargeError, match=r"'huge' needs 4096 bytes.*--memory"):
        SampleStore(1024).reserve("huge", 4096)


@given(st.lists(st.tuples(st.integers(1, 300), st.booleans()), min_size=1, max_size=200))
@settings(max_examples=100, deadline=None)
def test_budget_holds_and_blocks_never_overlap(ops):
    store = SampleStore(1024)
    held: list[str] = []
    for n, (size, keep) in enumerate(ops):
        key = f"s{n}"
        offset = store.reserve(key, size)
        if offset is None:
            assert held, "refused while nothing was referenced"
            store.release(held.pop(0), "job")
            continue
        store.commit(key, key)
        store.acquire(key, "job")
        if keep:
            held.append(key)
        else:
            store.release(key, "job")
        spans = sorted((e.offset, e.offset + e.nbytes) for e in store._entries.values())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
        assert store.used == sum(e.nbytes for e in store._entries.values()) <= store.capacity


def test_samples_no_job_wants_are_evicted_before_older_wanted_ones():
    evicted = []
    wanted = {"a", "c"}
    store = SampleStore(192, on_evict=evicted.append, wanted=wanted.__contains__)
    for key in "abc":
        loaded(store, key)
    store.reserve("d", 64)
    assert evicted == ["b"], "the oldest unwanted sample goes first"
    wanted.clear()
    store.reserve("e", 64)
    assert evicted == ["b", "a"], "with nothing wanted, plain LRU order"


def test_an_unwanted_sample_goes_first_however_many_wanted_ones_are_older():
    """A lagging job leaves many older samples it still wants; the newest sample, which every
    job has taken, is the one to evict."""
    evicted = []
    wanted = {f"w{n}" for n in range(500)}
    store = SampleStore(501 * 64, on_evict=evicted.append, wanted=wanted.__contains__)
    for n in range(500):
        loaded(store, f"w{n}")
    loaded(store, "done")
    store.reserve("next", 64)
    assert evicted == ["done"]


def test_refile_sorts_again_after_the_jobs_changed():
    evicted = []
    wanted = {"a", "b"}
    store = SampleStore(192, on_evict=evicted.append, wanted=wanted.__contains__)
    for key in "abc":
        loaded(store, key)
    wanted.symmetric_difference_update("bc")  # a job that wanted b left; one that wants c came
    store.refile()
    store.reserve("d", 64)
    store.reserve("e", 64)
    assert evicted == ["b", "a"], "b is no longer wanted; then the oldest wanted one"

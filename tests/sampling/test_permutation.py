from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import globalloader as gl
from globalloader.sampling.permutation import Permutation


@given(n=st.integers(0, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_is_a_bijection(n, seed, epoch):
    assert np.array_equal(np.sort(Permutation(n, seed, epoch).array()), np.arange(n))


def test_large_domain_is_a_bijection_and_maps_any_block():
    n = 70_001  # above the explicit-permutation threshold: the Feistel path
    perm = Permutation(n, seed=11, epoch=3)
    full = perm.array()
    assert np.array_equal(np.sort(full), np.arange(n))
    assert np.array_equal(perm[np.arange(500, 900)], full[500:900])
    assert not np.array_equal(full, Permutation(n, seed=11, epoch=4).array())


def test_small_sets_draw_every_order_uniformly():
    counts = dict.fromkeys(itertools.permutations(range(4)), 0)
    for epoch in range(24_000):
        counts[tuple(Permutation(4, seed=1, epoch=epoch).array())] += 1
    assert chisquare(list(counts.values())).pvalue > 0.001


def test_large_domain_positions_are_uniform():
    n, reps = 70_001, 40
    # Where element 0..9 land, over many epochs, spread evenly over 10 position bins.
    bins = np.zeros(10)
    for epoch in range(reps):
        inv = np.argsort(Permutation(n, seed=2, epoch=epoch).array())
        np.add.at(bins, (inv[:1000] * 10) // n, 1)
    assert chisquare(bins).pvalue > 0.001


@pytest.mark.parametrize("n", [1000, 100_000, 1_000_003])
def test_runs_map_like_single_positions(n: int) -> None:
    """`run` serves positions from cached chunks: every run, across chunk edges and at the end,
    must equal mapping the positions one array at a time."""
    perm = Permutation(n, seed=11, epoch=2)
    fresh = Permutation(n, seed=11, epoch=2)
    rng = np.random.default_rng(0)
    starts = [0, n - 1, max(0, n - 700), *rng.integers(0, n, 20).tolist(), 16383 % n, 16384 % n]
    for start in starts:
        for length in (1, 2, 999, 20_000, 40_000):
            stop = min(n, start + length)
            assert np.array_equal(perm.run(start, stop), fresh[np.arange(start, stop)]), (start, stop)
    block = perm.run(0, min(n, 1000))
    block[:] = -1  # the caller's own copy: the cache is untouched
    assert np.array_equal(perm.run(0, min(n, 1000)), fresh[np.arange(min(n, 1000))])


def test_runs_from_many_threads_agree() -> None:
    n = 500_000
    perm, expected = Permutation(n, seed=3), Permutation(n, seed=3).array()
    starts = np.random.default_rng(1).integers(0, n - 1000, 400).tolist()

    def check(start: int) -> bool:
        return bool(np.array_equal(perm.run(start, start + 1000), expected[start : start + 1000]))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(check, starts))


@pytest.mark.parametrize("chain", ["shuffle", "shuffle, select", "select, shuffle"])
def test_a_tasks_run_maps_as_its_positions_do(chain: str) -> None:
    """A task's positions reach the last index operator as a run (`parents_run`, mapped ahead by
    `Permutation.run`); any other positions map one by one. Both must give the same indices."""
    n = 200_000
    ds = gl.Dataset(gl.from_sequence(range(n)))
    if chain == "shuffle":
        ds = ds.shuffle(seed=5)
    elif chain == "shuffle, select":
        ds = ds.shuffle(seed=5).select(np.random.default_rng(0).permutation(n)[: n // 2])
    else:
        ds = ds.select(range(0, n, 2)).shuffle(seed=5)
    plan, length = ds.plan, len(ds.plan.indices(0))
    rng = np.random.default_rng(1)
    worker = list(range(1000, 60_000, 2000))  # every other task, as one of two workers asks: mapped ahead
    for epoch in (0, 1):
        for start in [0, length - 1000, *rng.integers(0, length - 1000, 20).tolist(), *worker]:
            stop = start + 1000
            expected = plan.map_positions(np.arange(start, stop, dtype=np.int64), epoch)
            assert np.array_equal(plan.indices(epoch, start, stop), expected), (epoch, start)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_runs_at_a_workers_stride_map_like_single_positions(workers: int) -> None:
    """A worker's tasks come every `workers` tasks: the runs mapped ahead at that stride, and the
    last, shorter task, must equal mapping each task's positions alone."""
    n, size = 123_457, 1000
    perm, fresh = Permutation(n, seed=9), Permutation(n, seed=9)
    for worker in range(workers):
        for task in range(worker, -(-n // size), workers):
            start, stop = task * size, min(n, (task + 1) * size)
            assert np.array_equal(perm.run(start, stop), fresh[np.arange(start, stop)]), (worker, task)


def test_the_orders_of_a_seed_never_change() -> None:
    """A checkpoint stores positions: other orders from the same (seed, epoch) in a later release
    would resume it into other samples. These are the first release's (Feistel and explicit)."""
    big = Permutation(100_000, 7, 3)
    assert big[np.array([0, 1, 2, 50_000, 99_999])].tolist() == [82366, 90800, 25688, 66762, 56790]
    assert big.run(0, 3).tolist() == [82366, 90800, 25688]
    assert Permutation(10, 7, 3).array().tolist() == [4, 6, 1, 3, 8, 2, 9, 0, 5, 7]

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

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

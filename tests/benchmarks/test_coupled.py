"""Tests for benchmarks/coupled.py: the seed slides' two-job lock-step rule.

One step: each job's element is uniform over its remaining set and the two agree with
probability n_i / max(n1, n2). Over epochs: each job's order is a uniform permutation. Fixed
seeds, alpha = 0.001, and the slides' first (biased) merge rule as a control that must fail.
"""

from __future__ import annotations

import importlib.util
import itertools
import random
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from globalloader.errors import ArgumentError

_SPEC = importlib.util.spec_from_file_location("coupled", Path(__file__).parents[2] / "benchmarks" / "coupled.py")
assert _SPEC is not None and _SPEC.loader is not None
coupled = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(coupled)
CoupledPair, coupled_pair_step = coupled.CoupledPair, coupled.coupled_pair_step

ALPHA = 0.001


def _uniform_pvalue(draws: list[int], support: set[int]) -> float:
    values = sorted(support)
    counts = [draws.count(value) for value in values]
    assert sum(counts) == len(draws), "a draw fell outside its set"
    return float(stats.chisquare(counts).pvalue)


def _agreement_pvalue(same: int, trials: int, p: float) -> float:
    return float(stats.binomtest(same, trials, p).pvalue)


CASES = {
    "slides, n1 = n2": ({1, 2, 3, 4, 5}, {1, 2, 3, 6, 7}),
    "n1 > n2": ({1, 2, 3, 4, 5}, {1, 2, 3, 6}),
    "n1 < n2": ({1, 2, 3, 4}, {1, 2, 3, 6, 7}),
    "S1 inside S2": ({1, 2, 3}, {1, 2, 3, 4, 5, 6, 7}),
    "S2 inside S1": ({1, 2, 3, 4, 5, 6, 7}, {2, 3}),
}


@pytest.mark.parametrize("case", CASES)
def test_one_step_is_uniform_for_both_and_agrees_as_often_as_possible(case: str) -> None:
    s1, s2 = CASES[case]
    rng = random.Random(len(s1) * 10 + len(s2))
    trials = 30_000
    pairs = [coupled_pair_step(s1, s2, rng) for _ in range(trials)]
    assert _uniform_pvalue([e1 for e1, _ in pairs], s1) > ALPHA
    assert _uniform_pvalue([e2 for _, e2 in pairs], s2) > ALPHA
    best = len(s1 & s2) / max(len(s1), len(s2))
    same = sum(e1 == e2 for e1, e2 in pairs)
    assert _agreement_pvalue(same, trials, best) > ALPHA
    assert same / trials == pytest.approx(best, abs=0.015)


def test_slide_example_agrees_with_probability_0_6() -> None:
    rng = random.Random(2021)
    trials = 50_000
    same = sum(a == b for a, b in (coupled_pair_step(range(1, 6), [1, 2, 3, 6, 7], rng) for _ in range(trials)))
    assert same / trials == pytest.approx(0.6, abs=0.01)
    assert _agreement_pvalue(same, trials, 0.6) > ALPHA


def test_identical_sets_always_agree_and_disjoint_sets_never() -> None:
    rng = random.Random(1)
    assert all(a == b for a, b in (coupled_pair_step({4, 5, 6}, {4, 5, 6}, rng) for _ in range(500)))
    assert all(a != b for a, b in (coupled_pair_step({1, 2}, {3, 4, 5}, rng) for _ in range(500)))


def _copy_when_shared(s1: set[int], s2: set[int], rng: random.Random) -> tuple[int, int]:
    """The slides' first merge ("if job 1 picks the intersection, both take it"): biased when
    n1 != n2, as the slides themselves show."""
    e1 = rng.choice(sorted(s1))
    if e1 in s2:
        return e1, e1
    return e1, rng.choice(sorted(s2 - s1))


def test_control_copying_whenever_possible_is_rejected() -> None:
    s1, s2 = CASES["n1 < n2"]
    rng = random.Random(3)
    pairs = [_copy_when_shared(s1, s2, rng) for _ in range(30_000)]
    assert _uniform_pvalue([e2 for _, e2 in pairs], s2) < ALPHA


def test_step_leaves_its_arguments_alone() -> None:
    s1, s2 = [3, 1, 2], {2, 3, 9}
    coupled_pair_step(s1, s2, random.Random(0))
    assert s1 == [3, 1, 2] and s2 == {2, 3, 9}


def test_empty_sets_are_refused() -> None:
    with pytest.raises(ArgumentError, match="non-empty"):
        coupled_pair_step([], [1], random.Random(0))
    with pytest.raises(ArgumentError, match="non-empty"):
        CoupledPair([1], [], random.Random(0))


# -- whole epochs in lock-step -------------------------------------------------------------


def _epochs(pair: CoupledPair, sizes: tuple[int, int], steps: int) -> tuple[np.ndarray, ...]:
    """Run `steps` steps; cut each job's stream into its epochs (a job restarts exactly when
    its set is used up)."""
    streams: tuple[list[int], list[int]] = ([], [])
    for _ in range(steps):
        e1, e2 = pair.step()
        streams[0].append(e1)
        streams[1].append(e2)
    return tuple(
        np.array(stream[: len(stream) // size * size]).reshape(-1, size)
        for stream, size in zip(streams, sizes, strict=True)
    )


def _orders_pvalue(orders: np.ndarray) -> float:
    code = {perm: k for k, perm in enumerate(itertools.permutations(sorted(orders[0])))}
    counts = np.bincount([code[tuple(row)] for row in orders.tolist()], minlength=len(code))
    return float(stats.chisquare(counts).pvalue)


@pytest.mark.parametrize(
    ("s1", "s2"),
    [({0, 1, 2, 3}, {2, 3, 4, 5}), ({0, 1, 2, 3}, {1, 2, 3, 4, 5}), ({0, 1, 2, 3}, {1, 2, 3})],
)
def test_each_epoch_of_each_job_is_a_uniform_permutation(s1: set[int], s2: set[int]) -> None:
    pair = CoupledPair(s1, s2, random.Random(len(s2)))
    first, second = _epochs(pair, (len(s1), len(s2)), 50_000 * len(s1))
    for orders, wanted in ((first, s1), (second, s2)):
        assert (np.sort(orders, axis=1) == sorted(wanted)).all()
    assert _orders_pvalue(first) > ALPHA
    if len(s2) == 4:
        assert _orders_pvalue(second) > ALPHA
    else:
        size = len(s2)
        table = np.stack([np.bincount(np.searchsorted(sorted(s2), second[:, k]), minlength=size) for k in range(size)])
        expected = len(second) / size
        statistic = ((table - expected) ** 2 / expected).sum() * (size - 1) / size
        assert stats.chi2.sf(statistic, (size - 1) ** 2) > ALPHA


def test_identical_sets_in_lock_step_load_each_sample_once() -> None:
    pair = CoupledPair(range(100), range(100), random.Random(5))
    assert all(a == b for a, b in (pair.step() for _ in range(1000)))

"""The two-job lock-step coupling from the seed slides, kept as a reference for the joint sampler.

Two jobs draw one element each per step from their remaining sets R1 and R2. Job 1 draws
uniformly; job 2 copies it as often as its own uniform marginal allows, which makes
P(same element) = |R1 & R2| / max(|R1|, |R2|), the most one step can give. Applied to the
remaining sets at every step, both epoch orders are uniform permutations. It needs the two jobs
in lock-step, which real jobs are not: the server uses `JointSampler` (region-wise follow) and
this module measures what that gives away.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from globalloader.errors import ArgumentError


class _Pool:
    """A set with O(1) uniform draw, membership, insertion and removal (swap-remove)."""

    __slots__ = ("items", "where")

    def __init__(self, items: Iterable[int] = ()) -> None:
        self.items: list[int] = []
        self.where: dict[int, int] = {}
        for item in items:
            self.add(item)

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, item: int) -> bool:
        return item in self.where

    def add(self, item: int) -> None:
        self.where[item] = len(self.items)
        self.items.append(item)

    def remove(self, item: int) -> None:
        at = self.where.pop(item)
        last = self.items.pop()
        if last != item:
            self.items[at] = last
            self.where[last] = at

    def draw(self, rng: random.Random) -> int:
        return self.items[rng.randrange(len(self.items))]


def coupled_pair_step(remaining1: Iterable[int], remaining2: Iterable[int], rng: random.Random) -> tuple[int, int]:
    """One lock-step draw (e1, e2) from the two jobs' remaining sets; neither set is changed.

    e1 is uniform over `remaining1` and e2 uniform over `remaining2`, and e1 == e2 with
    probability n_i / max(n1, n2). Both sets must be non-empty. The caller removes e1 from job
    1's set and e2 from job 2's only: an element taken by one job alone stays in the other's.
    """
    r1, r2 = set(remaining1), set(remaining2)
    if not r1 or not r2:
        raise ArgumentError("coupled_pair_step needs two non-empty remaining sets")
    shared = r1 & r2
    # Sorted so that a seeded rng gives the same draw whatever the iteration order of the sets.
    return _step(_Pool(sorted(shared)), _Pool(sorted(r1 - shared)), _Pool(sorted(r2 - shared)), rng)


class CoupledPair:
    """Two jobs in lock-step under the slides' rule, epoch after epoch.

    `step()` returns (e1, e2): one element for each job. A job whose epoch ran out starts its
    next epoch with its whole set, coupled against what the other job has left. Each job's
    epochs are uniform permutations; per step the jobs agree as often as one step allows.
    """

    def __init__(self, set1: Iterable[int], set2: Iterable[int], rng: random.Random) -> None:
        self._sets = (sorted(set(set1)), sorted(set(set2)))
        if not self._sets[0] or not self._sets[1]:
            raise ArgumentError("CoupledPair needs two non-empty sets")
        self._rng = rng
        self._shared, self._only1, self._only2 = _Pool(), _Pool(), _Pool()
        self._left = [0, 0]  # elements each job has left this epoch

    def step(self) -> tuple[int, int]:
        """The next element of each job (a job starts its next epoch when its set is used up)."""
        if not self._left[0] or not self._left[1]:
            self._restart()
        e1, e2 = _step(self._shared, self._only1, self._only2, self._rng)
        _take(self._shared, self._only1, self._only2, e1, e2)
        self._left[0] -= 1
        self._left[1] -= 1
        return e1, e2

    def _restart(self) -> None:
        """Refill the finished job(s) and re-split the remaining sets into their three parts."""
        rest1 = [*self._shared.items, *self._only1.items]
        rest2 = [*self._shared.items, *self._only2.items]
        if not self._left[0]:
            rest1 = self._sets[0]
        if not self._left[1]:
            rest2 = self._sets[1]
        r1, r2 = set(rest1), set(rest2)
        self._shared = _Pool(sorted(r1 & r2))
        self._only1 = _Pool(sorted(r1 - r2))
        self._only2 = _Pool(sorted(r2 - r1))
        self._left = [len(r1), len(r2)]


def _step(shared: _Pool, only1: _Pool, only2: _Pool, rng: random.Random) -> tuple[int, int]:
    """The slides' rule on R1 = shared + only1, R2 = shared + only2 (both non-empty)."""
    ni = len(shared)
    n1, n2 = ni + len(only1), ni + len(only2)
    u = rng.randrange(n1)
    in_shared = u < ni
    e1 = shared.items[u] if in_shared else only1.items[u - ni]
    if n1 <= n2:
        # P(e2 = x) for shared x: (1/n1) * (n1/n2) = 1/n2; the rest of the mass goes to only2,
        # which is non-empty whenever it is needed (n2 > n1 >= ni).
        if in_shared and rng.random() * n2 < n1:
            return e1, e1
        return e1, only2.draw(rng)
    if in_shared:
        return e1, e1
    # e1 is in only1 (non-empty as n1 > n2 >= ni): move mass p to the shared set so that
    # P(e2 in shared) = ni/n1 + (1 - ni/n1) * p = ni/n2. p = 1 when only2 is empty.
    p = 1.0 - n1 * (n2 - ni) / (n2 * (n1 - ni))
    if rng.random() < p:
        return e1, shared.draw(rng)
    return e1, only2.draw(rng)


def _take(shared: _Pool, only1: _Pool, only2: _Pool, e1: int, e2: int) -> None:
    """Remove e1 from R1 and e2 from R2; a shared element taken by one job moves to the other's
    own part, since the other must still see it this epoch."""
    if e1 == e2:
        shared.remove(e1)
        return
    if e1 in shared:
        shared.remove(e1)
        only2.add(e1)
    else:
        only1.remove(e1)
    if e2 in shared:
        shared.remove(e2)
        only1.add(e2)
    else:
        only2.remove(e2)

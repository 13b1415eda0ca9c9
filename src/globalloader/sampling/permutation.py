"""Seeded bijections of `range(n)`: a global per-epoch shuffle without a permutation buffer.

A balanced Feistel network over the smallest even number of bits that covers `n` is a bijection
of `[0, 2**bits)`; cycle-walking (re-applying it until the value lands below `n`) restricts it to a
bijection of `[0, n)`. Memory is O(1) whatever `n`, any position can be mapped on its own (so a
resumed epoch needs no replay), and positions are mapped in vectorized NumPy blocks.

Below `_EXPLICIT_BELOW` elements the round functions see too few bits to reach every order with
equal probability, so small sets use an explicit uniform permutation (at most 512 KiB).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import numpy as np

from globalloader._seeding import PERMUTATION, generator, sequence
from globalloader.errors import ArgumentError

_ROUNDS = 6
_EXPLICIT_BELOW = 1 << 16
# A run of positions is mapped together with the runs expected next, about this many positions
# in all: a task's thousand positions alone would pay NumPy's per-call cost in every round and
# walking step.
_AHEAD = 1 << 14
_RUNS_KEPT = 64
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """SplitMix64 finalizer of (x + key): a keyed round function with full avalanche."""
    z = (x + key) * _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


class Permutation:
    """A seeded bijection of `range(n)` for one (seed, epoch); different epochs are independent.

    `perm[positions]` maps an integer array of positions to source positions; `perm.array()`
    materialises the whole order (for small n or tests).
    """

    def __init__(self, n: int, seed: int, epoch: int = 0) -> None:
        if n < 0:
            raise ArgumentError(f"Permutation: n must be >= 0, got {n}")
        self.n = int(n)
        half = max(1, ((max(self.n, 2) - 1).bit_length() + 1) // 2)
        self._half = np.uint64(half)
        self._mask = np.uint64((1 << half) - 1)
        self._keys = [np.uint64(k) for k in sequence(seed, epoch, PERMUTATION).generate_state(_ROUNDS, np.uint64)]
        self._explicit = generator(seed, epoch, PERMUTATION).permutation(self.n) if self.n < _EXPLICIT_BELOW else None
        self._runs: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()  # mapped ahead, by (start, stop)
        self._last_start = -1

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right, key) & self._mask)
        return (left << self._half) | right

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            bad = int(pos[(pos < 0) | (pos >= self.n)][0])
            raise ArgumentError(f"Permutation: position {bad} outside [0, {self.n})")
        if self._explicit is not None:
            return self._explicit[pos]
        out = self._feistel(pos.astype(np.uint64))
        walking = out >= np.uint64(self.n)
        while walking.any():
            out[walking] = self._feistel(out[walking])
            walking[walking] = out[walking] >= np.uint64(self.n)
        return out.astype(np.int64)

    def run(self, start: int, stop: int) -> np.ndarray:
        """`self[arange(start, stop)]`. A worker asks for runs at a fixed stride (its tasks: every
        `workers`-th one), so each call also maps the runs that follow at the stride since the
        previous call, in one vectorized computation, and keeps them for their calls. Safe from
        several threads: a run mapped twice or evicted early is only mapped again."""
        size = stop - start
        if self._explicit is not None or not 0 <= start < stop <= self.n:
            return self[np.arange(start, stop, dtype=np.int64)]
        mapped = self._runs.pop((start, stop), None)
        stride = start - self._last_start
        self._last_start = start
        if mapped is not None:
            return mapped
        stride = max(stride, size)
        starts = start + stride * np.arange(max(1, _AHEAD // size), dtype=np.int64)
        starts = starts[starts + size <= self.n]
        block = self[(starts[:, None] + np.arange(size, dtype=np.int64)).ravel()].reshape(len(starts), size)
        for first, row in zip(starts[1:].tolist(), block[1:], strict=True):
            self._runs[(first, first + size)] = row
        while len(self._runs) > _RUNS_KEPT:
            with contextlib.suppress(KeyError):  # another thread took it first
                self._runs.popitem(last=False)
        first_run: np.ndarray = block[0]
        return first_run

    def array(self) -> np.ndarray:
        """The whole order as an int64 array of length n."""
        return self[np.arange(self.n, dtype=np.int64)]

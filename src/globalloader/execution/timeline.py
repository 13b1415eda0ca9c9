"""The training loop over time, in bounded memory: what `report()` plots.

Per time bucket: steps taken, seconds waited for data, seconds spent in the loop's own body. Buckets
start one second wide and double (neighbours merged) whenever there would be more than
`MAX_BUCKETS`, so a week-long run costs no more memory than a half-hour one (a few hundred KB).
Each step's wait also goes into a log-scale histogram (10 bins per decade, 1 us to 1000 s).
Recording a step is a few float additions: cheap enough for every `next()`.

A "step" is one item the loop takes: a batch for batched chains (and for the torch drop-in), a
sample otherwise. Time between passes (evaluation, checkpointing) is not counted as the loop's.
"""

from __future__ import annotations

import math
import time

MAX_BUCKETS = 2048
DECADES = (-6, 3)  # histogram range: 10**-6 s to 10**3 s
BINS_PER_DECADE = 10


def wait_edges() -> list[float]:
    """The histogram's bin edges in seconds; bin 0 is below the first edge, the last above the last."""
    lo, hi = DECADES
    return [10 ** (lo + k / BINS_PER_DECADE) for k in range((hi - lo) * BINS_PER_DECADE + 1)]


class StepTimeline:
    """Steps, waits and loop time per bucket of run time, and a histogram of waits per step.

    Call `begin()` when a pass starts, then `step(wait)` as each item reaches the loop. Not
    thread-safe: the loop's thread records.
    """

    def __init__(self) -> None:
        self.origin: float | None = None  # perf_counter() of the first step's request
        self.width = 1.0  # seconds per bucket
        self.steps: list[int] = []
        self.waits: list[float] = []
        self.loops: list[float] = []
        self.histogram = [0] * (len(wait_edges()) + 1)
        self.count = 0
        self.wait_s = self.loop_s = 0.0
        self.first_wait: float | None = None  # the first step's wait (workers starting, caches cold)
        self.span = 0.0  # seconds from the origin to the latest step (the last bucket ends there)
        self._last: float | None = None  # when the previous step of this pass reached the loop

    def begin(self) -> None:
        """A new pass: time since the previous pass's last step is not the loop's."""
        self._last = None

    def step(self, wait: float) -> None:
        """A step reached the loop after it waited `wait` seconds for it."""
        now = time.perf_counter()
        asked = now - wait
        if self.origin is None:
            self.origin = asked
            self.first_wait = wait
        loop = max(0.0, asked - self._last) if self._last is not None else 0.0
        self._last = now
        self.span = now - self.origin
        self.count += 1
        self.wait_s += wait
        self.loop_s += loop
        bucket = int((now - self.origin) / self.width)
        while bucket >= MAX_BUCKETS:
            self._coarsen()
            bucket = int((now - self.origin) / self.width)
        if bucket >= len(self.steps):
            grow = bucket + 1 - len(self.steps)
            self.steps += [0] * grow
            self.waits += [0.0] * grow
            self.loops += [0.0] * grow
        self.steps[bucket] += 1
        self.waits[bucket] += wait
        self.loops[bucket] += loop
        self.histogram[_bin(wait)] += 1

    def _coarsen(self) -> None:
        self.width *= 2
        self.steps = [sum(self.steps[i : i + 2]) for i in range(0, len(self.steps), 2)]
        self.waits = [sum(self.waits[i : i + 2]) for i in range(0, len(self.waits), 2)]
        self.loops = [sum(self.loops[i : i + 2]) for i in range(0, len(self.loops), 2)]


def _bin(wait: float) -> int:
    lo, hi = DECADES
    if wait <= 10.0**lo:
        return 0
    position = (math.log10(wait) - lo) * BINS_PER_DECADE
    return min(int(position) + 1, (hi - lo) * BINS_PER_DECADE + 1)

"""What every pass over an epoch shares, local or fed by the server: the consumer's clock, task
results from the worker pool, the end of the epoch, and the position a resume needs.

A position is (epoch, task, offset, consumed, tail, base): a local run counts tasks and items taken
from the current one; a run whose order is not a pure function of the seed (shared mode) instead
names the samples already consumed this epoch (`consumed`, with task = offset = 0). A chain with
a tail (`dataset.tail`) adds the tail's state; an epoch resumed from another rank or world size
its `base`, and positions count in this rank's share of what that left.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, NamedTuple, NoReturn, Protocol

import numpy as np

from globalloader.dataset.plan import Plan
from globalloader.dataset.resume import Base
from globalloader.errors import ServerGoneError, ServerStartError
from globalloader.execution.stats import LoaderStats, warn_skipped
from globalloader.execution.workers import Task


class Position(NamedTuple):
    epoch: int
    task: int = 0
    offset: int = 0
    consumed: list[int] | None = None
    tail: dict[str, Any] | None = None
    base: Base | None = None  # what other worlds consumed of this epoch (`dataset.resume`)


UNAVAILABLE = (ServerGoneError, ServerStartError)  # the server is not there: share="auto" goes on alone


class Host(Protocol):
    """The Loader as its runs see it."""

    plan: Plan
    workers: int
    prefetch: int
    mode: str
    on_error: str
    timeout: float
    statistics: LoaderStats
    pool: Any

    def finished(self, run: EpochRun) -> None: ...
    def broken(self) -> None: ...
    def fall_back(self, exc: BaseException, position: Position) -> EpochRun: ...


class EpochRun:
    """One pass over (the rest of) an epoch; the Loader's iterator. Subclasses write `_next`
    (the next item, or `_end_epoch()`), `position` and `drain`."""

    def __init__(self, host: Host, epoch: int) -> None:
        self.host, self.plan, self.epoch = host, host.plan, epoch
        self._pool, self._width = host.pool, max(1, host.workers)
        self._skipped: list[tuple[int, str]] = []
        self._last_yield: float | None = None
        host.statistics.new_pass()

    def __iter__(self) -> EpochRun:
        return self

    def __next__(self) -> Any:
        stats = self.host.statistics
        now = time.perf_counter()
        if self._last_yield is not None:
            stats.consumer_busy(now - self._last_yield)
        item = self._next()
        self._last_yield = time.perf_counter()
        stats.consumer_wait(self._last_yield - now)
        return item

    def _next(self) -> Any:
        raise NotImplementedError

    def position(self) -> Position:
        raise NotImplementedError

    def drain(self) -> None:
        """Collect what is in flight so the workers are clean for the next run."""
        raise NotImplementedError

    def _submit_task(self, task: Task) -> None:
        """Queue a task on its worker; a failing pool is handed back to the Loader as broken."""
        try:
            self._pool.submit(task.number % self._width, task)
        except BaseException:
            self.host.broken()
            raise

    def _result(self, task: int) -> Any:
        """Task `task`'s result; a failing pool is handed back to the Loader as broken."""
        try:
            res = self._pool.result(task % self._width)
        except BaseException:
            self.host.broken()
            raise
        self.host.statistics.add_task(res.timer, res.idle, len(res.skipped))
        self._skipped.extend(res.skipped)
        return res

    def _end_epoch(self) -> NoReturn:
        warn_skipped(self._skipped, self.epoch)
        self._skipped = []
        self.host.finished(self)
        raise StopIteration


def remaining_indices(all_indices: np.ndarray, consumed: list[int]) -> np.ndarray:
    """`all_indices` minus `consumed` as multisets, order kept (pad duplicates count twice)."""
    if not consumed:  # every epoch start: no per-index Python work
        return all_indices
    left = Counter(consumed)
    keep = np.ones(len(all_indices), dtype=bool)
    for pos, index in enumerate(all_indices.tolist()):
        if left[index]:
            left[index] -= 1
            keep[pos] = False
    return all_indices[keep]

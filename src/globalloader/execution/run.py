"""What every pass over an epoch shares, local or fed by the server: the consumer's clock, task
results from the worker pool and the end of the epoch. Where a pass is, is its cursor's
(`dataset.cursor`).
"""

from __future__ import annotations

import time
from typing import Any, NoReturn, Protocol

from globalloader.dataset.plan import Plan
from globalloader.dataset.resume import Position
from globalloader.errors import ServerGoneError, ServerStartError
from globalloader.execution.stats import LoaderStats, warn_skipped
from globalloader.execution.workers import Task

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

"""What every pass over an epoch shares, local or fed by the server: the consumer's clock, the task
window over the Loader's workers and the end of the epoch. Where a pass is, is its cursor's
(`dataset.cursor`).
"""

from __future__ import annotations

import time
from typing import Any, NoReturn, Protocol

from globalloader.dataset.plan import Plan
from globalloader.dataset.resume import Position
from globalloader.errors import ServerGoneError, ServerStartError
from globalloader.execution.stats import LoaderStats, warn_skipped
from globalloader.execution.window import TaskWindow, WorkerSet
from globalloader.execution.workers import Result, Task

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
    worker_set: WorkerSet | None

    def finished(self, run: EpochRun) -> None: ...
    def broken(self) -> None: ...
    def fall_back(self, exc: BaseException, position: Position) -> EpochRun: ...


class EpochRun:
    """One pass over (the rest of) an epoch; the Loader's iterator. Subclasses write `_next`
    (the next item, or `_end_epoch()`), `position` and `drain`. `first`: the pass's first task."""

    def __init__(self, host: Host, epoch: int, first: int = 0) -> None:
        self.host, self.plan, self.epoch = host, host.plan, epoch
        assert host.worker_set is not None, "the Loader starts its workers before a run"
        width = max(1, host.workers)
        self._task_window: TaskWindow[Task] = TaskWindow(host.worker_set, width, host.prefetch, first=first)
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
        """Queue a task on its worker; failing workers are handed back to the Loader as broken."""
        try:
            self._task_window.submit(task)
        except BaseException:
            self.host.broken()
            raise

    def _result(self) -> tuple[Task, Result]:
        """The oldest task and its result; failing workers are handed back to the Loader as broken."""
        try:
            task, _, res = self._task_window.collect()
        except BaseException:
            self.host.broken()
            raise
        self.host.statistics.add_task(res.timer, res.idle, len(res.skipped))
        self._skipped.extend(res.skipped)
        return task, res

    def _drain_window(self) -> None:
        """Collect the results in flight, dropping them; failing workers are handed back as broken."""
        try:
            self._task_window.drain()
        except BaseException:  # noqa: BLE001 - whatever a result raised, the workers are not to be trusted
            self.host.broken()

    def _end_epoch(self) -> NoReturn:
        warn_skipped(self._skipped, self.epoch)
        self._skipped = []
        self.host.finished(self)
        raise StopIteration

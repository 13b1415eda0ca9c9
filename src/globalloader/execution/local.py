"""A pass over an epoch computed by this Loader's own workers.

Tasks go through the task window (`execution.window`): round-robin over the workers, yielded in
task order. A task's output depends
only on (chain, epoch, task), so the cursor's position (`dataset.cursor`) is all a resume needs:
whatever was prefetched is recomputed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from globalloader.dataset.cursor import END, Cursor
from globalloader.dataset.resume import Position
from globalloader.execution.run import EpochRun, Host
from globalloader.execution.workers import Task
from globalloader.sources.base import Prefetching

# How far past the submitted tasks remote objects are fetched ahead: at least this many tasks, and
# at least this many samples (a window shuffle moves on to new shards every `window` shards, so a
# horizon of a few small batches would announce them only milliseconds before they are read).
_PREFETCH_TASKS = 8
_PREFETCH_SAMPLES = 4096


class LocalRun(EpochRun):
    def __init__(self, host: Host, position: Position) -> None:
        super().__init__(host, position.epoch, first=position.task)
        self._cursor = cursor = Cursor(self.plan, position)
        source = self.plan.source
        self._prefetch_to = position.task  # tasks before this one were announced to the source
        self._prefetcher = source if isinstance(source, Prefetching) and source.remote and cursor.tasks else None
        self._horizon = max(_PREFETCH_TASKS, -(-_PREFETCH_SAMPLES // self.plan.task_size))

    def position(self) -> Position:
        return self._cursor.position()

    def _submit(self) -> None:
        cursor = self._cursor
        self._announce()  # before the first submission: this process starts the downloads, not a worker
        while not self._task_window.full():
            claimed = cursor.claim()
            if claimed is None:
                break
            self._submit_task(Task(self.epoch, *claimed))
        self._announce()

    def _announce(self) -> None:
        """Tell a remote source which samples the next tasks read, so that it downloads them
        while the workers compute the tasks before: the epoch's order is known in advance."""
        cursor = self._cursor
        if self._prefetcher is None or cursor.tasks is None:
            return
        last = min(cursor.tasks, cursor.next_task + self._horizon)
        if self._prefetch_to >= last:
            return
        self._prefetcher.prefetch(np.concatenate([cursor.sources(t) for t in range(self._prefetch_to, last)]))
        self._prefetch_to = last

    def _collect(self) -> bool:
        """Add the next task's result to the cursor, in order; False at the end of the epoch."""
        cursor = self._cursor
        self._submit()
        if not self._task_window:
            return False
        cursor.add(self._result()[1].output)
        self._submit()
        return True

    def _next(self) -> Any:
        item = self._cursor.next(self._collect)
        if item is END:
            self._end_epoch()
        return item

    def drain(self) -> None:
        self._drain_window()
        self._cursor.clear()

"""Gathering a worker's next batches of a columnar chain in one call.

A batch gathered by column (`sources._columns`) costs a few takes per column, and each call pays
a fixed cost besides its rows: mostly Arrow's kernel dispatch, which in a worker whose caches the
decoding, the pickling and the other processes have just emptied is about 70 us, as much as
taking a thousand rows. A windowed shuffle over Parquet spent a sixth of its time there.

A worker is dealt every `stride`-th task (the pool deals tasks round-robin). So when it asks for
task t after task t - s, it offers the source the rows of t, t + s, ..., t + (k - 1) s
(`read_columns_ahead`); the source gathers at once those that lie in the blocks task t reads
(the rest of a window, of a row group) and the other batches are kept for their turn. The
batches are the same: a gather is row-wise, so a slice of one large gather is the small gather.
Only tasks whose indices the plan computes itself come here (their rows depend on (epoch, task)
alone); kept batches are dropped at the first request they do not answer, so a worker thread
holds at most k - 1 of them. A source opts in with `gather_rows`, the rows it would gather at
once (k = gather_rows // batch size).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np


class Plan(Protocol):
    """What a gather ahead needs of the plan (`dataset.plan.Plan`)."""

    source: Any

    def task_indices(self, epoch: int, task: int) -> np.ndarray: ...
    def num_tasks(self) -> int | None: ...


class _Thread:
    """What one worker thread asked for last, and the batches it gathered ahead."""

    def __init__(self) -> None:
        self.epoch = -1
        self.last = -1
        self.kept: dict[int, dict[str, Any]] = {}


class GatherAhead:
    """Serves a columnar plan's own tasks, gathering up to `tasks` of a worker's tasks per call."""

    def __init__(self, tasks: int) -> None:
        self.tasks = tasks
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"tasks": self.tasks}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["tasks"])  # type: ignore[misc]

    def read(self, plan: Plan, epoch: int, task: int) -> dict[str, Any]:
        """Task `task`'s batch: kept from an earlier gather, or gathered now with the tasks this
        thread will likely ask for next."""
        state: _Thread | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _Thread()
        same_epoch = state.epoch == epoch
        previous = state.last if same_epoch else -1
        state.epoch, state.last = epoch, task
        kept = state.kept.pop(task, None) if same_epoch else None
        if kept is not None:
            return kept
        state.kept.clear()
        indices = plan.task_indices(epoch, task)
        stride = task - previous if previous >= 0 else 0
        total = plan.num_tasks() or 0
        later = [t for t in range(task + stride, task + stride * self.tasks, stride) if t < total] if stride > 0 else []
        if not later:
            return plan.source.read_columns(indices)  # type: ignore[no-any-return]
        parts = [indices, *(plan.task_indices(epoch, t) for t in later)]
        # The source gathers only rows in blocks this task reads: an error is this task's own.
        batches = plan.source.read_columns_ahead(parts)
        state.kept = dict(zip(later, batches[1:], strict=False))
        return batches[0]  # type: ignore[no-any-return]

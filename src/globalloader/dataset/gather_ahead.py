"""Gathering a worker's next batches of a columnar chain in one call.

A batch gathered by column (`sources._columns`) pays a fixed cost per call besides its rows
(mostly Arrow's kernel dispatch: about 70 us in a busy worker, as much as taking a thousand
rows); a windowed shuffle over Parquet spent a sixth of its time there. A worker is dealt every
`stride`-th task, so when it asks for task t after t - s, the source (`GathersAhead`) is offered
the rows of t, t + s, ..., t + (k - 1) s and gathers at once those in the blocks task t reads;
the other batches are kept for their turn (a gather is row-wise: a slice of a large gather is
the small gather). Only the plan's own tasks come here (rows a function of (epoch, task));
kept batches are dropped at the first request they do not answer, so a thread holds at most
k - 1 of them; k = the source's `gather_rows` // batch size.
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

    def __reduce__(self) -> tuple[type[GatherAhead], tuple[int]]:
        return GatherAhead, (self.tasks,)  # a copy starts with no thread's batches

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

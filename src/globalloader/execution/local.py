"""A pass over an epoch computed by this Loader's own workers.

Tasks are assigned to workers round-robin and yielded in task order. A task's output depends
only on (chain, epoch, task), so the position (epoch, task, offset) is all a resume needs:
whatever was prefetched is recomputed. A position given as the samples consumed (what a shared
run records) runs the epoch's order without them.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from globalloader.dataset.resume import epoch_order
from globalloader.dataset.tail import NEED, Tail
from globalloader.execution.run import EpochRun, Host, Position, remaining_indices
from globalloader.execution.workers import Task
from globalloader.sources.base import Prefetching

_PREFETCH_TASKS = 8  # tasks past the submitted ones whose remote objects are fetched ahead


class LocalRun(EpochRun):
    def __init__(self, host: Host, position: Position) -> None:
        epoch, task, offset, consumed, tail, base = position
        super().__init__(host, epoch)
        self._epoch_order = epoch_order(self.plan, epoch, base)
        self._next_submit = self._next_result = task
        self._current, self._taken = task, 0
        self._pending: deque[Any] = deque()
        self._exhausted = False
        self._skip_first = offset
        self._reader = self.plan.stream_reader(epoch, task) if self.plan.is_stream else None
        self._tail = Tail(self.plan.tail, self.plan.seed, epoch, tail) if self.plan.grouped else None
        if self._tail is not None:
            self._tail.fed = offset
        self._consumed = consumed
        self._order = None if consumed is None else remaining_indices(self._epoch_order.indices(), consumed)
        self._total = None if self.plan.is_stream else self._count_tasks()
        source = self.plan.source
        self._prefetch_to = task  # tasks before this one were announced to the source
        self._prefetcher = source if isinstance(source, Prefetching) and source.remote and self._total else None

    def _count_tasks(self) -> int:
        if self._order is None:
            total = self._epoch_order.num_tasks()
            assert total is not None, "a random-access chain knows its length"
            return total
        n, batch = len(self._order), self.plan.batch
        return batch.count(n) if batch is not None else -(-n // self.plan.task_size)

    def _indices(self, t: int) -> np.ndarray | None:
        if self._order is None:  # None: the worker maps the task's positions itself, in parallel
            return self._epoch_order.task_items(t)
        size = self.plan.task_size
        return self._order[t * size : (t + 1) * size]

    def position(self) -> Position:
        tail = None
        if self._tail is not None:
            task, offset, tail = self._current, self._tail.fed, self._tail.state()
        elif self._pending:
            task, offset = self._current, self._taken
        elif self._skip_first:  # loaded mid-task, nothing yielded yet
            task, offset = self._current, self._skip_first
        else:
            task, offset = self._next_result, 0
        base = self._epoch_order.base
        if self._order is None:
            return Position(self.epoch, task, offset, None, tail, base)
        done = self._order[: task * self.plan.task_size + offset].tolist()
        return Position(self.epoch, 0, 0, list(self._consumed or []) + done, tail, base)

    def _submit(self) -> None:
        plan = self.plan
        while not self._exhausted and self._next_submit - self._next_result < self.host.prefetch:
            t = self._next_submit
            items: list[tuple[int, Any]] | np.ndarray | None  # (index, record) pairs of a stream, else indices
            if self._reader is not None:
                items = plan.stream_task(self._reader, t)
                if items is None:
                    self._exhausted = True
                    return
            else:
                assert self._total is not None, "a random-access chain knows its length"
                if t >= self._total:
                    self._exhausted = True
                    return
                items = self._indices(t)
            self._submit_task(Task(self.epoch, t, items))
            self._next_submit += 1
        self._announce()

    def _announce(self) -> None:
        """Tell a remote source which samples the next tasks read, so that it downloads them
        while the workers compute the tasks before: the epoch's order is known in advance."""
        if self._prefetcher is None or self._total is None:
            return
        last = min(self._total, self._next_submit + _PREFETCH_TASKS)
        if self._prefetch_to >= last:
            return
        indices: list[np.ndarray] = []
        for t in range(self._prefetch_to, last):
            given = self._indices(t)
            indices.append(given if given is not None else self.plan.task_indices(self.epoch, t))
        self._prefetcher.prefetch(np.concatenate(indices))
        self._prefetch_to = last

    def _collect(self) -> Any:
        """The next task's result, in order; None at the end of the epoch."""
        self._submit()
        if self._next_result == self._next_submit:
            return None
        t = self._next_result
        res = self._result(t)
        self._next_result += 1
        self._current, self._taken = t, 0
        return res

    def _next(self) -> Any:
        tail = self._tail
        while tail is not None:
            item = tail.pop()
            if item is not NEED:
                return item
            res = self._collect()
            if res is not None:
                tail.add(res.output, self._skip_first)
                self._skip_first = 0
                self._submit()
            elif not tail.flush():
                self._end_epoch()
        while not self._pending:
            res = self._collect()
            if res is None:
                self._end_epoch()
            if res.output is not None:
                self._pending.extend([res.output] if self.plan.batch is not None else res.output)
            if self._skip_first:
                for _ in range(min(self._skip_first, len(self._pending))):
                    self._pending.popleft()
                self._taken, self._skip_first = self._skip_first, 0
            self._submit()
        self._taken += 1
        return self._pending.popleft()

    def drain(self) -> None:
        try:
            while self._next_result < self._next_submit:
                self._pool.result(self._next_result % self._width)
                self._next_result += 1
        except BaseException:  # noqa: BLE001 - whatever a result raised, the pool is not to be trusted
            self.host.broken()
        self._pending.clear()
        if self._tail is not None:
            self._tail.groups.clear()

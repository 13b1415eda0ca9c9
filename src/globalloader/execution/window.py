"""The task window: tasks in flight over a set of workers, for the Loader and the DataLoader drop-in.

Tasks go to the workers round-robin (skipping retired ones), at most `depth` are in flight, and
results come back in task order, or as they come (`in_order=False`). Every worker answers its own
tasks in the order it got them, so reading the worker holding the oldest task delivers in task
order with no reorder buffer. Waiting is the workers' business: their `result` raises
`LoaderTimeoutError` past the timeout and `WorkerError` when one died, as each set does today.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, Protocol, TypeVar, cast

T = TypeVar("T")


class WorkerSet(Protocol):
    """Workers that each run their tasks in the order they were submitted."""

    def submit(self, worker: int, task: Any) -> None: ...
    def result(self, worker: int) -> Any: ...
    def close(self) -> None: ...


class AnyOrderWorkerSet(WorkerSet, Protocol):
    """Workers that can also say which of them answered first."""

    def result_any(self) -> tuple[int, Any]: ...


class TaskWindow(Generic[T]):
    """Tasks (of type T) submitted to `count` workers and not yet collected.

    The first task goes to worker `first % count`, so a pass resumed at task `first` places its
    tasks where an unbroken pass would have.
    """

    def __init__(self, workers: WorkerSet, count: int, depth: int, in_order: bool = True, first: int = 0) -> None:
        self._workers, self._count, self.depth, self._in_order = workers, count, depth, in_order
        self._next_worker = first % count
        self._sent = 0  # tasks submitted: a task's place in `_order`
        self._order: deque[tuple[int, int]] = deque()  # (place, worker) in submission order
        self._queued: list[deque[tuple[int, T]]] = [deque() for _ in range(count)]  # (place, task) not yet answered
        self._retired = [False] * count
        self._lost = 0  # tasks of retired workers still in `_order`: nothing will be collected for them

    def __len__(self) -> int:
        """Tasks in flight on workers not retired."""
        return len(self._order) - self._lost

    def full(self) -> bool:
        return len(self) >= self.depth

    def submit(self, task: T) -> int | None:
        """Send `task` to the next worker not retired; its index, or None when all are retired."""
        worker = self._next_worker
        for _ in range(self._count):
            if not self._retired[worker]:
                break
            worker = (worker + 1) % self._count
        else:
            return None
        self._next_worker = (worker + 1) % self._count
        self._workers.submit(worker, task)
        self._order.append((self._sent, worker))
        self._queued[worker].append((self._sent, task))
        self._sent += 1
        return worker

    def collect(self) -> tuple[T, int, Any]:
        """(task, worker, result) of the oldest task in flight, or of the first to finish with
        `in_order=False`. Tasks of a retired worker are dropped, not waited for."""
        if not self._in_order:
            worker, result = cast(AnyOrderWorkerSet, self._workers).result_any()
            place, task = self._queued[worker].popleft()
            self._order.remove((place, worker))
            if self._retired[worker]:
                self._lost -= 1
            return task, worker, result
        while self._retired[self._order[0][1]]:
            _, worker = self._order.popleft()
            self._queued[worker].popleft()
            self._lost -= 1
        worker = self._order[0][1]
        result = self._workers.result(worker)
        self._order.popleft()
        return self._queued[worker].popleft()[1], worker, result

    def retire(self, worker: int) -> None:
        """Give `worker` no more tasks and expect nothing more of it (an iterable dataset's copy ran out)."""
        if not self._retired[worker]:
            self._retired[worker] = True
            self._lost += len(self._queued[worker])

    def drain(self) -> None:
        """Collect every task in flight, dropping the results (whatever a result raises propagates)."""
        while len(self):
            self.collect()
